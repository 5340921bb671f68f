"""Checks that run before any pod starts, so bad configuration fails fast and says what to set."""

from __future__ import annotations

from typing import Any

from kinetic_prefect import gcs
from kinetic_prefect.errors import ConfigurationError


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


def check_credentials(cluster: Any) -> Any:
    """Credentials for GCS outside emulator mode: the block's, else Application Default."""
    if gcs.emulator_host():
        return None
    credentials_block = getattr(cluster, "gcp_credentials", None) if cluster else None
    try:
        if credentials_block is not None:
            return credentials_block.get_credentials_from_service_account()
        import google.auth

        credentials, _ = google.auth.default()
        return credentials
    except Exception as exc:
        raise ConfigurationError(
            f"No usable GCP credentials ({exc}). Set service_account_info or service_account_file "
            "on the KineticCluster's gcp_credentials block, run `gcloud auth application-default "
            "login`, or set GOOGLE_APPLICATION_CREDENTIALS (on GKE, use Workload Identity)."
        ) from exc


def check_jobs_root(jobs_root: str, cluster: Any) -> None:
    """The jobs bucket exists and is reachable with the configured credentials."""
    credentials = check_credentials(cluster)
    bucket, _ = gcs.split_gs_uri(jobs_root)
    client = gcs.storage_client(
        project=getattr(cluster, "project", None) if cluster else None, credentials=credentials
    )
    try:
        exists = client.bucket(bucket).exists()
    except Exception as exc:
        raise ConfigurationError(
            f"Cannot reach the jobs bucket gs://{bucket}: {exc}. Check the credentials' access."
        ) from exc
    if not exists:
        raise ConfigurationError(
            f"The jobs bucket gs://{bucket} does not exist. Create it (gcloud storage buckets "
            f"create gs://{bucket}) or set jobs_bucket on the KineticCluster / KINETIC_JOBS_BUCKET."
        )
