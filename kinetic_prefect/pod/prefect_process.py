"""What a pod process needs of Prefect beyond the task engine.

Rereading Prefect's settings after the environment changed (a pod forked from
the local template), sending queued logs and events without exiting (a warm
pod between tasks), the result record a persisted result travels as, whether
that result was stored, and one attempt of the engine without its in-process
retries (a slice's host 0). Each leans on Prefect internals; the tests named in
each docstring fail if they change:
`test_task_logs_reach_the_api_before_the_flow_ends_its_warm_pods`,
`test_a_forked_pod_reads_prefect_settings_from_its_own_environment`,
`test_a_result_record_replaced_after_the_pod_wrote_it_is_refused_naming_it_never_unpickled`,
`test_a_local_pod_that_cannot_write_a_gcs_results_bucket_fails_naming_storage_objects_create`,
`test_an_exception_on_host_0_retries_the_whole_slice_with_one_attempt_number`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def send_logs_and_events(timeout: float) -> bool:
    """Send the log lines and events this process has queued for the API; True if all went.

    For a warm pod between tasks: its process does not exit, so Prefect's at-exit
    drain of its log and event workers does not run, and a pod stopped while idle
    would lose what the last task logged. `drain_all` is what Prefect's own exit
    handlers call; the next task's first log line or event starts a new worker.
    `test_task_logs_reach_the_api_before_the_flow_ends_its_warm_pods` fails if that changes.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    deadline = time.monotonic() + timeout
    sent = True
    for worker in (APILogWorker, EventsWorker):  # logs first: events of the end come last
        result = worker.drain_all(timeout=max(deadline - time.monotonic(), 0.0))
        if isinstance(result, tuple):
            sent = sent and not result[1]
    return sent


def reload_prefect_settings() -> None:
    """Read Prefect's settings and logging configuration again from this process's environment.

    For a process whose environment was replaced after `import prefect` (a pod
    forked from the local backend's template). Prefect keeps the settings it
    read at import in its global settings context; `refresh_global_settings_context`
    is how Prefect itself rereads them after plugins set variables. The test
    `test_a_forked_pod_reads_prefect_settings_from_its_own_environment` fails if that changes.
    """
    from prefect import context
    from prefect.logging.configuration import setup_logging

    context.refresh_global_settings_context()
    setup_logging(incremental=False)


def send_telemetry(timeout: float) -> bool:
    """Before a warm pod reports a task's end: its logs and events, sent (the pod will not exit)."""
    return send_logs_and_events(timeout)


def shippable_state(state: Any, task: Any) -> Any:
    """The state to send back: a persisted result travels as its metadata only.

    The orchestrator then reads the value through Prefect's result store, like
    any other Prefect process would, instead of through the pod's report.
    """
    record = _persisted_record(state, task)
    if record is not None:
        return state.model_copy(update={"data": record.metadata})
    return state


def _persisted_record(state: Any, task: Any) -> Any:
    """The result record of a Completed task whose result went to a storage block, else None."""
    from prefect._internal.result_records import ResultRecord

    record = state.data
    if (
        isinstance(record, ResultRecord)
        and state.is_completed()
        and task.persist_result is True
        and record.metadata.storage_block_id is not None
    ):
        return record
    return None


class _LoggedErrors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.exceptions: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.exceptions.append(record.exc_info[1])


@contextmanager
def logged_task_run_errors() -> Iterator[list[BaseException]]:
    """The exceptions Prefect logs for the task run while the block runs (its run logger's)."""
    handler = _LoggedErrors()
    logger = logging.getLogger("prefect.task_runs")
    logger.addHandler(handler)
    try:
        yield handler.exceptions
    finally:
        logger.removeHandler(handler)


def direct_result_writes(task: Any) -> None:
    """Ready a task whose results go to a saved GCS bucket (`PodGcsBucket`) to write them.

    The orchestrator decided the cache lookup before the pod started, so the engine here
    does not look up again (`refresh_cache`): it writes. What a warm pod's earlier tasks
    wrote was reported already.
    `test_a_result_record_replaced_after_the_pod_wrote_it_is_refused_naming_it_never_unpickled`
    fails if the engine stops writing through the block's `write_path`.
    """
    from kinetic_prefect.common.prefect_pod_storage import WRITTEN, PodGcsBucket

    WRITTEN.clear()
    if isinstance(task.result_storage, PodGcsBucket):
        task.refresh_cache = True


def _direct_location(task: Any, metadata: Any) -> str | None:
    """gs://bucket/object of the record `metadata` names, if the storage writes directly."""
    from kinetic_prefect.common.prefect_pod_storage import PodGcsBucket

    storage = task.result_storage
    if not isinstance(storage, PodGcsBucket):
        return None
    if storage._block_document_id != metadata.storage_block_id:
        return None
    return storage.location(str(metadata.storage_key))


