"""Cancelling a flow run (as the UI does) stops its task pods though its flow process is gone.

The flow process is SIGKILLed first, with an orphan timeout far longer than the test's
bound, so only the pods' own look at the flow run's state can end them in time.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prefect import get_client
from prefect.states import Cancelling

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

# The pods' watchdog looks every orphan_timeout/4 s, at most every 15 s.
ORPHAN_TIMEOUT = 60
LOOK_EVERY = ORPHAN_TIMEOUT / 4
OPTIONS = {"orphan_timeout": ORPHAN_TIMEOUT, "steps": 200, "pause": 1.0}


def _cancel(flow_run_id: str) -> float:
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
    return time.monotonic()


def test_cancelling_a_flow_run_whose_process_is_gone_ends_its_local_pods(workdir: Path):
    first, flow_run_id = _started_training(_local_checkpoints, **OPTIONS)
    _kill(first)
    assert _live_pods(workdir, flow_run_id)

    cancelled = _cancel(flow_run_id)
    wait_until(lambda: not _live_pods(workdir, flow_run_id), 120, "the pod to end")

    assert time.monotonic() - cancelled < LOOK_EVERY + SIGTERM_SLACK < ORPHAN_TIMEOUT


def test_cancelling_a_flow_run_whose_process_is_gone_ends_its_jobs(
    gke: str, cluster: KubeCluster, gcs: GcsTestBucket
):
    first, flow_run_id = _started_training(_gcs_checkpoints(gcs), cluster=gke, **OPTIONS)
    _kill(first)
    assert cluster.jobs()

    cancelled = _cancel(flow_run_id)
    wait_until(lambda: not cluster.jobs(), 120, "the Job to be deleted")

    assert time.monotonic() - cancelled < LOOK_EVERY + SIGTERM_SLACK + TTL < ORPHAN_TIMEOUT
