"""Pretrain, then fine-tune from the pretrain's checkpoint, then evaluate: checkpoints across tasks.

`pretrain` fits a small two-layer model with Adam-style momentum, saving an Orbax
checkpoint every step, and returns a `Checkpoint` of its last step. Each
`finetune` (mapped over learning rates, each in a pod of its own) restores only
the parameters from it (a partial restore: the optimizer state is left behind and
starts fresh), trains on a shifted target and saves its own checkpoints in its own
output dir. `evaluate` restores each fine-tune's checkpoint and ranks them. In the
Prefect UI each checkpoint is an asset, materialized by the task that returned it
and referenced by the tasks that read it.

    python flows/pretrain_finetune.py
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task
from prefect.utilities.annotations import unmapped

from kinetic_prefect import Checkpoint, KineticTaskRunner, checkpoint_manager

FEATURES = 8


def _data(shift: float) -> tuple[Any, Any]:
    import jax
    import jax.numpy as jnp

    x = jax.random.normal(jax.random.PRNGKey(0), (256, FEATURES))
    y = jnp.sin(x.sum(axis=1)) + shift
    return x, y


def _init_params() -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    return {
        "w1": jax.random.normal(k1, (FEATURES, 16)) * 0.3,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16,)) * 0.3,
        "b2": jnp.zeros(()),
    }


def _loss(params: dict[str, Any], x: Any, y: Any) -> Any:
    import jax.numpy as jnp

    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


def _train(
    params: dict[str, Any], momentum: dict[str, Any], steps: range, lr: float, shift: float
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Gradient descent with momentum; saves `{"params", "opt"}` at every step."""
    import jax
    import orbax.checkpoint as ocp

    x, y = _data(shift)
    grad = jax.jit(jax.value_and_grad(_loss))
    manager = checkpoint_manager(total_steps=steps.stop, max_to_keep=3)
    value = _loss(params, x, y)
    for step in steps:
        value, grads = grad(params, x, y)
        momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, momentum, grads)
        params = jax.tree_util.tree_map(lambda p, m: p - lr * m, params, momentum)
        manager.save(step, args=ocp.args.StandardSave({"params": params, "opt": momentum}))
    manager.wait_until_finished()
    return params, momentum, float(value)


@task
def pretrain(steps: int = 5, lr: float = 0.05) -> Checkpoint:
    """Train from scratch; the returned `Checkpoint` is the last saved step."""
    import jax

    params = _init_params()
    momentum = jax.tree_util.tree_map(lambda p: p * 0, params)
    _, _, loss = _train(params, momentum, range(steps), lr, shift=0.0)
    get_run_logger().info("pretrain loss %.4f", loss)
    return Checkpoint.latest()


@task
def finetune(base: Checkpoint, lr: float, steps: int = 5) -> Checkpoint:
    """Start from `base`'s parameters with a fresh optimizer; save in this task's own dir."""
    import jax

    params = base.restore({"params": _init_params()}, partial=True)["params"]
    momentum = jax.tree_util.tree_map(lambda p: p * 0, params)
    _, _, loss = _train(params, momentum, range(steps), lr, shift=0.5)
    get_run_logger().info(
        "fine-tune lr=%g from %s step %s: loss %.4f", lr, base.uri, base.step, loss
    )
    return Checkpoint.latest()


@task
def evaluate(candidates: list[Checkpoint], lrs: list[float]) -> list[dict[str, Any]]:
    """Each fine-tune's loss on the shifted target, best first."""
    x, y = _data(shift=0.5)
    scored = []
    for lr, candidate in zip(lrs, candidates, strict=True):
        params = candidate.restore({"params": _init_params()}, partial=True)["params"]
        scored.append({"lr": lr, "loss": float(_loss(params, x, y)), "checkpoint": candidate.uri})
    return sorted(scored, key=lambda row: row["loss"])


@flow(name="pretrain-finetune", task_runner=KineticTaskRunner(), log_prints=True)
def pretrain_finetune(
    lrs: tuple[float, ...] = (0.01, 0.03, 0.1), steps: int = 5
) -> list[dict[str, Any]]:
    """Pretrain once, fine-tune per learning rate from its checkpoint, then evaluate."""
    base = pretrain.submit(steps=steps)
    tuned = finetune.map(unmapped(base), list(lrs), steps=steps)
    ranked = evaluate.submit(tuned, list(lrs)).result()
    for row in ranked:
        print(f"lr={row['lr']:g}: loss {row['loss']:.4f}")
    return ranked


if __name__ == "__main__":
    pretrain_finetune()
