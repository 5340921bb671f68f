"""Task runs waiting on their upstreams hold no thread: they are parked until those end.

A flow that submits a gate task, more tasks that depend on it than the runner has
submitter threads, and then the task that opens the gate must finish: a runner whose
waiting submissions each held a thread had none left for the opener, and the gate
waited until its own deadline. Pods import this module to run its tasks.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, task
from prefect.futures import PrefectConcurrentFuture, wait

from kinetic_prefect import KineticTaskRunner
from tests.support.waiting import wait_for_task_run_state

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

# More dependents than the runner's eight submitter threads.
DEPENDENTS = 10
# How long the gate waits for its opener before it fails (the case then fails, not hangs).
GATE_SECONDS = 120.0


@task
def gate_opened(gate: str, seconds: float, fail_once_open: bool = False) -> str:
    deadline = time.monotonic() + seconds
    pause = threading.Event()
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nobody opened {gate} within {seconds:g}s")
        pause.wait(0.05)
    if fail_once_open:
        raise RuntimeError("the gate failed on purpose: its dependents are NotReady")
    return "opened"


@task
def after(upstream: str, index: int) -> tuple[str, int]:
    return upstream, index


@task
def open_gate(gate: str) -> str:
    Path(gate).touch()
    return "opener ran"


def dependents_then_their_opener(runner: KineticTaskRunner, gate: Path) -> tuple[list[Any], str]:
    """The gate, `DEPENDENTS` tasks that take its result, then the task that opens it."""

    @flow(task_runner=runner)
    def run(gate: str) -> tuple[list[Any], str]:
        opened = gate_opened.submit(gate, GATE_SECONDS)
        dependents = [after.submit(opened, index) for index in range(DEPENDENTS)]
        opener = open_gate.submit(gate)
        return [d.result() for d in dependents], opener.result()

    return run(str(gate))


def test_dependents_of_a_gate_leave_room_for_the_task_that_opens_it(workdir: Path):
    results, opener = dependents_then_their_opener(
        KineticTaskRunner(max_parallel=4), workdir / "gate"
    )

    assert opener == "opener ran"
    assert results == [("opened", index) for index in range(DEPENDENTS)]


def _submitter_threads() -> int:
    return sum(t.name.startswith("kinetic-submit") for t in threading.enumerate())


def test_two_hundred_waiting_task_runs_add_no_thread_to_the_flow_process(workdir: Path):
    gate = workdir / "gate"

    @flow(task_runner=KineticTaskRunner(max_parallel=4))
    def run(gate: str) -> tuple[int, int, int, set[str]]:
        failing = gate_opened.submit(gate, GATE_SECONDS, fail_once_open=True)
        waiting = [after.submit(failing, index) for index in range(20)]
        with_twenty = threading.active_count()
        waiting += [after.submit(failing, index) for index in range(20, 200)]
        with_two_hundred = threading.active_count()
        submitters = _submitter_threads()
        Path(gate).touch()
        wait(waiting)
        return with_twenty, with_two_hundred, submitters, {f.state.name for f in waiting}

    with_twenty, with_two_hundred, submitters, states = run(str(gate))

    # The gate failed: none of the 200 ran a pod, each was NotReady as Prefect decides it.
    assert states == {"NotReady"}
    # Threads of Prefect's own may end meanwhile; none is added for the waiting runs.
    assert with_two_hundred <= with_twenty, (with_twenty, with_two_hundred)
    # A waiting run holds no submitter thread: a pool of eight blocked ones was the old way.
    assert submitters < 8, submitters


class _RefusesCallbacks(PrefectConcurrentFuture[Any]):
    """A wrapped future that cannot take a done callback (a broken future type)."""

    def add_done_callback(self, fn: Any) -> None:
        raise RuntimeError("this future takes no callbacks")


def test_a_task_run_whose_upstreams_cannot_be_waited_on_fails_and_is_not_left_pending():
    @flow(task_runner=KineticTaskRunner(max_parallel=2))
    def run() -> tuple[str, str, Any]:
        upstream = _RefusesCallbacks(uuid.uuid4(), concurrent.futures.Future())
        future = after.submit(upstream, 0)
        future.wait(30)  # the state the runner resolved it with, not the API's yet
        return future.state.type.value, future.state.message or "", future.task_run_id

    state, message, task_run_id = run()

    assert state == "FAILED"
    assert "this future takes no callbacks" in message
    # Task-run states reach the API as events: the server records them shortly after.
    wait_for_task_run_state(task_run_id, "FAILED")
