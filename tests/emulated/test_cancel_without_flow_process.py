"""Cancelling a flow run (as the UI does) stops its task pods, and no pod asks the API to learn it.

The flow process's runner looks at its flow run's state (one request every 15 s
for the whole flow run) and marks the lease its pods read; each pod's watchdog
sees the mark at its next look at the lease. The orphan timeout is far longer
than the test's bound, so only the marked lease can end the pods in time. A flow
process that is gone cannot mark anything: its pods end after the orphan timeout
(tests/emulated/test_reattach.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import get_client
from prefect.states import Cancelling

from kinetic_prefect.backends.local.pods import read_pod
from kinetic_prefect.launch.manifest import LABEL_FLOW_RUN_ID
from tests.conftest import GcsTestBucket
from tests.emulated.test_reattach import (
    _gcs_checkpoints,
    _kill,
    _live_pods,
    _local_checkpoints,
    _started_training,
)
from tests.support.kube import KubeCluster
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_api", "workdir")]

ORPHAN_TIMEOUT = 60
OPTIONS = {"orphan_timeout": ORPHAN_TIMEOUT, "steps": 200, "pause": 1.0}
# What the pod's watchdog says as it ends the pod for a lease marked cancelled.
ENDED_BY_THE_LEASE = "nobody owns this pod: the runner marked its lease: the flow run is cancelled"


def _cancel(flow_run_id: str) -> None:
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(), force=True)


def _local_pod_logs(workdir: Path, flow_run_id: str) -> list[str]:
    pods_dir = workdir / ".kinetic" / "pods"
    pods = [read_pod(pods_dir, path.stem) for path in sorted(pods_dir.glob("*.json"))]
    return [
        pod.log_path.read_text()
        for pod in pods
        if pod is not None and pod.labels.get(LABEL_FLOW_RUN_ID) == flow_run_id
    ]


def test_cancelling_a_flow_run_ends_its_local_pods_through_the_lease(workdir: Path):
    process, flow_run_id = _started_training(_local_checkpoints, **OPTIONS)
    try:
        assert _live_pods(workdir, flow_run_id)

        _cancel(flow_run_id)
        wait_until(lambda: not _live_pods(workdir, flow_run_id), 120, "the pod to end")
    finally:
        _kill(process)

    # The pod ended itself for its lease marked cancelled: a pod ended by its orphan
    # timeout (60 s) would give the lease's age as the reason, and the runner stopping
    # it would say so in its log.
    (log,) = _local_pod_logs(workdir, flow_run_id)
    assert ENDED_BY_THE_LEASE in log
    assert "(stopped by the runner)" not in log


def _pod_log(cluster: KubeCluster, job_name: str) -> Path:
    """The log of the Job's one pod, as the kubelet writes it and the API serves it."""
    logs = cluster.call(lambda: dict(cluster.emulator.log_files))
    (path,) = [path for (_, pod), path in logs.items() if pod.startswith(f"{job_name}-")]
    return path


def test_cancelling_a_flow_run_ends_its_jobs_through_the_lease(
    gke: str, cluster: KubeCluster, gcs: GcsTestBucket
):
    process, flow_run_id = _started_training(_gcs_checkpoints(gcs), cluster=gke, **OPTIONS)
    try:
        (job,) = cluster.jobs()
        pod_log = _pod_log(cluster, job["metadata"]["name"])

        _cancel(flow_run_id)
        wait_until(lambda: not cluster.jobs(), 120, "the Job to be deleted")
    finally:
        _kill(process)

    # The pod ended itself for its lease and its Job went after its TTL: no client (the
    # runner, the CLI) deleted a Job or a pod, as the API server's request log shows.
    deleted = [
        r.resource.plural
        for r in cluster.client_requests()
        if r.method == "DELETE" and r.resource is not None and r.resource.plural in {"jobs", "pods"}
    ]
    assert deleted == []
    assert ENDED_BY_THE_LEASE in pod_log.read_text()
