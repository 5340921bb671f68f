"""The pod process: its arguments, the watchdog, then one task run (or, warm, one after another).

`python -m kinetic_prefect.pod` and the local backend's forked pods both start here.
"""

from __future__ import annotations

import os

from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.pod import prefect_process
from kinetic_prefect.pod import slice as slice_host
from kinetic_prefect.pod.exit import flush_and_exit
from kinetic_prefect.pod.runner import EXIT_COMPLETED, log, parse_args, process_age, run_task
from kinetic_prefect.pod.warm import WarmLoop
from kinetic_prefect.pod.watchdog import start_watchdog


def main(argv: list[str] | None = None) -> int:
    startup = process_age()
    run = parse_args(argv)
    start_watchdog(Intervals.from_environ(os.environ).watchdog_look_seconds)
    if startup is not None:
        run.timings["startup"] = startup
    index, hosts = slice_host.slice_position()
    loop = WarmLoop.from_environ(hosts)
    if loop is not None:
        return loop.serve(run)
    code = run_task(run, index, hosts)[0]
    if hosts > 1 and code != EXIT_COMPLETED:
        leave_slice(code)
    return code


def leave_slice(code: int) -> None:
    """End a slice host whose attempt is over without JAX's shutdown barrier.

    At exit JAX shuts its distributed client down, which waits for every host
    to do the same; the other hosts of a failed attempt may be blocked in a
    collective and never get there. The task's logs and events are sent first,
    as Prefect's own exit handlers would.
    """
    telemetry_seconds = Intervals.from_environ(os.environ).telemetry_seconds
    if not prefect_process.send_logs_and_events(telemetry_seconds):
        log(f"some logs or events did not reach the API in {telemetry_seconds:g}s")
    flush_and_exit(code)
