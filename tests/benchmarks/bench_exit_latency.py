"""Local pod exit to resolved future: the pod's own shutdown against the runner's reaction.

Run: `.venv/bin/python tests/benchmarks/bench_exit_latency.py [N]`.

A pod's last write is its `final-state.json`; it then exits, the local
backend's watcher wakes on the pod's pidfd and reaps it, and the runner reads
the pod's records and resolves the future. The benchmark times two spans per
pod, in the same flow run:

- pod shutdown: `final-state.json` written (its mtime) → reaped (watcher woke);
- runner reaction: reaped → future resolved (its done callback ran).

Reaping is timed by a subclass of `LocalBackend` defined here, so the library
itself runs unchanged. Both spans are wall-clock (`time.time()` and file
mtimes share the realtime clock), so they compare directly.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from prefect import flow, task  # noqa: E402
from prefect.testing.utilities import prefect_test_harness  # noqa: E402

import kinetic_prefect.backends.local.backend as local_backend  # noqa: E402
from kinetic_prefect import KineticTaskRunner  # noqa: E402
from kinetic_prefect.backends.local.container import HostProcess, PodProcess  # noqa: E402

WORKERS = 2

# No lock guards these: the flow, and with it this module's globals that its
# callback uses, is pickled into every pod's payload, and a lock cannot be
# pickled. Each write is one dict assignment, atomic under the GIL.
_reaped: dict[str, float] = {}
_resolved: dict[str, float] = {}


class _TimedLocalBackend(local_backend.LocalBackend):
    def _reap(self, pod: PodProcess, host: HostProcess) -> None:
        # First thing the watcher does once the pidfd is readable: the pod has exited.
        _reaped[pod.job_id] = time.time()
        super()._reap(pod, host)


@task
def trivial(x: int) -> int:
    return x + 1


def _run(n: int) -> list[str]:
    """Runs the flow; returns the job ids in submission order."""

    @flow(task_runner=KineticTaskRunner(max_parallel=WORKERS))
    def fan_out(n: int) -> list[str]:
        futures = trivial.map(range(n))
        for future in futures:
            # Pods take seconds to start, so no future is done yet; a callback added
            # to a done future would run at once and record the wrong moment.
            assert not future.wrapped_future.done(), future.state
            future.add_done_callback(_record_resolution)
        assert [f.result() for f in futures] == [x + 1 for x in range(n)]
        return [f.job_id for f in futures]

    return fan_out(n)


def _record_resolution(future: object) -> None:
    _resolved[future.job_id] = time.time()  # type: ignore[attr-defined]


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def _coarse_clock_resolution_ms() -> float | None:
    # File timestamps come from the kernel's coarse clock, so an mtime can read a
    # tick early; its resolution bounds that error.
    clock = getattr(time, "CLOCK_REALTIME_COARSE", 5 if sys.platform == "linux" else None)
    if clock is None:
        return None
    try:
        return time.clock_getres(clock) * 1000
    except OSError:
        return None


def main(n: int = 20) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kinetic-bench-"))
    os.chdir(workdir)
    # The runner imports LocalBackend from its module when it first needs one.
    local_backend.LocalBackend = _TimedLocalBackend  # type: ignore[misc]
    with prefect_test_harness(server_startup_timeout=120):
        job_ids = _run(n)

    shutdown, reaction = [], []
    for job_id in job_ids:
        record = workdir / ".kinetic" / "kinetic" / job_id / "final-state.json"
        written = os.stat(record).st_mtime
        shutdown.append(_reaped[job_id] - written)
        reaction.append(_resolved[job_id] - _reaped[job_id])
    assert all(r >= 0 for r in reaction), reaction

    rows = {
        "pod shutdown (final-state.json -> reaped)": shutdown,
        "runner reaction (reaped -> future resolved)": reaction,
        "total (final-state.json -> future resolved)": [
            a + b for a, b in zip(shutdown, reaction, strict=True)
        ],
    }
    print(
        f"\nPod exit to resolved future, N={n} trivial tasks, {WORKERS} pods at once, "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'measure':<46}{'median ms':>10}{'p90 ms':>9}{'min ms':>9}{'max ms':>9}")
    for name, values in rows.items():
        ms = [v * 1000 for v in values]
        print(
            f"{name:<46}{statistics.median(ms):>10.1f}{_p90(ms):>9.1f}{min(ms):>9.1f}{max(ms):>9.1f}"
        )
    ratio = statistics.median(reaction) / statistics.median(shutdown)
    print(f"runner reaction / pod shutdown (medians): {ratio:.3g}x")
    resolution = _coarse_clock_resolution_ms()
    if resolution is not None:
        print(f"mtime granularity: {resolution:.1f} ms (pod shutdown may read up to this long)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
