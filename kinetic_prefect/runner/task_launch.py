"""One task run on its way through one or more pods.

`TaskLaunch` holds what the runner was given for a task run (the task, its run,
its settings and context), what its pods get (`Inputs`, once prepared) and its
`RunState`. Only `kinetic_prefect.runner.run_loop` assigns its fields; everyone
else reads them and posts events (`TaskRunEvents`).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prefect.client.schemas.objects import TaskRun

from kinetic_prefect.backends.base import Backend, PodExit
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.launch.accelerators import Accelerator, parse_accelerator
from kinetic_prefect.launch.manifest import DataVolume
from kinetic_prefect.launch.settings import LaunchSettings, spot_request
from kinetic_prefect.runner.run_state import Event, RunState


@dataclass(frozen=True)
class Inputs:
    """What the task run's pods get, resolved and shipped once before the first pod."""

    store: JobsStore
    parameters: dict[str, Any] = field(default_factory=dict)
    dependencies: dict[str, set[Any]] | None = None
    data_volumes: tuple[DataVolume, ...] = ()
    local_data_paths: tuple[Path, ...] = ()
    data_bytes_uploaded: int = 0


@dataclass
class TaskLaunch:
    """One task run on its way through one or more pods (one per attempt)."""

    task: Any
    task_run: TaskRun
    future: concurrent.futures.Future[Any]
    settings: LaunchSettings
    accelerator: Accelerator
    task_key: str
    output_dir: str
    context: contextvars.Context
    serialized_context: dict[str, Any]
    state: RunState
    inputs: Inputs | None = None
    # The backend and Job manifest of the current attempt, once its pod was started.
    backend: Backend | None = None
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def job_id(self) -> str:
        return self.state.job_id

    @property
    def job_ids(self) -> tuple[str, ...]:
        return self.state.job_ids

    @property
    def cancelled(self) -> bool:
        return self.state.cancelled

    @property
    def pods_launched(self) -> int:
        return self.state.pods_launched

    @property
    def store(self) -> JobsStore | None:
        return self.inputs.store if self.inputs is not None else None

    @property
    def data_bytes_uploaded(self) -> int:
        return self.inputs.data_bytes_uploaded if self.inputs is not None else 0

    def attempt_accelerator(self) -> Accelerator:
        """The accelerator for the next pod: with `spot="fallback"` the last one is on-demand."""
        spot = spot_request(self.settings.spot, last_attempt=self.state.last_attempt)
        if spot is None or spot == self.accelerator.spot:
            return self.accelerator
        return parse_accelerator(self.accelerator.name, spot=spot)

    def in_context(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` with the submitting flow's context (settings, flow run, client)."""
        return self.context.copy().run(fn, *args)


class TaskRunEvents(Protocol):
    """Where the modules that start or adopt a task run's pods (warm pods, reattach) tell of
    them: the launcher reads what a pod left, off the loop, and posts it."""

    def post(self, launch: TaskLaunch, event: Event) -> None: ...

    def on_pod_pending(self, launch: TaskLaunch, reason: str) -> None: ...

    def on_pod_exit(self, launch: TaskLaunch, outcome: PodExit) -> None: ...
