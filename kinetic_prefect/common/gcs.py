"""Google Cloud Storage: clients with retries, emulator mode, and the jobs store on a bucket.

Emulator mode: when `STORAGE_EMULATOR_HOST` is set, every client this project
creates uses anonymous credentials, in the orchestrator and in every pod.
Every client retries 429, 5xx and connection errors with backoff at the HTTP
layer, so uploads, downloads and Prefect result writes all survive a flaky GCS.
"""

from __future__ import annotations

import io
import os
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from google.cloud.storage import Client

RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
# Objects over 8 MiB go up as resumable uploads in chunks of this size: one
# chunk per request is held in memory, and a failed chunk is re-sent alone.
UPLOAD_CHUNK_BYTES = 32 * 1024 * 1024
EMULATOR_PROJECT = "kinetic-emulator"

# What the orchestrator does on the jobs bucket (payloads written, final states read, prefixes
# listed and cleaned up; an overwrite needs delete too), all held by roles/storage.objectAdmin.
JOBS_BUCKET_PERMISSIONS = (
    "storage.objects.create",
    "storage.objects.delete",
    "storage.objects.get",
    "storage.objects.list",
)
# What reading a task's result through Prefect's GcsBucket needs (it reads the bucket's
# metadata before every read).
RESULTS_BUCKET_READ_PERMISSIONS = ("storage.buckets.get", "storage.objects.get")
# What a pod's engine writing a result through GcsBucket needs (an overwrite needs delete).
RESULTS_BUCKET_WRITE_PERMISSIONS = (
    "storage.buckets.get",
    "storage.objects.create",
    "storage.objects.delete",
    "storage.objects.get",
)
PERMISSIONS_DOC = (
    'docs/kubernetes.md "Permissions" (roles: '
    "https://cloud.google.com/iam/docs/roles-permissions/storage)"
)


def emulator_host() -> str | None:
    """The GCS emulator endpoint, when emulator mode is on."""
    return os.environ.get("STORAGE_EMULATOR_HOST") or None


def retrying_session(credentials: Any | None) -> Any:
    """An HTTP session for google-cloud-storage that retries transient failures."""
    import requests
    from requests.adapters import HTTPAdapter
    from urllib3.util.retry import Retry

    if credentials is None:
        session = requests.Session()
    else:
        from google.auth.transport.requests import AuthorizedSession

        session = AuthorizedSession(credentials)
    retry = Retry(
        total=10,
        connect=10,
        read=10,
        status=10,
        backoff_factor=0.1,
        backoff_max=8,
        status_forcelist=RETRY_STATUSES,
        allowed_methods=None,  # our writes are idempotent: same bytes to the same key
        raise_on_status=False,
        respect_retry_after_header=True,
    )
    adapter = HTTPAdapter(max_retries=retry, pool_maxsize=32)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


# google-cloud-storage (3.17 on) otherwise fetches each bucket's metadata in the background,
# once per client and bucket, to label trace spans even with tracing off, and checks that
# the bucket exists after every 404: a request (and a storage.buckets.get denial, which
# roles/storage.objectAdmin does not grant) per pod, and one per missing object looked for.
# The library reads it at each request, so pods get it in their manifest's env: a warm
# pod puts its environment back between tasks, which would drop a value set here.
NO_BUCKET_METADATA_ENV = "DISABLE_GCS_PYTHON_CLIENT_OTEL_BUCKET_METADATA"


def storage_client(project: str | None = None, credentials: Any | None = None) -> Client:
    """A Cloud Storage client with the given credentials, else the default ones.

    The default is Application Default Credentials, or anonymous in emulator mode;
    given credentials are used in emulator mode too, so the emulator sees their tokens.
    """
    from google.cloud import storage

    # A user's own setting is kept.
    os.environ.setdefault(NO_BUCKET_METADATA_ENV, "true")
    if emulator_host():
        from google.auth.credentials import AnonymousCredentials

        return storage.Client(
            project=project or EMULATOR_PROJECT,
            credentials=credentials or AnonymousCredentials(),
            _http=retrying_session(credentials),
        )
    if credentials is None:
        import google.auth

        credentials, default_project = google.auth.default(
            scopes=["https://www.googleapis.com/auth/devstorage.read_write"]
        )
        project = project or default_project
    return storage.Client(
        project=project, credentials=credentials, _http=retrying_session(credentials)
    )


