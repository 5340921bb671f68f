"""Per-task overhead of KineticTaskRunner (local) against Prefect's own runners.

Run: `make bench` or `.venv/bin/python tests/benchmarks/bench_overhead.py [N]`.

All runners map the same trivial task over N inputs in one run, against one
real Prefect API, so the ratios compare like with like on a noisy machine.
Cold pods fork from the local backend's preloaded template (`docs/local-pods.md`);
the "fresh" row starts each as a new Python instead. The second table is where
a local pod's time goes, from the timings each task records in its
`final-state.json`, for cold pods and for tasks on warm pods (`warm_pods=True`).
Then a run mixing two pod specs shows that warm pods are shared only
within a spec, and a run with the jobs store on fake-gcs-server
(through a counting proxy) prints the GCS requests per task, cold and warm.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, task  # noqa: E402
from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

from kinetic_prefect import KineticTaskRunner, resources  # noqa: E402
from kinetic_prefect.backends.local.template import TEMPLATE_ENV  # noqa: E402

WORKERS = 2


@task
def trivial(x: int) -> int:
    return x + 1


@task
def flavour_and_pid(x: int) -> tuple[str, int]:
    return os.environ.get("FLAVOUR", ""), os.getpid()


def _time_runner(runner: object, n: int) -> float:
    @flow(task_runner=runner)
    def fan_out(n: int) -> list[int]:
        return [f.result() for f in trivial.map(range(n))]

    started = time.perf_counter()
    assert fan_out(n) == [x + 1 for x in range(n)]
    return time.perf_counter() - started


_WALL = re.compile(r"pod exited with code -?\d+ after ([0-9.]+)s")


def _pod_profile(jobs_root: Path) -> dict[str, list[float]]:
    """Phase timings of every task; `exit` only for a pod that ran one task (cold)."""
    phases: dict[str, list[float]] = {}
    for record in (jobs_root / "kinetic").glob("*/final-state.json"):
        timings = json.loads(record.read_text())["timings"]
        timings["engine"] = timings.get("run", 0.0) - timings.get("hydrate", 0.0)
        log = jobs_root / "pods" / f"{record.parent.name}.log"
        walls = _WALL.findall(log.read_text()) if log.exists() else []
        if walls and not (record.parent / "warm").exists():
            timings["exit"] = float(walls[-1]) - sum(v for k, v in timings.items() if k != "run")
        for name, value in timings.items():
            phases.setdefault(name, []).append(value)
    return phases


def _print_profile(title: str, phases: dict[str, list[float]]) -> None:
    order = ["startup", "download", "verify", "extract", "unpickle", "data", "environment"]
    order += ["hydrate", "engine", "report", "exit"]
    tasks = len(phases.get("run", []))
    # A phase only some tasks have (a warm pod's start-up) counts per task, not per pod.
    per_task = {p: sum(phases[p]) / tasks for p in order if p in phases and tasks}
    total = sum(per_task.values())
    notes = {
        "startup": "interpreter start and kinetic_prefect import",
        "unpickle": "mostly `import prefect`, pulled in by the payload",
        "hydrate": "Prefect context (collections load only for an unregistered block type)",
        "engine": "task engine: API round trips, state events, the task itself",
        "exit": "after the report: log/event drain, exit handlers, reaping by the backend",
    }
    print(f"\n{title} ({tasks} tasks; mean per task)")
    print(f"{'phase':<13}{'mean s':>9}{'median s':>10}{'share':>8}  note")
    for name, mean in per_task.items():
        median = statistics.median(phases[name])
        share = mean / total if total else 0.0
        print(f"{name:<13}{mean:>9.3f}{median:>10.3f}{share:>8.0%}  {notes.get(name, '')}")


def _mixed_specs(n: int, jobs_root: Path) -> None:
    """Half the tasks with FLAVOUR=a, half with FLAVOUR=b, interleaved, on warm pods."""

    @flow(
        task_runner=KineticTaskRunner(
            max_parallel=WORKERS, warm_pods=True, jobs_root=str(jobs_root)
        )
    )
    def mixed(n: int) -> list[tuple[str, int]]:
        futures = []
        for x in range(n):
            with resources(env={"FLAVOUR": "ab"[x % 2]}):
                futures.append(flavour_and_pid.submit(x))
        return [f.result() for f in futures]

    results = mixed(n)
    launched = len(list((jobs_root / "pods").glob("*.json")))
    print(f"\nTwo pod specs mixed on warm pods: {n} tasks, {launched} pods launched")
    print(f"{'spec':<12}{'tasks':>7}{'pods':>6}")
    for flavour in "ab":
        mine = [pid for f, pid in results if f == flavour]
        print(f"{'FLAVOUR=' + flavour:<12}{len(mine):>7}{len(set(mine)):>6}")
    shared = {pid for f, pid in results if f == "a"} & {pid for f, pid in results if f == "b"}
    print(f"pods that ran both specs: {len(shared)}")


def _gcs_requests(n: int) -> dict[str, float]:
    """GCS requests per task with the jobs store and results on fake-gcs-server."""
    import uuid

    from kinetic_prefect.common import gcs as kgcs
    from tests.conftest import GcsTestBucket
    from tests.support.clusters import gcs_cluster
    from tests.support.gcs import FaultInjectingProxy, fake_gcs_server

    per_task: dict[str, float] = {}
    with fake_gcs_server() as upstream, FaultInjectingProxy(upstream, every=None) as proxy:
        emulator_env = {"STORAGE_EMULATOR_HOST": proxy.url, "TENSORSTORE_GCS_HTTP_URL": proxy.url}
        os.environ.update(emulator_env)
        kgcs._clients.clear()
        client = kgcs.storage_client()
        for label, warm in (("cold", False), ("warm", True)):
            bucket = client.create_bucket(f"kp-bench-{uuid.uuid4().hex[:10]}")
            test_bucket = GcsTestBucket(bucket.name, client, emulator_env)
            cluster = gcs_cluster(test_bucket, f"bench-{label}")
            runner = KineticTaskRunner(cluster=cluster, max_parallel=WORKERS, warm_pods=warm)
            before = proxy.requests
            _time_runner(runner, n)
            per_task[label] = (proxy.requests - before) / n
    return per_task


def main(n: int = 20) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kinetic-bench-"))
    os.chdir(workdir)
    cold_root, warm_root, fresh_root = workdir / "cold", workdir / "warm", workdir / "fresh"
    runners = {
        "ThreadPoolTaskRunner": ThreadPoolTaskRunner(max_workers=WORKERS),
        "ProcessPoolTaskRunner": ProcessPoolTaskRunner(max_workers=WORKERS),
        "KineticTaskRunner (cold)": KineticTaskRunner(
            max_parallel=WORKERS, jobs_root=str(cold_root)
        ),
        "KineticTaskRunner (warm)": KineticTaskRunner(
            max_parallel=WORKERS, jobs_root=str(warm_root), warm_pods=True
        ),
    }
    with prefect_test_harness(server_startup_timeout=120):
        _time_runner(ThreadPoolTaskRunner(), 2)  # warm the API and imports
        totals = {name: _time_runner(runner, n) for name, runner in runners.items()}
        # Cold pods started as fresh Pythons instead of forked from the preloaded template.
        os.environ[TEMPLATE_ENV] = "0"
        fresh = KineticTaskRunner(max_parallel=WORKERS, jobs_root=str(fresh_root))
        totals["KineticTaskRunner (cold, fresh)"] = _time_runner(fresh, n)
        del os.environ[TEMPLATE_ENV]
        _mixed_specs(n, workdir / "mixed")
        requests = _gcs_requests(n)

    thread = totals["ThreadPoolTaskRunner"]
    process = totals["ProcessPoolTaskRunner"]
    print(f"\nPer-task overhead, N={n} trivial tasks, {WORKERS} workers, {os.cpu_count()} CPUs")
    print(f"{'runner':<32}{'total s':>9}{'per task s':>12}{'vs thread':>11}{'vs process':>12}")
    for name, total in totals.items():
        print(
            f"{name:<32}{total:>9.2f}{total / n:>12.3f}"
            f"{total / thread:>10.1f}x{total / process:>11.1f}x"
        )
    pods = len(list((warm_root / "pods").glob("*.json")))
    print(f"warm: {pods} pods for {n} tasks")

    _print_profile("Where a cold pod's time goes", _pod_profile(cold_root))
    _print_profile("Where a cold pod's time goes, fresh Python", _pod_profile(fresh_root))
    _print_profile("Where a task's time goes on warm pods", _pod_profile(warm_root))

    print(f"\nGCS requests per task (jobs store and results on fake-gcs-server), N={n}")
    for label, count in requests.items():
        print(f"{label:<6}{count:>8.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
