"""Run Prefect tasks and flows in Kinetic accelerator pods.

Example:
    ```python
    from prefect import flow, task
    from kinetic_prefect import KineticTaskRunner

    @task
    def square(x: int) -> int:
        return x * x

    @flow(task_runner=KineticTaskRunner(accelerator="cpu"))
    def squares(n: int) -> list[int]:
        return [f.result() for f in square.map(range(n))]
    ```
"""

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "Data",
    "KineticCluster",
    "KineticFuture",
    "KineticGcpCredentials",
    "KineticTaskRunner",
    "checkpoint_manager",
    "output_dir",
    "report_progress",
    "resources",
    "summarize_sweep",
]

_LAZY = {
    "KineticTaskRunner": "kinetic_prefect.runner.task_runner",
    "KineticFuture": "kinetic_prefect.runner.task_runner",
    "resources": "kinetic_prefect.launch.settings",
    "Data": "kinetic_prefect.data.data",
    "report_progress": "kinetic_prefect.outputs.reporting",
    "summarize_sweep": "kinetic_prefect.outputs.reporting",
    "output_dir": "kinetic_prefect.outputs.checkpoint",
    "checkpoint_manager": "kinetic_prefect.outputs.checkpoint",
    "Checkpoint": "kinetic_prefect.outputs.checkpoint",
    "KineticCluster": "kinetic_prefect.blocks.cluster",
    "KineticGcpCredentials": "kinetic_prefect.blocks.credentials",
}


def __dir__() -> list[str]:
    # `prefect block register -m kinetic_prefect` finds blocks with dir(): list the lazy names.
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    # Imports are lazy so that `python -m kinetic_prefect.pod` and the CLI start fast.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kinetic_prefect' has no attribute {name!r}")
