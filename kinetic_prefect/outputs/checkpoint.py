"""`output_dir()` and `checkpoint_manager()`: durable outputs that outlive a pod.

In a pod, `KINETIC_OUTPUT_DIR` is the task run's own prefix, the same for every
attempt, so a retried or relaunched task finds its checkpoints. Outside a pod
(a plain local call, a notebook) both fall back to a local directory.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

from kinetic_prefect.common.env import OUTPUT_DIR_ENV, TERMINATION_GRACE_ENV

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
    configured = os.environ.get(OUTPUT_DIR_ENV)
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


def checkpoint_manager(
    total_steps: int | None = None, save_on_preemption: bool = False, **options: Any
) -> Any:
    """An Orbax `CheckpointManager` at `{output_dir()}/checkpoints` (local or `gs://`).

    Keyword arguments are `orbax.checkpoint.CheckpointManagerOptions` fields
    (`max_to_keep`, `save_interval_steps`, ...). With `total_steps`, each save of
    step `s` also advances the task run's progress artifact to `(s + 1) / total_steps`.

    With `save_on_preemption=True`, a SIGTERM (spot reclaim, eviction, node drain)
    does not end the pod at once: the next `save()` is written even off its
    interval, waited for, and then the pod ends as preempted, so the relaunched pod
    resumes from that step. Without a save within `KINETIC_TERMINATION_GRACE_SECONDS`
    (default 25, inside Kubernetes' 30 s grace) the pod ends anyway.

    Example:
        ```python
        mngr = checkpoint_manager(total_steps=steps, max_to_keep=2)
        start = (mngr.latest_step() or -1) + 1
        state = mngr.restore(mngr.latest_step()) if start else init_state()
        for step in range(start, steps):
            state = update(state)
            mngr.save(step, args=ocp.args.StandardSave(state))
        mngr.wait_until_finished()
        ```
    """
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(
        checkpoint_dir(), options=ocp.CheckpointManagerOptions(**options)
    )
    if total_steps is not None:
        _report_progress_on_save(manager, total_steps)
    if save_on_preemption and os.environ.get(OUTPUT_DIR_ENV):
        _save_then_leave_on_sigterm(manager)
    return manager


def _leave_as_preempted() -> None:
    # Die by SIGTERM, as the infrastructure meant: the runner relaunches on its own budget.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _save_then_leave_on_sigterm(manager: Any) -> None:
    requested = threading.Event()
    grace = float(os.environ.get(TERMINATION_GRACE_ENV, "25"))

    def on_sigterm(signum: int, frame: Any) -> None:
        requested.set()
        timer = threading.Timer(grace, _leave_as_preempted)
        timer.daemon = True
        timer.start()

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: SIGTERM keeps its default action
        return
    save = manager.save

    def save_or_leave(step: int, *args: Any, **kwargs: Any) -> bool:
        if not requested.is_set():
            return bool(save(step, *args, **kwargs))
        kwargs["force"] = True
        saved = bool(save(step, *args, **kwargs))
        manager.wait_until_finished()
        _leave_as_preempted()
        return saved

    manager.save = save_or_leave


def _report_progress_on_save(manager: Any, total_steps: int) -> None:
    # Orbax's constructor may hand back its own implementation class, so the
    # instance's save is wrapped rather than subclassed.
    from kinetic_prefect.outputs.reporting import report_progress

    save = manager.save

    def save_and_report(step: int, *args: Any, **kwargs: Any) -> bool:
        saved = bool(save(step, *args, **kwargs))
        if saved:
            report_progress(step + 1, total_steps)
        return saved

    manager.save = save_and_report
