"""The example flows run as they are on the local default, and show their results in the UI."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from prefect import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, ArtifactFilterType

from flows.checkpointed_training import checkpointed_training
from flows.data_example import data_example
from flows.hyperparameter_sweep import hyperparameter_sweep
from flows.pretrain_finetune import pretrain_finetune

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


def _artifacts(**filters: Any) -> list[Any]:
    async def read() -> list[Any]:
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(**filters))

    return asyncio.run(read())


@pytest.mark.slow
def test_checkpointed_training_resumes_after_its_pod_is_killed_and_reports_full_progress():
    result = checkpointed_training(steps=40, interrupt_at=15)

    progress = [float(a.data) for a in _artifacts(type=ArtifactFilterType(any_=["progress"]))]
    assert result["resumed_from"] >= 15
    assert result["loss"] < 0.5
    assert 100.0 in progress


@pytest.mark.slow
def test_sweep_ranks_configurations_and_publishes_a_table_and_loss_plot(workdir: Path):
    ranked = hyperparameter_sweep(learning_rates=[0.03, 1.0], hidden_widths=[8], steps=60)

    table = _artifacts(key=ArtifactFilterKey(any_=["hyperparameter-sweep-metrics"]))
    plots = sorted(workdir.glob(".kinetic/outputs/*/flow/loss-curves.png"))
    assert [r["final_loss"] for r in ranked] == sorted(r["final_loss"] for r in ranked)
    assert len(table) == 1
    assert plots and plots[0].read_bytes().startswith(b"\x89PNG")


def test_data_example_reads_the_dataset_in_a_pod():
    stats = data_example()

    assert stats["rows"] == 500
    assert abs(stats["slope"] - 2.0) < 0.1


def test_pretrain_finetune_ranks_fine_tunes_that_started_from_the_pretrain_checkpoint():
    ranked = pretrain_finetune(lrs=(0.003, 0.03), steps=5)

    assert [row["loss"] for row in ranked] == sorted(row["loss"] for row in ranked)
    assert {row["lr"] for row in ranked} == {0.003, 0.03}
    assert len({row["checkpoint"] for row in ranked}) == 2
    assert all(row["checkpoint"].startswith("file://") for row in ranked)
