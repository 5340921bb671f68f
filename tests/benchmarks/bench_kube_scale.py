"""A map of N tasks on the emulated cluster with NODES TPU nodes, on cold and on warm pods.

Run: `.venv/bin/python tests/benchmarks/bench_kube_scale.py [N] [NODES] [cold|warm]` (100, 8,
both).

The real parts of the tests: the kmock API server with the test kubelet, whose node
pool has NODES `tpu-v5e-4` nodes (one pod each; the rest wait for capacity), pods
that really run, fake-gcs-server behind the IAM proxy with the documented grants,
and a real Prefect API behind a request counter. The flow runs in a process of its
own, so its CPU time is the runner's alone; the same map on Prefect's
`ThreadPoolTaskRunner`, in the same kind of process, is the baseline.

Per task: the runner's Kubernetes API requests (the kubelet's are not counted), GCS
requests of the runner and its pods together (every request the IAM proxy received),
Prefect API requests of the runner and its pods, and the flow process's CPU time. And
how soon a pod's end is noticed: from the kubelet recording its container's exit to
the future resolving in the flow process (median and slowest, cold pods only: a warm
pod's container exits after its last task).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

ROOT = Path(__file__).resolve().parents[2]
ACCELERATOR = "tpu-v5e-4"


def run_flow(runner_kind: str, n: int) -> None:
    """In the flow process: map `plus_one` over range(n), print states and CPU as JSON."""
    from prefect import flow, task
    from prefect.futures import wait
    from prefect.task_runners import ThreadPoolTaskRunner

    from kinetic_prefect import KineticTaskRunner

    @task
    def plus_one(x: int) -> int:
        return x + 1

    if runner_kind == "threads":
        runner = ThreadPoolTaskRunner()
    else:
        runner = KineticTaskRunner(
            cluster=os.environ["KINETIC_CLUSTER"],
            accelerator=ACCELERATOR,
            allow_loopback_api=True,
            warm_pods=runner_kind == "warm",
        )

    resolved: dict[str, float] = {}

    @flow(task_runner=runner)
    def fan_out(n: int) -> tuple[list[str], list[int]]:
        futures = plus_one.map(range(n))
        for future in futures:
            job_id = getattr(future, "job_id", None)
            if job_id is not None:
                future.wrapped_future.add_done_callback(
                    lambda _, job=job_id: resolved.setdefault(job, time.time())
                )
        wait(futures)
        states = [f.state.type.value for f in futures]
        return states, [f.result() for f in futures if f.state.is_completed()]

    cpu, wall = time.process_time(), time.perf_counter()
    states, values = fan_out(n)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    right = values == [x + 1 for x in range(n)]
    result = {"states": states, "right": right, "cpu": cpu, "wall": wall, "resolved": resolved}
    print(json.dumps(result))


def _flow_process(runner_kind: str, n: int, env: dict[str, str], cwd: Path) -> dict[str, object]:
    completed = subprocess.run(
        [sys.executable, __file__, "--flow", runner_kind, str(n)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    (cwd / f"flow-{runner_kind}.log").write_text(completed.stderr)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    if completed.returncode != 0 or not lines:
        raise RuntimeError(f"The {runner_kind} flow failed:\n{completed.stderr[-5000:]}")
    result: dict[str, object] = json.loads(lines[-1])
    if not result["right"]:
        raise AssertionError(f"wrong or missing results: {result['states']}")
    return result


def request_kind(method: str, path: str) -> str:
    """`GET media assign-N.json`: a GCS request's method, form and object basename (digits N)."""
    url = urlsplit(path)
    query = parse_qs(url.query)
    name = unquote(url.path.split("/o/", 1)[1]) if "/o/" in url.path else ""
    name = name or (query.get("name") or query.get("prefix") or [""])[0]
    if url.path.startswith("/upload/"):
        form = "upload"
    elif "/o/" not in url.path:
        form = "list" if url.path.endswith("/o") else "bucket"
    else:
        form = "media" if query.get("alt") == ["media"] else "metadata"
    base = re.sub(r"[0-9a-f]{16,}", "<key>", name.rstrip("/").rsplit("/", 1)[-1])
    base = re.sub(r"[0-9]+", "N", base)
    return f"{method} {form} {base}"


def print_breakdown(
    label: str, requests: list[tuple[str, str, str]], uploaded: list[str], n: int
) -> None:
    """GCS requests per task by kind, most first (uploads by the object they wrote)."""
    kinds = Counter(
        request_kind(method, path)
        for _, method, path in requests
        if not path.startswith("/upload/")
    )
    kinds.update(request_kind("POST", f"/upload/?name={name}") for name in uploaded)
    print(f"\nGCS requests per task by kind ({label})")
    for kind, count in kinds.most_common():
        print(f"{count / n:>8.2f}  {kind}")