def split_gs_uri(uri: str) -> tuple[str, str]:
    """`gs://bucket/some/prefix` → (`bucket`, `some/prefix`); raises on a URI without a bucket."""
    if not uri.startswith("gs://"):
        raise ValueError(f"{uri!r} is not a gs:// URI.")
    bucket, _, prefix = uri[len("gs://") :].partition("/")
    if not bucket:
        raise ValueError(f"{uri!r} has no bucket: use gs://BUCKET/optional/prefix.")
    return bucket, prefix.strip("/")


# What task pods do on the environment store: read archives, manifests and markers.
ENVIRONMENT_STORE_READ_PERMISSIONS = ("storage.objects.get",)
# Reading and listing objects, all that roles/storage.objectViewer holds of them.
_VIEWER_PERMISSIONS = frozenset({"storage.objects.get", "storage.objects.list"})


def viewer_enough(permissions: list[str]) -> bool:
    """Whether roles/storage.objectViewer holds every one of `permissions`."""
    return _VIEWER_PERMISSIONS.issuperset(permissions)


def role_holding(permission: str, read_only: bool = False) -> str:
    """The role the docs grant for `permission`: bucket metadata, or objects.

    `read_only`: the identity only reads the bucket's objects (task pods on the
    environment store), so the role is objectViewer where it holds the permission.
    """
    if permission == "storage.buckets.get":
        return "roles/storage.legacyBucketReader"
    if read_only and permission in _VIEWER_PERMISSIONS:
        return "roles/storage.objectViewer"
    return "roles/storage.objectAdmin"


def grant_hint(
    bucket: str, permissions: list[str], member: str | None = None, read_only: bool = False
) -> str:
    """The gcloud commands that grant `permissions` on `bucket` to `member` (else MEMBER).

    `read_only`: `member` only reads the bucket's objects, as the docs grant it.
    """
    roles = sorted({role_holding(p, read_only) for p in permissions})
    commands = "; ".join(
        f"gcloud storage buckets add-iam-policy-binding gs://{bucket} "
        f"--member={member or 'MEMBER'} --role={role}"
        for role in roles
    )
    who = (
        member
        or "the account that lacks it (MEMBER: user:YOU@EXAMPLE.COM, or "
        "serviceAccount:GSA@PROJECT.iam.gserviceaccount.com for pods through Workload Identity)"
    )
    return (
        f"Grant {' and '.join(roles)} on gs://{bucket} to {who}: {commands}. See {PERMISSIONS_DOC}."
    )


def denied_permission(exc: BaseException) -> str | None:
    """The permission a GCS 403 names; None when `exc` is not a 403 from GCS."""
    from google.api_core.exceptions import Forbidden

    if not isinstance(exc, Forbidden):
        return None
    match = re.search(r"does not have ([\w.]+) access", str(exc))
    return match[1] if match else "a storage permission"


def holds_key(gcp_credentials: Any) -> bool:
    """Whether a prefect-gcp `GcpCredentials` block holds a service-account key (info or file)."""
    return bool(
        getattr(gcp_credentials, "service_account_info", None)
        or getattr(gcp_credentials, "service_account_file", None)
    )


def _credentials_key(gcp_credentials: Any) -> str | None:
    """What tells one block's identity from another's; None: the process default."""
    if not holds_key(gcp_credentials):
        return None
    info = gcp_credentials.service_account_info
    if info is not None:
        import hashlib
        import json

        text = json.dumps(info.get_secret_value(), sort_keys=True)
        return f"info:{hashlib.sha256(text.encode()).hexdigest()}"
    return f"file:{gcp_credentials.service_account_file}"


_clients: dict[tuple[str | None, str | None], Any] = {}
_clients_lock = threading.Lock()


def shared_client(gcp_credentials: Any = None) -> Client:
    """The process's client for a prefect-gcp `GcpCredentials` block (None: the default).

    A block with a service-account key acts as that account; one without acts as
    Application Default Credentials, as prefect-gcp's block does. One client per
    identity (and emulator setting) per process: clients hold connection pools.
    """
    key = (emulator_host(), _credentials_key(gcp_credentials))
    with _clients_lock:
        if key not in _clients:
            if key[1] is None:
                _clients[key] = storage_client()
            else:
                _clients[key] = storage_client(
                    project=getattr(gcp_credentials, "project", None),
                    credentials=gcp_credentials.get_credentials_from_service_account(),
                )
        return _clients[key]


