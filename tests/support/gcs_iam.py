"""GCS as strict as Cloud IAM: a permission proxy in front of fake-gcs-server.

fake-gcs-server lets anyone do anything. `IamProxy` stands in front of it and
checks every request of the JSON API against the IAM permission Cloud Storage
checks for it, for the identity that made it, answering a denied request with
GCS's 403 (its JSON error shape and wording). It answers `testIamPermissions`
itself, from the identity's roles.

Identities. Clients in emulator mode send no token, so the proxy tells callers
apart by the port they reach: one port per identity (`endpoint(member)`), which
the product neither chooses nor sees. A request that carries a bearer token in
`tokens` (issued for a service-account key, tests/support/oauth_tokens.py) acts
as the token's member instead, whatever port it reached. The test process (the
user running flows) reaches the user's port; a pod reaches the port of its Kubernetes service
account's Google service account, as Workload Identity gives it (the test
kubelet puts that port in the pod's env, tests/support/pod_env.py). A
Kubernetes service account without a Workload Identity mapping reaches a port
whose principal has no roles.

Roles. `ROLE_PERMISSIONS` holds the storage permissions of the Cloud Storage
roles, from Google's IAM reference
(https://cloud.google.com/iam/docs/roles-permissions/storage); non-storage
permissions (resourcemanager.*, orgpolicy.*, ...) are left out. The grants are
read from the `gcloud` commands of docs/kubernetes.md's "Permissions" section
(`documented_grants()`), the ones a user runs, so the tests cannot pass with a
grant the docs do not tell users to make.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kinetic_prefect.common.gcs import EMULATOR_PROJECT

_ROOT = Path(__file__).resolve().parents[2]
PERMISSIONS_DOC = _ROOT / "docs" / "kubernetes.md"
WORKLOAD_IDENTITY_ANNOTATION = "iam.gke.io/gcp-service-account"
WORKLOAD_IDENTITY_USER = "roles/iam.workloadIdentityUser"
# Who runs the tests' flows: the docs' placeholder for "you".
USER_MEMBER = "user:YOU@EXAMPLE.COM"
# The Google service accounts the docs let the pods' Kubernetes accounts act as.
PODS_MEMBER = f"serviceAccount:kinetic-pods@{EMULATOR_PROJECT}.iam.gserviceaccount.com"
RUNNER_MEMBER = f"serviceAccount:kinetic-runner@{EMULATOR_PROJECT}.iam.gserviceaccount.com"

_OBJECTS_ALL = {
    "storage.objects.create",
    "storage.objects.delete",
    "storage.objects.get",
    "storage.objects.getIamPolicy",
    "storage.objects.list",
    "storage.objects.overrideUnlockedRetention",
    "storage.objects.restore",
    "storage.objects.setIamPolicy",
    "storage.objects.setRetention",
    "storage.objects.update",
}
_FOLDERS = {"storage.folders.create", "storage.folders.delete", "storage.folders.get"}
_FOLDERS |= {"storage.folders.list", "storage.folders.rename"}
_MANAGED_FOLDERS = {f"storage.managedFolders.{v}" for v in ("create", "delete", "get", "list")}
_MANAGED_FOLDERS |= {"storage.managedFolders.getIamPolicy", "storage.managedFolders.setIamPolicy"}
_MULTIPART = {f"storage.multipartUploads.{v}" for v in ("abort", "create", "list", "listParts")}
_BUCKETS_ALL = {
    f"storage.buckets.{v}"
    for v in ("create", "delete", "get", "getIamPolicy", "list", "setIamPolicy", "update")
}

# The storage.* permissions of each role (https://cloud.google.com/iam/docs/roles-permissions/storage).
ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "roles/storage.admin": frozenset(_BUCKETS_ALL | _OBJECTS_ALL | _FOLDERS | _MANAGED_FOLDERS)
    | _MULTIPART,
    "roles/storage.objectAdmin": frozenset(_OBJECTS_ALL | _FOLDERS | _MANAGED_FOLDERS | _MULTIPART),
    "roles/storage.objectUser": frozenset(
        {f"storage.objects.{v}" for v in ("create", "delete", "get", "list", "restore", "update")}
        | _FOLDERS
        | {f"storage.managedFolders.{v}" for v in ("create", "delete", "get", "list")}
        | _MULTIPART
    ),
    "roles/storage.objectCreator": frozenset(
        {"storage.objects.create", "storage.folders.create", "storage.managedFolders.create"}
        | {"storage.multipartUploads.create", "storage.multipartUploads.abort"}
        | {"storage.multipartUploads.listParts"}
    ),
    "roles/storage.objectViewer": frozenset(
        {"storage.objects.get", "storage.objects.list", "storage.folders.get"}
        | {"storage.folders.list", "storage.managedFolders.get", "storage.managedFolders.list"}
    ),
    "roles/storage.bucketViewer": frozenset({"storage.buckets.get", "storage.buckets.list"}),
    "roles/storage.legacyBucketReader": frozenset({"storage.buckets.get", "storage.objects.list"}),
    "roles/storage.legacyBucketWriter": frozenset(
        {"storage.buckets.get", "storage.objects.list", "storage.objects.create"}
        | {"storage.objects.delete", "storage.objects.restore"}
    ),
    "roles/storage.legacyBucketOwner": frozenset(
        {"storage.buckets.get", "storage.buckets.update", "storage.buckets.getIamPolicy"}
        | {"storage.buckets.setIamPolicy", "storage.objects.list", "storage.objects.create"}
        | {"storage.objects.delete", "storage.objects.restore"}
    ),
    "roles/storage.legacyObjectReader": frozenset({"storage.objects.get"}),
    "roles/storage.legacyObjectOwner": frozenset(
        {"storage.objects.get", "storage.objects.update", "storage.objects.getIamPolicy"}
        | {"storage.objects.setIamPolicy"}
    ),
}


# -- the documented grants --------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """`member` holds `role` on `bucket` (a placeholder such as JOBS_BUCKET in the docs)."""

    bucket: str
    member: str
    role: str


_BUCKET_BINDING = re.compile(
    r"gcloud storage buckets add-iam-policy-binding gs://(?P<bucket>\S+)\s+"
    r"--member=(?P<member>\S+)\s+--role=(?P<role>\S+)"
)
_SA_BINDING = re.compile(
    r"gcloud iam service-accounts add-iam-policy-binding (?P<gsa>\S+)\s+"
    r"--role=(?P<role>\S+)\s+--member=\"?serviceAccount:[^\[\s]+\[(?P<ns>[^/\]]+)/(?P<ksa>[^\]]+)\]"
)


def doc_section(path: Path, heading: str) -> str:
    """The section of a Markdown file under `heading` (`## ...`), continuation lines joined."""
    text = path.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return re.sub(r"\\\n\s*", " ", text[start : end if end > 0 else None])


def _permissions_section() -> str:
    return doc_section(PERMISSIONS_DOC, "## Permissions")


def filled(value: str, substitutions: dict[str, str]) -> str:
    """Placeholders replaced where they stand as words (not the CLUSTER of KINETIC_CLUSTER)."""
    for placeholder, actual in substitutions.items():
        value = re.sub(rf"(?<![\w-]){placeholder}(?![\w-])", actual, value)
    return value


def documented_grants(substitutions: dict[str, str]) -> list[Grant]:
    """The bucket grants docs/kubernetes.md tells users to make, placeholders substituted."""
    grants = [
        Grant(filled(m["bucket"], substitutions), filled(m["member"], substitutions), m["role"])
        for m in _BUCKET_BINDING.finditer(_permissions_section())
    ]
    assert grants, f"no `gcloud storage buckets add-iam-policy-binding` in {PERMISSIONS_DOC}"
    return grants


def documented_workload_identity_users(substitutions: dict[str, str]) -> set[tuple[str, str]]:
    """(Kubernetes account, Google service account) pairs the docs let act as each other."""
    return {
        (m["ksa"], filled(m["gsa"], substitutions))
        for m in _SA_BINDING.finditer(_permissions_section())
        if m["role"] == WORKLOAD_IDENTITY_USER
    }


def documented_kubectl_commands(substitutions: dict[str, str]) -> list[str]:
    """The `kubectl` lines of docs/kubernetes.md "Permissions" (the Workload Identity
    annotations), placeholders substituted: the test cluster's admin runs them."""
    return [
        filled(line.strip(), substitutions)
        for line in _permissions_section().splitlines()
        if line.strip().startswith("kubectl ")
    ]


