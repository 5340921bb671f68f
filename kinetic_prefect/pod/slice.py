"""The pod's place in a multi-host slice, and what the hosts other than host 0 do.

Every host of a slice runs the task function (SPMD). Host 0 runs it through
Prefect's engine and reports the task run (states, result, logs, the final-state
record); every other host calls the task's function directly, with the same
parameters, `KINETIC_OUTPUT_DIR` and hydrated Prefect context, but without the
engine and with logging to the Prefect API switched off, so the task run has one
history. A host other than 0 whose function raises exits non-zero, which ends the
whole attempt (one host lost is the attempt lost).

Before the task runs, the slice is wired with `jax.distributed.initialize` from
the env the Job gives every host, so collectives and Orbax multi-host
checkpointing work across hosts.
"""

from __future__ import annotations

import os
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


def initialize_distributed(index: int, hosts: int) -> None:
    """Connect this host to the slice's other hosts through jax.distributed."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        # CPU collectives across processes (local emulation of a slice).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ[COORDINATOR_ENV],
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


def run_function(contents: dict[str, Any]) -> Any:
    """Call the task's function with the payload's parameters, without Prefect's engine."""
    from prefect.context import hydrated_context
    from prefect.utilities.callables import parameters_to_args_kwargs

    task = contents["task"]
    args, kwargs = parameters_to_args_kwargs(task.fn, contents["parameters"])
    with hydrated_context(quiet_context(contents["context"])):
        if task.isasync:
            import asyncio

            return asyncio.run(task.fn(*args, **kwargs))
        return task.fn(*args, **kwargs)
