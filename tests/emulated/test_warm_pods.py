"""Warm pods: a pod takes the next task run of its pod spec instead of exiting."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, get_client, get_run_logger, task
from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId
from prefect.context import FlowRunContext
from prefect.settings import PREFECT_LOGGING_TO_API_BATCH_INTERVAL, temporary_settings
from typer.testing import CliRunner

from kinetic_prefect import KineticTaskRunner, resources
from kinetic_prefect.backends.local.pods import LocalPod, read_pod
from kinetic_prefect.cli import app
from kinetic_prefect.common import layout
from kinetic_prefect.common.handover import BEGIN_MARK
from kinetic_prefect.outputs.checkpoint import output_dir
from tests.support.waiting import recorded_task_run, wait_for_task_run_state, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

# A task's deadline (the first task of a pod includes the pod's start-up and its report,
# which a loaded machine has taken past 6 s), and how long each task of a chain on one pod
# runs: together longer than the deadline, each with room left for its hand-over and report.
DEADLINE_SECONDS = 20
TASK_SECONDS = DEADLINE_SECONDS * 0.6
IDLE_SECONDS = 1.5


@task
def note_environment(x: int) -> dict[str, Any]:
    seen = os.environ.get("SET_BY_A_TASK")
    os.environ["SET_BY_A_TASK"] = str(x)
    return {
        "x": x,
        "pid": os.getpid(),
        "env_output_dir": os.environ["KINETIC_OUTPUT_DIR"],
        "output_dir": output_dir(),
        "seen": seen,
        "flavour": os.environ.get("FLAVOUR", ""),
        "collecting": gc.isenabled(),
    }


@task
def log_marker(marker: str) -> str:
    get_run_logger().info(marker)
    return marker


@task
def exit_hard() -> None:
    os._exit(3)


@task
def wait_for_gate(gate: str) -> str:
    while not Path(gate).exists():
        threading.Event().wait(0.05)
    return "opened"


@task
def busy_for(seconds: float) -> int:
    threading.Event().wait(seconds)
    return os.getpid()


def _pods(workdir: Path) -> list[LocalPod]:
    """Every pod the local backend recorded (not the runner's own count)."""
    pods_dir = workdir / ".kinetic" / "pods"
    found = [read_pod(pods_dir, path.stem) for path in sorted(pods_dir.glob("*.json"))]
    return [pod for pod in found if pod is not None]


def _pod_with_pid(workdir: Path, pid: int) -> LocalPod:
    return next(pod for pod in _pods(workdir) if pod.pid == pid)


def test_ten_tasks_share_two_warm_pods_each_with_its_own_output_dir_and_a_clean_env(workdir):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=2))
    def run() -> list[dict[str, Any]]:
        return [future.result() for future in note_environment.map(range(10))]

    results = run()

    pods = _pods(workdir)
    assert len(pods) <= 2
    assert {r["pid"] for r in results} <= {pod.pid for pod in pods}
    assert [r["x"] for r in results] == list(range(10))
    assert len({r["output_dir"] for r in results}) == 10
    assert [r["env_output_dir"] for r in results] == [r["output_dir"] for r in results]
    assert [r["seen"] for r in results] == [None] * 10
    assert all(r["collecting"] for r in results)


@task
def length_in(blob: bytes) -> tuple[int, int]:
    return len(blob), os.getpid()


def test_a_small_payload_travels_in_its_assignment_and_a_large_one_through_the_store(workdir):
    from kinetic_prefect.common.handover import INLINE_PAYLOAD_BYTES

    large = INLINE_PAYLOAD_BYTES + 1

    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> list[tuple[str, tuple[int, int]]]:
        futures = [length_in.submit(b"x" * size) for size in (1, 2, large)]
        return [(future.job_id, future.result()) for future in futures]

    ran = run()

    assert [length for _, (length, _) in ran] == [1, 2, large]
    assert len({pid for _, (_, pid) in ran}) == 1  # one warm pod ran all three
    jobs = workdir / ".kinetic" / "kinetic"
    # The first job started the pod (which is named after it). The pod claimed each task,
    # its own first one too, before it ran it. Only the first payload and the large one
    # have an object.
    (first,) = [path.parent.parent.name for path in jobs.glob("*/warm/assign-1.json")]
    for job_id, _ in ran:
        assert json.loads((jobs / job_id / layout.WARM_POD_JSON).read_text())["pod"] == first
    for job_id, (length, _) in ran:
        uploaded = (jobs / job_id / layout.PAYLOAD_FILE).exists()
        assert uploaded == (job_id == first or length == large), (job_id, length)


