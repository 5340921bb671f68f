"""A hyperparameter sweep fanned out over pods, at most `max_parallel` at a time.

Each configuration trains in its own pod; the flow ends with a table artifact
of metrics per configuration and a loss-curve plot saved in its output dir.

    python flows/hyperparameter_sweep.py
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.utilities.annotations import unmapped

if __package__ in (None, ""):  # run as a script: make `flows` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows.quickstart import publish_summary, train  # noqa: E402
from kinetic_prefect import KineticTaskRunner  # noqa: E402

LEARNING_RATES = [0.03, 0.1, 0.3, 1.0]
HIDDEN_WIDTHS = [4, 16]


@flow(name="hyperparameter-sweep", task_runner=KineticTaskRunner(max_parallel=2), log_prints=True)
def hyperparameter_sweep(
    learning_rates: list[float] | None = None,
    hidden_widths: list[int] | None = None,
    steps: int = 200,
) -> list[dict[str, Any]]:
    """Grid search over learning rate x hidden width; returns metrics sorted best first."""
    grid = [
        {"lr": lr, "hidden": hidden}
        for lr, hidden in itertools.product(
            learning_rates or LEARNING_RATES, hidden_widths or HIDDEN_WIDTHS
        )
    ]
    results = [f.result() for f in train.map(grid, steps=unmapped(steps))]
    ranked = sorted(results, key=lambda r: r["final_loss"])
    publish_summary(ranked, key="hyperparameter-sweep-metrics")
    best = ranked[0]
    config = best["config"]
    print(f"best: lr={config['lr']:g} hidden={config['hidden']} loss={best['final_loss']:.4f}")
    return ranked


if __name__ == "__main__":
    hyperparameter_sweep()
