"""KineticTaskRunner behaves as Prefect's task runners do.

The behaviours checked by Prefect's own runner suites (ThreadPool/ProcessPool in
Prefect's tests, prefect-dask's and prefect-ray's) that apply to a runner whose
tasks run in other processes, each against a real Prefect API with real pods.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, get_client, tags, task
from prefect.assets import Asset, materialize
from prefect.context import FlowRunContext, TagsContext, get_run_context
from prefect.futures import as_completed
from prefect.states import Cancelling, Completed
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import allow_failure

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.runner.task_launch import TaskLaunch
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.lowest_prefect, pytest.mark.usefixtures("prefect_api", "workdir")]

CANCEL_GRACE = 3


@task
def wait_for_file(path: str) -> str:
    while not Path(path).exists():
        time.sleep(0.05)
    return path


@task
def plus_one(x: int) -> int:
    return x + 1


@task
def explode() -> None:
    raise ValueError("boom")


@task
def current_tags() -> set[str]:
    return set(TagsContext.get().current_tags)


@task
def interrupt() -> None:
    raise KeyboardInterrupt()


@task(timeout_seconds=1)
async def sleeps_past_its_timeout() -> int:
    await asyncio.sleep(30)
    return 42


@task
async def depends_on(value: object) -> int:
    return 1764


@task
async def independent() -> int:
    return 74088


@flow(task_runner=KineticTaskRunner(cancel_grace_seconds=CANCEL_GRACE))
def leave_a_chain_unfinished(gate: str, finish: str, left_at: str) -> None:
    """Leaves `a -> b -> c` unfinished by returning or raising; writes when it left to `left_at`."""
    a = wait_for_file.submit(gate)
    b = plus_one.submit(1, wait_for=[a])
    plus_one.submit(b)
    Path(left_at).write_text(repr(time.time()))
    if finish == "raise":
        raise RuntimeError("leaving early")


@task
def wait_for_file_once_started(path: str, started_dir: str) -> str:
    Path(started_dir, f"{os.getpid()}-{time.monotonic_ns()}").touch()
    while not Path(path).exists():
        time.sleep(0.05)
    return path


@flow(task_runner=KineticTaskRunner(cancel_grace_seconds=1, max_parallel=2))
def leave_unfinished(shape: str, finish: str, linger: bool, gate: str, started: str) -> None:
    """Leaves a chain or a map with dependents unfinished, at once or once a pod runs."""
    if shape == "chain":
        a = wait_for_file_once_started.submit(gate, started)
        b = plus_one.submit(1, wait_for=[a])
        plus_one.submit(b)
    else:
        waiting = wait_for_file_once_started.map([gate] * 3, started_dir=started)
        plus_one.map([1, 2, 3], wait_for=[waiting])
    if linger:
        wait_until(lambda: os.listdir(started), 120, "a pod to run its task")
    if finish == "raise":
        raise RuntimeError("leaving early")


def _task_run_states(flow_run_id: object) -> list[str]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return sorted(run.state.type.value for run in runs if run.state is not None)


def _cancelled_at(flow_run_id: object) -> list[float]:
    """When each of the flow run's task runs first became Cancelled, as the API records it."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
        histories = [client.read_task_run_states(run.id) for run in runs]
    return sorted(
        min(s.timestamp.timestamp() for s in history if s.type.value == "CANCELLED")
        for history in histories
    )


@pytest.mark.parametrize("finish", ["return", "raise"])
def test_leaving_the_flow_with_a_chain_unfinished_cancels_every_task_run_within_the_grace(
    workdir: Path, finish: str
):
    left_at = workdir / "left-at"
    state = leave_a_chain_unfinished(
        str(workdir / "never"), finish, str(left_at), return_state=True
    )

    flow_run_id = state.state_details.flow_run_id
    # The API records the runner's states from events: give it time to catch up.
    wait_until(
        lambda: _task_run_states(flow_run_id) == ["CANCELLED"] * 3,
        30,
        f"every task run to be Cancelled (now {_task_run_states(flow_run_id)})",
    )
    cancelled_after = [at - float(left_at.read_text()) for at in _cancelled_at(flow_run_id)]
    assert len(cancelled_after) == 3
    assert all(0 <= after <= CANCEL_GRACE for after in cancelled_after), cancelled_after