def test_a_task_that_ends_its_warm_pod_is_crashed_and_the_next_task_gets_a_new_pod(workdir):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> tuple[int, str, int]:
        first = note_environment.submit(1).result()
        crashed = exit_hard.submit()
        crashed.wait()
        after = note_environment.submit(2).result()
        return first["pid"], crashed.state.type.value, after["pid"]

    first_pid, crashed, after_pid = run()

    assert crashed == "CRASHED"
    assert _pod_with_pid(workdir, first_pid).exit_code == 3
    assert after_pid != first_pid


def test_tasks_share_warm_pods_only_within_their_pod_spec(workdir):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=2))
    def run() -> list[dict[str, Any]]:
        results = []
        for x in range(4):
            with resources(env={"FLAVOUR": "b"} if x % 2 else {}):
                results.append(note_environment.submit(x).result())
        return results

    results = run()

    flavours_by_pid: dict[int, set[str]] = {}
    for result in results:
        flavours_by_pid.setdefault(result["pid"], set()).add(result["flavour"])
    assert flavours_by_pid == {results[0]["pid"]: {""}, results[1]["pid"]: {"b"}}
    assert len(_pods(workdir)) == 2


def test_a_task_of_another_spec_retires_an_idle_pod_holding_the_only_slot(workdir):
    # Past pytest-timeout's 900 s backstop: the run can end only if the idle pod is retired.
    idle_seconds = 3600.0

    @flow(
        task_runner=KineticTaskRunner(
            warm_pods=True, max_parallel=1, warm_pod_idle_seconds=idle_seconds
        )
    )
    def run() -> tuple[int, int]:
        first = note_environment.submit(1).result()
        with resources(env={"FLAVOUR": "b"}):
            other = note_environment.submit(2).result()
        return first["pid"], other["pid"]

    first_pid, other_pid = run()

    assert other_pid != first_pid
    assert _pod_with_pid(workdir, first_pid).exit_code == -signal.SIGTERM


@task
def pid_and_end() -> tuple[int, float]:
    """This pod's pid, and when the task ended on the machine's monotonic clock (which every
    process here shares): the pod idles from a moment after it."""
    return os.getpid(), time.monotonic()


def test_an_idle_warm_pod_ends_by_itself_after_its_idle_time(workdir):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, warm_pod_idle_seconds=IDLE_SECONDS))
    def run() -> tuple[int, float]:
        pid, task_ended = pid_and_end.submit().result()
        wait_until(lambda: _pod_with_pid(workdir, pid).ended, 30, "the idle pod to end")
        return pid, time.monotonic() - task_ended

    pid, idle_for = run()

    pod = _pod_with_pid(workdir, pid)
    assert pod.exit_code == 0
    # Seen ended after it ended, which was after idling IDLE_SECONDS from after its task ended.
    assert idle_for >= IDLE_SECONDS
    assert f"idle for {IDLE_SECONDS:g}s: ending this warm pod" in pod.log_path.read_text()


def test_leaving_the_flow_ends_its_idle_warm_pods(workdir):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, warm_pod_idle_seconds=600))
    def run() -> int:
        return note_environment.submit(1).result()["pid"]

    pid = run()

    pod = _pod_with_pid(workdir, pid)
    assert pod.gone()
    assert "pod exited with code -15 after" in pod.log_path.read_text()
    assert pod.log_path.read_text().rstrip().endswith("(stopped by the runner)")


def _api_log_messages(task_run_ids: list[Any]) -> list[str]:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            LogFilter(task_run_id=LogFilterTaskRunId(any_=task_run_ids)), limit=200
        )
    return [log.message for log in logs]


@pytest.mark.lowest_prefect
def test_task_logs_reach_the_api_before_the_flow_ends_its_warm_pods(workdir):
    """With Prefect's default log batching, as users run it (the suite's is shorter)."""

    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> list[Any]:
        futures = [log_marker.submit(f"warm-log-marker-{i}") for i in range(2)]
        for future in futures:
            future.wait()
        return [future.task_run_id for future in futures]

    with temporary_settings({PREFECT_LOGGING_TO_API_BATCH_INTERVAL: 2.0}):
        task_run_ids = run()

    messages = _api_log_messages(task_run_ids)
    assert [f"warm-log-marker-{i}" in messages for i in range(2)] == [True, True]


