"""Checkpoints that outlive a pod: `output_dir()`, `checkpoint_manager()` and `Checkpoint`.

In a pod, `KINETIC_OUTPUT_DIR` is the task run's own prefix, the same for every
attempt, so a retried or relaunched task finds its checkpoints. Outside a pod
(a plain local call, a notebook) both fall back to a local directory.

`Checkpoint` is a small, picklable reference to an Orbax checkpoint directory
(and a step) that a task returns to hand its checkpoint downstream: the next task
takes it as an argument, so Prefect's dependency tracking, caching and retries
apply as to any other value. It reads only: a downstream task restores from it
and writes its own checkpoints in its own `output_dir()`. In the Prefect UI the
checkpoint is an asset (its URI is the key), materialized by the task that
returned it and referenced by the tasks that read it.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kinetic_prefect.common.env import OUTPUT_DIR_ENV
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.errors import CheckpointError

LOCAL_FALLBACK_ROOT = Path(".kinetic") / "outputs" / "local"
# The default output root outside a pod (a local runner's `{jobs root}/outputs`).
LOCAL_OUTPUT_ROOT = Path(".kinetic") / "outputs"
CHECKPOINTS = "checkpoints"
# The item a checkpoint saved without `ocp.args.Composite` is stored under.
DEFAULT_ITEM = "default"


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
    return _join(output_dir(), CHECKPOINTS)


def _join(root: str, *parts: str) -> str:
    if "://" in root:
        return "/".join([root.rstrip("/"), *parts])
    return str(Path(root).absolute().joinpath(*parts))


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
    (default 10, inside the 15 s GKE gives a pod on a reclaimed Spot VM) the pod ends
    anyway.

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
    grace = Intervals.from_environ(os.environ).emergency_window_seconds

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


@dataclass(frozen=True)
class Checkpoint:
    """A reference to an Orbax checkpoint directory and one of its steps (None: the latest).

    Return one from a task to hand its checkpoint to the tasks that take it; they
    restore from it and write their own checkpoints elsewhere.

    Example:
        ```python
        @task
        def pretrain() -> Checkpoint:
            mngr = checkpoint_manager()
            ...  # mngr.save(step, args=ocp.args.StandardSave(state))
            mngr.wait_until_finished()
            return Checkpoint.latest()

        @task
        def finetune(base: Checkpoint, lr: float) -> float:
            params = base.restore({"params": init_params()}, partial=True)["params"]
            ...  # train with a fresh optimizer, saving to this task's own checkpoint_manager()
        ```
    """

    directory: str
    step: int | None = None

    @classmethod
    def latest(cls) -> Checkpoint:
        """This task run's newest saved step (`checkpoint_manager()`'s directory)."""
        checkpoint = cls(checkpoint_dir())
        found = checkpoint.at(checkpoint.resolved_step())
        _record_asset("prefect.asset.materialization.succeeded", found.uri)
        return found

    @classmethod
    def of_task(
        cls, flow_run_id: object, task_key: str, output_root: str | None = None
    ) -> Checkpoint:
        """The checkpoints of task `task_key` (`KineticFuture.task_key`) of an earlier flow run.

        `output_root` is the runner's output root; by default the one this task run
        writes under (in a pod), else the local runner's `.kinetic/outputs`.
        """
        root = output_root or _current_output_root()
        return cls(_join(root, str(flow_run_id), task_key, CHECKPOINTS))

    @property
    def uri(self) -> str:
        """The directory as an asset key: `gs://...` or `file:///...`."""
        if "://" in self.directory:
            return self.directory.rstrip("/")
        return Path(self.directory).absolute().as_uri()

    def at(self, step: int) -> Checkpoint:
        """The same directory at `step`."""
        return Checkpoint(self.directory, step)

    def steps(self) -> list[int]:
        """The steps saved in the directory, oldest first."""
        _record_asset("prefect.asset.referenced", self.uri)
        return sorted(self._manager().all_steps())

    def manager(self) -> Any:
        """A read-only Orbax `CheckpointManager` over the directory: saving does nothing."""
        _record_asset("prefect.asset.referenced", self.uri)
        return self._manager()

    def resolved_step(self) -> int:
        """`step`, checked to exist; the latest step when `step` is None."""
        steps = sorted(self._manager().all_steps())
        if not steps:
            raise CheckpointError(
                f"No checkpoint step in {self.directory}: nothing was saved there (or it is "
                "not an Orbax checkpoint directory). Save with checkpoint_manager() in the "
                "task that returns the Checkpoint, and wait_until_finished() before returning."
            )
        if self.step is None:
            return steps[-1]
        if self.step not in steps:
            raise CheckpointError(
                f"No step {self.step} in {self.directory}; the steps there are {steps}."
            )
        return self.step

    def restore(self, template: Any = None, partial: bool = False) -> Any:
        """The saved pytree at `step` (the latest when None).

        With a `template` the leaves are restored as the template's (types, shapes,
        dtypes, sharding); with `partial=True` only the leaves present in the template
        are read, e.g. the parameters without the optimizer state. A checkpoint saved
        as several items (`ocp.args.Composite`) restores to a dict of items, and its
        template is a dict of the items to restore.
        """
        import orbax.checkpoint as ocp

        _record_asset("prefect.asset.referenced", self.uri)
        step = self.resolved_step()
        manager = self._manager()
        items = self._items(step)
        single = items == [DEFAULT_ITEM]
        if template is None:
            restored = manager.restore(step)
            return restored if single else dict(restored.items())
        if single:
            _check_template(template, self._saved_tree(step), partial, self.directory)
            return manager.restore(
                step, args=ocp.args.PyTreeRestore(item=template, partial_restore=partial)
            )
        if not isinstance(template, dict) or not set(template) <= set(items):
            raise CheckpointError(
                f"{self.directory} step {step} holds the items {items}: pass a dict of "
                "templates keyed by the items to restore."
            )
        args = {}
        for name, item_template in template.items():
            saved = self._saved_tree(step, name)
            _check_template(item_template, saved, partial, self.directory, name)
            args[name] = ocp.args.PyTreeRestore(item=item_template, partial_restore=partial)
        return dict(manager.restore(step, args=ocp.args.Composite(**args)).items())

    def _items(self, step: int) -> list[str]:
        """The items a step holds: `default` for a single tree, else the Composite's names."""
        from etils import epath

        step_dir = epath.Path(self.directory) / str(step)
        return sorted(p.name for p in step_dir.iterdir() if p.is_dir())

    def _saved_tree(self, step: int, item: str = DEFAULT_ITEM) -> Any:
        """The saved tree's structure (array metadata at its leaves), read without the arrays."""
        import orbax.checkpoint as ocp
        from etils import epath

        path = epath.Path(self.directory) / str(step) / item
        try:
            return ocp.PyTreeCheckpointHandler().metadata(path).tree
        except Exception as exc:
            raise CheckpointError(
                f"Item {item!r} of {self.directory} step {step} is not a saved pytree ({exc}); "
                "restore it without a template."
            ) from exc

    def metadata(self) -> dict[str, Any]:
        """The step's custom metadata and metrics, as `CheckpointManager.save` stored them."""
        step = self.resolved_step()
        stored = self._manager().metadata(step)
        return {
            "custom_metadata": dict(getattr(stored, "custom_metadata", None) or {}),
            "metrics": dict(getattr(stored, "metrics", None) or {}),
        }

    def _manager(self) -> Any:
        import orbax.checkpoint as ocp

        return ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(read_only=True)
        )