def test_a_task_run_whose_upstream_ended_with_its_flow_run_is_cancelled_not_left_not_ready(
    workdir: Path,
):
    # The flow run's state says it is over while the flow is still inside the runner (as
    # when the engine records the flow's end before leaving the runner, or the UI cancels
    # it): the runner marks the lease and the upstream's pod ends itself. The run waiting
    # for it must end Cancelled, as the runner's exit would end it, not NotReady (Pending).
    started = workdir / "started"
    started.mkdir()

    seen: list[str] = []

    @flow(task_runner=KineticTaskRunner(cancel_grace_seconds=CANCEL_GRACE))
    def run() -> None:
        upstream = wait_for_file_once_started.submit(str(workdir / "never"), str(started))
        downstream = plus_one.submit(1, wait_for=[upstream])
        wait_until(lambda: os.listdir(started), 120, "the upstream's pod to run its task")
        with get_client(sync_client=True) as client:
            flow_run_id = FlowRunContext.get().flow_run.id  # type: ignore[union-attr]
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
        downstream.wait(timeout=120)
        upstream.wait(timeout=120)
        seen.extend([upstream.state.type.value, downstream.state.type.value])

    run(return_state=True)  # the flow run ends as Prefect makes of a run it was told cancels

    assert seen == ["CANCELLED", "CANCELLED"]


@task(retries=1, retry_delay_seconds=3600)
def crashes_its_pod() -> None:
    os._exit(3)


def _task_run_state(task_run_id: object) -> tuple[str | None, int]:
    """The task run's state name (None before the API has it) and run count, from the API."""
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            task_run = client.read_task_run(task_run_id)  # type: ignore[arg-type]
        except ObjectNotFound:  # its creation is an event the API has not recorded yet
            return None, 0
    return (task_run.state.name if task_run.state else None), task_run.run_count


def test_a_task_run_waiting_out_its_retry_delay_ends_cancelled_when_its_flow_run_is_cancelled(
    workdir: Path,
):
    # Its pod crashed and its retry is an hour away. Cancelling the flow run while the flow
    # is still inside the runner ends it at the runner's next look at the flow run, not
    # after the delay, and no pod runs it again.
    seen: list[object] = []

    @flow(task_runner=KineticTaskRunner(cancel_grace_seconds=CANCEL_GRACE))
    def run() -> None:
        crashing = crashes_its_pod.submit()
        wait_until(
            lambda: _task_run_state(crashing.task_run_id)[0] == "AwaitingRetry",
            120,
            "the crashed task run to wait for its retry",
        )
        with get_client(sync_client=True) as client:
            flow_run_id = FlowRunContext.get().flow_run.id  # type: ignore[union-attr]
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
        crashing.wait(timeout=120)
        seen.append(crashing.state.type.value)
        wait_until(
            lambda: _task_run_state(crashing.task_run_id)[0] == "Cancelled",
            60,
            "the API to record the task run Cancelled",
        )
        seen.append(_task_run_state(crashing.task_run_id)[1])

    run(return_state=True)

    assert seen == ["CANCELLED", 1]  # one run: its crashed pod's


def test_a_task_submitted_after_its_flow_run_was_found_cancelled_launches_no_pod(
    workdir: Path,
):
    # The flow goes on after its flow run was set Cancelling (nothing stops a local flow
    # run's process): a task submitted once the runner found the flow run over ends
    # Cancelled at once, as the earlier ones did, and no pod is started for it.
    seen: list[object] = []

    @flow(task_runner=KineticTaskRunner(cancel_grace_seconds=CANCEL_GRACE))
    def run() -> None:
        first = wait_for_file.submit(str(workdir / "never"))
        wait_until(
            lambda: _task_run_state(first.task_run_id)[0] == "Running", 120, "the first to run"
        )
        with get_client(sync_client=True) as client:
            flow_run_id = FlowRunContext.get().flow_run.id  # type: ignore[union-attr]
            client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
        first.wait(timeout=120)  # its pod ended itself once the lease was marked
        late = plus_one.submit(1)
        late.wait(timeout=60)
        seen.extend([first.state.type.value, late.state.type.value, late.job_id])

    run(return_state=True)

    first_state, late_state, late_job = seen
    assert (first_state, late_state) == ("CANCELLED", "CANCELLED")
    pods = workdir / ".kinetic" / "pods"
    assert not list(pods.glob(f"{late_job}*")), "a pod was started for the late task"


