"""End to end: the quickstart sweep trains a real JAX model per configuration in local pods."""

from __future__ import annotations

import math

import pytest

from flows.quickstart import quickstart_sweep

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

# Two balanced classes: guessing scores 0.5, so a model that learned anything clears this.
WELL_ABOVE_CHANCE = 0.7


@pytest.mark.slow
def test_quickstart_sweep_returns_a_model_per_configuration_that_learned():
    configs = [{"lr": 0.3, "hidden": 8}, {"lr": 1.0, "hidden": 16}]

    results = quickstart_sweep(configs=configs, steps=50)

    assert [r["config"] for r in results] == configs
    assert [r["steps"] for r in results] == [50, 50]
    assert all(math.isfinite(r["final_loss"]) for r in results)
    assert all(r["final_loss"] < r["initial_loss"] for r in results)
    assert all(r["accuracy"] > WELL_ABOVE_CHANCE for r in results)