# -- what a request needs ---------------------------------------------------------------------


@dataclass(frozen=True)
class Need:
    """A permission on a resource: a bucket, an object of it, or the project (bucket None)."""

    permission: str
    bucket: str | None
    object: str | None = None

    @property
    def resource(self) -> str:
        if self.bucket is None:
            return "Google Cloud project"
        return "Google Cloud Storage object" if self.object else "Google Cloud Storage bucket"


def _split(path: str) -> tuple[list[str], dict[str, list[str]]]:
    parsed = urllib.parse.urlsplit(path)
    parts = [urllib.parse.unquote(p) for p in parsed.path.split("/") if p]
    return parts, urllib.parse.parse_qs(parsed.query)


def _multipart_name(body: bytes) -> str | None:
    match = re.search(rb"\{.*?\}", body, re.S)
    if match is None:
        return None
    try:
        name = json.loads(match.group(0)).get("name")
    except ValueError:
        return None
    return str(name) if name else None


def needs(
    method: str, path: str, body: bytes, object_exists: Callable[[str, str], bool]
) -> list[Need] | None:
    """The permissions Cloud Storage checks for a JSON API request; None: the proxy answers."""
    parts, query = _split(path)
    if parts[:1] == ["download"]:
        parts = parts[1:]
    if parts[:3] == ["upload", "storage", "v1"] and len(parts) >= 5:
        bucket = parts[4]
        if "upload_id" in query:
            return []  # the session was authorized when it was started
        name = (query.get("name") or [None])[0]
        if name is None and body:
            name = _multipart_name(body)
        wanted = [Need("storage.objects.create", bucket, name or "")]
        no_overwrite = (query.get("ifGenerationMatch") or [""])[0] == "0"
        if name and not no_overwrite and object_exists(bucket, name):
            wanted.append(Need("storage.objects.delete", bucket, name))
        return wanted
    if parts[:2] != ["storage", "v1"] or len(parts) < 3 or parts[2] != "b":
        raise ValueError(f"the IAM proxy does not know the request {method} {path}")
    rest = parts[3:]
    if not rest:
        return [
            Need("storage.buckets.create" if method == "POST" else "storage.buckets.list", None)
        ]
    bucket = rest[0]
    if len(rest) == 1:
        verb = {"GET": "get", "DELETE": "delete"}.get(method, "update")
        return [Need(f"storage.buckets.{verb}", bucket)]
    if rest[1] == "iam":
        if rest[2:] == ["testPermissions"]:
            return None
        verb = "getIamPolicy" if method == "GET" else "setIamPolicy"
        return [Need(f"storage.buckets.{verb}", bucket)]
    if rest[1] != "o":
        raise ValueError(f"the IAM proxy does not know the request {method} {path}")
    if len(rest) == 2:
        return [Need("storage.objects.list", bucket)]
    name = rest[2]
    if len(rest) == 3:
        if name == "compose" and method == "POST":
            return [Need("storage.objects.create", bucket, name)]
        verb = {"GET": "get", "HEAD": "get", "DELETE": "delete"}.get(method, "update")
        return [Need(f"storage.objects.{verb}", bucket, name)]
    if rest[3] in ("rewriteTo", "copyTo") and len(rest) >= 8:
        target_bucket, target = rest[5], rest[7]
        wanted = [
            Need("storage.objects.get", bucket, name),
            Need("storage.objects.create", target_bucket, target),
        ]
        if object_exists(target_bucket, target):
            wanted.append(Need("storage.objects.delete", target_bucket, target))
        return wanted
    raise ValueError(f"the IAM proxy does not know the request {method} {path}")


