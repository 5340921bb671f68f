"""An unsaved result of N MB coming back from a local pod, against the same task in threads.

Run: `.venv/bin/python tests/benchmarks/bench_large_result.py [MB ...]` (8 64 256).

An unsaved result travels in the task's final state: inside the signed
`final-state.json` up to 1 MiB of pickled state, beside it as `final-state.pkl` above
that. Each case runs in a process of its own, under Prefect's test harness, so its
peak RSS is the flow process's alone: the flow, one `KineticTaskRunner` task on the
local backend returning N MB of bytes, the result back in the flow. The baseline is
the same flow on Prefect's `ThreadPoolTaskRunner`, in the same kind of process.
Printed: wall seconds and peak RSS per case, and kinetic's over the baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ONE_CASE = """
import json, os, resource, sys, time
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner
from prefect.testing.utilities import prefect_test_harness
from kinetic_prefect import KineticTaskRunner

MB, RUNNER = int(sys.argv[1]), sys.argv[2]

@task
def big(n: int) -> bytes:
    return b"x" * (n * 1024 * 1024)

runner = KineticTaskRunner() if RUNNER == "kinetic" else ThreadPoolTaskRunner()

@flow(task_runner=runner)
def one(n: int) -> int:
    return len(big.submit(n).result())

with prefect_test_harness():
    one(1)  # the server, imports and first pod: not what is measured
    start = time.monotonic()
    size = one(MB)
    took = time.monotonic() - start
assert size == MB * 1024 * 1024
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": took, "rss_mb": rss}))
"""


def _case(mb: int, runner: str, workdir: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", ONE_CASE, str(mb), runner],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(sizes: list[int]) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        for mb in sizes:
            threads = _case(mb, "threads", workdir)
            kinetic = _case(mb, "kinetic", workdir)
            rows.append((mb, kinetic, threads))
    print()
    print("MB    kinetic s  threads s  ratio   kinetic RSS MB  threads RSS MB  ratio")
    for mb, kinetic, threads in rows:
        print(
            f"{mb:<5} {kinetic['seconds']:>9.1f}  {threads['seconds']:>9.1f}  "
            f"{kinetic['seconds'] / threads['seconds']:>5.1f}x  "
            f"{kinetic['rss_mb']:>14.0f}  {threads['rss_mb']:>14.0f}  "
            f"{kinetic['rss_mb'] / threads['rss_mb']:>5.1f}x"
        )


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [8, 64, 256])