class GcsStore:
    """The jobs store over `gs://bucket/prefix`, with byte and request counters.

    `gcp_credentials`, a prefect-gcp `GcpCredentials` block, is whom the store acts
    as (the orchestrator's `KineticCluster.gcp_credentials`); None: the default.
    """

    def __init__(
        self, root: str, client: Client | None = None, gcp_credentials: Any = None
    ) -> None:
        self.bucket_name, self.prefix = split_gs_uri(root)
        self.root = f"gs://{self.bucket_name}" + (f"/{self.prefix}" if self.prefix else "")
        self._client = client
        self.gcp_credentials = gcp_credentials
        self._counters = threading.Lock()
        self.bytes_uploaded = 0
        self.uploads = 0

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = shared_client(self.gcp_credentials)
        return self._client

    def _name(self, key: str) -> str:
        key = key.strip("/")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _prefix(self, prefix: str) -> str:
        # `a/b/` is the folder `a/b/` and nothing else: its trailing slash is kept.
        name = self._name(prefix)
        return f"{name}/" if prefix.endswith("/") and name and not name.endswith("/") else name

    def _blob(self, key: str) -> Any:
        return self.client.bucket(self.bucket_name).blob(self._name(key))

    def uri(self, key: str) -> str:
        return f"gs://{self.bucket_name}/{self._name(key)}"

    def put_bytes(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> str:
        """Write the object (with custom `metadata`, in the same request)."""
        return self.put_stream(key, io.BytesIO(data), len(data), metadata)

    def put_stream(
        self, key: str, stream: BinaryIO, size: int, metadata: dict[str, str] | None = None
    ) -> str:
        from google.cloud.storage.retry import DEFAULT_RETRY

        # A resumable upload rewinds `stream` to the last byte GCS confirmed and
        # re-sends from there; `stream` must support tell() and seek().
        blob = self._blob(key)
        blob.chunk_size = UPLOAD_CHUNK_BYTES
        if metadata:
            blob.metadata = metadata
        blob.upload_from_file(stream, size=size, rewind=False, retry=DEFAULT_RETRY)
        with self._counters:
            self.bytes_uploaded += size
            self.uploads += 1
        return self.uri(key)

    def put_if_absent(self, key: str, data: bytes, deadline: float | None = None) -> bytes | None:
        """Write the object only if there is none (`ifGenerationMatch=0`): None if this call
        created it, else the object that is there. A retried request whose first try
        landed is refused by GCS as well; the object then holds exactly `data`, which
        tells the two apart. `deadline`: seconds for the request and its retries."""
        from google.api_core.exceptions import PreconditionFailed
        from google.cloud.storage.retry import DEFAULT_RETRY

        retry = DEFAULT_RETRY if deadline is None else DEFAULT_RETRY.with_deadline(deadline)
        timeout = 60.0 if deadline is None else deadline
        try:
            self._blob(key).upload_from_string(
                data, if_generation_match=0, retry=retry, timeout=timeout
            )
        except PreconditionFailed:
            there = self.get_bytes(key)
            return None if there == data else there
        with self._counters:
            self.bytes_uploaded += len(data)
            self.uploads += 1
        return None

    def get_bytes(self, key: str) -> bytes:
        """The object's bytes; `FileNotFoundError` when there is none, as in `LocalStore`."""
        from google.api_core.exceptions import NotFound

        try:
            data: bytes = self._blob(key).download_as_bytes()
        except NotFound as exc:
            raise FileNotFoundError(self.uri(key)) from exc
        return data

    def get_metadata(self, key: str) -> dict[str, str] | None:
        """The object's custom metadata ({} if it has none); None when there is no object."""
        blob = self.client.bucket(self.bucket_name).get_blob(self._name(key))
        return None if blob is None else dict(blob.metadata or {})

    def get_file(self, key: str, destination: Path) -> None:
        destination.parent.mkdir(parents=True, exist_ok=True)
        self._blob(key).download_to_filename(str(destination))

    def list(self, prefix: str) -> list[tuple[str, int]]:
        """Objects whose names start with `prefix` (exactly: `p/` never matches `p-extra/`)."""
        name = self._prefix(prefix)
        strip = f"{self.prefix}/" if self.prefix else ""
        return sorted(
            (blob.name[len(strip) :], int(blob.size or 0))
            for blob in self.client.list_blobs(self.bucket_name, prefix=name)
        )

    def exists(self, key: str) -> bool:
        return bool(self._blob(key).exists())

    def delete_prefix(self, prefix: str) -> int:
        """Delete the object `prefix` and every object under `prefix/`."""
        name = self._name(prefix)
        blobs = [
            blob
            for blob in self.client.list_blobs(self.bucket_name, prefix=name)
            if blob.name == name or blob.name.startswith(f"{name}/")
        ]
        for blob in blobs:
            blob.delete()
        return len(blobs)

    def bucket_exists(self) -> bool:
        return bool(self.client.bucket(self.bucket_name).exists())
