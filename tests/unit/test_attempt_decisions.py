"""What the runner does after a pod that left no report of its own: a table."""

from __future__ import annotations

import pytest
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Completed, Crashed, Failed, State

from kinetic_prefect.runner.attempt_end import (
    CONCLUDE,
    RELAUNCH_PREEMPTED,
    RETRY,
    after_silent_end,
    ask_recorded_runs,
    concluded_state,
)

CRASHED, CANCELLED, COMPLETED, FAILED = (
    StateType.CRASHED,
    StateType.CANCELLED,
    StateType.COMPLETED,
    StateType.FAILED,
)

# (state the backend's view made, cancelled, preempted, preemptions left, retries left,
#  the pod never ran the task) -> next step
ROWS = [
    pytest.param(CRASHED, False, False, 3, 2, False, RETRY, id="a crash with retries left"),
    pytest.param(CRASHED, False, False, 3, 0, False, CONCLUDE, id="a crash with no retry left"),
    pytest.param(
        CRASHED, False, True, 3, 0, False, RELAUNCH_PREEMPTED, id="a preemption spends no retry"
    ),
    pytest.param(
        CRASHED, False, True, 0, 2, False, RETRY, id="preemptions used up: a retry instead"
    ),
    pytest.param(CRASHED, False, True, 0, 0, False, CONCLUDE, id="preemptions and retries used up"),
    pytest.param(
        CRASHED, False, False, 3, 2, True, CONCLUDE, id="a phase or start failure is not retried"
    ),
    pytest.param(
        CRASHED,
        False,
        True,
        1,
        0,
        True,
        RELAUNCH_PREEMPTED,
        id="preempted before the task ran: relaunched all the same",
    ),
    pytest.param(CRASHED, True, True, 3, 2, False, CONCLUDE, id="cancelled: never relaunched"),
    pytest.param(CANCELLED, False, False, 3, 2, False, CONCLUDE, id="a Cancelled state stands"),
    pytest.param(COMPLETED, False, True, 3, 2, False, CONCLUDE, id="a Completed state stands"),
    pytest.param(FAILED, False, False, 3, 2, False, CONCLUDE, id="a Failed state stands"),
]


@pytest.mark.parametrize(
    (
        "state_type",
        "cancelled",
        "preempted",
        "preemptions_left",
        "retries_left",
        "never_ran",
        "step",
    ),
    ROWS,
)
def test_after_a_pod_that_left_no_report(
    state_type, cancelled, preempted, preemptions_left, retries_left, never_ran, step
):
    assert (
        after_silent_end(
            state_type=state_type,
            cancelled=cancelled,
            preempted=preempted,
            preemptions_left=preemptions_left,
            retries_left=retries_left,
            pod_never_ran_the_task=never_ran,
        )
        == step
    )


# (the state a silent end concluded, cancelled or its flow run marked over) -> what the run ends as
CONCLUDED = [
    pytest.param(Crashed(message="exit 143"), True, CANCELLED, id="stopped while being cancelled"),
    pytest.param(Crashed(message="exit 1"), False, CRASHED, id="a crash on its own stands"),
    pytest.param(Completed(), True, COMPLETED, id="a Completed state stands"),
    pytest.param(Failed(message="boom"), True, FAILED, id="a Failed state stands"),
    pytest.param(Cancelled(message="by the API"), True, CANCELLED, id="a Cancelled state stands"),
]


@pytest.mark.parametrize(("state", "cancelled", "expected"), CONCLUDED)
def test_a_silent_end_while_cancelling_concludes_cancelled(
    state: State[object], cancelled: bool, expected: StateType
) -> None:
    concluded = concluded_state(state, cancelled)

    assert concluded.type == expected
    if expected != state.type:
        assert state.message is not None and state.message in (concluded.message or "")


@pytest.mark.parametrize(
    ("retries", "crashed", "preempted", "hosts", "ask"),
    [
        pytest.param(
            2, True, False, 1, True, id="a crashed pod with retries: its engine may have retried"
        ),
        pytest.param(0, True, False, 1, False, id="no retries: nothing depends on the count"),
        pytest.param(2, False, False, 1, False, id="not a crash: never relaunched"),
        pytest.param(2, True, True, 1, False, id="preempted: its own budget"),
        pytest.param(
            1,
            True,
            False,
            2,
            False,
            id="a slice: host 0 runs one attempt, its recorded Retrying never ran",
        ),
    ],
)
def test_when_the_api_run_count_decides_a_relaunch(
    retries: int, crashed: bool, preempted: bool, hosts: int, ask: bool
) -> None:
    assert (
        ask_recorded_runs(retries=retries, crashed=crashed, preempted=preempted, hosts=hosts) is ask
    )
