"""The GKE metadata server, as Workload Identity gives it to a pod (and gcloud ADC to you).

On GKE a pod's Application Default Credentials come from the metadata server at
169.254.169.254: `google.auth.default()` pings it, reads the service account's
email and project, and fetches access tokens from it. Code that asks for ADC
itself (prefect-gcp's `pull_from_gcs` and `push_to_gcs` deployment steps) needs
it. `MetadataServer` answers those requests on a local port, for the identity it
was started for; `env()` is the `GCE_METADATA_HOST` / `GCE_METADATA_IP` pair that
points google-auth at it. The tokens it issues are opaque: which identity a GCS
request acts as is decided by the IAM proxy's port (tests/support/gcs_iam.py),
so these only let ADC-using code start.

Each pod the kubelet starts gets an address of its own (`pod_env`), as GKE's metadata
server tells pods apart by their IP. GKE documents that its metadata server needs a
few seconds before it accepts requests from a newly created pod
(https://cloud.google.com/kubernetes-engine/docs/concepts/workload-identity#limitations):
with `new_pod_seconds`, a pod's connections in its first seconds are closed unanswered,
or answered `new_pod_status` (a 503, say) when it is given. `requests` logs every
request as (pod, path, status), "refused" for a connection closed unanswered.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from typing import Any

_FLAVOR = "Metadata-Flavor"
_ROOT = "/computeMetadata/v1"


def serve(handler: type[http.server.BaseHTTPRequestHandler]) -> http.server.ThreadingHTTPServer:
    """`handler` answering on a free local port, from a daemon thread (`stop` ends it)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def stop(server: http.server.ThreadingHTTPServer | None) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


def respond(
    handler: http.server.BaseHTTPRequestHandler,
    status: int,
    content_type: str,
    body: str,
    headers: dict[str, str] | None = None,
) -> None:
    """Answer `handler`'s request with `body`."""
    data = body.encode()
    handler.send_response(status)
    for name, value in (headers or {}).items():
        handler.send_header(name, value)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class MetadataServer:
    def __init__(
        self,
        project: str,
        email: str = "default",
        new_pod_seconds: float = 0.0,
        new_pod_status: int | None = None,
    ) -> None:
        self.project = project
        self.email = email
        self.new_pod_seconds = new_pod_seconds
        # What a new pod gets in its first seconds: None, its connection closed unanswered.
        self.new_pod_status = new_pod_status
        # (pod, path, status or "refused"); pod "" for the address of `env()`.
        self.requests: list[tuple[str, str, int | str]] = []
        self._server: http.server.ThreadingHTTPServer | None = None
        self._pod_servers: dict[str, http.server.ThreadingHTTPServer] = {}
        self._lock = threading.Lock()

    def answer(self, path: str) -> tuple[int, str, str] | None:
        """(status, content type, body) for a metadata path, None when unknown."""
        path = path.split("?", 1)[0].rstrip("/")
        if path in ("", _ROOT):
            return 200, "text/plain", "computeMetadata/\n"
        if path == f"{_ROOT}/project/project-id":
            return 200, "text/plain", self.project
        account = f"{_ROOT}/instance/service-accounts/default"
        if path == account:
            info = {
                "email": self.email,
                "aliases": ["default"],
                "scopes": ["https://www.googleapis.com/auth/cloud-platform"],
            }
            return 200, "application/json", json.dumps(info)
        if path == f"{account}/email":
            return 200, "text/plain", self.email
        if path == f"{account}/token":
            token = {"access_token": "metadata-token", "expires_in": 3599, "token_type": "Bearer"}
            return 200, "application/json", json.dumps(token)
        return None

    def _handler(self, pod: str) -> type[http.server.BaseHTTPRequestHandler]:
        outer = self
        # Counted from the pod's first request, not from its creation: however long its
        # container takes to start, the pod meets the refusal.
        ready_at: list[float] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                with outer._lock:
                    if not ready_at:
                        ready_at.append(time.monotonic() + (outer.new_pod_seconds if pod else 0))
                if time.monotonic() < ready_at[0]:
                    self._refuse()
                    return
                found = outer.answer(self.path)
                if self.headers.get(_FLAVOR) != "Google" or found is None:
                    outer._log(pod, self.path, 403 if found else 404)
                    self.send_response(403 if found else 404)
                    self.end_headers()
                    return
                outer._log(pod, self.path, found[0])
                respond(self, *found, headers={_FLAVOR: "Google"})

            def _refuse(self) -> None:
                status = outer.new_pod_status
                outer._log(pod, self.path, status or "refused")
                self.close_connection = True
                if status is None:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler

    def _log(self, pod: str, path: str, status: int | str) -> None:
        with self._lock:
            self.requests.append((pod, path.split("?", 1)[0], status))

    def __enter__(self) -> MetadataServer:
        self._server = serve(self._handler(""))
        return self

    def __exit__(self, *exc: object) -> None:
        stop(self._server)
        for server in self._pod_servers.values():
            stop(server)

    def pod_env(self, pod: str) -> dict[str, str]:
        """What points a new pod at this server, at an address of its own (see above)."""
        with self._lock:
            if pod not in self._pod_servers:
                self._pod_servers[pod] = serve(self._handler(pod))
            port = self._pod_servers[pod].server_address[1]
        return {"GCE_METADATA_HOST": f"127.0.0.1:{port}", "GCE_METADATA_IP": f"127.0.0.1:{port}"}

    def token_requests(self, pod: str) -> list[int | str]:
        """The statuses of `pod`'s token requests, in order."""
        with self._lock:
            return [s for p, path, s in self.requests if p == pod and path.endswith("/token")]

    def env(self) -> dict[str, str]:
        """What points google-auth's ADC at this server."""
        assert self._server is not None
        address = f"127.0.0.1:{self._server.server_address[1]}"
        return {"GCE_METADATA_HOST": address, "GCE_METADATA_IP": address}
