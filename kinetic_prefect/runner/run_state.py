"""What a task run does next: a pure function of its state and one event.

A task run goes from submission to a resolved future through one or more pods.
Everything that learns something about it (the submitter, a backend's watcher,
the warm pool, reattach, a retry's timer, a cancel, the flow's exit) posts an
`Event`; `step(state, event)` returns the task run's next `RunState` and the
`Effect`s that carry it out (record a state, resolve the future, launch or stop
a pod, wake up later). `kinetic_prefect.runner.run_loop` applies them, one
event at a time, and is the only writer of a task run's state.

Nothing here does I/O or reads a clock: the events carry what was read
elsewhere (the pod's final record, the API's run count, the next Job's name,
the retry delay).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

from prefect.states import Cancelled, Failed, Running, State

from kinetic_prefect.errors import PodPhaseError, PodStartError
from kinetic_prefect.runner.attempt_end import (
    RELAUNCH_PREEMPTED,
    RETRY,
    AttemptEnd,
    after_silent_end,
    concluded_state,
    exception_or_none,
)


class Phase(enum.StrEnum):
    PREPARING = "preparing"  # upstreams, data and code; no pod asked for yet
    LAUNCHING = "launching"  # the attempt's pod is being created, placed or claimed
    RUNNING = "running"  # the attempt's pod exists (it may still be pending)
    AWAITING_RETRY = "awaiting-retry"  # between two pods: a retry's delay
    FINAL = "final"  # the future is resolved; nothing but a record again follows


@dataclass(frozen=True)
class RunState:
    """One task run as the runner knows it. `job_ids[-1]` is the current attempt's Job."""

    job_ids: tuple[str, ...]
    retries: int  # the task's `retries`
    preemption_retries: int  # relaunches the infrastructure's preemptions may use
    phase: Phase = Phase.PREPARING
    pods_launched: int = 0
    # Engine runs used so far (a pod may run the task several times: Prefect's retries).
    runs_used: int = 0
    # Pods the infrastructure took away; retried without using `retries`.
    preemptions: int = 0
    cancelled: bool = False
    final: State[Any] | None = None
    # The final state is one the runner recorded (a cancel, a crash, a launch failure), not
    # the pod's: it is recorded again after a late pod, so that it stays the last word.
    final_is_runners: bool = False
    # The current pod was launched by an earlier flow process and taken over.
    adopted: bool = False

    @property
    def job_id(self) -> str:
        return self.job_ids[-1]

    @property
    def retries_left(self) -> int:
        used = max(0, self.runs_used - 1 - self.preemptions)
        return max(0, self.retries - used)

    @property
    def engine_retries(self) -> int:
        """The retries the next pod's engine may grant: the task's, less the runs used
        (runs lost to preemption are not counted: they are retried on their own budget)."""
        used = max(0, self.runs_used - self.preemptions)
        return max(0, self.retries - used)

    @property
    def preemptions_left(self) -> int:
        return max(0, self.preemption_retries - self.preemptions)

    @property
    def last_attempt(self) -> bool:
        return self.retries_left == 0 and self.preemptions_left == 0

    @property
    def done(self) -> bool:
        return self.phase is Phase.FINAL


# -- events -----------------------------------------------------------------------


@dataclass(frozen=True)
class EarlierPod:
    """A pod an earlier flow process launched for this task run: to adopt while it runs,
    or whose completed state (`completed`) is the task run's."""

    job_id: str
    completed: State[Any] | None = None
    backend: Any = None


@dataclass(frozen=True)
class Prepared:
    """Upstreams, data and code are ready (`inputs` is what the pods get). `cached` is a
    result Prefect's cache policy already holds; `earlier`, a pod launched before."""

    inputs: Any
    cached: State[Any] | None = None
    earlier: EarlierPod | None = None


@dataclass(frozen=True)
class Started:
    """A pod for `job_id` is being created (or a warm pod was given it)."""

    job_id: str
    backend: Any
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Unstarted:
    """The warm pod given `job_id` ended before taking it; it is placed again."""

    job_id: str


@dataclass(frozen=True)
class PodPending:
    job_id: str
    reason: str


@dataclass(frozen=True)
class PodEnded:
    """The pod of `job_id` ended, and this is what it left (read off the loop).

    `next_job_id` names the Job of a relaunch; `retry_delay` is the task's delay
    after `runs_used` runs (`PodEnded.runs_used`); `stopped` says the pod was
    cancelled or its flow run is over (the lease says so).
    """

    job_id: str
    end: AttemptEnd
    next_job_id: str
    preempted: bool = False
    stopped: bool = False
    unreadable: bool = False
    recorded_runs: int = 0
    retry_delay: float = 0.0
    task_run: Any = None