def test_a_handover_write_that_fails_after_it_landed_retries_the_task_instead_of_cancelling_it(
    workdir, monkeypatch
):
    """As a GCS upload that times out after the object was stored: the pod took the task."""
    from kinetic_prefect.common.storage import LocalStore

    put_bytes = LocalStore.put_bytes

    def put_then_fail(self: LocalStore, key: str, data: bytes) -> str:
        stored = put_bytes(self, key, data)
        if key.endswith("/warm/assign-1.json"):
            accepted = layout.job_file(json.loads(data)[0]["job_id"], layout.WARM_POD_JSON)
            wait_until(lambda: self.exists(accepted), 60, "the pod to take the task")
            raise OSError("the write timed out")
        return stored

    monkeypatch.setattr(LocalStore, "put_bytes", put_then_fail)

    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> tuple[int, Any, int]:
        first = note_environment.submit(1).result()["pid"]
        handed = note_environment.submit(2)
        return first, handed.task_run_id, handed.result()["pid"]

    first_pid, task_run_id, handed_pid = run()
    wait_for_task_run_state(task_run_id, "COMPLETED")
    with get_client(sync_client=True) as client:
        run_count = client.read_task_run(task_run_id).run_count
        history = [state.name for state in client.read_task_run_states(task_run_id)]

    # It ran on the pod that took it, was put back to await its retry, and ran again on
    # another pod: never Cancelled.
    assert handed_pid != first_pid
    assert "AwaitingRetry" in history
    assert "Cancelled" not in history
    assert history[-1] == "Completed"
    assert run_count == 2, history


def test_a_pod_that_dies_while_the_store_cannot_say_whether_it_took_its_task_crashes_the_task(
    workdir, monkeypatch
):
    from kinetic_prefect.common.storage import LocalStore

    get_bytes = LocalStore.get_bytes

    def unreadable_claim(self: LocalStore, key: str) -> bytes:
        if key.endswith(f"/{layout.WARM_POD_JSON}"):
            raise OSError("the store did not answer")
        return get_bytes(self, key)

    monkeypatch.setattr(LocalStore, "get_bytes", unreadable_claim)

    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> tuple[str | None, int]:
        first = note_environment.submit(1).result()["pid"]
        crashed = exit_hard.submit()
        crashed.wait(timeout=120)
        return (crashed.state.type.value if crashed.state.is_final() else None), first

    state, first_pid = run()

    assert state == "CRASHED"
    assert _pod_with_pid(workdir, first_pid).exit_code == 3


def test_a_task_handed_to_a_pod_that_ends_before_taking_it_runs_on_a_fresh_pod_without_a_retry(
    workdir,
):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> tuple[int, int, Any]:
        first = note_environment.submit(1)
        first_pid = first.result()["pid"]
        os.kill(first_pid, signal.SIGSTOP)  # the pod cannot pick the next task up
        handed = note_environment.submit(2)
        assignment = workdir / ".kinetic" / "kinetic" / first.job_id / "warm" / "assign-1.json"
        wait_until(assignment.exists, 30, "the task to be handed to the stopped pod")
        os.kill(first_pid, signal.SIGKILL)
        return first_pid, handed.result()["pid"], handed.task_run_id

    first_pid, handed_pid, task_run_id = run()
    wait_for_task_run_state(task_run_id, "COMPLETED")
    with get_client(sync_client=True) as client:
        run_count = client.read_task_run(task_run_id).run_count
        history = [state.name for state in client.read_task_run_states(task_run_id)]

    assert handed_pid != first_pid
    assert len(_pods(workdir)) == 2
    # No retry: one run, never put back to await one.
    assert run_count == 1
    assert "AwaitingRetry" not in history


