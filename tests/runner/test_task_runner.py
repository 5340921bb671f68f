"""End to end: flows whose tasks run in local Kinetic pods, against a real Prefect API."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.utilities.annotations import allow_failure, quote, unmapped

from kinetic_prefect import KineticTaskRunner, resources
from kinetic_prefect.errors import PayloadError, PodPhaseError
from kinetic_prefect.launch.accelerators import UnknownAcceleratorError
from tests.support.modules import import_fresh
from tests.support.waiting import task_run_state, wait_for_task_run_state, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


@task
def square_with_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


@task
def add(x: int, y: int = 1) -> int:
    return x + y


@task
def explode() -> None:
    raise ValueError("boom")


@task
def describe(value: object) -> str:
    return f"got {type(value).__name__}"


@task
async def double_async(x: int) -> tuple[int, int]:
    await asyncio.sleep(0)
    return 2 * x, os.getpid()


@task
def wait_for_gate(gate: str) -> str:
    threading_event = threading.Event()
    while not Path(gate).exists():
        threading_event.wait(0.05)
    return "opened"


@task
def hang_with_child(pid_file: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import threading; threading.Event().wait()"])
    Path(pid_file).write_text(f"{os.getpid()} {child.pid}")
    threading.Event().wait()


@task
def touch(path: str) -> str:
    Path(path).touch()
    return path


def test_a_pod_that_finds_its_task_run_already_final_runs_nothing_and_leaves_it_so(
    workdir: Path,
):
    from prefect import get_client
    from prefect.states import Cancelled

    gate, ran = workdir / "gate", workdir / "ran"

    @flow(task_runner=KineticTaskRunner(max_parallel=1))
    def run() -> tuple[object, object]:
        first = wait_for_gate.submit(str(gate))
        queued = touch.submit(str(ran))  # its pod waits for the only slot
        wait_until(lambda: task_run_state(queued.task_run_id), 30, "the queued run in the API")
        with get_client(sync_client=True) as client:
            client.set_task_run_state(
                queued.task_run_id, Cancelled(message="Cancelled from the UI"), force=True
            )
        gate.touch()
        first.wait()
        queued.wait()
        return queued.state, queued.task_run_id

    state, task_run_id = run()

    assert state.is_cancelled()  # type: ignore[attr-defined]
    assert "already Cancelled" in state.message  # type: ignore[attr-defined]
    assert not ran.exists()
    recorded = task_run_state(task_run_id)
    assert (recorded.name, recorded.message) == ("Cancelled", "Cancelled from the UI")


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        state = stat.read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _sigkill_pending(pid: int) -> bool:
    """Whether SIGKILL is pending for the process (its status's pending-signal masks)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True  # gone meanwhile
    pending = ("SigPnd", "ShdPnd")
    masks = [line.split()[1] for line in status.splitlines() if line.startswith(pending)]
    return any(int(mask, 16) & (1 << (signal.SIGKILL - 1)) for mask in masks)


def test_mapped_task_returns_every_result_from_pods_outside_the_flow_process(launched_manifests):
    @flow(task_runner=KineticTaskRunner())
    def squares() -> tuple[list[tuple[int, int]], list[object], int]:
        futures = square_with_pid.map(range(5))
        return [f.result() for f in futures], [f.task_run_id for f in futures], os.getpid()

    results, task_run_ids, flow_pid = squares()

    assert [value for value, _ in results] == [0, 1, 4, 9, 16]
    assert flow_pid not in {pid for _, pid in results}
    assert len(launched_manifests) == 5
    for task_run_id in task_run_ids:
        wait_for_task_run_state(task_run_id, "COMPLETED")


def raise_in_a_pod(runner: KineticTaskRunner) -> tuple[str, object]:
    """Run a task that raises ValueError("boom"); the formatted exception and the task run id."""

    @flow(task_runner=runner)
    def failing() -> tuple[str, object]:
        future = explode.submit()
        with pytest.raises(ValueError, match="boom") as info:
            future.result()
        return "".join(traceback.format_exception(info.value)), future.task_run_id

    return failing()


PROJECT_TASKS = """
import time
from pathlib import Path

from prefect import task


@task
def explode_once_opened(gate: str, started: str) -> None:
    Path(started).touch()
    while not Path(gate).exists():
        time.sleep(0.05)
    raise ValueError("boom from the project")
"""


def test_remote_traceback_shows_the_source_line_when_only_the_pod_has_the_file(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
):
    project = workdir / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'project'\n")
    (project / "project_tasks.py").write_text(PROJECT_TASKS)
    explode_once_opened = import_fresh(project, "project_tasks", monkeypatch).explode_once_opened

    gate, started = workdir / "gate", workdir / "started"

    @flow(task_runner=KineticTaskRunner())
    def failing() -> str:
        future = explode_once_opened.submit(str(gate), str(started))
        wait_until(started.exists, 120, "the task to start in its pod")
        # The pod runs its own copy from the code archive; this one is gone, as on GKE.
        (project / "project_tasks.py").rename(workdir / "elsewhere.py")
        gate.touch()
        with pytest.raises(ValueError, match="boom from the project") as info:
            future.result()
        return "".join(traceback.format_exception(info.value))

    formatted = failing()

    assert 'raise ValueError("boom from the project")' in formatted


def test_task_exception_is_reraised_with_the_pod_traceback_and_the_run_is_failed():
    formatted, task_run_id = raise_in_a_pod(KineticTaskRunner())

    assert "Traceback from the pod" in formatted
    assert "in explode" in formatted
    assert 'raise ValueError("boom")' in formatted
    wait_for_task_run_state(task_run_id, "FAILED")


def test_upstream_future_arrives_downstream_as_its_value():
    @flow(task_runner=KineticTaskRunner())
    def chain() -> int:
        first = add.submit(1)
        return add.submit(first, y=first).result()

    assert chain() == 4


def _downstream_of_failure(runner: object) -> tuple[str, str | None]:
    @flow(task_runner=runner)
    def run() -> tuple[str, str | None]:
        downstream = add.submit(explode.submit())
        downstream.wait()
        return downstream.state.type.value, downstream.state.name

    return run()


def test_failed_upstream_leaves_downstream_unrun_exactly_like_thread_pool(launched_manifests):
    kinetic = _downstream_of_failure(KineticTaskRunner())

    assert kinetic == _downstream_of_failure(ThreadPoolTaskRunner())
    assert kinetic[0] != "COMPLETED"
    assert [
        m["metadata"]["annotations"]["kinetic-prefect.io/task-name"] for m in launched_manifests
    ] == ["explode"]


def _allow_failure_result(runner: object) -> str:
    @flow(task_runner=runner)
    def run() -> str:
        return describe.submit(allow_failure(explode.submit())).result()

    return run()


def test_allow_failure_lets_downstream_run_like_thread_pool():
    assert _allow_failure_result(KineticTaskRunner()) == _allow_failure_result(
        ThreadPoolTaskRunner()
    )


def test_wait_for_unmapped_and_quote_behave_as_with_prefect_runners():
    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[list[int], str]:
        first = add.submit(0)
        mapped = add.map([1, 2], y=unmapped(10), wait_for=[first])
        quoted = describe.submit(quote([1, 2]))
        return [f.result() for f in mapped], quoted.result()

    assert run() == ([11, 12], "got list")


def test_async_task_runs_in_a_pod():
    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[int, int]:
        return double_async.submit(21).result()

    doubled, pid = run()
    assert doubled == 42 and pid != os.getpid()


def test_unknown_accelerator_fails_before_any_pod_listing_valid_names(launched_manifests):
    @flow(task_runner=KineticTaskRunner(accelerator="tpu-v9z-1"))
    def run() -> None:
        add.submit(1)

    with pytest.raises(UnknownAcceleratorError, match="tpu-v5e-1") as info:
        run()

    assert "kinetic-prefect accelerators" in str(info.value)
    assert launched_manifests == []


def test_unpicklable_argument_fails_at_submit_naming_the_parameter(launched_manifests):
    @flow(task_runner=KineticTaskRunner())
    def run() -> None:
        describe.submit(threading.Lock())

    with pytest.raises(PayloadError, match="Parameter 'value' of task 'describe'"):
        run()

    assert launched_manifests == []


def test_a_quoted_future_fails_at_submit_saying_how_to_pass_its_value(launched_manifests):
    @flow(task_runner=KineticTaskRunner())
    def run() -> None:
        upstream = add.submit(1)
        upstream.wait()
        describe.submit(quote(upstream))

    with pytest.raises(PayloadError, match=r"Parameter 'value' of task 'describe' .* quote\(\)"):
        run()

    # The upstream ran; the task given its quoted future was never launched.
    assert [
        m["metadata"]["annotations"]["kinetic-prefect.io/task-name"] for m in launched_manifests
    ] == ["add"]


def test_tampered_payload_is_refused_in_the_verify_phase(workdir: Path):
    gate = workdir / "gate"

    @flow(task_runner=KineticTaskRunner(max_parallel=1))
    def run() -> PodPhaseError:
        blocker = wait_for_gate.submit(str(gate))
        # The one pod slot is the blocker's before the victim is submitted, so the victim's
        # pod cannot start before its payload is tampered with.
        wait_for_task_run_state(blocker.task_run_id, "RUNNING", 60)
        victim = add.submit(1)
        payload = workdir / ".kinetic" / "kinetic" / victim.job_id / "payload.pkl"
        wait_until(payload.exists, 60, "the victim's payload to be uploaded")
        payload.write_bytes(payload.read_bytes() + b"tampered")
        gate.touch()
        blocker.wait()
        with pytest.raises(PodPhaseError) as info:
            victim.result()
        return info.value

    error = run()

    assert error.phase == "verify"
    assert "Failed during verify: sha256 mismatch for payload.pkl" in str(error)


def test_leaving_the_flow_kills_running_pods_and_their_children(workdir: Path):
    pid_file = workdir / "pids"

    @flow(task_runner=KineticTaskRunner())
    def run() -> None:
        hang_with_child.submit(str(pid_file))
        wait_until(pid_file.exists, 60, "the pod to start")

    run()

    pids = [int(p) for p in pid_file.read_text().split()]
    # By the time the flow returns, each is gone or has SIGKILL pending: the kernel ends a
    # process so signalled when it next runs, which on a loaded machine is not always at once.
    assert [pid for pid in pids if _alive(pid) and not _sigkill_pending(pid)] == []
    wait_until(
        lambda: not [pid for pid in pids if _alive(pid)],
        10,
        "the pod and its child to be gone",
        left=lambda: [pid for pid in pids if _alive(pid)],
    )


def test_resources_override_applies_only_inside_the_block(launched_manifests):
    @flow(task_runner=KineticTaskRunner(accelerator="cpu"))
    def run() -> None:
        with resources(accelerator="l4x2", spot=True):
            inside = add.submit(1)
        outside = add.submit(2)
        wait([inside, outside])

    run()

    selectors = sorted(
        (m["spec"]["template"]["spec"].get("nodeSelector") or {}).get(
            "cloud.google.com/gke-accelerator", "none"
        )
        for m in launched_manifests
    )
    assert selectors == ["none", "nvidia-l4"]


@task
def environment_variable(name: str) -> str | None:
    return os.environ.get(name)


def test_a_runner_without_cluster_uses_the_block_kinetic_cluster_names(monkeypatch):
    from kinetic_prefect.blocks import KineticCluster

    KineticCluster(backend="local", env={"CHOSEN_BY": "the saved block"}).save(
        "named-by-env", overwrite=True
    )
    monkeypatch.setenv("KINETIC_CLUSTER", "named-by-env")

    @flow(task_runner=KineticTaskRunner())
    def run() -> str | None:
        return environment_variable.submit("CHOSEN_BY").result()

    assert run() == "the saved block"


@task
def appends_a_line(path: str) -> int:
    with open(path, "a") as runs:
        runs.write("ran\n")
    return len(Path(path).read_text().splitlines())


@pytest.mark.parametrize(
    ("options", "runs"),
    [
        pytest.param({}, 1, id="default: the first attempt's result is reused"),
        pytest.param({"cache_policy": NO_CACHE}, 2, id="NO_CACHE: run again"),
        pytest.param({"refresh_cache": True}, 2, id="refresh_cache: run again"),
    ],
)
def test_a_flow_retry_reuses_a_completed_pod_unless_the_task_opts_out_of_reused_results(
    workdir: Path, options: dict[str, Any], runs: int
):
    log = workdir / "runs.txt"
    appends = appends_a_line.with_options(**options)

    @flow(retries=1, task_runner=KineticTaskRunner())
    def retried() -> int:
        seen = appends.submit(str(log)).result()
        if flow_run.run_count == 1:
            raise RuntimeError("the first attempt fails after its task completed")
        return seen

    assert retried() == runs
    assert len(log.read_text().splitlines()) == runs


def test_a_quoted_state_is_a_value_and_is_not_refused_as_a_quoted_future():
    import concurrent.futures
    import uuid

    from prefect.futures import PrefectConcurrentFuture
    from prefect.states import Completed

    from kinetic_prefect.runner.task_runner import _quoted_future

    assert not _quoted_future(quote(Completed(data=1)))
    assert not _quoted_future({"states": quote([Completed(data=1)])})
    future = PrefectConcurrentFuture(uuid.uuid4(), concurrent.futures.Future())
    assert _quoted_future({"runs": quote([future])})
    assert not _quoted_future({"runs": [future]})
