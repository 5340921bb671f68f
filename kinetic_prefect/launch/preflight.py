"""Checks that run before any pod starts, so bad configuration fails fast and says what to set."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Literal

from prefect.logging import get_logger

from kinetic_prefect.common import gcs
from kinetic_prefect.errors import ConfigurationError

logger = get_logger("kinetic_prefect.launch.preflight")

BucketVerdict = Literal["granted", "lacking", "missing", "unknown"]


def check_result_storage(storage: Any) -> None:
    """With GCS jobs storage, results must go to a saved prefect-gcp `GcsBucket` block."""
    from prefect_gcp.cloud_storage import GcsBucket

    how = (
        "Save a GcsBucket block (GcsBucket(bucket=..., gcp_credentials=KineticGcpCredentials())"
        ".save('results')) and set it as the KineticCluster's result_storage, or pass "
        "result_storage=GcsBucket.load('results') to the task."
    )
    if storage is None:
        raise ConfigurationError(f"A GCS cluster needs result storage for task results. {how}")
    if not isinstance(storage, GcsBucket):
        raise ConfigurationError(
            f"Result storage {type(storage).__name__} cannot be read outside the pod that wrote "
            f"it; use a GCS bucket. {how}"
        )
    if getattr(storage, "_block_document_id", None) is None:
        raise ConfigurationError(
            f"The GcsBucket result storage for bucket {storage.bucket!r} is not saved, so Prefect "
            f"cannot load it where results are read. {how}"
        )


def check_relative_result_storage(storage: Any) -> None:
    """A `LocalFileSystem` with a relative basepath is refused: a task runs in its pod's
    own working directory (its extracted code), so the pod would write its results in
    another folder than the one this process reads them from."""
    from prefect.filesystems import LocalFileSystem

    if not isinstance(storage, LocalFileSystem) or not storage.basepath:
        return
    basepath = str(storage.basepath)
    if "://" in basepath or Path(basepath).expanduser().is_absolute():
        return
    raise ConfigurationError(
        f"Result storage LocalFileSystem(basepath={basepath!r}) is a relative path: the task "
        "runs in its pod's own working directory, so the pod and the flow would resolve it to "
        f"different folders. Give an absolute path (for example {str(Path(basepath).resolve())!r})."
    )


def orchestrator_client(cluster: Any) -> Any:
    """The storage client this process uses for the cluster's buckets: the cluster's
    `gcp_credentials`, else Application Default Credentials (the jobs store's own)."""
    try:
        return gcs.shared_client(getattr(cluster, "gcp_credentials", None) if cluster else None)
    except Exception as exc:
        raise ConfigurationError(
            f"No usable GCP credentials ({exc}). Set service_account_info or service_account_file "
            "on the KineticCluster's gcp_credentials block, run `gcloud auth application-default "
            "login`, or set GOOGLE_APPLICATION_CREDENTIALS (on GKE, use Workload Identity)."
        ) from exc


def check_jobs_root(jobs_root: str, cluster: Any) -> None:
    """The jobs bucket exists and the configured credentials may use its objects."""
    bucket, _ = gcs.split_gs_uri(jobs_root)
    check_bucket_permissions(
        bucket,
        gcs.JOBS_BUCKET_PERMISSIONS,
        "jobs bucket",
        "set jobs_bucket on the KineticCluster / KINETIC_JOBS_BUCKET",
        cluster,
    )


def check_bucket_permissions(
    bucket: str, wanted: tuple[str, ...], what: str, instead: str, cluster: Any = None
) -> None:
    """The bucket exists and the configured credentials hold `wanted` on it.

    Asked with `testIamPermissions`, which needs no permission itself, so a
    missing grant is named rather than seen as an unreachable bucket. A server
    without it (fake-gcs-server answers 404) cannot tell the permissions: a read
    of the bucket then tells whether it exists, and the check passes (logged).
    """
    from google.api_core.exceptions import NotFound

    client = orchestrator_client(cluster)
    granted: set[str] | None = None
    read_status: int | None = None
    try:
        try:
            granted = set(client.bucket(bucket).test_iam_permissions(list(wanted)))
        except NotFound:
            read_status = _bucket_read_status(client, bucket)
    except Exception as exc:
        raise ConfigurationError(
            f"Cannot reach the {what} gs://{bucket}: {exc}. Check the credentials' access."
        ) from exc
    verdict, missing = bucket_verdict(wanted, granted, read_status)
    if verdict == "missing":
        raise ConfigurationError(
            f"The {what} gs://{bucket} does not exist. Create it (gcloud storage buckets "
            f"create gs://{bucket}) or {instead}."
        )
    if verdict == "lacking":
        raise ConfigurationError(
            f"The credentials lack {', '.join(missing)} on the {what} gs://{bucket}. "
            + gcs.grant_hint(bucket, missing)
        )
    if verdict == "unknown":
        logger.info(
            "The storage server cannot tell the permissions on the %s gs://%s "
            "(no testIamPermissions, as on an emulator); going on without checking them.",
            what,
            bucket,
        )


def _bucket_read_status(client: Any, bucket: str) -> int:
    """The HTTP status of a read of the bucket's metadata (GET bucket)."""
    from google.api_core.exceptions import Forbidden, NotFound

    try:
        client.get_bucket(bucket)
    except NotFound:
        return 404
    except Forbidden:
        return 403
    return 200


def bucket_verdict(
    wanted: Sequence[str], granted: Collection[str] | None, read_status: int | None
) -> tuple[BucketVerdict, list[str]]:
    """What GCS's answers say about a bucket: a verdict and the permissions it lacks.

    `granted` is what `testIamPermissions` granted, None when it answered 404;
    `read_status` is the status of GET bucket, read only then. A bucket that
    answers the read but not `testIamPermissions` is on a server that cannot
    tell the permissions: "unknown". Any other answer leaves the 404 standing:
    "missing" (GCS answers 403 to a caller without storage.buckets.get whether
    the bucket exists or not).
    """
    if granted is not None:
        missing = [p for p in wanted if p not in granted]
        return ("lacking", missing) if missing else ("granted", [])
    if read_status == 200:
        return "unknown", []
    return "missing", []


_LOOPBACK_HOSTS = {"localhost", "ip6-localhost", "ip6-loopback", "0.0.0.0", "::", ""}


def is_loopback_url(url: str) -> bool:
    """Whether `url` points at this machine only (localhost, 127.0.0.0/8, ::1, 0.0.0.0)."""
    import ipaddress
    from urllib.parse import urlsplit

    host = (urlsplit(url).hostname or "").lower()
    if host in _LOOPBACK_HOSTS or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_api_reachable_by_pods(settings: Any) -> str:
    """Refuse a Prefect API URL that pods in a cluster cannot reach; returns the URL.

    Pods report their task runs to the API themselves, so an ephemeral API (no
    `PREFECT_API_URL`: a server inside this process) or a loopback one would leave every
    pod unable to start. `allow_loopback_api` (`KINETIC_ALLOW_LOOPBACK_API=true`) accepts a
    loopback URL for clusters whose pods share this machine's network.
    """
    from prefect.settings import get_current_settings

    how = (
        "Set PREFECT_API_URL to an address the cluster's pods can reach: Prefect Cloud "
        "(prefect cloud login), or a Prefect server exposed to the cluster, e.g. "
        "http://prefect-server.prefect.svc.cluster.local:4200/api."
    )
    url = get_current_settings().api.url
    if not url:
        raise ConfigurationError(
            "The gke backend needs a Prefect API that outlives this process, but "
            f"PREFECT_API_URL is not set (Prefect would start an ephemeral server here). {how}"
        )
    if is_loopback_url(url) and not getattr(settings, "allow_loopback_api", False):
        raise ConfigurationError(
            f"PREFECT_API_URL={url} is a loopback address, which pods in the cluster cannot "
            f"reach. {how} If the pods share this machine's network (kind or minikube with "
            "hostNetwork), set KINETIC_ALLOW_LOOPBACK_API=true."
        )
    return str(url)


# -- kinetic-prefect doctor ---------------------------------------------------------------
