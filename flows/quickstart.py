"""Quickstart: a small JAX hyperparameter sweep where every trial runs in its own Kinetic pod.

The flow `quickstart-sweep` maps the task `train` over four configurations
(learning rate x hidden width). `KineticTaskRunner` launches each task run in a
separate pod — on the default local backend, a separate Python process — and
the flow gathers the metrics each pod reports and prints them as a table,
followed by where to find the runs in the Prefect UI.

Each trial trains a one-hidden-layer MLP with plain `jax.grad` and minibatch SGD
on a "two moons" dataset generated in code (fixed seed, nothing downloaded), and
reports its initial and final training loss and its accuracy on a held-out split.
Only the pods import JAX; the flow process never does.

Run it with `make demo`: it starts a local Prefect server (http://127.0.0.1:4200,
kept for the UI until `make demo-stop`) and runs this script against it. Run
directly, `python flows/quickstart.py` uses the server `PREFECT_API_URL` names,
or a temporary one that Prefect starts (and stops) when none is set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prefect import flow, task
from prefect.runtime import flow_run
from prefect.settings import get_current_settings
from prefect.utilities.annotations import unmapped

from kinetic_prefect import KineticTaskRunner, summarize_sweep

DEFAULT_CONFIGS: list[dict[str, Any]] = [
    {"lr": 0.03, "hidden": 8},
    {"lr": 0.3, "hidden": 8},
    {"lr": 0.3, "hidden": 32},
    {"lr": 1.0, "hidden": 32},
]
DATASET_SIZE = 1000
HELD_OUT_FRACTION = 0.2
BATCH_SIZE = 64
CURVE_POINTS = 60


def make_moons(seed: int, n: int = DATASET_SIZE, noise: float = 0.15) -> tuple[Any, Any]:
    """Two interleaving half circles with Gaussian noise: features (n, 2) and 0/1 labels (n,)."""
    import jax
    import jax.numpy as jnp

    angle_key, noise_key, shuffle_key = jax.random.split(jax.random.PRNGKey(seed), 3)
    labels = jnp.arange(n) % 2
    angles = jax.random.uniform(angle_key, (n,), maxval=jnp.pi)
    upper = jnp.stack([jnp.cos(angles), jnp.sin(angles)], axis=1)
    lower = jnp.stack([1.0 - jnp.cos(angles), 0.5 - jnp.sin(angles)], axis=1)
    features = jnp.where(labels[:, None] == 0, upper, lower)
    features = features + noise * jax.random.normal(noise_key, features.shape)
    order = jax.random.permutation(shuffle_key, n)
    return features[order], labels[order]


@task(name="train")
def train(config: dict[str, Any], steps: int = 300, seed: int = 0) -> dict[str, Any]:
    """Train a 2 -> hidden -> 1 tanh MLP with SGD; return its metrics."""
    import jax
    import jax.numpy as jnp

    started = time.perf_counter()
    lr, hidden = float(config["lr"]), int(config["hidden"])
    features, labels = jax.jit(make_moons, static_argnames=("n", "noise"))(seed)
    n_test = int(len(labels) * HELD_OUT_FRACTION)
    x_train, y_train = features[n_test:], labels[n_test:]
    x_test, y_test = features[:n_test], labels[:n_test]

    init_key, batch_key = jax.random.split(jax.random.PRNGKey(seed + 1))
    w1_key, w2_key = jax.random.split(init_key)
    params = {
        "w1": jax.random.normal(w1_key, (2, hidden)) / jnp.sqrt(2.0),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(w2_key, (hidden,)) / jnp.sqrt(hidden),
        "b2": jnp.zeros(()),
    }

    def logits(p: dict[str, Any], x: Any) -> Any:
        return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def loss(p: dict[str, Any], x: Any, y: Any) -> Any:
        z = logits(p, x)
        # Binary cross-entropy on logits, written to stay finite for large |z|.
        return jnp.mean(jnp.logaddexp(0.0, z) - y * z)

    def sgd_step(p: dict[str, Any], key: Any) -> tuple[dict[str, Any], Any]:
        batch = jax.random.choice(key, len(y_train), (BATCH_SIZE,), replace=False)
        batch_loss, grads = jax.value_and_grad(loss)(p, x_train[batch], y_train[batch])
        return jax.tree_util.tree_map(lambda w, g: w - lr * g, p, grads), batch_loss

    # One compiled loop over all steps: compiling costs more than the training itself.
    @jax.jit
    def fit(p: dict[str, Any], keys: Any) -> tuple[dict[str, Any], Any]:
        return jax.lax.scan(sgd_step, p, keys)

    initial_loss = float(loss(params, x_train, y_train))
    params, batch_losses = fit(params, jax.random.split(batch_key, steps))
    stride = max(1, steps // CURVE_POINTS)
    final_loss = float(loss(params, x_train, y_train))
    accuracy = float(jnp.mean((logits(params, x_test) > 0) == (y_test == 1)))
    return {
        "config": {"lr": lr, "hidden": hidden},
        "steps": steps,
        "initial_loss": initial_loss,
        "final_loss": final_loss,
        "accuracy": accuracy,
        "seconds": time.perf_counter() - started,
        "loss_curve": [float(v) for v in batch_losses[::stride]],
    }


def format_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """The results as aligned text lines: a header, a rule, then one row per configuration."""
    header = ("lr", "hidden", "steps", "initial loss", "final loss", "held-out acc", "seconds")
    rows = [
        (
            f"{r['config']['lr']:g}",
            str(r["config"]["hidden"]),
            str(r["steps"]),
            f"{r['initial_loss']:.4f}",
            f"{r['final_loss']:.4f}",
            f"{r['accuracy']:.1%}",
            f"{r['seconds']:.1f}",
        )
        for r in results
    ]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [header, tuple("-" * w for w in widths), *rows]
    return ["  ".join(map(str.rjust, line, widths)) for line in lines]


def publish_summary(results: Sequence[dict[str, Any]], key: str) -> str | None:
    """Metrics table and loss curves of a sweep, as Prefect artifacts (plot in the output dir)."""
    return summarize_sweep(
        [
            {
                **r["config"],
                "final_loss": round(r["final_loss"], 4),
                "accuracy": round(r["accuracy"], 4),
            }
            for r in results
        ],
        curves={
            f"lr={r['config']['lr']:g} hidden={r['config']['hidden']}": r["loss_curve"]
            for r in results
        },
        key=key,
    )


def where_to_find(flow_run_id: str) -> list[str]:
    """Lines telling where the flow run and its task runs can be seen in the Prefect UI."""
    ui_url = get_current_settings().ui_url
    if ui_url:
        return [f"Flow run {flow_run_id}: {ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}"]
    return [
        f"Flow run {flow_run_id} ran against a temporary Prefect server, gone once this exits.",
        "To browse the runs in the UI: `prefect server start`, then "
        "`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api` and run this again.",
    ]


@flow(name="quickstart-sweep", task_runner=KineticTaskRunner(), log_prints=True)
def quickstart_sweep(
    configs: list[dict[str, Any]] | None = None, steps: int = 300, seed: int = 0
) -> list[dict[str, Any]]:
    """Train one model per configuration, each in its own pod, and print the results table."""
    futures = train.map(configs or DEFAULT_CONFIGS, steps=unmapped(steps), seed=unmapped(seed))
    results = [future.result() for future in futures]
    publish_summary(results, key="quickstart-sweep-metrics")
    # One print per line: each becomes a log record, so the columns stay aligned.
    for line in [*format_table(results), *where_to_find(str(flow_run.id))]:
        print(line)
    return results


if __name__ == "__main__":
    quickstart_sweep()
