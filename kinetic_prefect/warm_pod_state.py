"""What a warm pod is to the runner, and which task runs may share one.

`spec_key` decides sharing: two attempts whose Job would be the same but for the
task's own identity (job id, task run, payload, output dir, attempt number) can
run one after the other in one pod. `kinetic_prefect.warm_pods` schedules them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect.logging import get_logger

from kinetic_prefect.backends.base import Backend, PodExit
from kinetic_prefect.manifest import (
    LABEL_TASK_IDENTITY,
    LaunchSpec,
    build_job_manifest,
    container_of,
)
from kinetic_prefect.pod import warm
from kinetic_prefect.pod_secrets import PodSecrets
from kinetic_prefect.storage import ArtifactStore

if TYPE_CHECKING:
    from kinetic_prefect.launching import Launcher, TaskLaunch

logger = get_logger("kinetic_prefect.warm_pods")

# Env that differs between task runs of one pod spec (the rest of the per-task env,
# job id and output dir, comes from LaunchSpec fields blanked in `spec_key`).
_PER_TASK_ENV = ("KINETIC_ATTEMPT",)
# The pointer from a task's job dir to the warm pod that ran it (for `jobs logs`).
WARM_POD_JSON = "warm-pod.json"

OnEnd = Callable[["TaskLaunch", PodExit], None]
OnPending = Callable[["TaskLaunch", str], None]


def warm_placement(
    launch: TaskLaunch,
    spec: LaunchSpec,
    backend: Backend,
    store: ArtifactStore,
    secrets: PodSecrets,
    launcher: Launcher,
) -> Placement:
    """The launcher's attempt as a placement for a warm pod."""
    settings = launch.settings
    return Placement(
        launch=launch,
        spec=spec,
        key=spec_key(spec, store.uri(""), settings.backend),
        backend=backend,
        store=store,
        secrets=secrets,
        idle_seconds=settings.warm_pod_idle_seconds,
        on_end=launcher.on_pod_exit,
        on_pending=launcher.on_pod_pending,
    )


def spec_key(spec: LaunchSpec, jobs_root: str, backend: str) -> str:
    """What must be equal for two task runs to share a pod."""
    generic = dataclasses.replace(
        spec,
        job_id="warm",
        task_name="warm",
        task_run_id=None,
        output_dir="",
        payload_uri="",
        payload_sha256="",
        job_dir_uri="",
        env={k: v for k, v in spec.env.items() if k not in _PER_TASK_ENV},
        extra_labels={k: v for k, v in spec.extra_labels.items() if k != LABEL_TASK_IDENTITY},
    )
    return json.dumps([backend, jobs_root, build_job_manifest(generic)], sort_keys=True)


@dataclass
class Placement:
    """A task run's attempt waiting for (or given to) a warm pod."""

    launch: TaskLaunch
    spec: LaunchSpec
    key: str
    backend: Backend
    store: ArtifactStore
    secrets: PodSecrets
    idle_seconds: float
    on_end: OnEnd
    on_pending: OnPending


@dataclass
class WarmPod:
    pod_id: str
    key: str
    backend: Backend
    store: ArtifactStore
    idle_seconds: float
    manifest: dict[str, Any] = field(default_factory=dict)
    placement: Placement | None = None  # the task it runs now
    sequence: int = 0  # assignments written so far
    current: int = 0  # the running task's assignment (0: the Job's own first task)
    deadline: float | None = None
    deadline_hit: bool = False
    # Writing a task's assignment failed: the pod is being ended; if it took the task
    # anyway, the task is retried as a pod the infrastructure took away, not cancelled.
    handover_failed: bool = False
    idle_since: float | None = None
    retiring: bool = False  # will end: takes no task
    ended: bool = False

    busy_since: float = 0.0
    next_check: float = 0.0

    def check_interval(self, now: float) -> float:
        """How soon to look for the running task's end again: promptly at first, then
        less often as a long task goes on (at most ten times the store's pace)."""
        base = warm.poll_seconds(self.store.uri(""))
        interval = min(10 * base, base * (1 + (now - self.busy_since) / 30))
        if self.deadline is not None and not self.deadline_hit:
            interval = min(interval, max(self.deadline - now, 0.0))
        return interval

    @property
    def warm_dir(self) -> str:
        return f"kinetic/{self.pod_id}/warm"

    def usable_for(self, key: str, now: float) -> bool:
        """Idle, of this spec, and not about to idle out."""
        if self.placement is not None or self.retiring or self.ended or self.key != key:
            return False
        margin = warm.reuse_margin(self.store.uri(""))
        return self.idle_since is not None and now - self.idle_since < self.idle_seconds - margin


def capacity(backend: Backend) -> int | None:
    limit = getattr(backend, "max_parallel", None)
    return int(limit) if limit else None


def pod_env(pod: WarmPod, placement: Placement) -> dict[str, str]:
    """The plain env of `placement`'s task in `pod`: its own, plus where the pod's work comes."""
    return {
        **placement.spec.env,
        warm.WARM_DIR_ENV: pod.store.uri(pod.warm_dir),
        warm.WARM_IDLE_ENV: f"{placement.idle_seconds:g}",
        warm.TASK_RUN_ID_ENV: placement.spec.task_run_id or "",
    }


def task_assignment(pod: WarmPod, placement: Placement) -> warm.Assignment:
    """What `pod` needs to run `placement`'s task: its pod arguments and its whole plain env."""
    spec = dataclasses.replace(placement.spec, env=pod_env(pod, placement))
    env = {
        item["name"]: item["value"]
        for item in container_of(build_job_manifest(spec))["env"]
        if "value" in item
    }
    return warm.Assignment(
        job_id=spec.job_id,
        task_run_id=spec.task_run_id or "",
        job_dir=spec.job_dir_uri,
        payload=spec.payload_uri,
        payload_sha256=spec.payload_sha256,
        context=spec.context_uri,
        context_sha256=spec.context_sha256,
        env=env,
    )


def took_task(pod: WarmPod, sequence: int) -> bool:
    """Whether the pod accepted its `sequence`-th task; if the store cannot tell, it did."""
    try:
        return pod.store.exists(f"{pod.warm_dir}/{warm.accepted_name(sequence)}")
    except Exception:
        logger.warning(
            "Could not tell whether warm pod %s took its task; its end counts as the task's",
            pod.pod_id,
            exc_info=True,
        )
        return True


def task_exit(
    outcome: PodExit, launch: TaskLaunch, *, deadline_hit: bool, handover_failed: bool
) -> PodExit:
    """How the task on a warm pod ended, from how the pod ended."""
    ended = dataclasses.replace(outcome, job_id=launch.job_id)
    if deadline_hit:
        return dataclasses.replace(
            ended, reason="DeadlineExceeded", cancelled=False, preempted=False
        )
    if handover_failed and not launch.cancelled:
        # The runner ended the pod after a failed write; the task is retried on its
        # preemption budget, as for a pod the infrastructure took away.
        return dataclasses.replace(
            ended,
            reason="the jobs store failed while the task was handed to a warm pod",
            cancelled=False,
            preempted=True,
        )
    return ended
