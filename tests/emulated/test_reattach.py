"""A flow process killed mid-training: its pods end within the orphan bound, or a restarted
process for the same flow run reattaches to them; never two pods for one task identity.

The flow process is `tests/support/scripts/orphaned_training.py`, run in a subprocess the test
SIGKILLs. What ran when comes from the backends' own records: the local backend's pod
records, the emulated cluster's pod events.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.settings import get_current_settings

from kinetic_prefect.launch.manifest import LABEL_FLOW_RUN_ID, LABEL_TASK_IDENTITY, LABEL_WARM
from tests.conftest import GcsTestBucket
from tests.runner.test_task_runner import _alive
from tests.support.kube import KubeCluster
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api", "workdir")]

ORPHAN_TIMEOUT = 4
# What the pod's watchdog writes when it ends a pod whose lease went unrenewed past its
# limit (when it decides so: tests/unit/test_orphan_decisions.py).
ENDED_UNOWNED = "ending, nobody owns this pod: the runner's lease was last renewed"
ORPHAN_LIMIT = f"(limit {ORPHAN_TIMEOUT}s"
TTL = 2
# Long enough that a restarted flow process finds the pod still running.
RESTART_TIMEOUT = 90
# Every first pod stops at its gate after two checkpoints (see the script): a killed
# process's pod never gets past it unless something ends the pod, and a restarted
# process's pod goes on only once the test has seen the restarted process take it over.
# A pod that resumes after a checkpoint has no gate to wait at.
TRAINING = {"steps": 4, "pause": 0.1}
RESTART = {"orphan_timeout": RESTART_TIMEOUT, **TRAINING}
KILLED = TRAINING


def _orchestrator(*args: str, cluster: str = "", **env: object) -> subprocess.Popen[str]:
    env.setdefault("gate", Path.cwd() / "gate")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.scripts.orphaned_training", *args],
        cwd=Path.cwd(),
        env={
            **os.environ,
            "PYTHONPATH": str(Path(__file__).parents[2]),
            "ORPHANED_TRAINING_CLUSTER": cluster,
            "ORPHANED_TRAINING_TTL": str(TTL),
            "PREFECT_API_URL": str(get_current_settings().api.url),
            **{f"ORPHANED_TRAINING_{k.upper()}": str(v) for k, v in env.items()},
        },
        stdout=subprocess.PIPE,
        text=True,
    )


def _started_training(
    checkpoints: Callable[[str], set[str]], cluster: str = "", **env: object
) -> tuple[subprocess.Popen[str], str]:
    """A flow process whose task pod has saved two checkpoints, and its flow run id."""
    first = _orchestrator("new", cluster=cluster, **env)
    flow_run_id = first.stdout.readline().split()[-1]  # type: ignore[union-attr]
    wait_until(lambda: len(checkpoints(flow_run_id)) >= 2, 240, "two checkpoints")
    return first, flow_run_id


def _local_checkpoints(flow_run_id: str) -> set[str]:
    return {p.name for p in Path(".kinetic", "outputs", flow_run_id).glob("*/checkpoints/[0-9]*")}


def _gcs_checkpoints(gcs: GcsTestBucket) -> Callable[[str], set[str]]:
    def steps(flow_run_id: str) -> set[str]:
        parts = (name.split("/") for name in gcs.names(f"outputs/{flow_run_id}/"))
        return {p[4] for p in parts if len(p) > 5 and p[3] == "checkpoints" and p[4].isdigit()}

    return steps


def _reattached(flow_run_id: str) -> bool:
    """Whether a task run of the flow run says it took over an earlier process's pod."""
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)]))
        )
    return any(
        (run.state and run.state.message or "").startswith("Reattached") for run in task_runs
    )


def _open_gate_once_reattached(process: subprocess.Popen[str], flow_run_id: str) -> None:
    def reattached() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"The restarted flow process exited with {process.returncode}")
        return _reattached(flow_run_id)

    wait_until(reattached, 120, "the restarted flow process to reattach to the pod")
    (Path.cwd() / "gate").touch()


def _result(process: subprocess.Popen[str]) -> int:
    lines, _ = process.communicate(timeout=300)
    assert process.returncode == 0, lines
    return int(lines.split()[-1])