def _queued_behind_a_gate(workdir: Path) -> tuple[Any, Any, LocalPod]:
    """In a flow: a warm pod that has run a task, a task running on it until
    `workdir / "gate"` exists, and a task handed to it to take once the gated one ends;
    and the pod."""
    note_environment.submit(0).wait()  # a pod still starting is handed one task only
    gated = wait_for_gate.submit(str(workdir / "gate"))
    wait_for_task_run_state(gated.task_run_id, "RUNNING")
    queued = note_environment.submit(2)
    jobs = workdir / ".kinetic" / "kinetic"
    wait_until(lambda: list(jobs.glob("*/warm/assign-2.json")), 30, "the third task's hand-over")
    (pod,) = _pods(workdir)
    return gated, queued, pod


def test_tasks_waiting_for_a_busy_pod_go_to_it_in_a_batch_and_each_is_taken_without_a_look(
    workdir,
):
    gate = workdir / "gate"

    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> tuple[list[str], list[int]]:
        gated, queued, _ = _queued_behind_a_gate(workdir)
        rest = note_environment.map(range(3, 7))
        gate.touch()
        pids = [f.result()["pid"] for f in [queued, *rest]]
        return [f.job_id for f in [gated, queued, *rest]], pids

    job_ids, pids = run()

    assert len(set(pids)) == 1
    jobs = workdir / ".kinetic" / "kinetic"
    (warm_dir,) = jobs.glob("*/warm")
    batches = [
        [task["job_id"] for task in json.loads(path.read_text())]
        for path in sorted(warm_dir.glob("assign-*.json"), key=lambda p: int(p.stem[7:]))
    ]
    # The gated task went to the idle pod; the next found the pod busy; the rest waited
    # for that one's hand-over and went in one batch.
    assert batches[0] == [job_ids[0]]
    assert sorted(sum(batches[1:], [])) == sorted(job_ids[1:])
    assert max(len(batch) for batch in batches) > 1, batches
    # The pod claimed each task; it took the second and later tasks of a batch as it
    # reported the task before, and named them in that report.
    reports = [json.loads((jobs / job_id / "final-state.json").read_text()) for job_id in job_ids]
    named = {r["next_job"] for r in reports} - {None}
    claims = [json.loads((jobs / j / layout.WARM_POD_JSON).read_text()) for j in job_ids]
    assert {claim["pod"] for claim in claims} == {warm_dir.parent.name}
    assert {job_id for batch in batches for job_id in batch[1:]} <= named


def test_a_task_queued_behind_a_long_task_runs_on_the_first_pod_that_frees_up(workdir):
    gate, other_gate = workdir / "gate", workdir / "other-gate"

    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=2))
    def run() -> tuple[dict[str, Any], str, str, bool]:
        note_environment.submit(0).wait()  # pod A, idle
        gated = wait_for_gate.submit(str(gate))  # runs on A until the gate opens
        wait_for_task_run_state(gated.task_run_id, "RUNNING")
        other = wait_for_gate.submit(str(other_gate))  # starts pod B
        wait_for_task_run_state(other.task_run_id, "RUNNING")
        # Both pods busy and no room for a third: queued on A, the pod that has ended a
        # task (B has not yet).
        queued = note_environment.submit(2)
        jobs = workdir / ".kinetic" / "kinetic"
        wait_until(lambda: list(jobs.glob("*/warm/assign-2.json")), 30, "the hand-over to A")
        other_gate.touch()  # B ends its task and is idle
        queued.wait(timeout=60)
        still_gated = queued.state.is_final() and not gated.state.is_final()
        gate.touch()
        return queued.result(), queued.job_id, other.job_id, still_gated

    result, queued_job, pod_b, still_gated = run()

    # It ran on B while A still ran its long task, and it ran once.
    assert still_gated
    assert _pod_with_pid(workdir, result["pid"]).job_id == pod_b
    jobs = workdir / ".kinetic" / "kinetic"
    (handed_to_a,) = jobs.glob("*/warm/assign-2.json")
    assert queued_job in handed_to_a.read_text()
    claim = json.loads((jobs / queued_job / layout.WARM_POD_JSON).read_text())
    assert claim["pod"] == pod_b


def test_a_task_queued_on_a_pod_that_dies_before_taking_it_runs_on_a_fresh_pod_as_attempt_one(
    workdir,
):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> tuple[int, str, int, Any]:
        gated, queued, pod = _queued_behind_a_gate(workdir)
        assert pod.pid is not None
        os.kill(pod.pid, signal.SIGKILL)
        gated.wait()
        return pod.pid, gated.state.type.value, queued.result()["pid"], queued.task_run_id

    killed_pid, gated_state, queued_pid, queued_id = run()

    assert gated_state == "CRASHED"
    assert queued_pid != killed_pid
    assert len(_pods(workdir)) == 2

    assert recorded_task_run(queued_id).run_count == 1