def denied_body(caller: str, need: Need) -> bytes:
    """GCS's 403, in its JSON error shape and wording."""
    message = (
        f"{caller} does not have {need.permission} access to the {need.resource}. "
        f"Permission '{need.permission}' denied on resource (or it may not exist)."
    )
    error = {
        "error": {
            "code": 403,
            "message": message,
            "errors": [{"message": message, "domain": "global", "reason": "forbidden"}],
        }
    }
    return json.dumps(error).encode()


def _not_found_body(message: str) -> bytes:
    error = {
        "code": 404,
        "message": message,
        "errors": [{"message": message, "domain": "global", "reason": "notFound"}],
    }
    return json.dumps({"error": error}).encode()


# -- the proxy --------------------------------------------------------------------------------

_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
_COPY_CHUNK = 1024 * 1024
# Every running proxy by each URL it serves: the test kubelet finds a pod's proxy by the
# address in its manifest env.
_RUNNING: dict[str, IamProxy] = {}
_RUNNING_LOCK = threading.Lock()


def proxy_serving(url: str) -> IamProxy | None:
    """The running proxy one of whose identity ports is `url`."""
    with _RUNNING_LOCK:
        return _RUNNING.get(url.rstrip("/"))


class IamProxy:
    """Forwards the JSON API to `upstream` for the identities it grants (module docstring).

    `lookup` is where the proxy checks objects itself (an overwrite needs delete),
    so a fault-injecting `upstream` never sees those requests. `denials` lists
    (caller, permission, bucket) of every request answered 403.
    """

    def __init__(self, upstream: str, lookup: str | None = None, project: str = "") -> None:
        self.upstream = upstream.removeprefix("http://").rstrip("/")
        self.lookup = (lookup or upstream).removeprefix("http://").rstrip("/")
        self.project = project
        self.grants: set[Grant] = set()
        # (Kubernetes account, Google service account) pairs allowed to act as each other
        # (roles/iam.workloadIdentityUser): `documented_workload_identity_users()`.
        self.workload_identity_users: set[tuple[str, str]] = set()
        self.denials: list[tuple[str, str, str | None]] = []
        # Bearer tokens and the member each stands for (tests/support/oauth_tokens.py).
        self.tokens: dict[str, str] = {}
        # Every caller a request was forwarded for.
        self.callers: set[str] = set()
        # (member, method, path) of every request received, in order.
        self.requests: list[tuple[str, str, str]] = []
        # The object name of every upload begun, in order: a POST to /upload/ (a multipart
        # upload, or a resumable one's start: the name is in its body); a resumable upload's
        # chunks, PUT to its session, are not uploads of their own.
        self.uploaded: list[str] = []
        self._servers: dict[str, http.server.ThreadingHTTPServer] = {}
        self._lock = threading.Lock()

    # -- identities and grants

    def grant(self, grants: Iterable[Grant]) -> None:
        with self._lock:
            self.grants.update(grants)

    @contextmanager
    def revoked(self, grant: Grant) -> Iterator[None]:
        """Without `grant` (which must be one of the proxy's) for the block."""
        with self._lock:
            assert grant in self.grants, f"{grant} is not granted"
            self.grants.discard(grant)
        try:
            yield
        finally:
            self.grant([grant])

    def permissions(self, member: str, bucket: str | None) -> set[str]:
        with self._lock:
            roles = {g.role for g in self.grants if g.member == member and g.bucket == bucket}
        return set().union(*(ROLE_PERMISSIONS.get(role, frozenset()) for role in roles))

    def endpoint(self, member: str) -> str:
        """The URL through which requests are made as `member` (started on first use)."""
        with self._lock:
            server = self._servers.get(member)
            if server is None:
                server = self._servers[member] = self._serve(member)
        return f"http://127.0.0.1:{server.server_address[1]}"

    def close(self) -> None:
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            with _RUNNING_LOCK:
                _RUNNING.pop(f"http://127.0.0.1:{server.server_address[1]}", None)
            server.shutdown()
            server.server_close()

    def __enter__(self) -> IamProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving

    def _found(self, path: str) -> bool:
        """Whether the emulator has the bucket or object at `path` (asked directly)."""
        connection = http.client.HTTPConnection(self.lookup, timeout=60)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            return response.status == 200
        finally:
            connection.close()

    def _object_exists(self, bucket: str, name: str) -> bool:
        return self._found(f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")

    def _bucket_exists(self, bucket: str) -> bool:
        return self._found(f"/storage/v1/b/{bucket}")

    def _serve(self, port_member: str) -> http.server.ThreadingHTTPServer:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            @property
            def member(self) -> str:
                with proxy._lock:
                    return self.member_unlocked()

            def member_unlocked(self) -> str:
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                return proxy.tokens.get(token.strip(), port_member)

            def log_message(self, *args: object) -> None:
                return

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _test_permissions(self) -> None:
                parts, query = _split(self.path)
                bucket = parts[3]
                if not proxy._bucket_exists(bucket):
                    self._answer(404, _not_found_body("The specified bucket does not exist."))
                    return
                held = proxy.permissions(self.member, bucket)
                asked = query.get("permissions") or []
                answer: dict[str, Any] = {"kind": "storage#testIamPermissionsResponse"}
                granted = [p for p in asked if p in held]
                if granted:
                    answer["permissions"] = granted
                self._answer(200, json.dumps(answer).encode())

            def _handle(self) -> None:
                with proxy._lock:
                    proxy.requests.append((self.member_unlocked(), self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.path.startswith("/upload/") and self.command == "POST":
                    name = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query).get(
                        "name"
                    ) or [_multipart_name(body) or ""]
                    with proxy._lock:
                        proxy.uploaded.append(name[0])
                try:
                    wanted = needs(self.command, self.path, body, proxy._object_exists)
                except ValueError as exc:
                    # A request the proxy cannot map must show up, not pass unchecked.
                    self._answer(
                        501, json.dumps({"error": {"code": 501, "message": str(exc)}}).encode()
                    )
                    return
                if wanted is None:
                    self._test_permissions()
                    return
                member = self.member
                caller = member.partition(":")[2] or member
                for need in wanted:
                    if need.permission not in proxy.permissions(member, need.bucket):
                        with proxy._lock:
                            proxy.denials.append((caller, need.permission, need.bucket))
                        self._answer(403, denied_body(caller, need))
                        return
                with proxy._lock:
                    proxy.callers.add(caller)
                self._forward(body)

            def _forward(self, body: bytes) -> None:
                connection = http.client.HTTPConnection(proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                connection.request(self.command, self.path, body=body or None, headers=headers)
                response = connection.getresponse()
                length = response.getheader("Content-Length")
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                if length is None or self.command == "HEAD":
                    data = response.read()
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self.send_header("Content-Length", length)
                    self.end_headers()
                    while chunk := response.read(_COPY_CHUNK):
                        self.wfile.write(chunk)
                connection.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        with _RUNNING_LOCK:
            _RUNNING[f"http://127.0.0.1:{server.server_address[1]}"] = self
        return server

    # -- Workload Identity

    def workload_identity_member(self, namespace: str, account: str, annotation: str | None) -> str:
        """The member a pod running as `namespace/account` acts as.

        The annotated Google service account when the docs let the Kubernetes
        account act as it; else the Kubernetes account's own principal, which
        holds no roles.
        """
        if annotation and (account, annotation) in self.workload_identity_users:
            return f"serviceAccount:{annotation}"
        return f"principal:{self.project}.svc.id.goog[{namespace}/{account}]"


@contextmanager
def strict_gcs(endpoint: str, lookup: str | None = None) -> Iterator[IamProxy]:
    """An `IamProxy` in front of `endpoint` that lets the documented Kubernetes accounts act
    as their Google service accounts; its grants are added per bucket."""
    with IamProxy(endpoint, lookup=lookup, project=EMULATOR_PROJECT) as proxy:
        proxy.workload_identity_users = documented_workload_identity_users(
            {"PROJECT": EMULATOR_PROJECT}
        )
        yield proxy
