"""KineticTaskRunner as Prefect's runners behave, at a scale: many flows, many tasks at once.

Apart from tests/runner/test_conformance.py because they measure no private Prefect API:
the lowest-Prefect run (`make test-lowest`) leaves them out.
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from prefect import flow

from kinetic_prefect import KineticTaskRunner
from tests.runner.test_conformance import (
    CANCEL_GRACE,
    _task_run_states,
    leave_unfinished,
    plus_one,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


# About 80 s, mostly waiting on pods: started early (tests/support/scheduling.py) rather
# than left to be the run's last case.
@pytest.mark.slow
def test_twenty_flows_left_unfinished_in_mixed_shapes_leave_no_task_run_unfinished(
    workdir: Path,
):
    shapes = [
        (shape, finish, linger)
        for linger in (False, True)
        for shape in ("chain", "map")
        for finish in ("return", "raise")
    ]
    cases = [shapes[i % len(shapes)] for i in range(20)]

    def leave(index: int) -> object:
        shape, finish, linger = cases[index]
        started = workdir / f"started-{index}"
        started.mkdir()
        state = leave_unfinished(
            shape, finish, linger, str(workdir / "never"), str(started), return_state=True
        )
        return state.state_details.flow_run_id

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        flow_run_ids = list(pool.map(leave, range(len(cases))))

    def unfinished() -> dict[str, list[str]]:
        states = {str(i): _task_run_states(i) for i in flow_run_ids}
        return {i: s for i, s in states.items() if set(s) != {"CANCELLED"}}

    def recorded() -> int:
        return sum(len(_task_run_states(i)) for i in flow_run_ids)

    # All of them, once the API recorded each: a run whose creation is still on its way
    # is neither counted nor unfinished yet.
    wait_until(
        lambda: not unfinished() and recorded() == 10 * 3 + 10 * 6,
        CANCEL_GRACE + 30,
        "every task run to be Cancelled",
        left=lambda: (recorded(), _histories(unfinished())),
    )


def _histories(flow_run_ids: object) -> dict[str, list[str]]:
    """Each task run of these flow runs with the states it went through, for a failure."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(flow_run_ids)))  # type: ignore[call-overload]
        )
        return {
            f"{run.name} {run.id}": [
                f"{s.timestamp:%H:%M:%S.%f} {s.type.value} {s.name} {s.message or ''}"
                for s in client.read_task_run_states(run.id)
            ]
            for run in runs
            if run.state is None or run.state.type.value != "CANCELLED"
        }


def test_thirty_tasks_run_without_crashing():
    # Warm pods: thirty hand-overs between tasks, at two pods' start-up cost.
    @flow(task_runner=KineticTaskRunner(warm_pods=True))
    def run() -> list[int]:
        return [f.result() for f in plus_one.map(range(30))]

    assert run() == list(range(1, 31))
