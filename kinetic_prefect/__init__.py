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

from typing import TYPE_CHECKING

from kinetic_prefect.common.lazy import lazy_names

if TYPE_CHECKING:
    from kinetic_prefect.blocks.cluster import KineticCluster
    from kinetic_prefect.blocks.credentials import KineticGcpCredentials
    from kinetic_prefect.data.data import Data
    from kinetic_prefect.launch.settings import resources
    from kinetic_prefect.outputs.checkpoint import Checkpoint, checkpoint_manager, output_dir
    from kinetic_prefect.outputs.reporting import report_progress, summarize_sweep
    from kinetic_prefect.runner.task_runner import KineticFuture, KineticTaskRunner

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


# Imports are lazy so that `python -m kinetic_prefect.pod` and the CLI start fast.
__dir__, __getattr__ = lazy_names(__name__, _LAZY)
