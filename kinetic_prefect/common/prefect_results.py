"""Prefect result records as bytes: read once, digested, and only then deserialised.

A pod's engine persists a task's result as a Prefect result record (JSON
metadata with the serialised value) in the task's result storage. The pod signs
the sha256 of those bytes in its final-state record; the orchestrator reads the
same bytes, checks the digest, and deserialises exactly those bytes, instead of
letting Prefect read (and unpickle) whatever the storage holds at that moment.

Prefect offers no public call that deserialises a record from given bytes or
reads a block's bytes without going through its result store, so this module
uses `ResultRecord.deserialize`, the storage blocks' `read_path(..., _sync=True)`
dispatch and a GCS block's `_resolve_path`.
`test_a_persisted_result_is_read_back_as_its_stored_bytes_then_deserialised`
reads a record Prefect wrote through both,
`test_a_result_record_replaced_after_the_pod_wrote_it_is_refused_naming_it_never_unpickled`
a real pod's, and `test_a_pod_resolves_result_keys_as_prefect_gcps_gcs_bucket_does`
holds the object read to the one a pod writes; they fail if any changes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StoredRecord:
    """A result record's bytes as its result storage holds them, and where they are."""

    location: str
    data: bytes
    # The seal the record carries in its own metadata (`read_stored(..., with_seal=True)`).
    seal: bytes | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def result_reference(state: Any) -> Any:
    """The metadata the state's result is referred to by (to be read from storage), or None."""
    from prefect.results import ResultRecordMetadata

    return state.data if isinstance(state.data, ResultRecordMetadata) else None


def _location(storage: Any, key: str) -> str:
    bucket = getattr(storage, "bucket", None)
    resolve = getattr(storage, "_resolve_path", None)
    if isinstance(bucket, str) and resolve is not None:
        # Where the block itself puts the key (prefect-gcp's private `_resolve_path`: below
        # its folder, unless the key already is), so this reads what the pod wrote.
        return f"gs://{bucket}/{resolve(key)}"
    basepath = getattr(storage, "basepath", None)
    if isinstance(basepath, str) and basepath:
        return f"{basepath.rstrip('/')}/{key}"
    return f"{key} (result storage block {getattr(storage, '_block_document_name', '?')})"


def read_stored(
    metadata: Any, gcp_credentials: Any = None, with_seal: bool = False
) -> StoredRecord:
    """The bytes of the result record `metadata` refers to, read once from its result storage.

    With `gcp_credentials` (a prefect-gcp `GcpCredentials` block: the orchestrator's
    `KineticCluster.gcp_credentials`) a record in a GCS bucket is read as that identity,
    the one the jobs bucket is used as; else as the storage block's own credentials.
    A GCS record is read with this process's shared client in one request (prefect-gcp's
    block would make a client and look the bucket up first); `FileNotFoundError` when
    there is none. `with_seal` also reads the seal a pod put in a GCS record's metadata
    (a request before the bytes; a missing record costs that one request only).
    """
    from prefect.results import resolve_result_storage

    storage: Any = resolve_result_storage(metadata.storage_block_id, _sync=True)  # type: ignore[call-arg]
    key = str(metadata.storage_key)
    location = _location(storage, key)
    if location.startswith("gs://"):
        from kinetic_prefect.common.gcs import GcsStore, split_gs_uri

        bucket, name = split_gs_uri(location)
        identity = gcp_credentials or getattr(storage, "gcp_credentials", None)
        store = GcsStore(f"gs://{bucket}", gcp_credentials=identity)
        seal = None
        if with_seal:
            from kinetic_prefect.common.records import SEAL_METADATA_KEY

            found = store.get_metadata(name)
            if found is None:
                raise FileNotFoundError(location)
            seal = found[SEAL_METADATA_KEY].encode() if SEAL_METADATA_KEY in found else None
        return StoredRecord(location, store.get_bytes(name), seal)
    return StoredRecord(location, storage.read_path(key, _sync=True))


def load_record(data: bytes, metadata: Any) -> Any:
    """The result record in `data` (this unpickles the value: check `data` first)."""
    from prefect.results import ResultRecord

    record: Any = ResultRecord.deserialize(data, backup_serializer=metadata.serializer)
    record.mark_persisted()
    return record
