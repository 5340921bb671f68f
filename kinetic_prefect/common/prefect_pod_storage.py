"""A saved `GcsBucket` as a task pod writes to it, without importing prefect-gcp.

The runner ships a `PodGcsBucket` in place of a task's saved prefect-gcp `GcsBucket`,
with the saved block's document id: Prefect's result store names that id in each record's
metadata, so records keep referring to the saved block, which the orchestrator reads them
back with. A pod that unpickled the `GcsBucket` itself would import prefect-gcp, whose
package imports its Cloud Run, Vertex and BigQuery modules: about a third of a second of
CPU at every pod's start.

It sets the block's private `_block_document_id` and stands in for `GcsBucket`'s
`_resolve_path`.
`test_a_result_record_replaced_after_the_pod_wrote_it_is_refused_naming_it_never_unpickled`
(a real pod's engine writing through it, its record read back through the saved block)
and `test_a_pod_resolves_result_keys_as_prefect_gcps_gcs_bucket_does` fail if either
stops holding.

Imported only where Prefect is already: the module defines a Prefect block.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import PurePosixPath
from typing import Any

from prefect.filesystems import WritableFileSystem

# Each result record this process wrote through a `PodGcsBucket`, by URI: its sha256, and
# its bytes when they are few enough to travel in the final-state record.
WRITTEN: dict[str, tuple[str, bytes | None]] = {}


def result_seal(task_run: Any, storage_block_id: str, storage_key: str, sha256: str) -> Any:
    """The pod's signed `ResultSeal` of a result record of `task_run` it persisted."""
    from kinetic_prefect.common.env import SIGNING_KEY_ENV
    from kinetic_prefect.common.records import ResultSeal

    seal = ResultSeal(
        flow_run_id=str(task_run.flow_run_id or "no-flow-run"),
        task_run_id=str(task_run.id),
        storage_block_id=storage_block_id,
        storage_key=storage_key,
        sha256=sha256,
    )
    key = os.environ.get(SIGNING_KEY_ENV)
    if key:
        seal.sign(key)
    return seal


class PodGcsBucket(WritableFileSystem):
    """A saved `GcsBucket` as a task pod writes to it: the same objects, one request each.

    prefect-gcp's block makes a client and looks its bucket up (a request, and
    `storage.buckets.get`) before every write. This writes the same bytes to the same
    object with the process's shared client, puts the record's seal (`result_seal`) in
    its custom metadata in the same request, and remembers what it wrote (`WRITTEN`),
    so the pod signs the digest without reading the record back. `gcp_credentials` is
    the bucket's credentials block when it holds a service-account key; None acts as
    Application Default Credentials (Workload Identity on GKE), as that block would.
    """

    _block_type_name = "Kinetic Pod GCS Bucket"
    _block_type_slug = "kinetic-pod-gcs-bucket"

    bucket: str
    bucket_folder: str = ""
    gcp_credentials: Any = None

    @classmethod
    def standing_in_for(cls, storage: Any) -> Any:
        """What a pod gets in `storage`'s place: a saved `GcsBucket` as this, else `storage`."""
        if getattr(storage, "_block_document_id", None) is None:
            return storage  # not a saved block: Prefect's task refuses it, not this
        gcs = sys.modules.get("prefect_gcp.cloud_storage")  # a GcsBucket has imported it
        # A subclass may write or resolve keys its own way: it goes to the pod as it is.
        if gcs is None or type(storage) is not gcs.GcsBucket:
            return storage
        from kinetic_prefect.common.gcs import holds_key

        credentials = storage.gcp_credentials
        pod = cls(
            bucket=storage.bucket,
            bucket_folder=storage.bucket_folder or "",
            gcp_credentials=credentials if holds_key(credentials) else None,
        )
        for private in ("_block_document_id", "_block_document_name", "_is_anonymous"):
            setattr(pod, private, getattr(storage, private))
        return pod

    def _resolve_path(self, path: str) -> str:
        """The object `path` names, as `GcsBucket` resolves it: below the folder, once."""
        if self.bucket_folder and path.startswith(self.bucket_folder):
            return path
        return str(PurePosixPath(self.bucket_folder, path)) if self.bucket_folder else path

    def location(self, path: str) -> str:
        """gs://bucket/object of `path`, as `WRITTEN` names it."""
        return str(self._store().uri(self._resolve_path(path)))

    def _store(self) -> Any:
        from kinetic_prefect.common.gcs import GcsStore

        return GcsStore(f"gs://{self.bucket}", gcp_credentials=self.gcp_credentials)

    def _write(self, path: str, content: bytes) -> str:
        from prefect.context import TaskRunContext

        from kinetic_prefect.common.records import INLINE_RESULT_BYTES, SEAL_METADATA_KEY

        resolved = self._resolve_path(path)
        sha256 = hashlib.sha256(content).hexdigest()
        context = TaskRunContext.get()
        metadata = None
        if context is not None:
            seal = result_seal(context.task_run, str(self._block_document_id), path, sha256)
            metadata = {SEAL_METADATA_KEY: seal.encode().decode()}
        small = content if len(content) <= INLINE_RESULT_BYTES else None
        WRITTEN[self._store().put_bytes(resolved, content, metadata)] = (sha256, small)
        return resolved

    def write_path(self, path: str, content: bytes, **_dispatch: Any) -> str:  # type: ignore[override]
        return self._write(path, content)

    async def awrite_path(self, path: str, content: bytes) -> str:
        import asyncio

        return await asyncio.to_thread(self._write, path, content)

    def read_path(self, path: str, **_dispatch: Any) -> bytes:  # type: ignore[override]
        return bytes(self._store().get_bytes(self._resolve_path(path)))

    async def aread_path(self, path: str) -> bytes:
        import asyncio

        return await asyncio.to_thread(self.read_path, path)
