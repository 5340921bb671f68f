"""Checkpointed training that survives its pod being killed.

The task fits a linear model with JAX, saving an Orbax checkpoint every step
into its `KINETIC_OUTPUT_DIR`. With `interrupt_at`, the first attempt kills its
own pod (SIGKILL, like a preemption) at that step; the runner records the task
run AwaitingRetry, launches a new pod for the same task run, and training resumes
from the last checkpoint instead of step 0. Progress shows in the Prefect UI as
a progress artifact that advances with each checkpoint.

    python flows/checkpointed_training.py
"""

from __future__ import annotations

import os
import signal
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.runtime import task_run

from kinetic_prefect import KineticTaskRunner, checkpoint_manager, output_dir


@task(retries=1)
def fit_linear(steps: int = 40, interrupt_at: int | None = 15, lr: float = 0.1) -> dict[str, Any]:
    """Fit y = 3x - 1 by gradient descent, resuming from the latest checkpoint."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    logger = get_run_logger()
    x = jnp.linspace(-1.0, 1.0, 256)
    y = 3.0 * x - 1.0
    manager = checkpoint_manager(total_steps=steps, max_to_keep=2)
    template = {"w": jnp.zeros(()), "b": jnp.zeros(())}
    latest = manager.latest_step()
    params = (
        template
        if latest is None
        else manager.restore(latest, args=ocp.args.StandardRestore(template))
    )
    start = 0 if latest is None else latest + 1
    logger.info("Starting at step %d (output dir %s)", start, output_dir())

    def loss(p: dict[str, Any]) -> Any:
        return jnp.mean((p["w"] * x + p["b"] - y) ** 2)

    grad = jax.jit(jax.value_and_grad(loss))
    value = loss(params)
    for step in range(start, steps):
        value, grads = grad(params)
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
        manager.save(step, args=ocp.args.StandardSave(params))
        manager.wait_until_finished()
        if step == interrupt_at and task_run.run_count == 1:
            logger.warning("Simulating a preemption at step %d", step)
            os.kill(os.getpid(), signal.SIGKILL)
    return {
        "resumed_from": start,
        "w": float(params["w"]),
        "b": float(params["b"]),
        "loss": float(value),
    }


@flow(name="checkpointed-training", task_runner=KineticTaskRunner(), log_prints=True)
def checkpointed_training(steps: int = 40, interrupt_at: int | None = 15) -> dict[str, Any]:
    """Train once; the first pod is killed mid-way and the retry resumes from its checkpoint."""
    result = fit_linear.submit(steps=steps, interrupt_at=interrupt_at).result()
    print(f"resumed from step {result['resumed_from']}; w={result['w']:.3f} b={result['b']:.3f}")
    return result


if __name__ == "__main__":
    checkpointed_training()