def test_cancel_all_stops_running_and_waiting_task_runs_and_then_refuses_new_work(
    workdir: Path,
):
    @flow(task_runner=KineticTaskRunner(cancel_grace_seconds=CANCEL_GRACE))
    def run() -> tuple[list[str], str]:
        runner = FlowRunContext.get().task_runner  # type: ignore[union-attr]
        waiting = wait_for_file.submit(str(workdir / "never"))
        downstream = plus_one.submit(waiting)
        runner.cancel_all()
        # Resolved by the time cancel_all returns (the API learns the states from events,
        # later: the grace case above reads those).
        assert all(future.wrapped_future.done() for future in (waiting, downstream))
        for future in (waiting, downstream):
            future.wait(timeout=0)
        cancelled = [waiting.state.type.value, downstream.state.type.value]
        with pytest.raises(RuntimeError) as refused:
            plus_one.submit(41)
        return cancelled, str(refused.value)

    cancelled, refusal = run()

    assert cancelled == ["CANCELLED", "CANCELLED"]
    assert "cancel_all" in refusal


def test_a_new_runner_works_after_another_was_cancelled():
    first = KineticTaskRunner()
    with first:
        first.cancel_all()

    @flow(task_runner=first.duplicate())
    def run() -> int:
        return plus_one.submit(41).result()

    assert run() == 42


def test_cancel_all_matches_thread_pool_runner_refusing_submit():
    with ThreadPoolTaskRunner() as runner:
        runner.cancel_all()
        with pytest.raises(RuntimeError):
            runner.submit(plus_one, {"x": 1})
    with KineticTaskRunner() as runner:
        runner.cancel_all()
        with pytest.raises(RuntimeError):
            runner.submit(plus_one, {"x": 1})


def _bare_launch(name: str = "t") -> TaskLaunch:
    """A task run's launch with what the loop reads, for driving the loop directly."""
    from prefect.client.schemas.objects import TaskRun

    from kinetic_prefect.runner.run_state import RunState

    return TaskLaunch(
        task=None,
        task_run=TaskRun(task_key=name, dynamic_key="0"),
        future=concurrent.futures.Future(),
        settings=None,  # type: ignore[arg-type]
        accelerator=None,  # type: ignore[arg-type]
        task_key="",
        output_dir="",
        context=contextvars.copy_context(),
        serialized_context={},
        state=RunState(job_ids=(f"kp-{name}-0",), retries=0, preemption_retries=0),
    )


def test_a_future_resolves_once_whoever_gets_there_first():
    """Eight threads post a hundred endings of one task run: the first the loop applies is
    recorded and resolves the future; every later one finds the run ended."""
    from kinetic_prefect.runner.run_loop import RunLoop
    from kinetic_prefect.runner.run_state import Conclude

    launch = _bare_launch()
    endings = [Completed(data=n) for n in range(100)]
    loop = RunLoop(actions=None)  # type: ignore[arg-type]
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda state: loop.post(launch, Conclude(state)), endings))
        resolved = launch.future.result(timeout=30)
    finally:
        loop.close()

    assert resolved in endings
    assert launch.state.final is resolved
    assert launch.task_run.state is resolved, "recorded once, and never replaced"


def test_the_loop_holds_no_thread_once_idle_after_close_and_after_a_late_post():
    """A loop's thread ends once nothing is queued: `close` returns after it, and a post
    after `close` (a pod that ended late) is applied by a thread that ends too; the I/O
    threads (which resolve the futures) end with them."""
    from kinetic_prefect.runner.run_loop import RunLoop
    from kinetic_prefect.runner.run_state import Conclude

    before = set(threading.enumerate())

    def loop_threads(*names: str) -> list[threading.Thread]:
        return [
            thread
            for thread in threading.enumerate()
            if thread not in before and thread.name.startswith(names)
        ]

    loop = RunLoop(actions=None)  # type: ignore[arg-type]
    for name in ("before", "late"):
        launch = _bare_launch(name)
        loop.post(launch, Conclude(Completed(data=name)))
        assert launch.future.result(timeout=30).data == name
        if name == "before":
            assert loop_threads("kinetic-run-loop", "kinetic-io"), "the loop had threads"
            loop.close()
            assert loop_threads("kinetic-run-loop") == [], "close returns once the loop ended"
        wait_until(
            lambda: not loop_threads("kinetic-run-loop", "kinetic-io"),
            30,
            f"the loop's threads to end ({name} close)",
            left=lambda: loop_threads("kinetic-run-loop", "kinetic-io"),
        )


