"""Google's OAuth token endpoint for service-account keys, on a local port.

A service-account key (the JSON a user downloads, and a prefect-gcp
`GcpCredentials` block's `service_account_info`) names a `token_uri`: google-auth
signs a JWT with the key and exchanges it there for an access token (the JWT
bearer grant, RFC 7523), which it then sends with every request. `TokenEndpoint`
answers that exchange without a network: `key(email)` generates an RSA key
whose `token_uri` points here, and the endpoint checks each assertion's
signature against the public half before it issues an opaque token for the
key's account. `issued` maps each token to the member it stands for; the IAM
proxy (tests/support/gcs_iam.py) acts as that member for a request that carries
it, as Cloud Storage does.
"""

from __future__ import annotations

import http.server
import json
import secrets
import threading
import urllib.parse
from typing import Any

from tests.support.metadata_server import respond, serve, stop

_JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"
# The audience google-auth signs assertions for, whatever the key's token_uri.
_AUDIENCE = "https://oauth2.googleapis.com/token"


class TokenEndpoint:
    """A token endpoint for the keys it generated; tokens go into `issued` (token → member)."""

    def __init__(self, issued: dict[str, str]) -> None:
        self.issued = issued
        self._public_keys: dict[str, str] = {}
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None

    @property
    def token_uri(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/token"

    def key(self, email: str, project: str) -> dict[str, str]:
        """A new service-account key for `email`, in the JSON shape Google issues it."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa

        private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        key_id = secrets.token_hex(20)
        public_pem = private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        with self._lock:
            self._public_keys[key_id] = public_pem.decode()
        private_pem = private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return {
            "type": "service_account",
            "project_id": project,
            "private_key_id": key_id,
            "private_key": private_pem.decode(),
            "client_email": email,
            "client_id": str(secrets.randbelow(10**20)),
            "token_uri": self.token_uri,
        }

    def exchange(self, form: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        """(status, body) for a token request: a token for a valid assertion, else 400."""
        from google.auth import jwt

        if form.get("grant_type") != [_JWT_BEARER] or not form.get("assertion"):
            return 400, {"error": "unsupported_grant_type"}
        with self._lock:
            keys = dict(self._public_keys)
        try:
            claims = jwt.decode(form["assertion"][0], certs=keys, audience=_AUDIENCE)
        except (ValueError, KeyError) as exc:
            return 400, {"error": "invalid_grant", "error_description": str(exc)}
        token = f"ya29.kp-{secrets.token_urlsafe(24)}"
        with self._lock:
            self.issued[token] = f"serviceAccount:{claims['iss']}"
        return 200, {"access_token": token, "expires_in": 3599, "token_type": "Bearer"}

    def __enter__(self) -> TokenEndpoint:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                form = urllib.parse.parse_qs(self.rfile.read(length).decode())
                status, answer = outer.exchange(form)
                respond(self, status, "application/json", json.dumps(answer))

        self._server = serve(Handler)
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self._server)