def _kill(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


def _ended_unowned(log: str) -> bool:
    """The pod's log says its watchdog ended it: no renewal of its lease within the limit."""
    return ENDED_UNOWNED in log and ORPHAN_LIMIT in log


# -- local backend ---------------------------------------------------------------------------


def _pod_records(workdir: Path, flow_run_id: str) -> list[dict[str, Any]]:
    records = [json.loads(p.read_text()) for p in (workdir / ".kinetic" / "pods").glob("*.json")]
    mine = [r for r in records if r["labels"].get(LABEL_FLOW_RUN_ID) == flow_run_id]
    return sorted(mine, key=lambda r: r["launched_at"])


def _live_pods(workdir: Path, flow_run_id: str) -> list[int]:
    return [r["pid"] for r in _pod_records(workdir, flow_run_id) if _alive(r.get("pid") or 0)]


def test_a_killed_flow_processs_local_pod_ends_in_time_and_a_rerun_resumes_after_it(
    workdir: Path,
):
    first, flow_run_id = _started_training(_local_checkpoints, **KILLED)
    _kill(first)
    wait_until(lambda: not _live_pods(workdir, flow_run_id), 60, "the orphaned pod to end")
    ended = time.time()

    resumed_from = _result(_orchestrator("again", flow_run_id, **KILLED))

    old, new = _pod_records(workdir, flow_run_id)
    # Its first pod was parked at a gate nobody opens: only its watchdog could end it.
    logs = [p.read_text() for p in (workdir / ".kinetic" / "pods").glob("*.log")]
    assert [_ended_unowned(log) for log in logs].count(True) == 1
    assert resumed_from >= 2
    assert old["labels"][LABEL_TASK_IDENTITY] == new["labels"][LABEL_TASK_IDENTITY]
    assert old["started_at"] < ended < new["started_at"] < new["ended_at"]


def test_a_restarted_local_flow_process_reattaches_to_its_running_pod(workdir: Path):
    options = RESTART
    first, flow_run_id = _started_training(_local_checkpoints, **options)
    _kill(first)

    second = _orchestrator("again", flow_run_id, **options)
    started_again = time.time()
    _open_gate_once_reattached(second, flow_run_id)
    resumed_from = _result(second)

    (pod,) = _pod_records(workdir, flow_run_id)
    assert resumed_from == 0  # the first pod's own result: it trained from step 0
    # Its end was recorded by the restarted process, which watched the pod end.
    assert pod["started_at"] < started_again < pod["ended_at"]


# -- gke backend on the emulated cluster -----------------------------------------------------


def _most_pods_at_once(cluster: KubeCluster, flow_run_id: str) -> int:
    """From the cluster's pod events: the most pods of one task identity running at once."""

    def identity(pod: dict[str, Any]) -> str | None:
        labels = pod["metadata"].get("labels") or {}
        return labels[LABEL_TASK_IDENTITY] if labels.get(LABEL_FLOW_RUN_ID) == flow_run_id else None

    return cluster.most_at_once(
        "pods",
        lambda kind, pod: kind != "DELETED" and (pod.get("status") or {}).get("phase") == "Running",
        identity,
    )


def test_a_killed_flow_processs_job_is_gone_in_time_and_a_rerun_resumes_after_it(
    gke: str, cluster: KubeCluster, gcs: GcsTestBucket
):
    first, flow_run_id = _started_training(_gcs_checkpoints(gcs), cluster=gke, **KILLED)
    _kill(first)
    wait_until(lambda: not cluster.jobs(), 90, "the orphaned Job to be deleted")
    log_files = cluster.call(lambda: list(cluster.emulator.log_files.values()))
    logs = [path.read_text() for path in log_files]

    resumed_from = _result(_orchestrator("again", flow_run_id, cluster=gke, **KILLED))

    # The first pod was parked at a gate nobody opens: only its watchdog could end it.
    assert [_ended_unowned(log) for log in logs].count(True) == 1
    assert resumed_from >= 2
    assert len(cluster.created_jobs()) == 2
    assert _most_pods_at_once(cluster, flow_run_id) == 1


def test_a_flow_process_sigkilled_mid_run_leaves_no_secret_once_its_jobs_are_gone(
    gke: str, cluster: KubeCluster, gcs: GcsTestBucket
):
    first, _ = _started_training(_gcs_checkpoints(gcs), cluster=gke, **KILLED)
    (job,) = cluster.jobs()
    (secret,) = cluster.secrets()
    owners = secret["metadata"].get("ownerReferences") or []
    assert [o["uid"] for o in owners] == [job["metadata"]["uid"]]

    _kill(first)
    wait_until(lambda: not cluster.jobs(), 90, "the orphaned Job to be deleted")

    wait_until(lambda: not cluster.secrets(), 30, "the Secret to be collected with its Job")


def test_a_restarted_flow_process_reattaches_to_its_running_job(
    gke: str, cluster: KubeCluster, gcs: GcsTestBucket
):
    options = RESTART
    first, flow_run_id = _started_training(_gcs_checkpoints(gcs), cluster=gke, **options)
    _kill(first)

    second = _orchestrator("again", flow_run_id, cluster=gke, **options)
    _open_gate_once_reattached(second, flow_run_id)
    resumed_from = _result(second)

    assert resumed_from == 0  # the first pod's own result: it trained from step 0
    assert len(cluster.created_jobs()) == 1
    assert _most_pods_at_once(cluster, flow_run_id) == 1


def test_a_restarted_flow_process_stops_its_predecessors_warm_pod_before_launching(
    workdir: Path,
):
    options = {**RESTART, "warm": 1}
    first, flow_run_id = _started_training(_local_checkpoints, **options)
    _kill(first)
    (warm_pod,) = _pod_records(workdir, flow_run_id)

    restarted = time.time()
    resumed_from = _result(_orchestrator("again", flow_run_id, **options))

    old, *new = _pod_records(workdir, flow_run_id)
    assert old["job_id"] == warm_pod["job_id"]
    # Stopped at once: not left at its gate (its training unfinished) nor idling for 120 s.
    assert old["ended_at"] - restarted < 60
    assert old["labels"][LABEL_WARM] == "true"
    assert new and all(old["ended_at"] < pod["started_at"] for pod in new)
    assert resumed_from >= 2  # the training, the warm pod's second task, resumed