def test_a_callback_that_raises_anything_leaves_the_loop_applying_events():
    """A future's done callback runs on the loop's thread; one raising `SystemExit` is
    logged, and the next task run's event is applied all the same."""
    from kinetic_prefect.runner.run_loop import RunLoop
    from kinetic_prefect.runner.run_state import Conclude

    loop = RunLoop(actions=None)  # type: ignore[arg-type]
    first, second = _bare_launch("first"), _bare_launch("second")

    def leave(_: object) -> None:
        raise SystemExit(3)

    first.future.add_done_callback(leave)
    try:
        loop.post(first, Conclude(Completed(data=1)))
        loop.post(second, Conclude(Completed(data=2)))
        assert second.future.result(timeout=30).data == 2
    finally:
        loop.close()


def test_a_done_callback_may_wait_for_another_task_run_of_the_runner():
    """As on a thread pool's worker: the first run's callback waits for the second's
    result, which the loop goes on to decide meanwhile."""
    from kinetic_prefect.runner.run_loop import RunLoop
    from kinetic_prefect.runner.run_state import Conclude

    loop = RunLoop(actions=None)  # type: ignore[arg-type]
    first, second = _bare_launch("first"), _bare_launch("second")
    seen: list[object] = []
    first.future.add_done_callback(lambda _: seen.append(second.future.result(timeout=30)))
    try:
        loop.post(first, Conclude(Completed(data=1)))
        first.future.result(timeout=30)
        loop.post(second, Conclude(Completed(data=2)))
        wait_until(lambda: seen, 30, "the first run's callback to have the second's result")
    finally:
        loop.close()
    assert [state.data for state in seen] == [2]  # type: ignore[attr-defined]


def test_closing_the_loop_cancels_a_task_run_waiting_to_be_retried():
    """A retry due in ten minutes: `close` does not wait for it, and the run ends Cancelled
    rather than waiting for a loop that is gone."""
    from prefect.states import AwaitingRetry

    from kinetic_prefect.runner.attempt_end import AttemptEnd
    from kinetic_prefect.runner.run_loop import CLOSED_WHILE_WAITING, RunLoop
    from kinetic_prefect.runner.run_state import Phase, PodEnded

    launch = _bare_launch("retried")
    launch.state = dataclasses.replace(launch.state, phase=Phase.RUNNING, retries=1)
    loop = RunLoop(actions=None)  # type: ignore[arg-type]
    retrying = AttemptEnd(AwaitingRetry(), reported_by_pod=True)
    loop.post(launch, PodEnded("kp-retried-0", retrying, "kp-retried-1", retry_delay=600))
    wait_until(lambda: launch.state.phase is Phase.AWAITING_RETRY, 30, "the retry to wait")
    started = time.monotonic()
    loop.close()

    assert time.monotonic() - started < 300, "close waited for the retry's delay"
    cancelled = launch.future.result(timeout=0)
    assert cancelled.is_cancelled() and cancelled.message == CLOSED_WHILE_WAITING


class _StopsRecorded:
    """The loop's pod actions, recording which pods it asks to stop and how."""

    def __init__(self) -> None:
        self.stopped: list[tuple[str, str]] = []

    def launch_attempt(self, launch: TaskLaunch) -> None:
        raise AssertionError("a cancelled run launched a pod")

    def adopt(self, launch: TaskLaunch, job_id: str) -> None:
        raise AssertionError(f"a cancelled run adopted {job_id}")

    def stop_pod(self, launch: TaskLaunch, job_id: str) -> None:
        self.stopped.append(("its own", job_id))

    def stop_earlier(self, launch: TaskLaunch, job_id: str) -> None:
        self.stopped.append(("earlier", job_id))


