"""A map of N tasks on the emulated Kubernetes cluster, with pods that really run.

Run: `.venv/bin/python tests/benchmarks/bench_kube_scale.py [N] [MAX_PARALLEL]` (100, 4).

The kmock API server, the test kubelet (which runs every pod's container on this
machine), fake-gcs-server behind a counting proxy for the jobs bucket and the
results, and a real Prefect API, as in the tests. The same map runs on cold pods
(one Job per task) and on warm pods (`warm_pods=True`), and the table prints, per
task: the runner's Kubernetes API requests (the test kubelet's own are not
counted) and the GCS requests of the runner and its pods together.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, task  # noqa: E402
from prefect.futures import wait  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

from kinetic_prefect import KineticTaskRunner  # noqa: E402


@task
def plus_one(x: int) -> int:
    return x + 1


def _run(cluster_name: str, n: int, max_parallel: int, warm: bool) -> tuple[list[str], float]:
    runner = KineticTaskRunner(
        cluster=cluster_name, allow_loopback_api=True, max_parallel=max_parallel, warm_pods=warm
    )

    @flow(task_runner=runner)
    def fan_out(n: int) -> tuple[list[str], list[int]]:
        futures = plus_one.map(range(n))
        wait(futures)
        states = [f.state.type.value for f in futures]
        return states, [f.result() for f in futures if f.state.is_completed()]

    started = time.perf_counter()
    states, values = fan_out(n)
    took = time.perf_counter() - started
    if values != [x + 1 for x in range(n)]:
        raise AssertionError(f"wrong or missing results: {states}")
    return states, took


def main(n: int = 100, max_parallel: int = 4) -> None:
    from kinetic_prefect.common import gcs as kgcs
    from tests.conftest import GcsTestBucket
    from tests.support.clusters import gcs_cluster
    from tests.support.gcs import FaultInjectingProxy, fake_gcs_server
    from tests.support.kube import running_cluster

    workdir = Path(tempfile.mkdtemp(prefix="kinetic-kube-scale-"))
    os.chdir(workdir)
    rows = []
    with (
        prefect_test_harness(server_startup_timeout=120),
        fake_gcs_server() as upstream,
        FaultInjectingProxy(upstream, every=None) as proxy,
    ):
        emulator_env = {"STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}
        os.environ.update(emulator_env)
        kgcs._clients.clear()
        client = kgcs.storage_client()
        for label, warm in (("cold", False), ("warm", True)):
            with running_cluster(workdir / label) as cluster:
                os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
                bucket = client.create_bucket(f"kp-scale-{uuid.uuid4().hex[:10]}")
                name = gcs_cluster(
                    GcsTestBucket(bucket.name, client, emulator_env), f"scale-{label}", "gke"
                )
                kube_before, gcs_before = len(cluster.client_requests()), proxy.requests
                states, took = _run(name, n, max_parallel, warm)
                kube = len(cluster.client_requests()) - kube_before
                rows.append(
                    (
                        label,
                        states.count("COMPLETED"),
                        took,
                        len(cluster.created_jobs()),
                        kube / n,
                        (proxy.requests - gcs_before) / n,
                    )
                )

    print(f"\n{n}-task map on the emulated cluster, max_parallel={max_parallel}, pods run")
    print(
        f"{'pods':<6}{'completed':>10}{'wall s':>9}{'per task s':>12}{'Jobs':>6}"
        f"{'k8s req/task':>14}{'GCS req/task':>14}"
    )
    for label, completed, took, jobs, kube, gcs_requests in rows:
        print(
            f"{label:<6}{completed:>10}{took:>9.1f}{took / n:>12.3f}{jobs:>6}"
            f"{kube:>14.2f}{gcs_requests:>14.1f}"
        )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
