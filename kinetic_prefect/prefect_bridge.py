"""The few places where kinetic-prefect speaks Prefect's engine language.

Kept together so that a Prefect upgrade touches one module: the serialized
context shipped to pods, the task run created on the orchestrator, and the
state changes the orchestrator reports for pods that could not report their own.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from prefect.client.schemas.objects import TaskRun
from prefect.context import FlowRunContext, SettingsContext, TaskRunContext, serialize_context
from prefect.settings import get_current_settings
from prefect.states import State
from prefect.utilities.engine import emit_task_run_state_change_event

from kinetic_prefect import pod_settings


def api_url() -> str | None:
    """The API URL pods must use: the configured one, or this process's ephemeral server."""
    configured = get_current_settings().api.url
    if configured:
        return configured
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer._instances.get(None)
    return server.api_url if server is not None and server.server_process else None


def pod_context(task: Any, task_run: TaskRun) -> dict[str, Any]:
    """Prefect's serialized context for a pod, with every secret removed.

    Only the settings sections a pod needs travel (`kinetic_prefect.pod_settings`).
    It carries the task run's asset context (upstream assets, what it
    materializes) as prefect-dask and prefect-ray ship it, so asset lineage
    events come from the pod. Secrets (API key, auth string) travel separately
    as Kubernetes Secret refs and are put back by the pod.
    """
    task_inputs = {name: set(inputs) for name, inputs in (task_run.task_inputs or {}).items()}
    context = serialize_context(
        asset_ctx_kwargs={
            "task": task,
            "task_run_id": task_run.id,
            "task_inputs": task_inputs,
            "copy_to_child_ctx": True,
        }
    )
    settings_ctx = SettingsContext.get()
    if settings_ctx is not None:
        context["settings_context"] = pod_settings.pod_serialized_settings(
            settings_ctx.serialize(include_secrets=False), api_url()
        )
    return context


def secret_values() -> dict[str, str]:
    """Secret Prefect settings a pod needs, by the env var that delivers them."""
    return pod_settings.pod_secret_settings()


def pod_settings_env() -> dict[str, str]:
    """The Prefect settings a pod receives as env vars (an allowlist), secrets excluded."""
    return pod_settings.pod_settings_env(api_url())


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


def cached_state(task: Any, task_run: TaskRun, parameters: Mapping[str, Any]) -> State[Any] | None:
    """A `Cached` state when the task's cache policy hits a committed record, else None.

    Decided here, before any pod: the key is computed as Prefect's engine does
    and looked up in the task's result store.
    """
    from prefect.cache_policies import NO_CACHE, CachePolicy
    from prefect.results import get_result_store
    from prefect.settings import PREFECT_TASKS_REFRESH_CACHE
    from prefect.states import Completed

    policy = task.cache_policy
    refresh = (
        task.refresh_cache
        if task.refresh_cache is not None
        else PREFECT_TASKS_REFRESH_CACHE.value()
    )
    if not isinstance(policy, CachePolicy) or policy is NO_CACHE or refresh:
        return None
    store: Any = get_result_store().update_for_task(task, _sync=True)  # type: ignore[call-arg]
    flow_context = FlowRunContext.get()
    context = TaskRunContext.model_construct(
        task=task, task_run=task_run, parameters=dict(parameters), result_store=store
    )
    try:
        key = policy.compute_key(
            task_ctx=context,
            inputs=dict(parameters),
            flow_parameters=(flow_context.parameters if flow_context else None) or {},
        )
    except Exception:
        return None
    if not key or not store.exists(key):
        return None
    record = store.read(key)
    return Completed(
        name="Cached", message="Cached: the result was found in the result store.", data=record
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


class _DeferredRegistry(dict[str, Any]):
    """A Prefect type registry whose kinetic-prefect entries import on first use.

    Prefect reads its registries with `get`, `keys`, `values` and `items`; a
    deferred key is imported when it is asked for by name, and every deferred
    key when the registry is listed, so lookups see the same classes as with
    eager imports.
    """

    def __init__(self, entries: Mapping[str, Any]) -> None:
        super().__init__(entries)
        self.deferred: dict[str, str] = {}

    def _load(self, key: object) -> None:
        module = self.deferred.pop(key, None) if isinstance(key, str) else None
        if module is not None:
            import importlib

            importlib.import_module(module)

    def _load_all(self) -> None:
        for key in list(self.deferred):
            self._load(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._load(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self._load(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._load(key)
        return super().__contains__(key)

    def __iter__(self) -> Any:
        self._load_all()
        return super().__iter__()

    def __len__(self) -> int:
        self._load_all()
        return super().__len__()

    def keys(self) -> Any:
        self._load_all()
        return super().keys()

    def values(self) -> Any:
        self._load_all()
        return super().values()

    def items(self) -> Any:
        self._load_all()
        return super().items()


def register_deferred(base: type, entries: Mapping[str, str]) -> None:
    """Register dispatch keys of `base` (a block slug, a worker type) by module, imported on use.

    Prefect registers a block or worker class when its module is imported;
    this lets the `prefect.collections` entry point name the classes without
    importing them (and prefect-gcp, prefect-kubernetes) in every process that
    loads collections. Prefect keeps its registries in a private table; the
    test `test_deferred_registration_reaches_prefects_registry` fails if that changes.
    """
    from prefect.utilities import dispatch

    registry = dispatch.get_registry_for_type(base)
    if registry is None:
        raise TypeError(f"{base.__name__} is not a Prefect dispatch base type")
    owner = next(cls for cls in base.mro() if dispatch._TYPE_REGISTRIES.get(cls) is registry)
    if not isinstance(registry, _DeferredRegistry):
        registry = _DeferredRegistry(registry)
        dispatch._TYPE_REGISTRIES[owner] = registry
    for key, module in entries.items():
        if not dict.__contains__(registry, key):
            registry.deferred[key] = module


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
