"""Each test's CPU, with everything it started: `pytest -p tests.support.cpu_accounting`.

Not loaded by default. Each pytest worker writes one JSON line per test to
`$KP_CPU_ACCOUNTING` (default `cpu-accounting.jsonl`): the test's wall time, the worker's
own CPU seconds, and those of every process below the worker (servers, pods, CLI
processes), counted from /proc as utime + stime of the live ones plus what reaped
children left in their parents' cutime and cstime. A process that leaves the worker's
tree (a daemon re-parented to init) is not counted. Only xdist workers write, so the
controller's view of all workers at once is never mixed in.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_started: dict[str, tuple[float, float, float]] = {}


def _descendants_cpu(root: int) -> float:
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        fields = text[text.rfind(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
        cpu[int(entry)] = sum(int(f) for f in fields[11:15]) / _TICK
    total, todo = 0.0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, []))
    return total


def _now() -> tuple[float, float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    below = _descendants_cpu(os.getpid()) + reaped.ru_utime + reaped.ru_stime
    return time.monotonic(), own.ru_utime + own.ru_stime, below


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _started[nodeid] = _now()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    if nodeid not in _started:
        return
    (wall0, own0, below0), (wall1, own1, below1) = _started.pop(nodeid), _now()
    record = {
        "test": nodeid,
        "worker": os.environ["PYTEST_XDIST_WORKER"],
        "wall": round(wall1 - wall0, 2),
        "own_cpu": round(own1 - own0, 2),
        "children_cpu": round(below1 - below0, 2),
    }
    with open(os.environ.get("KP_CPU_ACCOUNTING", "cpu-accounting.jsonl"), "a") as out:
        out.write(json.dumps(record) + "\n")