@dataclass(frozen=True)
class RetryDue:
    job_id: str


@dataclass(frozen=True)
class Cancel:
    message: str


@dataclass(frozen=True)
class FlowRunOver:
    """The runner's lease found the flow run cancelling or final while the flow is still
    in the runner (the lease is marked once every run has taken this in)."""

    message: str


@dataclass(frozen=True)
class Conclude:
    """A state no pod reported: a cached result, a failure to launch. The runner records it."""

    state: State[Any]


@dataclass(frozen=True)
class EngineDecided:
    """Prefect's engine here decided the task run's final state itself (NotReady)."""

    state: State[Any]


Event = (
    Prepared
    | Started
    | Unstarted
    | PodPending
    | PodEnded
    | RetryDue
    | Cancel
    | FlowRunOver
    | Conclude
    | EngineDecided
)


# -- effects ----------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """Record `state` for the task run in Prefect."""

    state: State[Any]


@dataclass(frozen=True)
class RecordAwaitingRetry:
    delay: float
    note: str


@dataclass(frozen=True)
class Resolve:
    state: State[Any]


@dataclass(frozen=True)
class Launch:
    """Launch the current attempt's pod."""


@dataclass(frozen=True)
class Adopt:
    job_id: str


@dataclass(frozen=True)
class StopPod:
    job_id: str


@dataclass(frozen=True)
class StopEarlier:
    """Stop a live pod an earlier flow process launched, which this run will never take
    over (it ended while it was being prepared)."""

    job_id: str


@dataclass(frozen=True)
class WakeAfter:
    """Post `RetryDue(job_id)` after `delay` seconds (`note` says why, for the log)."""

    delay: float
    job_id: str
    note: str


@dataclass(frozen=True)
class ShowPending:
    reason: str


Effect = (
    Record
    | RecordAwaitingRetry
    | Resolve
    | Launch
    | Adopt
    | StopPod
    | StopEarlier
    | WakeAfter
    | ShowPending
)

Step = tuple[RunState, tuple[Effect, ...]]


def _conclude(state: RunState, final: State[Any], *before: Effect) -> Step:
    """The runner records `final` and resolves the future with it."""
    ended = dataclasses.replace(state, phase=Phase.FINAL, final=final, final_is_runners=True)
    return ended, (*before, Record(final), Resolve(final))


def _record_again(state: RunState) -> Step:
    """A late word about a task run the runner ended: its final state is recorded again,
    newer than whatever the pod recorded while it was being stopped."""
    if not state.final_is_runners or state.final is None:
        return state, ()
    again = state.final.fresh_copy()
    return dataclasses.replace(state, final=again), (Record(again),)


def _relaunch(state: RunState, job_id: str, delay: float, note: str, *, record: bool) -> Step:
    waiting = dataclasses.replace(
        state, phase=Phase.AWAITING_RETRY, job_ids=(*state.job_ids, job_id), adopted=False
    )
    effects: tuple[Effect, ...] = (WakeAfter(delay, job_id, note),)
    if record:
        effects = (RecordAwaitingRetry(delay, note), *effects)
    return waiting, effects


def step(state: RunState, event: Event) -> Step:
    """The task run's next state, and what to do about it."""
    match event:
        case Cancel(message=message):
            if state.done:
                return dataclasses.replace(state, cancelled=True), ()
            cancelled = dataclasses.replace(state, cancelled=True)
            stop: tuple[Effect, ...] = ()
            if state.phase in (Phase.LAUNCHING, Phase.RUNNING):
                stop = (StopPod(state.job_id),)
            return _conclude(cancelled, Cancelled(message=message), *stop)
        case FlowRunOver(message=message):
            if state.done:
                return state, ()
            if state.phase is Phase.RUNNING:
                # Left to its pod, which ends itself on reading the marked lease (or
                # completes first): its end, read as stopped, concludes the run.
                return state, ()
            # No pod of its own to end it: it ends now, before an upstream's pod ending
            # itself could make it NotReady, or a retry's delay could launch a pod.
            return step(state, Cancel(message))
        case Conclude(state=final):
            return (state, ()) if state.done else _conclude(state, final)
        case EngineDecided(state=final):
            if state.done:
                return _record_again(state)
            return dataclasses.replace(state, phase=Phase.FINAL, final=final), (Resolve(final),)
        case Prepared(cached=cached, earlier=earlier):
            return _prepared(state, cached, earlier)
        case Started(job_id=job_id):
            if job_id != state.job_id:
                return state, ()
            started = dataclasses.replace(state, pods_launched=state.pods_launched + 1)
            if state.cancelled:
                return started, (StopPod(job_id),)
            if state.done:
                return started, ()
            return dataclasses.replace(started, phase=Phase.RUNNING), ()
        case Unstarted(job_id=job_id):
            if job_id != state.job_id or state.done:
                return state, ()
            given_back = state.pods_launched - 1
            return dataclasses.replace(state, pods_launched=given_back, phase=Phase.LAUNCHING), ()
        case PodPending(job_id=job_id, reason=reason):
            if job_id != state.job_id or state.done:
                return state, ()
            return state, (ShowPending(reason),)
        case RetryDue(job_id=job_id):
            if job_id != state.job_id or state.phase is not Phase.AWAITING_RETRY:
                return state, ()
            if state.cancelled:
                return state, ()
            return dataclasses.replace(state, phase=Phase.LAUNCHING), (Launch(),)
        case PodEnded():
            return _pod_ended(state, event)
    raise TypeError(f"Not a task-run event: {event!r}")


