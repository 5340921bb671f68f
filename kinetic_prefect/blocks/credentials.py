"""`KineticGcpCredentials`: GCP credentials that work with the GCS emulator.

A module of its own because a pod whose results go to a GCS bucket with a
service-account key imports it (its task carries these credentials; without a key the
pod gets none, `common.prefect_pod_storage`): it needs prefect-gcp, never
prefect-kubernetes, which `KineticCluster` needs (about half a second of CPU per pod).
"""

from __future__ import annotations

from typing import Any

from prefect_gcp.credentials import GcpCredentials

from kinetic_prefect.blocks.schema import SchemaOnce
from kinetic_prefect.common import gcs

DOCUMENTATION_URL = "https://pypi.org/project/kinetic-prefect/"


class KineticGcpCredentials(SchemaOnce, GcpCredentials):
    """GCP credentials whose storage clients retry transient errors and honour the emulator.

    With `STORAGE_EMULATOR_HOST` set, credentials are anonymous in every process
    unless the block holds a service-account key; otherwise this behaves as
    prefect-gcp's `GcpCredentials` (service account info or file, else Application
    Default Credentials / Workload Identity).

    Examples:
        Load saved credentials and list a bucket:
        ```python
        from kinetic_prefect import KineticGcpCredentials

        credentials = KineticGcpCredentials.load("BLOCK_NAME")
        client = credentials.get_cloud_storage_client()
        print([blob.name for blob in client.list_blobs("my-kinetic-jobs", max_results=5)])
        ```

        Save a result storage block that pods can read with these credentials:
        ```python
        from prefect_gcp.cloud_storage import GcsBucket
        from kinetic_prefect import KineticGcpCredentials

        GcsBucket(bucket="my-results", gcp_credentials=KineticGcpCredentials()).save("results")
        ```
    """

    _block_type_name = "Kinetic GCP Credentials"
    _block_type_slug = "kinetic-gcp-credentials"
    _description = "GCP credentials with retrying storage clients and GCS emulator support."
    _documentation_url = DOCUMENTATION_URL  # type: ignore[assignment]
    _logo_url = GcpCredentials._logo_url

    def block_initialization(self) -> None:
        # prefect-gcp resolves credentials when the block is built; the emulator has
        # none, and a block loaded before credentials exist must still load: the
        # preflight check says what to set before any pod starts.
        if gcs.emulator_host():
            self.project = self.project or gcs.EMULATOR_PROJECT  # type: ignore[has-type]
            return
        try:
            super().block_initialization()
        except Exception as exc:
            import google.auth.exceptions

            if not isinstance(exc, google.auth.exceptions.DefaultCredentialsError):
                raise

    def get_credentials_from_service_account(self) -> Any:
        if self._anonymous():
            from google.auth.credentials import AnonymousCredentials

            return AnonymousCredentials()
        return super().get_credentials_from_service_account()

    def get_cloud_storage_client(self, project: str | None = None) -> Any:
        credentials = None if self._anonymous() else self.get_credentials_from_service_account()
        return gcs.storage_client(project=project or self.project, credentials=credentials)

    def _anonymous(self) -> bool:
        # Emulator mode has no default credentials; a service-account key is still used.
        return bool(gcs.emulator_host()) and not gcs.holds_key(self)