def written_record(task: Any, metadata: Any) -> tuple[str, bytes | None] | None:
    """The sha256 of the result record `metadata` names, and its bytes when small, if this
    process wrote it directly."""
    from kinetic_prefect.common.prefect_pod_storage import WRITTEN

    location = _direct_location(task, metadata)
    return WRITTEN.get(location) if location else None


def unstored_result(state: Any, task: Any, logged: list[BaseException]) -> Any:
    """A Failed state when a Completed task's persisted result is not in its GCS storage.

    Prefect's engine writes the result record when it commits the task's
    transaction, and a failed commit is logged, not raised: the run still ends
    Completed, and whoever reads the result later finds nothing. A record written
    through a `PodGcsBucket` is known to be stored; another GCS one is looked
    up here (its metadata only). A missing one fails the run with the error Prefect
    logged (a GCS 403 names the permission). None when the result is stored, not
    persisted, or not on GCS. `test_a_task_pod_that_cannot_write_the_results_bucket_
    fails_naming_storage_objects_create` fails if that changes.
    """
    from prefect.blocks.core import Block
    from prefect.states import Failed

    from kinetic_prefect.common.gcs import GcsStore, denied_permission, grant_hint, split_gs_uri
    from kinetic_prefect.common.prefect_pod_storage import WRITTEN
    from kinetic_prefect.errors import ResultNotStoredError

    record = _persisted_record(state, task)
    if record is None:
        return None
    direct = _direct_location(task, record.metadata)
    if direct is not None:
        if direct in WRITTEN:
            return None
        bucket, path = split_gs_uri(direct)
        needed = ["storage.objects.create"]
    else:
        storage: Any = Block.load_from_ref(record.metadata.storage_block_id)
        resolve = getattr(storage, "_resolve_path", None)
        if not getattr(storage, "bucket", None) or resolve is None:
            return None
        bucket, path = str(storage.bucket), resolve(record.metadata.storage_key)
        if GcsStore(f"gs://{bucket}").exists(path):
            return None
        needed = ["storage.buckets.get", "storage.objects.create"]
    cause = f": {logged[-1]}" if logged else ""
    denied = denied_permission(logged[-1]) if logged else None
    message = (
        f"The task returned, but Prefect could not store its result at gs://{bucket}/{path}"
        f"{cause}. The run is failed rather than Completed without a readable result. "
        + grant_hint(bucket, [denied] if denied else needed)
    )
    error = ResultNotStoredError(message)
    return Failed(message=message, data=error)


def run_one_attempt(
    task: Any,
    task_run: Any,
    parameters: dict[str, Any],
    wait_for: Any,
    dependencies: Any,
    context: dict[str, Any],
    return_type: str = "state",
) -> Any:
    """One run of the task through Prefect's engine, stopping where the engine would retry.

    `run_task_sync` / `run_task_async` loop while the task run is Running or
    Scheduled: a retry runs the function again in this process. A slice host
    must not (the other hosts are still in the failed attempt's collectives),
    so the engine's loop runs once here: the engine records the retry state
    (`Retrying`, or `AwaitingRetry` with a delay) and returns it, and the
    runner relaunches every host. Returns the state (`return_type` is always
    "state"). This drives the engine's own steps, as `run_task_sync` does;
    `test_an_exception_on_host_0_retries_the_whole_slice_with_one_attempt_number`
    fails if they change.
    """
    from prefect.task_engine import AsyncTaskRunEngine, SyncTaskRunEngine

    engine_class = AsyncTaskRunEngine if task.isasync else SyncTaskRunEngine
    engine: Any = engine_class(
        task=task, parameters=parameters, task_run=task_run, wait_for=wait_for, context=context
    )
    if task.isasync:
        import asyncio

        return asyncio.run(_one_attempt_async(engine, dependencies))
    with engine.start(task_run_id=None, dependencies=dependencies):
        if engine.is_running():
            engine.wait_until_ready()
            with (
                engine.asset_context(),
                engine.run_context(),
                engine.transaction_context() as transaction,
            ):
                engine.call_task_fn(transaction)
    return engine.state


async def _one_attempt_async(engine: Any, dependencies: Any) -> Any:
    async with engine.start(task_run_id=None, dependencies=dependencies):
        if engine.is_running():
            await engine.wait_until_ready()
            async with (
                engine.asset_context(),
                engine.run_context(),
                engine.transaction_context() as transaction,
            ):
                await engine.call_task_fn(transaction)
    return engine.state