def test_cancelling_a_flows_tasks_cancels_one_queued_on_a_busy_warm_pod_and_starts_no_pod(
    workdir,
):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1, cancel_grace_seconds=2))
    def run() -> tuple[str, str, LocalPod]:
        runner = FlowRunContext.get().task_runner  # type: ignore[union-attr]
        gated, queued, pod = _queued_behind_a_gate(workdir)
        runner.cancel_all()
        gated.wait()
        queued.wait()
        return gated.state.type.value, queued.state.type.value, pod

    gated_state, queued_state, pod = run()

    assert (gated_state, queued_state) == ("CANCELLED", "CANCELLED")
    assert [p.job_id for p in _pods(workdir)] == [pod.job_id]
    assert _pod_with_pid(workdir, pod.pid).ended


def test_cancelling_a_task_on_a_warm_pod_ends_that_pod_and_records_it_cancelled(workdir):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1, cancel_grace_seconds=2))
    def run() -> tuple[int, str, object]:
        runner = FlowRunContext.get().task_runner  # type: ignore[union-attr]
        first_pid = note_environment.submit(1).result()["pid"]
        waiting = wait_for_gate.submit(str(workdir / "never"))
        wait_for_task_run_state(waiting.task_run_id, "RUNNING")
        runner.cancel_all()
        waiting.wait()
        return first_pid, waiting.state.type.value, waiting.task_run_id

    first_pid, cancelled, task_run_id = run()

    assert cancelled == "CANCELLED"
    assert _pod_with_pid(workdir, first_pid).ended
    wait_for_task_run_state(task_run_id, "CANCELLED")


@pytest.mark.parametrize("warm_pods", [False, True], ids=["cold", "warm"])
def test_a_task_past_its_deadline_is_crashed_with_deadline_exceeded_on_cold_and_warm_pods(
    workdir, warm_pods
):
    runner = KineticTaskRunner(
        warm_pods=warm_pods, max_parallel=1, timeout_seconds=DEADLINE_SECONDS
    )

    @flow(task_runner=runner)
    def run() -> tuple[str, str]:
        note_environment.submit(1).result()
        hung = wait_for_gate.submit(str(workdir / "never"))
        hung.wait()
        return hung.state.type.value, hung.state.message or ""

    state_type, message = run()

    assert state_type == "CRASHED"
    assert "DeadlineExceeded" in message


def test_a_warm_pods_deadline_is_per_task_run(workdir):
    @flow(
        task_runner=KineticTaskRunner(
            warm_pods=True, max_parallel=1, timeout_seconds=DEADLINE_SECONDS
        )
    )
    def run() -> list[int]:
        warm_up = note_environment.submit(1).result()["pid"]
        return [warm_up, *(busy_for.submit(TASK_SECONDS).result() for _ in range(2))]

    pids = run()

    assert len(set(pids)) == 1


def test_jobs_logs_of_a_task_on_a_warm_pod_prints_that_tasks_part_of_the_pod_log(workdir):
    @flow(task_runner=KineticTaskRunner(warm_pods=True, max_parallel=1))
    def run() -> list[str]:
        first = note_environment.submit(1)
        first.wait()
        second = note_environment.submit(2)
        second.wait()
        return [first.job_id, second.job_id]

    first, second = run()

    output = CliRunner().invoke(app, ["jobs", "logs", second]).output
    assert output.startswith(f"{BEGIN_MARK} {second} ")
    assert first not in output
    assert "Finished in state Completed()" in output


def test_a_map_on_the_emulated_cluster_runs_in_a_single_warm_job(gke, cluster):
    runner = KineticTaskRunner(cluster=gke, allow_loopback_api=True, warm_pods=True, max_parallel=1)

    @flow(task_runner=runner)
    def run() -> list[int]:
        return [future.result()["x"] for future in note_environment.map(range(4))]

    assert run() == [0, 1, 2, 3]
    assert len(cluster.created_jobs()) == 1


