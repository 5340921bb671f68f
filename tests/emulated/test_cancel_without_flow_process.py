"""Cancelling a flow run (as the UI does) stops its task pods, and no pod asks the API to learn it.

The flow process's runner looks at its flow run's state (one request every 15 s
for the whole flow run) and marks the lease its pods read; each pod's watchdog
sees the mark at its next look at the lease. The orphan timeout is far longer
than the test's bound, so only the marked lease can end the pods in time. A flow
process that is gone cannot mark anything: its pods end after the orphan timeout
(tests/emulated/test_reattach.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prefect import get_client
from prefect.states import Cancelling

from kinetic_prefect.pod.watchdog import LOOK_SECONDS
from kinetic_prefect.runner.lease import FLOW_RUN_LOOK_SECONDS
from tests.conftest import GcsTestBucket
from tests.emulated.test_reattach import (
    SIGTERM_SLACK,
    TTL,
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
# The runner's look at the flow run, then the pod's look at the lease.
NOTICE = min(FLOW_RUN_LOOK_SECONDS, ORPHAN_TIMEOUT / 4) + min(LOOK_SECONDS, ORPHAN_TIMEOUT / 4)
OPTIONS = {"orphan_timeout": ORPHAN_TIMEOUT, "steps": 200, "pause": 1.0}


def _cancel(flow_run_id: str) -> float:
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
    return time.monotonic()


def test_cancelling_a_flow_run_ends_its_local_pods_through_the_lease(workdir: Path):
    process, flow_run_id = _started_training(_local_checkpoints, **OPTIONS)
    try:
        assert _live_pods(workdir, flow_run_id)

        cancelled = _cancel(flow_run_id)
        wait_until(lambda: not _live_pods(workdir, flow_run_id), 120, "the pod to end")

        assert time.monotonic() - cancelled < NOTICE + SIGTERM_SLACK < ORPHAN_TIMEOUT
    finally:
        _kill(process)


def test_cancelling_a_flow_run_ends_its_jobs_through_the_lease(
    gke: str, cluster: KubeCluster, gcs: GcsTestBucket
):
    process, flow_run_id = _started_training(_gcs_checkpoints(gcs), cluster=gke, **OPTIONS)
    try:
        assert cluster.jobs()

        cancelled = _cancel(flow_run_id)
        wait_until(lambda: not cluster.jobs(), 120, "the Job to be deleted")

        assert time.monotonic() - cancelled < NOTICE + SIGTERM_SLACK + TTL < ORPHAN_TIMEOUT
    finally:
        _kill(process)
