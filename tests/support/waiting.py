"""Waiting on conditions with deadlines, never on fixed sleeps."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    what: str = "condition",
    left: Callable[[], object] | None = None,
) -> T:
    """Call `probe` until it returns a truthy value; fail after `timeout` seconds.

    `left`, if given, says what was still in the way; the failure shows it.
    With SUITE_WAIT_LOG set, each wait appends how long it took to that file, so
    a run shows which deadlines a slower machine would come close to (docs/testing.md).
    """
    start = time.monotonic()
    deadline = start + timeout
    delay = 0.01
    met = False
    try:
        while True:
            value = probe()
            if value:
                met = True
                return value
            if time.monotonic() > deadline:
                shown = f": {left()!r}" if left is not None else ""
                raise AssertionError(f"Timed out after {timeout}s waiting for {what}{shown}")
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
    finally:
        _log_wait(what, timeout, time.monotonic() - start, met)


def _log_wait(what: str, timeout: float, elapsed: float, met: bool) -> None:
    log = os.environ.get("SUITE_WAIT_LOG")
    if not log:
        return
    line = json.dumps(
        {
            "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
            "what": what,
            "timeout": timeout,
            "elapsed": round(elapsed, 2),
            "met": met,
        }
    )
    try:
        with open(log, "a") as out:
            out.write(line + "\n")
    except OSError:  # a measurement only: it never changes a wait's outcome
        pass


def wait_past_jobs(cluster: object, jobs: int, seconds: float, what: str) -> None:
    """Wait until the cluster has had `jobs` Jobs created, then `seconds` more: for a case
    that holds capacity back past a timeout of the product's (twice it, say) counted from
    its last Job's creation."""
    created_jobs: Callable[[], list[object]] = cluster.created_jobs  # type: ignore[attr-defined]
    wait_until(lambda: len(created_jobs()) >= jobs, 120, f"{jobs} Jobs to be created")
    since = time.monotonic()
    wait_until(lambda: time.monotonic() - since > seconds, seconds + 120, what)


def task_run_state(task_run_id: object) -> object:
    """The task run's state as the API has it (None if the API does not know it yet)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_task_run(task_run_id).state  # type: ignore[arg-type]
        except ObjectNotFound:
            return None


# How long a task run's record must stay unchanged, once it shows a final state, before a
# test reads it as the run's last word. Prefect 3.9.1's server applies events as they
# arrive, two at a time and one per write, from every process that sends them (the flow
# process, each pod), and puts a failed write back at the end of its queue: a state sent
# before the final one can still land after it.
RECORDER_SETTLE_SECONDS = 1.0


def _settled(read: Callable[[], tuple[T, object] | None], timeout: float, what: str) -> T:
    """`read()` gives (value, fingerprint) once the run shows a final state, else None; the
    value once its fingerprint stayed the same for `RECORDER_SETTLE_SECONDS`."""
    seen: dict[str, Any] = {}

    def probe() -> tuple[T] | None:
        found = read()
        now = time.monotonic()
        if found is None:
            seen.clear()
            return None
        value, fingerprint = found
        if seen.get("fingerprint") != fingerprint:
            seen.update(fingerprint=fingerprint, since=now)
            return None
        return (value,) if now - seen["since"] >= RECORDER_SETTLE_SECONDS else None

    return wait_until(probe, timeout, what)[0]


def recorded_task_run(task_run_id: object, timeout: float = 30.0, client: Any = None) -> Any:
    """The task run as the API has it once it shows a final state, and keeps it.

    Task-run states reach the API as events, recorded by the server after the flow that
    caused them may have returned: a read straight after a flow can see an older state, or
    none, and a late event can still change it (`RECORDER_SETTLE_SECONDS`). `client`: a
    sync Prefect client of another API than this process's.
    """
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    def read() -> tuple[Any, object] | None:
        try:
            if client is not None:
                task_run = client.read_task_run(task_run_id)
            else:
                with get_client(sync_client=True) as own:
                    task_run = own.read_task_run(task_run_id)  # type: ignore[arg-type]
        except ObjectNotFound:
            return None
        if task_run.state is None or not task_run.state.is_final():
            return None
        return task_run, (task_run.state.id, task_run.run_count)

    return _settled(read, timeout, f"the API to record a final state of task run {task_run_id}")


def recorded_history(task_run_id: object, timeout: float = 30.0) -> list[Any]:
    """Every state the API recorded for the task run, oldest first, once it shows a final
    one and its history stopped changing (`RECORDER_SETTLE_SECONDS`)."""
    from prefect import get_client

    def read() -> tuple[list[Any], object] | None:
        with get_client(sync_client=True) as client:
            states = client.read_task_run_states(task_run_id)  # type: ignore[arg-type]
        ordered = sorted(states, key=lambda s: s.timestamp)
        if not ordered or not ordered[-1].is_final():
            return None
        return ordered, tuple(s.id for s in ordered)

    return _settled(read, timeout, f"the API to record the history of task run {task_run_id}")


def wait_for_task_run_state(task_run_id: object, state_type: str, timeout: float = 30.0) -> object:
    """Wait until the API shows the task run in `state_type` (recorded from events)."""

    def probe() -> object:
        state = task_run_state(task_run_id)
        return state if state is not None and state.type.value == state_type else None  # type: ignore[attr-defined]

    return wait_until(probe, timeout, f"task run {task_run_id} to be {state_type} in the API")
