"""Cost and latency at scale on the emulated cluster: a 100-task map.

Its latency bound holds on a quiet machine only: `make test` runs this module by itself
after every other test has ended (`ALONE_FOLDERS` in tests/support/scheduling.py).
"""

from __future__ import annotations

import statistics
import time

import pytest
from prefect import flow
from prefect.futures import wait

from tests.emulated.test_kubernetes_backend import _runner, trivial

pytestmark = [pytest.mark.alone, pytest.mark.usefixtures("prefect_api", "workdir")]


def test_a_100_task_map_costs_under_3_api_requests_per_task_and_exits_are_noticed_within_1s(
    gke, cluster
):
    cluster.kubelet.run_containers = False  # the pod ends with exit 0 as soon as it runs
    resolved: dict[str, float] = {}

    @flow(task_runner=_runner(gke))
    def fan_out() -> list[str]:
        futures = trivial.map(range(100))
        for future in futures:
            future.wrapped_future.add_done_callback(
                lambda _, job=future.job_id: resolved.setdefault(job, time.time())
            )
        wait(futures)
        return [f.job_id for f in futures]

    job_ids = fan_out()

    requests = cluster.client_requests()
    latencies = [resolved[j] - cluster.kubelet.finished_at[j] for j in job_ids]
    print(
        f"{len(requests)} API requests for {len(job_ids)} tasks; completion noticed after "
        f"median {statistics.median(latencies):.3f}s, max {max(latencies):.3f}s"
    )
    assert len(cluster.created_jobs()) == 100
    assert len(requests) < 3 * 100
    assert statistics.median(latencies) < 1.0