def test_a_run_cancelled_while_it_found_an_earlier_live_pod_stops_that_pod():
    """A cancel that lands after reattach found a live pod of an earlier flow process and
    before the run was prepared: the run stays Cancelled and that pod is stopped, not left
    to run on under this process's lease."""
    from kinetic_prefect.runner.run_loop import RunLoop
    from kinetic_prefect.runner.run_state import Cancel, EarlierPod, Prepared

    launch = _bare_launch("raced")
    actions = _StopsRecorded()
    loop = RunLoop(actions=actions)  # type: ignore[arg-type]
    try:
        loop.post(launch, Cancel("the flow run was cancelled"))
        loop.post(launch, Prepared(inputs=None, earlier=EarlierPod("kp-raced-earlier")))
        assert launch.future.result(timeout=30).is_cancelled()
        wait_until(lambda: actions.stopped, 30, "the earlier pod to be stopped")
    finally:
        loop.close()
    assert actions.stopped == [("earlier", "kp-raced-earlier")]
    assert launch.state.final is not None and launch.state.final.is_cancelled()


def _wait_for_forms(runner: object) -> list[object]:
    @flow(task_runner=runner)
    def run() -> list[object]:
        first = plus_one.submit(0)
        single = plus_one.submit(10, wait_for=first)
        failed = explode.submit()
        tolerant = plus_one.submit(20, wait_for=[allow_failure(failed)])
        strict = plus_one.submit(30, wait_for=[failed])
        strict.wait()
        return [
            single.result(),
            tolerant.result(),
            (strict.state.type.value, strict.state.name),
        ]

    return run()


def test_wait_for_a_single_future_and_allow_failure_behave_as_with_thread_pool():
    kinetic = _wait_for_forms(KineticTaskRunner(warm_pods=True))

    assert kinetic == _wait_for_forms(ThreadPoolTaskRunner())
    assert kinetic == [11, 21, ("PENDING", "NotReady")]


def test_submit_returns_at_once_while_upstreams_run(workdir: Path):
    # The upstream cannot end before the gate opens, and the gate opens only once
    # `submit` has returned: a submit that waited for its upstream would never return.
    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[bool, int]:
        gate = workdir / "gate"
        upstream = wait_for_file.submit(str(gate))
        downstream = plus_one.submit(1, wait_for=[upstream])
        upstream_running = not upstream.state.is_final()
        gate.touch()
        return upstream_running, downstream.result()

    upstream_running, value = run()

    assert value == 2
    assert upstream_running


def test_tags_reach_the_task_in_the_pod():
    @flow(task_runner=KineticTaskRunner())
    def run() -> set[str]:
        with tags("sweep", "tpu"):
            return current_tags.submit().result()

    assert {"sweep", "tpu"} <= run()


def test_keyboard_interrupt_in_the_task_ends_the_run_crashed_without_raising_in_wait():
    @flow(task_runner=KineticTaskRunner())
    def run() -> str:
        future = interrupt.submit()
        future.wait()
        return future.state.name

    assert run() == "Crashed"


def test_async_task_timeout_fails_it_leaves_its_dependent_not_ready_and_others_complete():
    @flow(task_runner=KineticTaskRunner())
    async def run() -> list[str]:
        timed_out = sleeps_past_its_timeout.submit()
        dependent = depends_on.submit(timed_out)
        other = independent.submit()
        for future in (timed_out, dependent, other):
            future.wait()
        return [f.state.type.value for f in (timed_out, dependent, other)]

    assert asyncio.run(run()) == ["FAILED", "PENDING", "COMPLETED"]


def test_as_completed_yields_futures_in_the_order_they_finish(tmp_path):
    gates = tmp_path / "gates"
    gates.mkdir()
    finishing_order = ["second", "third", "first"]

    @flow(task_runner=KineticTaskRunner(max_parallel=3))
    def run() -> list[str]:
        # Each task ends once its gate exists, and a gate opens only once the future before
        # it was yielded: the tasks finish in `finishing_order` however their pods start.
        futures = [wait_for_file.submit(str(gates / n)) for n in ("first", "second", "third")]
        (gates / finishing_order[0]).touch()
        yielded = []
        opened_next = [*finishing_order[1:], "after-the-last"]
        for future, gate in zip(as_completed(futures, timeout=300), opened_next, strict=False):
            yielded.append(Path(future.result()).name)
            (gates / gate).touch()
        return yielded

    assert run() == finishing_order


UPSTREAM = Asset(key="gs://kinetic-test/raw")
DOWNSTREAM = Asset(key="gs://kinetic-test/processed")


@materialize(UPSTREAM)
def extract() -> dict[str, int]:
    return {"rows": 50}


@materialize(DOWNSTREAM)
def load(data: dict[str, int]) -> dict[str, int]:
    return {"rows": data["rows"] * 2}


