"""Where the runner speaks Prefect's engine language.

Kept together so that a Prefect upgrade touches one module: the task run created
on the orchestrator, the cache lookup before any pod, the state changes the
runner records for pods that could not record their own, retry timing, and the
artifacts that show where a task run's pod runs.
`test_the_engine_adapter_records_states_the_api_then_reports_as_ended` and every test
of tests/runner/test_conformance.py (`test_tags_reach_the_task_in_the_pod`, ...) fail if
Prefect's engine changes under it.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from prefect.client.schemas.objects import TaskRun
from prefect.context import FlowRunContext, TaskRunContext
from prefect.states import State
from prefect.utilities.engine import emit_task_run_state_change_event

from kinetic_prefect.common import prefect_cache


def new_task_run(
    task: Any,
    task_run_id: uuid.UUID,
    parameters: Mapping[str, Any],
    wait_for: Any,
    dependencies: Mapping[str, set[Any]] | None,
) -> TaskRun:
    """The task run the pod's engine will drive, created here so it shows up at once."""
    from prefect.task_engine import _create_task_run_locally

    task_run = _create_task_run_locally(
        task=task,
        id=task_run_id,
        parameters=dict(parameters),
        flow_run_context=FlowRunContext.get(),
        parent_task_run_context=TaskRunContext.get(),
        wait_for=wait_for or None,
        extra_task_inputs=dict(dependencies) if dependencies else None,
    )
    assert task_run.state is not None
    emit_task_run_state_change_event(
        task_run=task_run, initial_state=None, validated_state=task_run.state
    )
    return task_run


def report_state(task_run: TaskRun, state: State[Any]) -> State[Any]:
    """Record a state the pod could not report itself (crash, phase failure, cancel)."""
    last = task_run.state
    if last is not None and last.timestamp >= state.timestamp:
        state.timestamp = last.timestamp + timedelta(microseconds=1)
    if state.is_running() and task_run.start_time is None:
        # As Prefect's engine marks a run's start (its own types disagree on the class).
        task_run.start_time = state.timestamp  # type: ignore[assignment]
    state.state_details.task_run_id = task_run.id
    state.state_details.flow_run_id = task_run.flow_run_id
    task_run.state = state
    task_run.state_id = state.id
    task_run.state_type = state.type
    task_run.state_name = state.name
    emit_task_run_state_change_event(task_run=task_run, initial_state=last, validated_state=state)
    return state


def run_not_ready(
    task: Any,
    task_run: TaskRun,
    parameters: dict[str, Any],
    wait_for: Any,
    dependencies: dict[str, set[Any]] | None,
) -> State[Any]:
    """Let Prefect's engine decide NotReady for unfinished upstreams (it never calls the task)."""
    from prefect.task_engine import run_task_sync

    state = run_task_sync(
        task=task,
        task_run=task_run,
        parameters=parameters,
        wait_for=wait_for,
        dependencies=dependencies,
        return_type="state",
    )
    return state  # type: ignore[return-value]


def cache_lookup(task: Any, task_run: TaskRun, parameters: Mapping[str, Any]) -> Any:
    """The task's result store and cache key when its cache policy applies, else None.

    The key is computed as Prefect's engine does (`common.prefect_cache`), from the
    parameters the pods get; whether a record is there, and whether it can be trusted,
    is `kinetic_prefect.runner.result_check`'s business.
    """
    from prefect.results import get_result_store

    if prefect_cache.refreshes(task) or not prefect_cache.caches(task):
        return None
    store: Any = get_result_store().update_for_task(task, _sync=True)  # type: ignore[call-arg]
    key = prefect_cache.cache_key(task, task_run, parameters, store)
    return (store, key) if key else None


def run_completion_hooks(task: Any, task_run: TaskRun, state: State[Any]) -> None:
    """Run the task's `on_completion` hooks for a state no pod reached (a cache hit found
    before launching), as Prefect's engine runs them for its own cache hits: each logged
    to the task run, a failing one logged and passed over."""
    import asyncio

    from prefect.logging.loggers import task_run_logger
    from prefect.utilities.asyncutils import run_coro_as_sync

    logger = task_run_logger(task_run, task=task)
    for hook in task.on_completion_hooks or []:
        name = getattr(hook, "__name__", repr(hook))
        try:
            logger.info("Running hook %r in response to entering state %r", name, state.name)
            result = hook(task, task_run, state)
            if asyncio.iscoroutine(result):
                run_coro_as_sync(result)
        except Exception:
            logger.error("An error was encountered while running hook %r", name, exc_info=True)
        else:
            logger.info("Hook %r finished running successfully", name)


