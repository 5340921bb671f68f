"""What a run shows in the Prefect UI: training progress and sweep summaries.

`report_progress(step, total)` keeps one progress artifact per task run up to
date. `summarize_sweep(...)` ends a sweep with a table artifact of metrics per
configuration and a loss-curve plot (PNG) saved in the run's output dir and
linked from a markdown artifact.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping, Sequence
from typing import Any
from uuid import UUID

from prefect.logging import get_logger

from kinetic_prefect.common.env import OUTPUT_DIR_ENV

logger = get_logger("kinetic_prefect.outputs.reporting")

_progress_lock = threading.Lock()
# The progress artifact of each task run in this process (a pod runs one task run).
_progress_artifacts: dict[UUID, UUID] = {}


def report_progress(step: int, total: int) -> float | None:
    """Advance the current task run's progress artifact to `step / total`.

    Outside a task run it does nothing and returns None.

    Example:
        ```python
        for step in range(steps):
            train_step()
            report_progress(step + 1, steps)
        ```
    """
    from prefect.artifacts import create_progress_artifact, update_progress_artifact
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    if context is None or total <= 0:
        return None
    progress = max(0.0, min(100.0, 100.0 * step / total))
    with _progress_lock:
        artifact_id = _progress_artifacts.get(context.task_run.id)
        if artifact_id is None:
            created = create_progress_artifact(
                progress=progress, description=f"Training progress of {context.task_run.name}"
            )
            _progress_artifacts[context.task_run.id] = UUID(str(created))
        else:
            update_progress_artifact(artifact_id=artifact_id, progress=progress)
    return progress


def plot_curves(curves: Mapping[str, Sequence[float]], title: str = "Training loss") -> bytes:
    """A PNG line plot with one curve per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    for label, values in curves.items():
        axes.plot(range(len(values)), list(values), label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(title)
    axes.legend(fontsize="small")
    axes.grid(alpha=0.3)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def run_output_dir() -> str:
    """Where a flow run keeps its own outputs: `$KINETIC_OUTPUT_DIR` in a flow pod,
    else `.kinetic/outputs/{flow_run_id}/flow` next to the flow."""
    import os
    from pathlib import Path

    from prefect.runtime import flow_run

    configured = os.environ.get(OUTPUT_DIR_ENV)
    if configured:
        return configured
    return str(Path(".kinetic", "outputs", str(flow_run.id or "no-flow-run"), "flow").absolute())


def summarize_sweep(
    rows: Sequence[Mapping[str, Any]],
    curves: Mapping[str, Sequence[float]] | None = None,
    key: str = "sweep-metrics",
) -> str | None:
    """Publish a sweep's metrics table and loss curves; returns where the plot was saved.

    Example:
        ```python
        summarize_sweep(
            [{"lr": 0.1, "loss": 0.2}, {"lr": 0.3, "loss": 0.1}],
            curves={"lr=0.1": losses_a, "lr=0.3": losses_b},
        )
        ```
    """
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from kinetic_prefect.common.storage import write_uri

    create_table_artifact(
        table=[dict(row) for row in rows], key=key, description="Metrics per configuration"
    )
    if not curves:
        return None
    location = f"{run_output_dir().rstrip('/')}/loss-curves.png"
    if "://" not in location:
        from pathlib import Path

        Path(location).parent.mkdir(parents=True, exist_ok=True)
    write_uri(location, plot_curves(curves))
    link = location if "://" in location else f"file://{location}"
    create_markdown_artifact(
        markdown=f"### Loss curves\n\n[{location}]({link})\n\n"
        f"One curve per configuration, saved in the run's output dir.",
        key=f"{key}-plot",
        description="Loss curves of the sweep",
    )
    logger.info("Loss curves saved to %s", location)
    return location
