"""Ending the pod process without tearing the interpreter down.

With Prefect, JAX and the task's modules loaded, CPython's own teardown
(clearing thousands of modules, finalizing their objects) takes longer than
most trivial tasks. By the time the last exit handler runs, the work that
matters is done: non-daemon threads were joined, Prefect's log and event
workers drained everything pending, every other `atexit` handler ran. What is
left is flushing files nobody closed, done here before the process ends with
the pod's exit code.
"""

from __future__ import annotations

import atexit
import gc
import io
import os

_BUFFERED = (io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair, io.TextIOWrapper)


class FastExit:
    """Registered first, so its handler runs after every other `atexit` handler."""

    def __init__(self) -> None:
        self.code: int | None = None
        atexit.register(self._exit)

    def _exit(self) -> None:
        if self.code is None:  # main did not return: let the interpreter report it
            return
        flush_and_exit(self.code)


def buffered_files() -> list[io.IOBase]:
    """Every buffered file object alive in the process.

    Matched on `type(obj)`, which reads no attribute of the object: `isinstance` asks for
    `obj.__class__`, and on a lazily imported module (`importlib.util.LazyLoader`, as
    Prefect loads some of its optional dependencies) that imports the whole module, in
    every pod, at its very end.
    """
    gc.unfreeze()  # `gc.get_objects` leaves frozen objects out (`runner.start_collecting`)
    return [obj for obj in gc.get_objects() if issubclass(type(obj), _BUFFERED)]


def flush_and_exit(code: int) -> None:
    """Flush every open file, then end the process with `code`, running nothing else."""
    for obj in buffered_files():
        try:
            if not obj.closed:
                obj.flush()
        except Exception:  # a file whose flush fails would fail at teardown too
            continue
    os._exit(code)