def main(n: int = 100, nodes: int = 8, modes: tuple[str, ...] = ("cold", "warm")) -> None:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from tests.conftest import documented_bucket, upload_suite_environment
    from tests.support.clusters import SHIPPED_REQUIREMENTS, gcs_cluster
    from tests.support.gcs import fake_gcs_server
    from tests.support.gcs_iam import strict_gcs
    from tests.support.kube import running_cluster
    from tests.support.kube_objects import gke_nodes
    from tests.support.request_counter import RequestCounter

    workdir = Path(tempfile.mkdtemp(prefix="kinetic-kube-scale-"))
    rows = []
    breakdowns: list[tuple[str, list[tuple[str, str, str]], list[str]]] = []
    with (
        prefect_test_harness(server_startup_timeout=120),
        RequestCounter(PREFECT_API_URL.value()) as prefect_api,
        fake_gcs_server() as gcs_server,
        strict_gcs(gcs_server) as iam,
    ):
        upload_suite_environment(gcs_server, SHIPPED_REQUIREMENTS, os.environ.__setitem__)
        bucket = documented_bucket(gcs_server, iam, os.environ.__setitem__)
        # The flow process, and through it every pod, waits the product's intervals, as a
        # user's would (not the suite's short ones: a pod's watchdog, for one, would read
        # its lease five times as often).
        env = {k: v for k, v in os.environ.items() if k != "KINETIC_INTERVALS"}
        env.update({"PREFECT_API_URL": prefect_api.url, "PYTHONPATH": str(ROOT)})
        baseline = _flow_process("threads", n, env, workdir)
        for label in modes:
            with running_cluster(workdir / label) as cluster:
                cluster.kubelet.nodes[:] = gke_nodes("tpu-pool", ACCELERATOR, nodes)
                name = gcs_cluster(bucket, f"scale-{label}", "gke")
                kube_before = len(cluster.client_requests())
                gcs_before, prefect_before = len(iam.requests), prefect_api.total
                uploads_before = len(iam.uploaded)
                result = _flow_process(
                    label,
                    n,
                    {**env, "KUBECONFIG": str(cluster.kubeconfig), "KINETIC_CLUSTER": name},
                    workdir,
                )
                breakdowns.append((label, iam.requests[gcs_before:], iam.uploaded[uploads_before:]))
                resolved: dict[str, float] = result["resolved"]  # type: ignore[assignment]
                finished = cluster.kubelet.finished_at
                notice = [resolved[j] - finished[j] for j in resolved if j in finished]
                (workdir / f"gcs-requests-{label}.json").write_text(
                    json.dumps(iam.requests[gcs_before:], indent=0)
                )
                rows.append(
                    (
                        label,
                        result["states"].count("COMPLETED"),  # type: ignore[attr-defined]
                        result["wall"],
                        cluster.kubelet.most_bound.get("tpu-pool", 0),
                        len(cluster.created_jobs()),
                        (len(cluster.client_requests()) - kube_before) / n,
                        (len(iam.requests) - gcs_before) / n,
                        (prefect_api.total - prefect_before) / n,
                        1000 * result["cpu"] / n,  # type: ignore[operator]
                        statistics.median(notice) if notice and label == "cold" else None,
                        max(notice) if notice and label == "cold" else None,
                    )
                )

    base_cpu = 1000 * baseline["cpu"] / n  # type: ignore[operator]
    print(f"\n{n}-task map of a trivial task, {nodes} {ACCELERATOR} nodes, pods run")
    print(
        f"{'pods':<6}{'done':>6}{'wall s':>8}{'pods at once':>14}{'Jobs':>6}{'k8s/task':>10}"
        f"{'GCS/task':>10}{'Prefect/task':>14}{'CPU ms/task':>13}{'vs threads':>12}"
        f"{'exit noticed s (median/max)':>29}"
    )
    for label, done, wall, at_once, jobs, kube, gcs_requests, prefect, cpu, median, most in rows:
        noticed = f"{median:.3f}/{most:.3f}" if median is not None else "-"
        print(
            f"{label:<6}{done:>6}{wall:>8.1f}{at_once:>14}{jobs:>6}{kube:>10.2f}"
            f"{gcs_requests:>10.1f}{prefect:>14.1f}{cpu:>13.1f}{cpu / base_cpu:>11.1f}x"
            f"{noticed:>29}"
        )
    print(
        f"{'threads':<6}{n:>6}{baseline['wall']:>8.1f}{'-':>14}{'-':>6}{'-':>10}{'-':>10}"
        f"{'-':>14}{base_cpu:>13.1f}{1:>11.1f}x"
    )
    for label, requests, uploaded in breakdowns:
        print_breakdown(label, requests, uploaded, n)
    print(f"\nEvery GCS request (identity, method, path): {workdir}/gcs-requests-*.json")
    print(f"The flow processes' logs: {workdir}/flow-*.log")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--flow"]:
        run_flow(sys.argv[2], int(sys.argv[3]))
    else:
        main(*(int(a) for a in sys.argv[1:3]), *([tuple(sys.argv[3:4])] if sys.argv[3:] else []))
