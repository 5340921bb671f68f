"""The pod's place in a multi-host slice, and what the hosts other than host 0 do.

Every host of a slice runs the task function (SPMD). Host 0 runs it through
Prefect's engine and reports the task run (states, result, logs, the final-state
record); every other host calls the task's function directly, with the same
parameters, `KINETIC_OUTPUT_DIR` and hydrated Prefect context, but without the
engine and with logging to the Prefect API switched off, so the task run has one
history. A host other than 0 whose function raises exits non-zero, which ends the
whole attempt (one host lost is the attempt lost).

Before anything can touch JAX (unpickling the arguments, which may hold
`jax.Array`s, or importing the task's module), the slice is wired with
`jax.distributed.initialize` from the env the Job gives every host, so
collectives and Orbax multi-host checkpointing work across hosts: JAX refuses
to initialise its distributed runtime once a backend is up. `JaxImportWatch`
notes what imported JAX first if anything ever does so earlier, so that the
pod fails naming it instead of with JAX's own error.

Each host runs one attempt. Host 0's engine does not retry in the pod: an
exception it would retry ends the attempt of every host, and the runner
relaunches the whole slice (`docs/multihost.md`). Every host reads its attempt
from what the runner put in the payload and the env, so all agree on it.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kinetic_prefect.common.env import (
    COORDINATOR_ENV,
    HOST_INDEX_ENV,
    SLICE_HOSTS_ENV,
)


def slice_position() -> tuple[int, int]:
    """(this host's index, number of hosts); (0, 1) outside a slice."""
    hosts = int(os.environ.get(SLICE_HOSTS_ENV) or 1)
    index = int(os.environ.get(HOST_INDEX_ENV) or 0) if hosts > 1 else 0
    if not 0 <= index < hosts:
        raise ValueError(f"{HOST_INDEX_ENV}={index} is outside a slice of {hosts} hosts")
    return index, hosts


def coordinator_address() -> str:
    """The slice's coordinator (host 0), as the Job's env names it."""
    address = os.environ.get(COORDINATOR_ENV, "")
    if not address:
        raise ValueError(f"{COORDINATOR_ENV} is not set: the pod was not started as a slice host")
    return address


class JaxImportWatch(importlib.abc.MetaPathFinder):
    """Notes where JAX was first imported, while the slice is not yet connected.

    It only watches: the import goes on as usual, and `stop()` says where it
    happened (the innermost frame outside the import machinery, and
    the pod phase it happened in).
    """

    def __init__(self) -> None:
        self.phase = "start-up"
        self.first: str | None = None
        if "jax" in sys.modules or "jaxlib" in sys.modules:
            self.first = (
                "before the pod started (the interpreter's start-up imported it: "
                "sitecustomize, a .pth file or PYTHONSTARTUP)"
            )

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> None:
        if self.first is None and fullname.partition(".")[0] in ("jax", "jaxlib"):
            self.first = f"during the pod's {self.phase} phase, {_importer()}"
        return None

    @classmethod
    def start(cls) -> JaxImportWatch:
        watch = cls()
        sys.meta_path.insert(0, watch)
        return watch

    def stop(self) -> str | None:
        """Stop watching; where JAX was first imported (None: it was not)."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        return self.first


def _importer() -> str:
    """The code that imports: the innermost frame that is not the import machinery."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith("<frozen importlib") or frame.filename == __file__:
            continue
        line = f": {frame.line}" if frame.line else ""
        return f"at {frame.filename}:{frame.lineno} (in {frame.name}{line})"
    return "by the interpreter"


def initialize_distributed(index: int, hosts: int) -> None:
    """Connect this host to the slice's other hosts through jax.distributed."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        # CPU collectives across processes (local emulation of a slice).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address(),
        num_processes=hosts,
        process_id=index,
    )


def quiet_context(context: dict[str, Any]) -> dict[str, Any]:
    """The serialized Prefect context with logging to the API off (hosts other than 0)."""
    settings = context.get("settings_context", {}).get("settings")
    if isinstance(settings, dict):
        logging = settings.setdefault("logging", {})
        logging.setdefault("to_api", {})["enabled"] = False
    return context


# Prefect's documented way to give `prefect.runtime.task_run.run_count` a value outside a task run.
RUN_COUNT_ENV = "PREFECT__RUNTIME__TASK_RUN__RUN_COUNT"


def run_function(contents: dict[str, Any]) -> Any:
    """Call the task's function with the payload's parameters, without Prefect's engine.

    `prefect.runtime.task_run.run_count` says the run host 0's engine is in:
    the run count the runner put in the payload, plus this run.
    """
    from prefect.context import hydrated_context
    from prefect.utilities.callables import parameters_to_args_kwargs

    os.environ[RUN_COUNT_ENV] = str(contents["task_run"].run_count + 1)
    task = contents["task"]
    args, kwargs = parameters_to_args_kwargs(task.fn, contents["parameters"])
    with hydrated_context(quiet_context(contents["context"])):
        if task.isasync:
            import asyncio

            return asyncio.run(task.fn(*args, **kwargs))
        return task.fn(*args, **kwargs)
