"""A kinetic task's result is deserialised only from bytes a pod signed.

Pods write results to result storage, which every task pod can write to. So the
orchestrator never lets Prefect read a result record of a kinetic task by
itself: it reads the record's bytes once, checks their sha256 against the digest
the pod signed, and deserialises those same bytes (`prefect_results.load_record`).

- After an attempt (`verified_result`, called by `attempt_end.read_attempt_end`,
  so also for reattached and warm pods): the digest is in the pod's signed
  final-state record, and so is a small record's copy (read from there, not from
  result storage).
- On a cache hit (`cached_state`) in saved result storage: the record may come
  from another flow run, so the digest is in the seal its pod left
  (`common.records.ResultSeal`: in the GCS record's metadata, else in the jobs
  store), signed with that flow run's key. (Unsaved result storage is the local
  backend's own disk, read as Prefect reads it.)

A digest that does not match, or a signature that does not verify, fails the
task run with `TamperedResultError` naming the record and the task run; a
record with no seal at all (written by something other than a kinetic pod) is
no cache hit: a pod runs the task again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prefect.logging import get_logger
from prefect.states import Failed, State

from kinetic_prefect.common import layout, prefect_results
from kinetic_prefect.common.records import FinalRecord, ResultSeal
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.errors import TamperedResultError
from kinetic_prefect.runner import prefect_engine as prefect_bridge

logger = get_logger("kinetic_prefect.runner.result_check")


def _task_run_name(task_run: Any) -> str:
    return f"task run {task_run.name!r} ({task_run.id})" if task_run is not None else "the task run"


def verified_result(
    record: FinalRecord, reference: Any, job_id: str, task_run: Any, gcp_credentials: Any = None
) -> Any:
    """The result record `reference` points at, deserialised only once its bytes match `record`.

    Read as `gcp_credentials`, whom the orchestrator acts as (`prefect_results.read_stored`).

    Raises `TamperedResultError` (naming the record and the task run) without
    deserialising anything otherwise.
    """
    run = _task_run_name(task_run)
    if not record.result_sha256 or record.result_storage_key != str(reference.storage_key):
        raise TamperedResultError(
            f"The result record {reference.storage_key!r} of {run} is not covered by the "
            f"signed final-state record of pod {job_id}; it was not unpickled. Rerun the task."
        )
    carried = record.carried_result()
    if carried is not None:
        stored = prefect_results.StoredRecord(f"the final-state record of pod {job_id}", carried)
    else:
        stored = prefect_results.read_stored(reference, gcp_credentials)
    if stored.sha256 != record.result_sha256:
        raise TamperedResultError(
            f"The result record {stored.location} of {run} was changed after pod {job_id} "
            f"wrote it (sha256 {stored.sha256}, signed {record.result_sha256}); it was not "
            "unpickled. Check who else can write to the result storage, then rerun the task."
        )
    return prefect_results.load_record(stored.data, reference)


def cached_state(
    task: Any,
    task_run: Any,
    parameters: Mapping[str, Any],
    jobs_store: JobsStore,
    flow_run_key: Callable[[str], str],
) -> State[Any] | None:
    """`Cached` when the task's cache policy hits a record a kinetic pod sealed, else None."""
    from prefect.results import ResultRecordMetadata

    found = prefect_bridge.cache_lookup(task, task_run, parameters)
    if found is None:
        return None
    result_store, key = found
    block_id = result_store.result_storage_block_id
    if block_id is None:
        # Unsaved storage: the local backend's pods share this machine's disk with the
        # flow, and pods elsewhere are refused unsaved storage before they start.
        if not result_store.exists(key):
            return None
        return prefect_bridge.cached(result_store.read(key))
    reference = ResultRecordMetadata(
        storage_key=key, storage_block_id=block_id, serializer=result_store.serializer
    )
    try:
        stored = prefect_results.read_stored(reference, jobs_store.gcp_credentials, with_seal=True)
    except Exception as exc:
        denied = prefect_bridge.denied_lookup(exc, result_store.result_storage)
        if denied is not None:
            raise denied from exc
        return None  # no record under the key: no cache hit
    try:
        seal_key = layout.result_seal_key(str(block_id), key)
        seal = ResultSeal.decode(
            stored.seal or jobs_store.get_bytes(seal_key),
            f"the seal of {stored.location}" if stored.seal else jobs_store.uri(seal_key),
        )
    except Exception as exc:
        logger.warning(
            "The cached result record %s has no seal from a kinetic pod (%s); running the task "
            "again",
            stored.location,
            exc,
        )
        return None
    if not (
        seal.signed_by(flow_run_key(seal.flow_run_id))
        and seal.storage_block_id == str(block_id)
        and seal.storage_key == key
        and seal.sha256 == stored.sha256
    ):
        message = (
            f"The cached result record {stored.location} for {_task_run_name(task_run)} does "
            f"not match the signed seal of task run {seal.task_run_id} that wrote it; it was "
            "not unpickled. Check who else can write to the result storage, then delete the "
            "record (or run the task with refresh_cache=True)."
        )
        return Failed(message=message, data=TamperedResultError(message))
    record = prefect_results.load_record(stored.data, reference)
    expiration = record.metadata.expiration
    if expiration is not None:
        import datetime

        if expiration < datetime.datetime.now(datetime.UTC):
            return None
    return prefect_bridge.cached(record)
