"""One task run on its way through one or more pods, and what is told of how its pods go.

`TaskLaunch` is the runner's record of a task run from submission to its resolved
future; `AttemptHooks` is what the modules that start or adopt its pods (warm
pods, reattach) call back when a pod waits, ends or must be replaced. The
launcher implements the hooks; those modules know them only through this Protocol.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from kinetic_prefect.backends.base import Backend, PodExit
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.launch.accelerators import Accelerator, parse_accelerator
from kinetic_prefect.launch.manifest import DataVolume
from kinetic_prefect.launch.settings import LaunchSettings, spot_request


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
    job_ids: list[str] = field(default_factory=list)
    store: JobsStore | None = None
    backend: Backend | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    pods_launched: int = 0
    # Engine runs used so far (a pod may run the task several times: Prefect's retries).
    runs_used: int = 0
    # Pods the infrastructure took away; they are retried without using `retries`.
    preemptions: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)
    dependencies: dict[str, set[Any]] | None = None
    retry_timer: threading.Timer | None = None
    data_volumes: tuple[DataVolume, ...] = ()
    local_data_paths: tuple[Path, ...] = ()
    data_bytes_uploaded: int = 0
    cancelled: bool = False
    # The final state the runner itself recorded (a cancel, a crash, a launch failure).
    recorded_final: State[Any] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def job_id(self) -> str:
        return self.job_ids[-1]

    @property
    def retries_left(self) -> int:
        used = max(0, self.runs_used - 1 - self.preemptions)
        return max(0, (self.task.retries or 0) - used)

    @property
    def engine_retries(self) -> int:
        """The retries the next pod's engine may grant: the task's, less the runs already used.

        Runs lost to preemption are not counted (they are retried on their own budget).
        """
        used = max(0, self.runs_used - self.preemptions)
        return max(0, (self.task.retries or 0) - used)

    @property
    def preemptions_left(self) -> int:
        return max(0, self.settings.preemption_retries - self.preemptions)

    def attempt_accelerator(self) -> Accelerator:
        """The accelerator for the next pod: with `spot="fallback"` the last one is on-demand."""
        last = self.retries_left == 0 and self.preemptions_left == 0
        spot = spot_request(self.settings.spot, last_attempt=last)
        if spot is None or spot == self.accelerator.spot:
            return self.accelerator
        return parse_accelerator(self.accelerator.name, spot=spot)

    def in_context(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` with the submitting flow's context (settings, flow run, client)."""
        return self.context.copy().run(fn, *args)

    def resolve(self, state: State[Any]) -> bool:
        """Resolve the future with `state` unless it already is; True if this call did."""
        with self.lock:
            if self.future.done():
                return False
            self.future.set_result(state)
            return True


class AttemptHooks(Protocol):
    """What happens when a task run's pod waits, ends, or needs replacing (the launcher's)."""

    def on_pod_pending(self, launch: TaskLaunch, reason: str) -> None: ...

    def on_pod_exit(self, launch: TaskLaunch, outcome: PodExit) -> None: ...

    def conclude(self, launch: TaskLaunch, state: State[Any]) -> None: ...

    def schedule_relaunch(
        self, launch: TaskLaunch, note: str, delay: float, recorded: bool = False
    ) -> None: ...
