"""Warm pods, the runner's side: which pod takes which task run, and how it is told.

With `warm_pods=True` a pod stays after its task for `warm_pod_idle_seconds`
and takes the next task run whose pod would be the same (`spec_key`: accelerator,
image, env and Secret refs, volumes, namespace, service account, code archive,
timeout, backend and jobs root). The first task of a pod travels in the Job's
arguments as with a cold pod; every later one as `assign-{n}.json` in the pod's
warm dir in the jobs store (`common.handover` has the records, `pod.warm` the pod's side).

`spec_key` decides sharing: two attempts whose Job would be the same but for the
task's own identity (job id, task run, payload, output dir, attempt number) can
run one after the other in one pod.

A task goes to an idle pod of its spec, else to a new pod where there is room, else
it is queued on a busy pod of its spec that has ended a task before (it runs) and
has nothing queued, or less than half a batch while half a batch waits: the waiting
tasks of the spec shared among its busy pods, up to `handover.MAX_BATCH` to a pod, go
in one assignment, written at once (with the task handed to an idle pod, if any).
The pod takes its next task as it reports the one before, without a look at the
store in between. A pod claims each task before it runs it, its first one too
(`handover.Claim`), so the runner can take back a task no pod has claimed: an idle
pod with nothing of its spec waiting takes the last queued task of the busy pod of
its spec with the longest queue, or the task of a pod of its spec waiting for a node
(whose Job then ends).

The runner learns that a task ended from its final record in its own
`kinetic/{job_id}/` dir, or from the pod's exit. On a bucket it reads the record once
the Prefect API shows the task run's state final: one request asks about every busy
pod's task run and up to half a batch of its queued ones (fewer when many pods are
due), at a pace that slows as tasks go on; the ends of those queued tasks that the API
shows are read in the same round. A record is
also read without that, every `warm_direct_look_seconds` at first and less often as
a task goes on (a task can end without a final state: the pod failed before the
engine ran; such a pod also exits), and for every busy pod while the API has not
answered within `warm_api_wait_seconds` (docs/intervals.md). On a local jobs dir each
look reads the records.
A pod that exits with a task it never claimed (it idled out just as the task
was handed to it, or died with a task queued) gives the task back: it is placed
again, on a fresh pod if need be, without touching the retry budget. Any other
exit is the task's, exactly as for a cold pod. `max_parallel` counts warm pods,
idle or not: a task that finds every slot taken and an idle pod of another spec
retires that pod.

Finite capacity. No new pod of a spec starts while one of them waits for capacity
(nodes of its kind busy): the task runs waiting for a pod go to the pods that run,
and the waiting pod's own task goes to the first of them that idles.
Without `max_parallel`, new pods of a spec also start in a slow start: at most as
many pods that have not yet ended a task as pods that have (and at least `warm_policy.RAMP`).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect.logging import get_logger

from kinetic_prefect.backends.base import WAITING_FOR_CAPACITY, Backend, PodExit
from kinetic_prefect.common import handover as warm
from kinetic_prefect.common import layout
from kinetic_prefect.common.env import ATTEMPT_ENV, TASK_RUN_ID_ENV, WARM_DIR_ENV, WARM_IDLE_ENV
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.common.layout import WARM_POD_JSON
from kinetic_prefect.common.records import FINAL_STATE_JSON, STATUS_PHASE_FAILED, FinalRecord
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.launch.manifest import (
    LABEL_TASK_IDENTITY,
    LABEL_WARM,
    LaunchSpec,
    build_job_manifest,
    container_of,
)
from kinetic_prefect.launch.pod_secrets import PodSecrets
from kinetic_prefect.launch.slices import build_workload
from kinetic_prefect.runner import prefect_engine, warm_policy
from kinetic_prefect.runner.run_state import Event, Started, Unstarted
from kinetic_prefect.runner.warm_policy import PodView, WaitingAttempt

if TYPE_CHECKING:
    from kinetic_prefect.launch.accelerators import Accelerator
    from kinetic_prefect.runner.task_launch import TaskLaunch, TaskRunEvents

logger = get_logger("kinetic_prefect.runner.warm_pods")

# Env that differs between task runs of one pod spec (the rest of the per-task env,
# job id and output dir, comes from LaunchSpec fields blanked in `spec_key`).
_PER_TASK_ENV = (ATTEMPT_ENV,)

OnEnd = Callable[["TaskLaunch", PodExit], None]
OnPending = Callable[["TaskLaunch", str], None]
Post = Callable[["TaskLaunch", Event], None]


# How many of a due pod's queued tasks the poller asks the API about with its running
# one (the ends it can read in one round): the half batch a pod may run through before
# the runner writes it more.
READ_AHEAD = warm.MAX_BATCH // 2


def runs_warm(launch: TaskLaunch, accelerator: Accelerator) -> bool:
    """Whether the attempt goes to a warm pod (multi-host slices never do: they launch cold)."""
    return bool(launch.settings.warm_pods) and accelerator.hosts == 1


def warm_placement(
    launch: TaskLaunch,
    spec: LaunchSpec,
    backend: Backend,
    store: JobsStore,
    secrets: PodSecrets,
    launcher: TaskRunEvents,
    payload: bytes | None = None,
) -> Placement:
    """The launcher's attempt as a placement for a warm pod (`payload`: not uploaded yet)."""
    settings = launch.settings
    return Placement(
        launch=launch,
        spec=spec,
        payload=payload,
        key=spec_key(spec, store.uri(""), settings.backend),
        backend=backend,
        store=store,
        secrets=secrets,
        idle_seconds=settings.warm_pod_idle_seconds,
        on_end=launcher.on_pod_exit,
        on_pending=launcher.on_pod_pending,
        post=launcher.post,
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
    # The payload when it was small enough not to be uploaded: it travels in the
    # assignment, or is uploaded to `spec.payload_uri` if the task starts a pod.
    payload: bytes | None
    key: str
    backend: Backend
    store: JobsStore
    secrets: PodSecrets
    idle_seconds: float
    on_end: OnEnd
    on_pending: OnPending
    post: Post
    # A pod is known to have claimed the task: it cannot be taken back.
    claimed: bool = False
    # The runner's claim keeps it for a pod that has not claimed it yet.
    kept: bool = False


@dataclass
class WarmPod:
    pod_id: str
    key: str
    backend: Backend
    store: JobsStore
    idle_seconds: float
    intervals: Intervals = field(default_factory=Intervals)
    manifest: dict[str, Any] = field(default_factory=dict)
    placement: Placement | None = None  # the task it runs now
    # The tasks handed to it while busy, which it takes in turn once `placement` has ended.
    queued: list[Placement] = field(default_factory=list)
    sequence: int = 0  # assignments written so far
    accepted: bool = True  # the pod is known to have taken the running task
    deadline: float | None = None
    deadline_hit: bool = False
    # Writing a task's assignment failed: the pod is being ended; if it took the task
    # anyway, the task is retried as a pod the infrastructure took away, not cancelled.
    handover_failed: bool = False
    idle_since: float | None = None
    retiring: bool = False  # will end: takes no task
    ended: bool = False
    proven: bool = False  # it ended a task: it runs
    capacity_wait: bool = False  # not yet running: the nodes of its kind are busy

    busy_since: float = 0.0
    next_check: float = 0.0
    next_look: float = 0.0  # when to read the final record even if the API says nothing

    def direct_look_interval(self, now: float) -> float:
        """How soon to read the running task's final record regardless of the API: for
        a task that ended without a final Prefect state (a phase failure in the pod).

        Every `warm_direct_look_seconds` at first, that much more apart for each minute
        the task has run, up to `warm_max_direct_look_seconds` (the pod's exit tells of
        such an end too).
        """
        ran = max(now - self.busy_since, 0.0)
        first = self.intervals.warm_direct_look_seconds
        return min(first * (1 + ran / 60), self.intervals.warm_max_direct_look_seconds)

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
        return layout.warm_dir(self.pod_id)

    def view(self) -> PodView:
        """What the placement policy reads of the pod."""
        return PodView(
            pod_id=self.pod_id,
            key=self.key,
            backend=id(self.backend),
            busy=self.placement is not None,
            busy_since=self.busy_since,
            idle_since=self.idle_since,
            idle_window=self.idle_seconds - warm.reuse_margin(self.store.uri("")),
            queued=len(self.queued),
            proven=self.proven,
            leaving=self.retiring or self.ended,
            ended=self.ended,
            capacity_wait=self.capacity_wait,
            handover_failed=self.handover_failed,
            takeable=len(self.takeable()),
        )

    def takeable(self) -> list[Placement]:
        """Its tasks another pod may take: those it is not known to have claimed, of its
        queue, or its first task while it waits for a node."""
        tasks = [*self.queued]
        if self.capacity_wait and self.placement is not None:
            tasks.insert(0, self.placement)
        return [task for task in tasks if not (task.claimed or task.launch.cancelled)]


def capacity(backend: Backend) -> int | None:
    limit = getattr(backend, "max_parallel", None)
    return int(limit) if limit else None


def pod_env(pod: WarmPod, placement: Placement) -> dict[str, str]:
    """The plain env of `placement`'s task in `pod`: its own, plus where the pod's work comes."""
    return {
        **placement.spec.env,
        WARM_DIR_ENV: pod.store.uri(pod.warm_dir),
        WARM_IDLE_ENV: f"{placement.idle_seconds:g}",
        TASK_RUN_ID_ENV: placement.spec.task_run_id or "",
    }


def plain_env(manifest: dict[str, Any]) -> dict[str, str]:
    return {
        item["name"]: item["value"] for item in container_of(manifest)["env"] if "value" in item
    }


def task_assignment(pod: WarmPod, placement: Placement) -> warm.Assignment:
    """What `pod` needs to run `placement`'s task: its pod arguments, its payload when small,
    and the plain env it would have had as a pod of its own where that differs from the
    env `pod` started with. What the pod got from elsewhere (the platform may add or set
    env) stays as the pod has it."""
    spec = dataclasses.replace(placement.spec, env=pod_env(pod, placement))
    own = plain_env(pod.manifest)
    env = {k: v for k, v in plain_env(build_job_manifest(spec)).items() if own.get(k) != v}
    payload = placement.payload
    return warm.Assignment(
        job_id=spec.job_id,
        task_run_id=spec.task_run_id or "",
        job_dir=spec.job_dir_uri,
        payload=spec.payload_uri,
        payload_sha256=spec.payload_sha256,
        context=spec.context_uri,
        context_sha256=spec.context_sha256,
        env=env,
        payload_inline=base64.b64encode(payload).decode() if payload is not None else "",
    )


def took_task(pod: WarmPod, job_id: str) -> bool:
    """Whether the pod took the task of job `job_id`: its claim names the pod. If the store
    cannot tell, it did."""
    try:
        return warm.claimant(pod.store, layout.job_file(job_id, WARM_POD_JSON)) == pod.pod_id
    except Exception:
        logger.warning(
            "Could not tell whether warm pod %s took its task; its end counts as the task's",
            pod.pod_id,
            exc_info=True,
        )
        return True


def take_back(
    placement: Placement, for_pod: str = "", sequence: int = 0, deadline: float | None = None
) -> warm.Claim | None:
    """Keep `placement`'s task from the pod it was given to, for the pod `for_pod` (its
    assignment `sequence`), or for none: None if it is kept so now, else the claim there.
    Raises if the store cannot say (within `deadline`)."""
    key = layout.job_file(placement.launch.job_id, WARM_POD_JSON)
    return warm.take_back(placement.store, key, for_pod, sequence, deadline)


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


@dataclass
class _Actions:
    """What `_schedule` decided under the lock, done after it is released."""

    # Each with the assignment number it was given: read again later, the number could be
    # that of a later decision (the pod then waits for one never written).
    # (idle pod, its assignment number, its tasks: the one it runs next first)
    hand: list[tuple[WarmPod, int, list[Placement]]] = field(default_factory=list)
    batches: list[tuple[WarmPod, int, list[Placement]]] = field(default_factory=list)
    start: list[tuple[WarmPod, Placement]] = field(default_factory=list)
    retire: list[WarmPod] = field(default_factory=list)
    # (idle pod, its assignment number, the task it took from another pod)
    take: list[tuple[WarmPod, int, list[Placement]]] = field(default_factory=list)


class WarmPods:
    """Every warm pod of one runner, and the task runs waiting for one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: list[WarmPod] = []
        self._waiting: collections.deque[Placement] = collections.deque()
        self._wake = threading.Event()
        self._poller: threading.Thread | None = None
        self._api_query: concurrent.futures.Future[set[Any]] | None = None
        self._closed = False

    # -- the launcher's hooks -----------------------------------------------------

    def take(
        self,
        launch: TaskLaunch,
        spec: LaunchSpec,
        backend: Backend,
        store: JobsStore,
        secrets: PodSecrets,
        launcher: TaskRunEvents,
        payload: bytes | None = None,
    ) -> bool:
        """Place the attempt on a warm pod if it is one for a warm pod (`runs_warm`); else make
        room for it. `payload`: the attempt's payload when it was not uploaded."""
        if runs_warm(launch, spec.accelerator):
            self.place(warm_placement(launch, spec, backend, store, secrets, launcher, payload))
            return True
        self.make_room(backend)
        return False

    def place(self, placement: Placement) -> None:
        """Run the attempt on an idle pod of its spec, a new pod, or as soon as one is free."""
        with self._lock:
            if self._closed:
                raise RuntimeError("The runner is closed; submit inside the flow run.")
            self._waiting.append(placement)
            waiting = len(self._waiting)
        logger.debug("%s waits for a warm pod (%d waiting)", placement.launch.job_id, waiting)
        self._schedule()

    def cancel(self, launch: TaskLaunch) -> bool:
        """End the pod running `launch` (or drop it from the queue); False if none has it."""
        with self._lock:
            for placement in self._waiting:
                if placement.launch is launch:
                    self._waiting.remove(placement)
                    return True
            pod = self._pod_running(launch)
            queued = None
            if pod is None:
                pod = next((p for p in self._pods if self._queued_on(p, launch)), None)
                if pod is None:
                    return False
                queued = next(task for task in pod.queued if task.launch is launch)
        if queued is not None:
            try:
                there = take_back(queued)
            except Exception:  # the pod may run it: it ends
                logger.warning("Could not take back %s", launch.job_id, exc_info=True)
            else:
                owner = "" if there is None else there.pod
                with self._lock:  # the pod that claimed it, or that the runner kept it for
                    named = next((p for p in self._pods if p.pod_id == owner), None)
                if there is None or (there.by_runner and named is None):
                    self._release(pod, queued)  # the pod skips it when it comes to it
                    return True
                pod = named or pod
        with self._lock:
            pod.retiring = True
        pod.backend.cancel(pod.pod_id)
        return True

    def make_room(self, backend: Backend) -> None:
        """Before a cold pod: retire an idle warm pod if they fill every slot."""
        with self._lock:
            views = [pod.view() for pod in self._pods]
            room = warm_policy.has_room(views, id(backend), capacity(backend))
            chosen = None if room else warm_policy.retirable(views, id(backend))
            victim = next((p for p in self._pods if chosen and p.pod_id == chosen.pod_id), None)
            if victim is not None:
                victim.retiring = True
        if victim is not None:
            self._retire(victim)

    def open(self) -> None:
        """Take work again after `close` (a runner entered again)."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Stop handing out work; the backends end the pods when they close."""
        with self._lock:
            self._closed = True
            self._waiting.clear()
        self._wake.set()

    def pods(self) -> list[str]:
        """The ids of the warm pods alive now (for tooling and tests)."""
        with self._lock:
            return [pod.pod_id for pod in self._pods]

    # -- deciding -----------------------------------------------------------------------

    @staticmethod
    def _queued_on(pod: WarmPod, launch: TaskLaunch) -> bool:
        return any(placement.launch is launch for placement in pod.queued)

    def _pod_running(self, launch: TaskLaunch) -> WarmPod | None:
        return next(
            (p for p in self._pods if p.placement is not None and p.placement.launch is launch),
            None,
        )

    def _schedule(self) -> None:
        actions = _Actions()
        now = time.monotonic()
        with self._lock:
            for placement in list(self._waiting):
                # The run's state, not its future: the loop resolves the future later, on
                # its I/O pool, and an ended run must not be handed to a pod meanwhile.
                if placement.launch.state.done:
                    self._waiting.remove(placement)
            pods = {pod.pod_id: pod for pod in self._pods}
            waiting = {placement.launch.job_id: placement for placement in self._waiting}
            backends = [p.backend for p in self._pods] + [p.backend for p in self._waiting]
            decided = warm_policy.plan(
                [pod.view() for pod in self._pods],
                [WaitingAttempt(job_id, p.key, id(p.backend)) for job_id, p in waiting.items()],
                {id(backend): capacity(backend) for backend in backends},
                now,
                max_batch=warm.MAX_BATCH,
            )
            for pod_id in decided.retire:
                pods[pod_id].retiring = True
                actions.retire.append(pods[pod_id])
            for pod_id, donor_id in decided.take:
                pod, donor = pods[pod_id], pods[donor_id]
                tasks = donor.takeable()
                if tasks and self._take_back_for(pod, donor, tasks[-1]):
                    if tasks[-1] is donor.placement:
                        # Its own task gone, the pod waiting for a node is not needed.
                        donor.placement, donor.retiring = None, True
                        actions.retire.append(donor)
                    else:
                        donor.queued.remove(tasks[-1])
                    actions.take.append(self._hand_to(pod, tasks[-1], now))
            for pod_id, job_id in decided.hand:
                self._waiting.remove(waiting[job_id])
                actions.hand.append(self._hand_to(pods[pod_id], waiting[job_id], now))
            handed = {pod.pod_id: batch for pod, _, batch in actions.hand}
            for job_id in decided.start:
                placement = waiting[job_id]
                self._waiting.remove(placement)
                pod = WarmPod(
                    pod_id=job_id,
                    key=placement.key,
                    backend=placement.backend,
                    store=placement.store,
                    idle_seconds=placement.idle_seconds,
                    intervals=placement.launch.settings.intervals,
                )
                self._pods.append(pod)
                self._busy(pod, placement, now)
                actions.start.append((pod, placement))
            for pod_id, job_ids in decided.queue:
                pod = pods[pod_id]
                batch = [waiting[job_id] for job_id in job_ids]
                pod.queued.extend(batch)
                for queued in batch:
                    self._waiting.remove(queued)
                if pod_id in handed:
                    # Handed a task in this same plan: one assignment carries both.
                    handed[pod_id].extend(batch)
                    continue
                pod.sequence += 1
                actions.batches.append((pod, pod.sequence, batch))
        for victim in actions.retire:
            self._retire(victim)
        for pod, placement in actions.start:
            self._start(pod, placement)
        for pod, sequence, batch in actions.hand + actions.batches:
            self._send(pod, sequence, batch)
        for pod, sequence, batch in actions.take:
            self._send(pod, sequence, batch, started=True)

    def _hand_to(
        self, pod: WarmPod, placement: Placement, now: float
    ) -> tuple[WarmPod, int, list[Placement]]:
        """(Under the lock.) The idle pod's next assignment starts with `placement`: the
        pod, the assignment's number, and its tasks."""
        pod.sequence += 1
        pod.accepted = False
        pod.idle_since = None
        self._busy(pod, placement, now)
        return pod, pod.sequence, [placement]

    def _busy(self, pod: WarmPod, placement: Placement, now: float) -> None:
        pod.placement = placement
        pod.busy_since = pod.next_check = now
        pod.next_look = now + pod.intervals.warm_direct_look_seconds
        timeout = placement.spec.timeout_seconds
        pod.deadline = now + timeout if timeout else None

    # -- acting ------------------------------------------------------------------------

    def _post_started(self, placement: Placement, manifest: dict[str, Any]) -> bool:
        """Tell the runner a pod has the attempt, unless it was cancelled meanwhile."""
        launch = placement.launch
        if launch.cancelled:
            return False
        placement.post(launch, Started(launch.job_id, placement.backend, manifest))
        return True

    def _start(self, pod: WarmPod, placement: Placement) -> None:
        # No activeDeadlineSeconds: the deadline is each task's, enforced here.
        spec = dataclasses.replace(
            placement.spec,
            env=pod_env(pod, placement),
            timeout_seconds=None,
            extra_labels={**placement.spec.extra_labels, LABEL_WARM: "true"},
        )
        workload = build_workload(spec)
        launch = placement.launch
        if not self._post_started(placement, workload.job):
            self._forget(pod)
            return

        pod.manifest = workload.job

        def on_pending(reason: str) -> None:
            with self._lock:
                waits = reason.startswith(WAITING_FOR_CAPACITY) and not pod.proven
                started_waiting, pod.capacity_wait = waits and not pod.capacity_wait, waits
            current = pod.placement
            if current is not None:
                current.launch.in_context(current.on_pending, current.launch, reason)
            if started_waiting:
                self._schedule()  # an idle pod of its spec may take its task

        try:
            if placement.payload is not None:  # the Job's arguments name it
                placement.store.put_bytes(
                    layout.job_file(launch.job_id, layout.PAYLOAD_FILE), placement.payload
                )
            placement.backend.launch(
                workload.job,
                on_exit=lambda outcome: self._pod_exited(pod, outcome),
                secrets=placement.secrets.contents(),
                on_pending=on_pending,
                extra_objects=workload.extra_objects,
            )
        except Exception as exc:
            logger.warning("Could not launch warm pod %s", pod.pod_id, exc_info=True)
            self._forget(pod)
            failed = PodExit(launch.job_id, None, start_failure=f"could not launch it: {exc}")
            launch.in_context(placement.on_end, launch, failed)
            self._schedule()
            return
        if launch.cancelled:
            # Cancelled while the Job was being created: the stop may have come before it.
            placement.backend.cancel(pod.pod_id)
        self._watch()
        self._schedule()  # what waits for it may be handed to it now

    def _send(
        self, pod: WarmPod, sequence: int, placements: list[Placement], started: bool = False
    ) -> None:
        """Write `assign-{sequence}.json`: an idle pod's next task and the tasks queued
        after it, or the tasks queued on a busy pod to take as it ends its task. Tasks
        cancelled meanwhile are left out; if that leaves none, one is taken back and
        written all the same (the pod skips it), so every number the pod waits for is
        written. `started`: the tasks were started before (taken from another pod)."""
        live = [p for p in placements if started or self._post_started(p, pod.manifest)]
        # Last first: a cancelled running task gives way to the first queued task left.
        for placement in reversed(placements):
            if placement not in live:
                self._release(pod, placement)
        if not live:
            try:
                take_back(placements[0])  # a claim there already is another (ended) pod's
            except Exception:
                # The pod could run a cancelled task: it ends instead.
                logger.warning("Could not take back %s", placements[0].launch.job_id)
                self._handover_failed(pod)
                return
        batch = [task_assignment(pod, placement) for placement in live or placements[:1]]
        try:
            pod.store.put_bytes(
                f"{pod.warm_dir}/{warm.assignment_name(sequence)}", warm.batch_to_json(batch)
            )
        except Exception:
            # The pod may never see it: end the pod, and its exit gives the tasks back.
            logger.warning(
                "Could not hand %s to warm pod %s", [a.job_id for a in batch], pod.pod_id
            )
            self._handover_failed(pod)
            return
        logger.debug("%s went to warm pod %s", [a.job_id for a in batch], pod.pod_id)
        self._watch()

    def _handover_failed(self, pod: WarmPod) -> None:
        with self._lock:
            pod.retiring = pod.handover_failed = True
        pod.backend.cancel(pod.pod_id)

    def _take_back_for(self, pod: WarmPod, donor: WarmPod, placement: Placement) -> bool:
        """(Under the lock, so that nothing of the donor's changes meanwhile: one write,
        within `warm_take_back_seconds`.) Keep `placement`, queued on `donor` (or its own
        task while it waits for a node), for the idle `pod`: True unless the donor has
        claimed it (or the store cannot say)."""
        deadline = placement.launch.settings.intervals.warm_take_back_seconds
        try:
            there = take_back(placement, pod.pod_id, pod.sequence + 1, deadline)
        except Exception:
            logger.warning(
                "Could not take %s from warm pod %s", placement.launch.job_id, donor.pod_id
            )
            # The runner's claim may have landed all the same: the donor would then skip
            # the task, which can no longer run under this job (`_task_ended`, `_exit_of`).
            placement.kept = placement.claimed = True
            return False
        if there is None:
            placement.kept = True
            logger.debug("%s taken from warm pod %s", placement.launch.job_id, donor.pod_id)
            return True
        if there.pod == donor.pod_id and not there.by_runner:
            # It claims its tasks in order: it has every one before this one too.
            for task in [donor.placement, *donor.queued]:
                if task is not None:
                    task.claimed = True
        else:
            placement.kept = placement.kept or there.by_runner
            placement.claimed = True
        return False

    def _retire(self, pod: WarmPod) -> None:
        logger.debug("Ending warm pod %s: idle, or waiting for a node without a task", pod.pod_id)
        pod.backend.cancel(pod.pod_id)

    def _release(self, pod: WarmPod, placement: Placement) -> None:
        """`placement` was taken back from the pod (for no pod): the pod skips it. If it was
        the pod's running task, the pod runs its next queued one, or is idle."""
        running = end_pod = False
        with self._lock:
            if placement in pod.queued:
                pod.queued.remove(placement)
            elif pod.placement is placement:
                running = True
                if pod.queued:
                    end_pod = self._promote(pod, None)
                else:
                    pod.placement = None
                    pod.idle_since = time.monotonic()
        if end_pod:
            pod.backend.cancel(pod.pod_id)
        if running:
            self._schedule()

    def _forget(self, pod: WarmPod) -> None:
        with self._lock:
            pod.ended = True
            if pod in self._pods:
                self._pods.remove(pod)

    # -- how tasks and pods end ------------------------------------------------------

    def _pod_exited(self, pod: WarmPod, outcome: PodExit) -> None:
        with self._lock:
            placement, queued, accepted = pod.placement, pod.queued, pod.accepted
            deadline_hit, handover_failed = pod.deadline_hit, pod.handover_failed
            pod.placement, pod.queued = None, []
        self._forget(pod)
        if placement is not None:
            # A kept task (the runner's claim is there) is the pod's only if it claimed it
            # over that claim: for its own first task too, taken while it waited for a node.
            if placement.kept or not accepted:
                accepted = took_task(pod, placement.launch.job_id)
            self._exit_of(pod, placement, accepted, outcome, deadline_hit, handover_failed)
        for task in queued:
            taken = took_task(pod, task.launch.job_id)
            self._exit_of(pod, task, taken, outcome, False, handover_failed)
        self._schedule()

    def _exit_of(
        self,
        pod: WarmPod,
        placement: Placement,
        accepted: bool,
        outcome: PodExit,
        deadline_hit: bool,
        handover_failed: bool,
    ) -> None:
        """The pod's exit, for a task handed to it: the task's end if the pod took it, else
        the task goes back to the queue."""
        launch = placement.launch
        if not accepted and not launch.cancelled:
            logger.info(
                "Warm pod %s ended before taking %s; placing it again", pod.pod_id, launch.job_id
            )
            if not placement.kept:
                placement.post(launch, Unstarted(launch.job_id))
                with self._lock:
                    if not self._closed:
                        self._waiting.appendleft(placement)
                return
            # The runner's claim keeps this job for a pod that will not run it: a new
            # attempt, under a new job, is launched instead.
            handover_failed = True
        ended = task_exit(
            outcome, launch, deadline_hit=deadline_hit, handover_failed=handover_failed
        )
        launch.in_context(placement.on_end, launch, ended)

    def _task_ended(self, pod: WarmPod, placement: Placement, data: bytes) -> None:
        """The task's final record is there (`data`): resolve it; the pod idles unless it ends."""
        launch = placement.launch
        try:
            record = FinalRecord.decode(data, f"the final record of job {launch.job_id}")
            stays = record.status != STATUS_PHASE_FAILED and record.state_type != "CRASHED"
            took_next = record.next_job
        except Exception:
            stays, took_next = False, None
        end_pod = False
        with self._lock:
            pod.proven, pod.capacity_wait = True, False
            if pod.placement is not placement:
                return  # the pod's exit got there first
            pod.placement = None
            # Queued tasks before the one it took, it skipped: a claim of the runner's
            # keeps them for another pod, or for none.
            ids = [task.launch.job_id for task in pod.queued]
            skipped = pod.queued[: ids.index(took_next)] if took_next in ids else []
            del pod.queued[: len(skipped)]
            if not stays or pod.retiring:
                pod.retiring = True  # the pod ends itself after such a task
                if pod.queued and took_next == pod.queued[0].launch.job_id:
                    self._promote(pod, took_next)  # it took it: its exit is that task's
            elif pod.queued:
                end_pod = self._promote(pod, took_next)
            else:
                pod.idle_since = time.monotonic()
        logger.debug("%s ended on warm pod %s", launch.job_id, pod.pod_id)
        launch.in_context(placement.on_end, launch, PodExit(launch.job_id, 0, final_record=data))
        for task in skipped:
            task.kept = True
            self._exit_of(pod, task, False, PodExit(task.launch.job_id, None), False, False)
        if end_pod:
            pod.backend.cancel(pod.pod_id)
        self._schedule()

    def _promote(self, pod: WarmPod, took_next: str | None) -> bool:
        """The pod's first queued task is its running one now (under the lock); True if the
        pod is to end, that task having been cancelled while it waited."""
        queued = pod.queued.pop(0)
        pod.accepted = took_next == queued.launch.job_id
        self._busy(pod, queued, time.monotonic())
        if queued.launch.cancelled:
            pod.retiring = True
            return True
        return False

    # -- the poller: task ends and deadlines of busy pods ----------------------------------

    def _ended_in_api(
        self, due: list[tuple[WarmPod, Placement]], queued: list[Any]
    ) -> set[Any] | None:
        """Which due task runs, and which `queued` ones, have a final state in the Prefect
        API (one request for up to `prefect_engine.READ_LIMIT` of them); None when each due
        pod's final record is to be read instead: a local store (a read costs nothing), or
        the API did not answer within `warm_api_wait_seconds` (the question stays asked;
        deadlines and other ends are not held up meanwhile)."""
        if not due or "://" not in due[0][0].store.uri(""):
            return None
        if self._api_query is not None and not self._api_query.done():
            return None
        ids = [placement.launch.task_run.id for _, placement in due] + queued
        launch = due[0][1].launch
        query: concurrent.futures.Future[set[Any]] = concurrent.futures.Future()

        def ask() -> None:
            try:
                query.set_result(launch.in_context(prefect_engine.ended_task_runs, ids))
            except BaseException as exc:
                query.set_exception(exc)

        # A daemon thread: an API that hangs holds up neither the poller nor the exit.
        threading.Thread(target=ask, name="kinetic-warm-api", daemon=True).start()
        self._api_query = query
        try:
            ended: set[Any] = query.result(timeout=launch.settings.intervals.warm_api_wait_seconds)
        except Exception:
            logger.debug("Could not read the states of busy warm pods' tasks", exc_info=True)
            return None
        return ended

    def _watch(self) -> None:
        with self._lock:
            if self._poller is None or not self._poller.is_alive():
                self._poller = threading.Thread(
                    target=self._poll, name="kinetic-warm-pods", daemon=True
                )
                self._poller.start()
        self._wake.set()

    def _poll(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                # A task being taken for another pod has no end to look for yet.
                busy = [(p, p.placement) for p in self._pods if p.placement is not None]
                # Asked about in the same request: a pod runs through short tasks sooner
                # than one end a round would be read.
                ahead = {
                    p.pod_id: [t.launch.task_run.id for t in p.queued[:READ_AHEAD]]
                    for p in self._pods
                }
            if not busy:
                self._wake.wait()
                self._wake.clear()
                continue
            now = time.monotonic()
            due = [(p, pl) for p, pl in busy if pl is not None and p.next_check <= now]
            # As many queued tasks as one request still has room for.
            each = max(0, (prefect_engine.READ_LIMIT - len(due)) // max(len(due), 1))
            queued = [i for p, _ in due for i in ahead.get(p.pod_id, [])[:each]]
            ended = self._ended_in_api(due, queued)
            now = time.monotonic()
            for pod, placement in due:
                current: Placement | None = placement
                # The tasks it took after this one that the API shows ended too, in turn.
                while current is not None and self._look_for_end(pod, current, now, ended):
                    with self._lock:
                        current = pod.placement
                    if ended is None or current is None or current.launch.task_run.id not in ended:
                        break
            soonest = min(p.next_check for p, _ in busy)
            self._wake.wait(max(soonest - time.monotonic(), 0.0))
            self._wake.clear()

    def _look_for_end(
        self, pod: WarmPod, placement: Placement, now: float, ended: set[Any] | None
    ) -> bool:
        """Read the task's final record when it is due (`ended`: the task runs the API
        shows final, None: read regardless); True if the task ended."""
        past_deadline = pod.deadline is not None and now >= pod.deadline
        look = (
            ended is None
            or placement.launch.task_run.id in ended
            or now >= pod.next_look
            or past_deadline  # a last look before the deadline ends the pod
        )
        if look:
            pod.next_look = now + pod.direct_look_interval(now)
        pod.next_check = min(now + pod.check_interval(now), pod.next_look)
        if not look:
            return False
        job_id = placement.launch.job_id
        try:
            data = pod.store.get_bytes(layout.job_file(job_id, FINAL_STATE_JSON))
        except FileNotFoundError:
            data = None
        except Exception:
            logger.debug("Could not look for the end of %s", job_id, exc_info=True)
            return False
        if data is not None:
            self._task_ended(pod, placement, data)
            return True
        if past_deadline and not pod.deadline_hit:
            with self._lock:
                pod.deadline_hit = pod.retiring = True
            pod.backend.cancel(pod.pod_id)
        return False
