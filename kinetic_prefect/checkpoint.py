"""`output_dir()` and `checkpoint_manager()`: durable outputs that outlive a pod.

In a pod, `KINETIC_OUTPUT_DIR` is the task run's own prefix, the same for every
attempt, so a retried or relaunched task finds its checkpoints. Outside a pod
(a plain local call, a notebook) both fall back to a local directory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

LOCAL_FALLBACK_ROOT = Path(".kinetic") / "outputs" / "local"


def output_dir() -> str:
    """This task run's output directory: `$KINETIC_OUTPUT_DIR`, or a local fallback.

    Example:
        ```python
        @task
        def train(cfg):
            Path(output_dir(), "metrics.json").write_text(json.dumps(metrics))
        ```
    """
    configured = os.environ.get("KINETIC_OUTPUT_DIR")
    if configured:
        return configured
    from prefect.context import TaskRunContext

    context = TaskRunContext.get()
    name = context.task.name if context else "default"
    directory = (LOCAL_FALLBACK_ROOT / name).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    return str(directory)


def checkpoint_dir() -> str:
    """Where `checkpoint_manager()` keeps checkpoints: `{output_dir()}/checkpoints`."""
    root = output_dir()
    if "://" in root:
        return root.rstrip("/") + "/checkpoints"
    return str(Path(root).absolute() / "checkpoints")


def checkpoint_manager(**options: Any) -> Any:
    """An Orbax `CheckpointManager` at `{output_dir()}/checkpoints` (local or `gs://`).

    Keyword arguments are `orbax.checkpoint.CheckpointManagerOptions` fields
    (`max_to_keep`, `save_interval_steps`, ...).

    Example:
        ```python
        mngr = checkpoint_manager(max_to_keep=2)
        start = (mngr.latest_step() or -1) + 1
        state = mngr.restore(mngr.latest_step()) if start else init_state()
        for step in range(start, steps):
            state = update(state)
            mngr.save(step, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        ```
    """
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(checkpoint_dir(), options=ocp.CheckpointManagerOptions(**options))
