"""The pod process: its arguments, the watchdog, then one task run (or, warm, one after another).

`python -m kinetic_prefect.pod` and the local backend's forked pods both start here.
"""

from __future__ import annotations

from kinetic_prefect.pod import slice as slice_host
from kinetic_prefect.pod.runner import parse_args, process_age, run_task
from kinetic_prefect.pod.warm import WarmLoop
from kinetic_prefect.pod.watchdog import start_watchdog


def main(argv: list[str] | None = None) -> int:
    startup = process_age()
    run = parse_args(argv)
    start_watchdog()
    if startup is not None:
        run.timings["startup"] = startup
    index, hosts = slice_host.slice_position()
    loop = WarmLoop.from_environ(hosts)
    if loop is not None:
        return loop.serve(run)
    return run_task(run, index, hosts)[0]