def cached(record: Any) -> State[Any]:
    """Prefect's `Cached` state for a result record found in the result store."""
    from prefect.states import Completed

    return Completed(
        name="Cached", message="Cached: the result was found in the result store.", data=record
    )


def denied_lookup(exc: BaseException, storage: Any) -> Exception | None:
    """The error to raise when a cache lookup failed because GCS denied it, else None.

    A lookup that fails is otherwise a miss, and the task runs again; one GCS
    denied names the permission, the bucket and the grant instead.
    """
    from kinetic_prefect.common import gcs
    from kinetic_prefect.errors import ConfigurationError

    permission = gcs.denied_permission(exc)
    if permission is None:
        return None
    bucket = getattr(storage, "bucket", "?")
    return ConfigurationError(
        f"Cannot look up the task's cached result: GCS denied {permission} on the result "
        f"bucket gs://{bucket} ({getattr(exc, 'message', exc)}). "
        + gcs.grant_hint(bucket, [permission])
    )


def retry_delay(task: Any, attempts_done: int) -> float:
    """Seconds to wait before the next attempt, per the task's retry settings."""
    delays = task.retry_delay_seconds
    if delays is None:
        return 0.0
    if isinstance(delays, (list, tuple)):
        if not delays:
            return 0.0
        delay = float(delays[min(attempts_done - 1, len(delays) - 1)])
    else:
        delay = float(delays)
    if task.retry_jitter_factor:
        from prefect.utilities.math import clamped_poisson_interval

        delay = clamped_poisson_interval(delay, clamping_factor=task.retry_jitter_factor)
    return max(delay, 0.0)


def awaiting_retry(delay: float, message: str | None = None) -> State[Any]:
    """Prefect's `AwaitingRetry` state, scheduled `delay` seconds from now."""
    from prefect.states import AwaitingRetry
    from prefect.types._datetime import now

    return AwaitingRetry(scheduled_time=now("UTC") + timedelta(seconds=delay), message=message)


def recorded_run_count(task_run_id: uuid.UUID) -> int:
    """How many times the API saw the task run start (0 if it cannot tell).

    A pod that dies may have run the task more than once (Prefect's own retries
    in the pod); the API's count keeps the retry budget honest across pods.
    """
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            return int(client.read_task_run(task_run_id).run_count or 0)
    except Exception:
        return 0


# Prefect's API answers at most 200 runs per read (PREFECT_API_DEFAULT_LIMIT's default).
READ_LIMIT = 200


def ended_task_runs(task_run_ids: list[uuid.UUID]) -> set[uuid.UUID]:
    """Those of `task_run_ids` whose state in the API is final: one request for each 200."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        TaskRunFilter,
        TaskRunFilterId,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import TERMINAL_STATES

    ended: set[uuid.UUID] = set()
    with get_client(sync_client=True) as client:
        for start in range(0, len(task_run_ids), READ_LIMIT):
            chunk = task_run_ids[start : start + READ_LIMIT]
            runs = client.read_task_runs(
                task_run_filter=TaskRunFilter(
                    id=TaskRunFilterId(any_=chunk),
                    state=TaskRunFilterState(
                        type=TaskRunFilterStateType(any_=list(TERMINAL_STATES))
                    ),
                ),
                limit=len(chunk),
            )
            ended.update(run.id for run in runs)
    return ended


def create_artifact(task_run: TaskRun, kind: str, description: str, data: Any) -> None:
    """Attach an artifact (markdown, table, ...) to the task run in the Prefect UI."""
    from prefect import get_client
    from prefect.client.schemas.actions import ArtifactCreate

    with get_client(sync_client=True) as client:
        client.create_artifact(
            ArtifactCreate(
                type=kind,
                description=description,
                data=data,
                task_run_id=task_run.id,
                flow_run_id=task_run.flow_run_id,
            )
        )


def record_output_location(task_run: TaskRun, rows: Mapping[str, str]) -> None:
    """A markdown artifact on the task run: where it runs and where its outputs go."""
    table = "\n".join(f"| {name} | `{value}` |" for name, value in rows.items())
    markdown = f"### Kinetic pod\n\n| | |\n|---|---|\n{table}\n"
    create_artifact(
        task_run, "markdown", "Where this task run's pod runs and writes its outputs", markdown
    )


def record_data_used(task_run: TaskRun, rows: list[dict[str, Any]]) -> None:
    """A table artifact on the task run: each `Data` it used, its content hash and size."""
    create_artifact(task_run, "table", "Data this task run used (URI, content hash, bytes)", rows)