def _warm_on_two_l4_nodes(gke: str, cluster: Any) -> KineticTaskRunner:
    """Two l4 nodes, and a warm runner whose pods idle past pytest-timeout's 900 s
    backstop: pods that waited out the idle time of the pods holding both nodes cannot
    let a run pass."""
    from tests.support.kube_objects import gke_nodes

    cluster.kubelet.nodes[:] = gke_nodes("l4-pool", "l4", 2)
    return KineticTaskRunner(
        cluster=gke,
        allow_loopback_api=True,
        accelerator="l4",
        warm_pods=True,
        warm_pod_idle_seconds=3600,
    )


def test_warm_pods_on_two_busy_nodes_share_the_map_instead_of_idling_on_their_nodes(gke, cluster):
    @flow(task_runner=_warm_on_two_l4_nodes(gke, cluster))
    def run() -> list[int]:
        return [future.result()["x"] for future in note_environment.map(range(12))]

    assert run() == list(range(12))

    # Without a bound on starting pods, each task got a Job of its own, and the pods that
    # waited for a node waited out the idle time of the pods holding both nodes.
    assert cluster.kubelet.most_bound["l4-pool"] == 2
    assert len(cluster.created_jobs()) <= 4


def test_the_task_of_a_pod_waiting_for_a_node_runs_on_the_first_warm_pod_that_idles(
    gke, cluster, gcs
):
    from kinetic_prefect.common.gcs import GcsStore
    from kinetic_prefect.common.handover import Claim

    @flow(task_runner=_warm_on_two_l4_nodes(gke, cluster))
    def run() -> tuple[list[dict[str, Any]], list[str]]:
        # Three pods start at once; one of them waits for one of the two nodes.
        futures = note_environment.map(range(3))
        return [f.result() for f in futures], [f.job_id for f in futures]

    results, job_ids = run()

    # Two pods ran the three tasks: one task went from the pod waiting for a node to a
    # pod that had run its own task (no third cold start, no node handed over), which
    # claimed it. Every other task its own pod claimed.
    assert len(cluster.created_jobs()) == 3
    pids = dict(zip(job_ids, [r["pid"] for r in results], strict=True))
    assert len(set(pids.values())) == 2
    store = GcsStore(gcs.uri)
    claims = {
        job_id: Claim.decode(store.get_bytes(layout.job_file(job_id, layout.WARM_POD_JSON)), job_id)
        for job_id in job_ids
    }
    (moved,) = [job_id for job_id, claim in claims.items() if claim.pod != job_id]
    host = claims[moved].pod
    assert host in job_ids and pids[moved] == pids[host]
    assert not claims[moved].by_runner
    assert cluster.kubelet.most_bound["l4-pool"] == 2


def test_warm_final_records_are_read_at_most_once_per_task_and_once_per_4_s_of_the_flow(
    gke, cluster, gcs
):
    from tests.support.gcs_iam import USER_MEMBER

    runner = KineticTaskRunner(cluster=gke, allow_loopback_api=True, warm_pods=True, max_parallel=1)

    @flow(task_runner=runner)
    def run() -> list[int]:
        return [future.result() for future in busy_for.map([3.0] * 3)]

    started = time.monotonic()
    assert len(set(run())) == 1
    wall = time.monotonic() - started

    reads = [
        path
        for member, method, path in gcs.iam.requests
        if member == USER_MEMBER and method == "GET" and "final-state.json" in path
    ]
    # One read per task once the API shows its state final, a look every 10 s without that,
    # and a look at each check whose API answer took over 2 s: the last two grow with time,
    # and with the machine's load, so the bound is per second of the flow, not a count (8
    # reads in 29 s were seen on a loaded machine). Reading each busy pod's record every
    # 0.5 s or so, as the runner once did, made 56 in 34 s.
    assert len(reads) <= 3 + wall / 4, (len(reads), wall)
    # The pod claimed each task, its first too: one write each.
    claims = [name for name in gcs.names() if name.endswith(f"/{layout.WARM_POD_JSON}")]
    assert len(claims) == 3, claims
    # Nobody looks a bucket up: google-cloud-storage does in the background unless told
    # not to, and a warm pod that put its environment back between tasks lost the setting.
    lookups = [
        (member, path)
        for member, method, path in gcs.iam.requests
        if re.fullmatch(r"/storage/v1/b/[^/?]+(\?.*)?", path)
    ]
    assert lookups == []