def _current_output_root() -> str:
    # KINETIC_OUTPUT_DIR is {output root}/{flow run id}/{task key}.
    configured = os.environ.get(OUTPUT_DIR_ENV)
    if configured:
        return configured.rstrip("/").rsplit("/", 2)[0]
    return str(LOCAL_OUTPUT_ROOT.absolute())


def _paths(tree: Any) -> Iterator[str]:
    import jax

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    for path, _leaf in leaves:
        yield "/".join(_key_name(k) for k in path)


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _check_template(
    template: Any, saved: Any, partial: bool, directory: str, item: str | None = None
) -> None:
    """Refuse a template whose leaves the checkpoint does not have, naming the first."""
    where = f"{directory}" + (f" (item {item!r})" if item else "")
    saved_paths = list(_paths(saved))
    template_paths = list(_paths(template))
    missing = next((p for p in template_paths if p not in saved_paths), None)
    if missing is not None:
        raise CheckpointError(
            f"The template's leaf {missing!r} is not in the checkpoint at {where}; "
            f"the checkpoint has {saved_paths[:10]}{' ...' if len(saved_paths) > 10 else ''}."
        )
    if not partial:
        extra = next((p for p in saved_paths if p not in template_paths), None)
        if extra is not None:
            raise CheckpointError(
                f"The checkpoint at {where} has {extra!r}, which the template lacks; add it "
                "to the template, or restore with partial=True to read only the template's "
                "leaves."
            )


_recorded: set[tuple[str, str, str]] = set()


def _record_asset(event: str, key: str) -> None:
    """Record the checkpoint as an asset of the current task run (once per run and key)."""
    from prefect.context import TaskRunContext
    from prefect.events import emit_event

    context = TaskRunContext.get()
    if context is None:
        return
    seen = (event, key, str(context.task_run.id))
    if seen in _recorded:
        return
    _recorded.add(seen)
    emit_event(
        event=event,
        resource={"prefect.resource.id": key, "prefect.resource.name": key},
        related=[
            {
                "prefect.resource.id": f"prefect.task-run.{context.task_run.id}",
                "prefect.resource.role": "task-run",
                "prefect.resource.name": context.task_run.name,
            }
        ],
    )