def _prepared(state: RunState, cached: State[Any] | None, earlier: EarlierPod | None) -> Step:
    if state.done:
        # Ended (cancelled) while it was being prepared: a live pod found for it meanwhile
        # would otherwise run on, its lease renewed by this flow process.
        if earlier is not None and earlier.completed is None:
            return state, (StopEarlier(earlier.job_id),)
        return state, ()
    if cached is not None:
        if not cached.is_completed():  # a record refused as tampered with: never ran
            return _conclude(state, cached)
        # As Prefect's engine records its own cache hits: Running (one run, a start time),
        # then Cached.
        return _conclude(dataclasses.replace(state, runs_used=1), cached, Record(Running()))
    if earlier is None:
        return dataclasses.replace(state, phase=Phase.LAUNCHING), (Launch(),)
    job_ids = (*state.job_ids[:-1], earlier.job_id)
    if earlier.completed is not None:
        return _conclude(dataclasses.replace(state, job_ids=job_ids), earlier.completed)
    adopting = dataclasses.replace(state, job_ids=job_ids, phase=Phase.RUNNING, adopted=True)
    message = f"Reattached to pod {earlier.job_id}, launched by an earlier flow process"
    return adopting, (Record(Running(message=message)), Adopt(earlier.job_id))


def _pod_ended(state: RunState, event: PodEnded) -> Step:
    if event.job_id != state.job_id:
        return state, ()
    if state.done:
        return _record_again(state)
    end = event.end
    if state.adopted:
        if state.cancelled or event.stopped:
            return state, ()
        if end.reported_by_pod and end.state.is_completed():
            return _conclude(state, end.state)
        note = (
            f"The reattached pod {event.job_id} ended without completing "
            f"({end.state.message}); launching a new pod"
        )
        return _relaunch(state, event.next_job_id, 0.0, note, record=True)
    if event.unreadable:
        return _conclude(state, end.state)
    if end.reported_by_pod:
        if end.retrying:
            counted = dataclasses.replace(state, runs_used=state.runs_used + 1)
            note = f"Relaunching every host of the slice: {end.state.message or 'retry'}"
            return _relaunch(counted, event.next_job_id, event.retry_delay, note, record=False)
        ended = dataclasses.replace(state, phase=Phase.FINAL, final=end.state)
        return ended, (Resolve(end.state),)
    counted = dataclasses.replace(state, runs_used=runs_after(state, event.recorded_runs))
    cancelled = state.cancelled or event.stopped
    decision = after_silent_end(
        state_type=end.state.type,
        cancelled=cancelled,
        preempted=event.preempted,
        preemptions_left=counted.preemptions_left,
        retries_left=counted.retries_left,
        pod_never_ran_the_task=isinstance(
            exception_or_none(end.state), (PodPhaseError, PodStartError)
        ),
    )
    if decision == RELAUNCH_PREEMPTED:
        preempted = dataclasses.replace(counted, preemptions=counted.preemptions + 1)
        note = (
            f"Preempted: {end.state.message} (preemption {preempted.preemptions} of "
            f"{state.preemption_retries}; the task's retries are untouched)"
        )
        return _relaunch(preempted, event.next_job_id, 0.0, note, record=True)
    if decision == RETRY:
        note = f"Retrying after a crash: {end.state.message}"
        return _relaunch(counted, event.next_job_id, event.retry_delay, note, record=True)
    return _conclude(counted, concluded_state(end.state, cancelled))


def runs_after(state: RunState, recorded_runs: int) -> int:
    """Engine runs used once a pod ended silently: one more, or what the API counted."""
    return max(state.runs_used + 1, recorded_runs)


def launch_failed(what: str, exc: BaseException) -> Conclude:
    return Conclude(Failed(message=f"{what}: {exc}", data=exc))