def _asset_events(flow_run_id: object) -> list[dict[str, object]]:
    with get_client(sync_client=True) as client:
        response = client._client.post(
            "/events/filter",
            json={
                "filter": {
                    "event": {"prefix": ["prefect.asset."]},
                    "related": {"id": [f"prefect.flow-run.{flow_run_id}"]},
                }
            },
        )
        response.raise_for_status()
        return response.json().get("events", [])


def test_asset_lineage_from_pods_names_the_upstream_asset():
    @flow(task_runner=KineticTaskRunner())
    def pipeline() -> object:
        load.submit(extract.submit()).wait()
        return get_run_context().flow_run.id  # type: ignore[union-attr]

    flow_run_id = pipeline()
    events = wait_until(
        lambda: (found := _asset_events(flow_run_id)) and len(found) >= 3 and found,
        60,
        "three asset events",
    )

    by_asset = {
        key: [e for e in events if e["resource"]["prefect.resource.id"] == key]  # type: ignore[index]
        for key in (UPSTREAM.key, DOWNSTREAM.key)
    }
    assert len(events) == 3
    assert sorted(e["event"] for e in by_asset[UPSTREAM.key]) == [  # type: ignore[type-var]
        "prefect.asset.materialization.succeeded",
        "prefect.asset.referenced",
    ]
    downstream_related = {r["prefect.resource.id"] for r in by_asset[DOWNSTREAM.key][0]["related"]}  # type: ignore[index]
    assert UPSTREAM.key in downstream_related


def test_duplicate_is_an_equal_unstarted_copy():
    runner = KineticTaskRunner(accelerator="l4", max_parallel=3)
    copy = runner.duplicate()

    assert copy == runner
    assert copy is not runner
    with pytest.raises(RuntimeError, match="must be started"):
        copy.submit(plus_one, {"x": 1})


@task
def own_pid() -> int:
    return os.getpid()


@task
def pids_of_self_and_child() -> tuple[int, int]:
    return os.getpid(), own_pid.submit().result()


def test_a_task_that_submits_a_task_gets_its_result_from_a_pod_of_its_own():
    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[int, int]:
        return pids_of_self_and_child.submit().result()

    outer, inner = run()

    assert len({outer, inner, os.getpid()}) == 3


@task
def summarise(values: list[int]) -> tuple[int, int]:
    return len(values), sum(values)


def test_large_parameters_reach_the_pod_whole():
    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[int, int]:
        return summarise.submit(list(range(10_000))).result()

    assert run() == (10_000, sum(range(10_000)))


def test_a_cache_hit_found_before_any_pod_runs_the_on_completion_hooks_as_prefect_does(
    workdir: Path,
):
    from prefect.cache_policies import INPUTS

    hook_log = str(workdir / "hooks.txt")

    def note_completion(task: object, task_run: object, state: Any) -> None:
        with open(hook_log, "a") as log:
            log.write(f"{state.name}\n")

    @task(cache_policy=INPUTS, persist_result=True, on_completion=[note_completion])
    def squared(x: int, nonce: str) -> int:
        return x * x

    def twice(runner: Any) -> list[tuple[str, int, bool]]:
        # A key of its own: no record of another run of this test can be a hit.
        nonce = uuid.uuid4().hex

        @flow(task_runner=runner)
        def run() -> Any:
            future = squared.submit(3, nonce)
            future.wait()
            return future.task_run_id

        seen = []
        for task_run_id in (run(), run()):
            # The API's view: the state name, the run count, whether it shows a start.
            wait_until(
                lambda run_id=task_run_id: _task_run_state(run_id)[0] in ("Completed", "Cached"),
                60,
                "the API to record the task run's final state",
            )
            with get_client(sync_client=True) as client:
                task_run = client.read_task_run(task_run_id)
            assert task_run.state is not None
            seen.append((task_run.state.name, task_run.run_count, task_run.start_time is not None))
        return seen

    prefects = twice(ThreadPoolTaskRunner())
    prefects_hooks = Path(hook_log).read_text().splitlines()
    Path(hook_log).unlink()
    ours = twice(KineticTaskRunner())

    assert prefects == ours == [("Completed", 1, True), ("Cached", 1, True)]
    assert Path(hook_log).read_text().splitlines() == prefects_hooks == ["Completed", "Cached"]
