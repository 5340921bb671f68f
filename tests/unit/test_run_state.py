"""A task run's next state and effects for each event it can meet: `run_state.step`'s table."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from prefect.states import Cancelled, Completed, Crashed, Failed, Pending, Retrying, State

from kinetic_prefect.errors import PodStartError
from kinetic_prefect.runner.attempt_end import AttemptEnd
from kinetic_prefect.runner.run_state import (
    Cancel,
    Conclude,
    EarlierPod,
    Effect,
    EngineDecided,
    FlowRunOver,
    Phase,
    PodEnded,
    PodPending,
    Prepared,
    Record,
    RecordAwaitingRetry,
    Resolve,
    RetryDue,
    RunState,
    Started,
    Unstarted,
    WakeAfter,
    step,
)

JOB, NEXT = "kp-train-0", "kp-train-1"
COMPLETED = Completed(message="done")
RUNNERS_CANCEL = Cancelled(message="The flow run ended while the task run was not finished.")


def run(phase: Phase = Phase.RUNNING, **changes: Any) -> RunState:
    state = RunState(job_ids=(JOB,), retries=2, preemption_retries=1, phase=phase)
    if phase is Phase.RUNNING:
        state = dataclasses.replace(state, pods_launched=1)
    return dataclasses.replace(state, **changes)


def ended_by_runner(final: State[Any] = RUNNERS_CANCEL, **changes: Any) -> RunState:
    return run(Phase.FINAL, final=final, final_is_runners=True, cancelled=True, **changes)


def ended_by_pod() -> RunState:
    return run(Phase.FINAL, final=COMPLETED)


def reported(state: State[Any]) -> AttemptEnd:
    return AttemptEnd(state, reported_by_pod=True)


def silent(state: State[Any]) -> AttemptEnd:
    return AttemptEnd(state, reported_by_pod=False)


CRASH = Crashed(message="Pod kp-train-0 ended without reporting a final state: OOMKilled.")
NEVER_STARTED = Failed(message="could not start", data=PodStartError("could not start"))


def ended(end: AttemptEnd, **facts: Any) -> PodEnded:
    return PodEnded(JOB, end, NEXT, **facts)


def kinds(effects: tuple[Any, ...]) -> list[str]:
    return [type(effect).__name__ for effect in effects]


# (state, event) -> (phase after, what else holds of the state, effects by kind)
ROWS = [
    # -- before the first pod
    pytest.param(
        run(Phase.PREPARING),
        Prepared(inputs=None),
        Phase.LAUNCHING,
        {},
        ["Launch"],
        id="prepared: the first pod is launched",
    ),
    pytest.param(
        run(Phase.PREPARING),
        Prepared(inputs=None, cached=COMPLETED),
        Phase.FINAL,
        {"final": COMPLETED, "final_is_runners": True, "runs_used": 1},
        ["Record", "Record", "Resolve"],
        id="a cached result: Running then Cached recorded, as Prefect's engine does; no pod",
    ),
    pytest.param(
        run(Phase.PREPARING),
        Prepared(inputs=None, cached=Failed(message="tampered")),
        Phase.FINAL,
        {"final_is_runners": True, "runs_used": 0},
        ["Record", "Resolve"],
        id="a cached record refused: Failed recorded, no run counted",
    ),
    pytest.param(
        run(Phase.PREPARING),
        Prepared(inputs=None, earlier=EarlierPod("kp-train-old")),
        Phase.RUNNING,
        {"job_ids": ("kp-train-old",), "adopted": True},
        ["Record", "Adopt"],
        id="reattach after a restart: the earlier live pod is adopted, shown Running",
    ),
    pytest.param(
        run(Phase.PREPARING),
        Prepared(inputs=None, earlier=EarlierPod("kp-train-old", completed=COMPLETED)),
        Phase.FINAL,
        {"job_ids": ("kp-train-old",), "final": COMPLETED},
        ["Record", "Resolve"],
        id="reattach after a restart: the earlier pod's Completed is the run's",
    ),
    pytest.param(
        run(Phase.PREPARING),
        EngineDecided(Pending(name="NotReady")),
        Phase.FINAL,
        {"final_is_runners": False},
        ["Resolve"],
        id="an upstream failure: the engine recorded NotReady, the future takes it",
    ),
    pytest.param(
        ended_by_runner(),
        EngineDecided(Pending(name="NotReady")),
        Phase.FINAL,
        {"final_is_runners": True},
        ["Record"],
        id="NotReady decided while a cancel was recorded: the cancel is recorded again",
    ),
    pytest.param(
        ended_by_runner(),
        Prepared(inputs=None),
        Phase.FINAL,
        {},
        [],
        id="prepared after a cancel: no pod",
    ),
    pytest.param(
        ended_by_runner(),
        Prepared(inputs=None, earlier=EarlierPod("kp-train-old")),
        Phase.FINAL,
        {"final": RUNNERS_CANCEL},
        ["StopEarlier"],
        id="an earlier live pod found after a cancel: stopped, not adopted",
    ),
    pytest.param(
        ended_by_runner(),
        Prepared(inputs=None, earlier=EarlierPod("kp-train-old", completed=COMPLETED)),
        Phase.FINAL,
        {"final": RUNNERS_CANCEL},
        [],
        id="an earlier ended pod found after a cancel: nothing to stop, the cancel stands",
    ),
    pytest.param(
        run(Phase.PREPARING),
        Conclude(Failed(message="Could not launch the pod: no quota")),
        Phase.FINAL,
        {"final_is_runners": True},
        ["Record", "Resolve"],
        id="a launch failure is recorded and resolved",
    ),
    # -- cancels
    pytest.param(
        run(Phase.PREPARING),
        Cancel("stop"),
        Phase.FINAL,
        {"cancelled": True, "final_is_runners": True},
        ["Record", "Resolve"],
        id="a cancel while preparing: nothing to stop",
    ),
    pytest.param(
        run(Phase.LAUNCHING),
        Cancel("stop"),
        Phase.FINAL,
        {"cancelled": True},
        ["StopPod", "Record", "Resolve"],
        id="a cancel during upload: the pod on its way is stopped",
    ),
    pytest.param(
        ended_by_runner(pods_launched=0),
        Started(JOB, backend=None, manifest={}),
        Phase.FINAL,
        {"pods_launched": 1},
        ["StopPod"],
        id="the pod of a cancel during upload starts after it: stopped again",
    ),
    pytest.param(
        run(Phase.RUNNING),
        Cancel("stop"),
        Phase.FINAL,
        {"cancelled": True},
        ["StopPod", "Record", "Resolve"],
        id="a cancel while the pod runs",
    ),
    pytest.param(
        run(Phase.AWAITING_RETRY, job_ids=(JOB, NEXT)),
        Cancel("stop"),
        Phase.FINAL,
        {"cancelled": True},
        ["Record", "Resolve"],
        id="a cancel between two pods: no pod to stop",
    ),
    pytest.param(
        ended_by_pod(),
        Cancel("stop"),
        Phase.FINAL,
        {"final": COMPLETED, "cancelled": True},
        [],
        id="a cancel after the pod completed changes nothing",
    ),
    # -- the flow run is over (the lease's look) while the flow is in the runner
    pytest.param(
        run(Phase.PREPARING),
        FlowRunOver("over"),
        Phase.FINAL,
        {"cancelled": True, "final_is_runners": True},
        ["Record", "Resolve"],
        id="flow run over while waiting for upstreams: Cancelled now, never NotReady",
    ),
    pytest.param(
        run(Phase.LAUNCHING),
        FlowRunOver("over"),
        Phase.FINAL,
        {"cancelled": True},
        ["StopPod", "Record", "Resolve"],
        id="flow run over during upload: the pod on its way is stopped",
    ),
    pytest.param(
        run(Phase.RUNNING),
        FlowRunOver("over"),
        Phase.RUNNING,
        {"cancelled": False},
        [],
        id="flow run over while the pod runs: left to the pod, which ends on the marked lease",
    ),
    pytest.param(
        run(Phase.RUNNING, adopted=True),
        FlowRunOver("over"),
        Phase.RUNNING,
        {"cancelled": False},
        [],
        id="the same for a pod adopted from an earlier flow process",
    ),
    pytest.param(
        run(Phase.RUNNING),
        ended(silent(CRASH), stopped=True),
        Phase.FINAL,
        {"final_is_runners": True},
        ["Record", "Resolve"],
        id="that pod ending itself (read as stopped) concludes Cancelled, with no retry",
    ),
    pytest.param(
        run(Phase.AWAITING_RETRY, job_ids=(JOB, NEXT)),
        FlowRunOver("over"),
        Phase.FINAL,
        {"cancelled": True},
        ["Record", "Resolve"],
        id="flow run over during a retry's delay: Cancelled now, no pod launched",
    ),
    pytest.param(
        ended_by_pod(),
        FlowRunOver("over"),
        Phase.FINAL,
        {"final": COMPLETED, "cancelled": False},
        [],
        id="flow run over after the pod completed changes nothing",
    ),
    # -- a pod's life
    pytest.param(
        run(Phase.LAUNCHING),
        Started(JOB, backend=None, manifest={}),
        Phase.RUNNING,
        {"pods_launched": 1},
        [],
        id="started",
    ),
    pytest.param(
        run(Phase.LAUNCHING),
        Started("kp-train-gone", backend=None, manifest={}),
        Phase.LAUNCHING,
        {"pods_launched": 0},
        [],
        id="a start of another attempt's Job is not this one's",
    ),
    pytest.param(
        run(Phase.RUNNING),
        Unstarted(JOB),
        Phase.LAUNCHING,
        {"pods_launched": 0},
        [],
        id="a warm pod that ended before taking the task gives it back",
    ),
    pytest.param(
        run(Phase.RUNNING),
        PodPending(JOB, "waiting for a node"),
        Phase.RUNNING,
        {},
        ["ShowPending"],
        id="a pending pod's reason is shown",
    ),
    pytest.param(
        ended_by_pod(),
        PodPending(JOB, "waiting for a node"),
        Phase.FINAL,
        {},
        [],
        id="a pending report after the end is dropped",
    ),
    pytest.param(
        run(),
        ended(reported(COMPLETED)),
        Phase.FINAL,
        {"final": COMPLETED, "final_is_runners": False},
        ["Resolve"],
        id="the pod reported Completed: resolved with its own state, not recorded again",
    ),
    pytest.param(
        run(),
        ended(reported(Retrying(message="host 0 raised"))),
        Phase.AWAITING_RETRY,
        {"runs_used": 1, "job_ids": (JOB, NEXT)},
        ["WakeAfter"],
        id="a slice's engine recorded its retry: every host relaunched, nothing recorded",
    ),
    pytest.param(
        run(),
        ended(silent(CRASH)),
        Phase.AWAITING_RETRY,
        {"runs_used": 1, "preemptions": 0, "job_ids": (JOB, NEXT)},
        ["RecordAwaitingRetry", "WakeAfter"],
        id="a crash with retries left: AwaitingRetry, then a new pod",
    ),
    pytest.param(
        run(runs_used=2),
        ended(silent(CRASH)),
        Phase.FINAL,
        {"runs_used": 3, "final": CRASH, "final_is_runners": True},
        ["Record", "Resolve"],
        id="a crash with no retry left: Crashed",
    ),
    pytest.param(
        run(),
        ended(silent(CRASH), recorded_runs=3),
        Phase.FINAL,
        {"runs_used": 3},
        ["Record", "Resolve"],
        id="a crash after the engine used the retries in the pod: Crashed",
    ),
    pytest.param(
        run(runs_used=2),
        ended(silent(CRASH), preempted=True),
        Phase.AWAITING_RETRY,
        {"preemptions": 1, "runs_used": 3},
        ["RecordAwaitingRetry", "WakeAfter"],
        id="a preemption on its own budget, with no retry left",
    ),
    pytest.param(
        run(preemptions=1),
        ended(silent(CRASH), preempted=True),
        Phase.AWAITING_RETRY,
        {"preemptions": 1},
        ["RecordAwaitingRetry", "WakeAfter"],
        id="preemptions used up: the task's retry instead",
    ),
    pytest.param(
        run(),
        ended(silent(NEVER_STARTED)),
        Phase.FINAL,
        {"final": NEVER_STARTED},
        ["Record", "Resolve"],
        id="a pod that never ran the task is not retried",
    ),
    pytest.param(
        run(),
        ended(silent(CRASH), stopped=True),
        Phase.FINAL,
        {"final_is_runners": True},
        ["Record", "Resolve"],
        id="a crash once the lease said the flow run is over: Cancelled, not retried",
    ),
    pytest.param(
        run(),
        ended(silent(Failed(message="unreadable")), unreadable=True),
        Phase.FINAL,
        {"final_is_runners": True},
        ["Record", "Resolve"],
        id="a final record that cannot be read ends the run Failed",
    ),
    pytest.param(
        ended_by_runner(),
        ended(silent(CRASH)),
        Phase.FINAL,
        {"final_is_runners": True},
        ["Record"],
        id="a late pod after the runner's final state: it is recorded again",
    ),
    pytest.param(
        ended_by_pod(),
        ended(silent(CRASH)),
        Phase.FINAL,
        {"final": COMPLETED},
        [],
        id="a late pod after the pod's own final state: nothing",
    ),
    pytest.param(
        run(job_ids=(JOB, NEXT)),
        ended(silent(CRASH)),
        Phase.RUNNING,
        {"runs_used": 0},
        [],
        id="the end of an earlier attempt's pod is not this attempt's",
    ),
    pytest.param(
        run(adopted=True),
        ended(reported(COMPLETED)),
        Phase.FINAL,
        {"final": COMPLETED},
        ["Record", "Resolve"],
        id="the adopted pod completed: recorded as the new run's",
    ),
    pytest.param(
        run(adopted=True),
        ended(silent(CRASH)),
        Phase.AWAITING_RETRY,
        {"adopted": False, "runs_used": 0, "job_ids": (JOB, NEXT)},
        ["RecordAwaitingRetry", "WakeAfter"],
        id="the adopted pod did not complete: a new pod at once",
    ),
    pytest.param(
        run(adopted=True),
        ended(silent(Cancelled()), stopped=True),
        Phase.RUNNING,
        {},
        [],
        id="the adopted pod was stopped: its cancel decides",
    ),
    # -- between pods
    pytest.param(
        run(Phase.AWAITING_RETRY, job_ids=(JOB, NEXT)),
        RetryDue(NEXT),
        Phase.LAUNCHING,
        {},
        ["Launch"],
        id="a retry's delay is over: the next pod",
    ),
    pytest.param(
        ended_by_runner(job_ids=(JOB, NEXT)),
        RetryDue(NEXT),
        Phase.FINAL,
        {},
        [],
        id="a retry due after a cancel launches nothing",
    ),
    pytest.param(
        run(Phase.AWAITING_RETRY, job_ids=(JOB, NEXT, "kp-train-2")),
        RetryDue(NEXT),
        Phase.AWAITING_RETRY,
        {},
        [],
        id="a stale retry's wake-up launches nothing",
    ),
]


@pytest.mark.parametrize(("state", "event", "phase", "holds", "effects"), ROWS)
def test_step(
    state: RunState, event: Any, phase: Phase, holds: dict[str, Any], effects: list[str]
) -> None:
    after, done = step(state, event)
    assert after.phase is phase
    for name, value in holds.items():
        assert getattr(after, name) == value, name
    assert kinds(done) == effects


def test_the_runners_final_state_recorded_again_is_a_newer_copy() -> None:
    after, done = step(ended_by_runner(), ended(silent(CRASH)))
    assert done == (Record(after.final),)
    assert after.final is not RUNNERS_CANCEL
    assert after.final.type == RUNNERS_CANCEL.type and after.final.id != RUNNERS_CANCEL.id


def test_a_relaunch_names_its_job_and_delay() -> None:
    after, done = step(run(), ended(silent(CRASH), retry_delay=30.0))
    assert after.job_id == NEXT
    wake = done[-1]
    assert isinstance(wake, WakeAfter) and (wake.delay, wake.job_id) == (30.0, NEXT)
    assert isinstance(done[0], RecordAwaitingRetry) and done[0].delay == 30.0


def test_a_crash_while_cancelling_concludes_cancelled_naming_the_pods_end() -> None:
    after, done = step(run(), ended(silent(CRASH), stopped=True))
    assert after.final is not None and after.final.is_cancelled()
    assert CRASH.message in (after.final.message or "")
    assert done == (Record(after.final), Resolve(after.final))


PHASES = [
    run(Phase.PREPARING),
    run(Phase.LAUNCHING),
    run(Phase.RUNNING),
    run(Phase.RUNNING, adopted=True),
    run(Phase.AWAITING_RETRY, job_ids=(JOB, NEXT)),
    ended_by_runner(),
    ended_by_pod(),
]
EVENTS = [
    Prepared(inputs=None),
    Prepared(inputs=None, cached=COMPLETED),
    Prepared(inputs=None, earlier=EarlierPod("kp-train-old")),
    Prepared(inputs=None, earlier=EarlierPod("kp-train-old", completed=COMPLETED)),
    Started(JOB, None, {}),
    Unstarted(JOB),
    PodPending(JOB, "waiting"),
    ended(reported(COMPLETED)),
    ended(reported(Retrying())),
    ended(silent(CRASH)),
    ended(silent(CRASH), preempted=True),
    RetryDue(JOB),
    RetryDue(NEXT),
    Cancel("stop"),
    FlowRunOver("over"),
    Conclude(Failed()),
    EngineDecided(Pending(name="NotReady")),
]


@pytest.mark.parametrize(
    ("state", "event"),
    list(itertools.product(PHASES, EVENTS)),
    ids=lambda value: type(value).__name__,
)
def test_every_pair_keeps_the_rules(state: RunState, event: Any) -> None:
    """Whatever arrives in whatever state: a future is resolved at most once and only
    on the way into FINAL; a final state never changes kind; no pod is launched for a
    cancelled or ended run; a cancelled run stays cancelled."""
    after, done = step(state, event)
    effects = kinds(done)
    assert effects.count("Resolve") == (after.done and not state.done)
    if state.done:
        assert after.done and after.final is not None and state.final is not None
        assert after.final.type == state.final.type
        assert not {"Launch", "Adopt", "WakeAfter", "ShowPending"} & set(effects)
    if after.cancelled:
        assert "Launch" not in effects and "Adopt" not in effects
    if "StopEarlier" in effects:
        assert state.done, "an earlier pod is stopped only for a run that ended first"
    assert after.cancelled >= state.cancelled
    if after.done:
        assert after.final is not None
    assert all(isinstance(effect, Effect) for effect in done)


def test_a_cached_result_records_running_first_then_the_cached_state() -> None:
    after, done = step(run(Phase.PREPARING), Prepared(inputs=None, cached=COMPLETED))
    running, cached, resolved = done
    assert isinstance(running, Record) and running.state.is_running()
    assert cached == Record(COMPLETED) and resolved == Resolve(COMPLETED)
