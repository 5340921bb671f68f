"""Checkpoints that outlive their task: handed downstream, restored partially, resumed exactly.

Each test runs real pods against a real Prefect API; the `gs://` variants keep the
jobs store and every checkpoint in fake-gcs-server.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import numpy as np
import pytest
from prefect import flow, get_client, task
from prefect.context import get_run_context
from prefect.runtime import task_run
from prefect.utilities.annotations import unmapped

from kinetic_prefect import Checkpoint, KineticTaskRunner, checkpoint_manager
from kinetic_prefect.errors import CheckpointError
from tests.support.waiting import wait_until

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

PRETRAIN_STEPS = 5


def _params(scale: float) -> dict[str, Any]:
    return {"w": np.arange(6.0).reshape(2, 3) * scale, "b": np.ones(3) * scale}


@task
def pretrain() -> Checkpoint:
    import orbax.checkpoint as ocp

    manager = checkpoint_manager()
    for step in range(PRETRAIN_STEPS):
        state = {"params": _params(step + 1.0), "opt": {"mu": np.full(3, -1.0 * step)}}
        manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    return Checkpoint.latest()


@task
def finetune(base: Checkpoint, lr: float) -> dict[str, Any]:
    import orbax.checkpoint as ocp

    restored = base.restore({"params": _params(0.0)}, partial=True)
    manager = checkpoint_manager()
    tuned = {k: v - lr for k, v in restored["params"].items()}
    manager.save(0, args=ocp.args.StandardSave({"params": tuned}))
    manager.wait_until_finished()
    own = Checkpoint.latest()
    return {
        "base_step": base.step,
        "restored": {k: v.tolist() for k, v in restored["params"].items()},
        "restored_keys": sorted(restored),
        "own": own.directory,
        "own_steps": own.steps(),
    }


@task
def restore_of(flow_run_id: str, task_key: str) -> dict[str, Any]:
    checkpoint = Checkpoint.of_task(flow_run_id, task_key)
    return {"steps": checkpoint.steps(), "w": checkpoint.restore()["params"]["w"].tolist()}


def _runner(kind: str, request: pytest.FixtureRequest) -> KineticTaskRunner:
    if kind == "local":
        return KineticTaskRunner()
    from tests.support.clusters import gcs_cluster

    gcs = request.getfixturevalue("gcs")
    return KineticTaskRunner(cluster=gcs_cluster(gcs, f"checkpoints-{kind}"))


def _asset_events(key: str) -> list[dict[str, Any]]:
    with get_client(sync_client=True) as client:
        response = client._client.post(
            "/events/filter",
            json={"filter": {"resource": {"id": [key]}}, "limit": 50},
        )
        response.raise_for_status()
        return response.json().get("events", [])


def _task_runs_of(events: list[dict[str, Any]], name: str) -> set[str]:
    return {
        related["prefect.resource.id"]
        for event in events
        if event["event"] == name
        for related in event.get("related", [])
        if related.get("prefect.resource.role") == "task-run"
    }


@pytest.mark.parametrize("kind", ["local", "gcs"])
def test_fine_tunes_restore_the_pretrain_checkpoint_and_write_their_own(
    kind: str, request: pytest.FixtureRequest
):
    @flow(task_runner=_runner(kind, request))
    def pipeline() -> tuple[Checkpoint, list[dict[str, Any]], str, list[str]]:
        base = pretrain.submit()
        tuned = finetune.map(unmapped(base), [0.1, 0.2, 0.3])
        results = [f.result() for f in tuned]
        return base.result(), results, str(base.task_run_id), [str(f.task_run_id) for f in tuned]

    base, results, pretrain_run, finetune_runs = pipeline()

    expected = {k: v.tolist() for k, v in _params(float(PRETRAIN_STEPS)).items()}
    assert base.step == PRETRAIN_STEPS - 1
    assert base.steps() == list(range(PRETRAIN_STEPS))  # no fine-tune wrote into it
    assert [r["base_step"] for r in results] == [PRETRAIN_STEPS - 1] * 3
    assert all(r["restored"] == expected for r in results)
    assert all(r["restored_keys"] == ["params"] for r in results)  # no optimizer state
    assert len({r["own"] for r in results} | {base.directory}) == 4
    assert all(r["own_steps"] == [0] for r in results)
    events = wait_until(
        lambda: (
            (found := _asset_events(base.uri))
            and len(_task_runs_of(found, "prefect.asset.referenced")) >= 3
            and found
        ),
        60,
        "the checkpoint's asset events",
    )
    materialized_by = _task_runs_of(events, "prefect.asset.materialization.succeeded")
    assert materialized_by == {f"prefect.task-run.{pretrain_run}"}
    assert _task_runs_of(events, "prefect.asset.referenced") == {
        f"prefect.task-run.{run}" for run in finetune_runs
    }


def test_a_later_flow_run_restores_a_task_of_an_earlier_one():
    runner = KineticTaskRunner()

    @flow(task_runner=runner)
    def first() -> tuple[str, str]:
        future = pretrain.submit()
        future.wait()
        return str(get_run_context().flow_run.id), future.task_key  # type: ignore[union-attr]

    @flow(task_runner=runner)
    def later(flow_run_id: str, task_key: str) -> dict[str, Any]:
        return restore_of.submit(flow_run_id, task_key).result()

    flow_run_id, task_key = first()
    restored = later(flow_run_id, task_key)

    assert restored["steps"] == list(range(PRETRAIN_STEPS))
    assert restored["w"] == _params(float(PRETRAIN_STEPS))["w"].tolist()


@task(retries=1)
def finetune_killed_once(base: Checkpoint) -> dict[str, Any]:
    """Adds 1 to every parameter per step; its first pod is killed after saving step 1."""
    import orbax.checkpoint as ocp

    manager = checkpoint_manager()
    latest = manager.latest_step()
    if latest is None:
        params, start = base.restore({"params": _params(0.0)}, partial=True)["params"], 0
    else:
        params, start = manager.restore(latest)["params"], latest + 1
    for step in range(start, 4):
        params = {k: v + 1.0 for k, v in params.items()}
        manager.save(step, args=ocp.args.StandardSave({"params": params}))
        manager.wait_until_finished()
        if step == 1 and task_run.run_count == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    return {"resumed_from": start, "w": params["w"].tolist()}


def test_a_retried_fine_tune_resumes_from_its_own_checkpoint_not_the_upstreams():
    @flow(task_runner=KineticTaskRunner())
    def pipeline() -> tuple[Checkpoint, dict[str, Any]]:
        base = pretrain.submit()
        return base.result(), finetune_killed_once.submit(base).result()

    base, tuned = pipeline()

    assert tuned["resumed_from"] == 2
    assert tuned["w"] == (_params(float(PRETRAIN_STEPS))["w"] + 4.0).tolist()
    assert base.steps() == list(range(PRETRAIN_STEPS))


def test_a_checkpoint_without_steps_names_its_directory(tmp_path):
    empty = Checkpoint(str(tmp_path / "nothing-here"))

    with pytest.raises(CheckpointError, match="nothing-here"):
        empty.restore()


def test_a_missing_step_names_the_steps_there(tmp_path):
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(str(tmp_path / "ck"))
    for step in (0, 2):
        manager.save(step, args=ocp.args.StandardSave({"w": np.zeros(2)}))
    manager.wait_until_finished()

    with pytest.raises(CheckpointError, match=r"No step 5 .*\[0, 2\]"):
        Checkpoint(str(tmp_path / "ck"), step=5).restore()


def test_a_template_that_does_not_fit_names_the_first_mismatching_path(tmp_path):
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(str(tmp_path / "ck"))
    manager.save(0, args=ocp.args.StandardSave({"params": _params(1.0), "opt": np.zeros(3)}))
    manager.wait_until_finished()
    checkpoint = Checkpoint(str(tmp_path / "ck"))

    with pytest.raises(CheckpointError, match="'params/kernel'"):
        checkpoint.restore({"params": {"kernel": np.zeros((2, 3))}}, partial=True)
    with pytest.raises(CheckpointError, match="'opt'.*partial=True"):
        checkpoint.restore({"params": _params(0.0)})


STREAM_STEPS = 12
KILL_AT = 6


@task(retries=1)
def consume_stream(interrupt: bool) -> list[list[int]]:
    """Reads a shuffled Grain dataset, checkpointing the iterator with the model state."""
    import grain
    import orbax.checkpoint as ocp

    dataset = grain.MapDataset.range(40).shuffle(seed=7).batch(2)
    iterator = iter(dataset)
    manager = checkpoint_manager(save_on_preemption=True)
    seen: list[list[int]] = []
    start = 0
    latest = manager.latest_step()
    if latest is not None:
        restored = manager.restore(
            latest,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore({"w": np.zeros(2)}),
                data=grain.checkpoint.CheckpointRestore(iterator),
                seen=ocp.args.JsonRestore(),
            ),
        )
        seen, start = restored["seen"], latest + 1
    for step in range(start, STREAM_STEPS):
        batch = next(iterator).tolist()
        if interrupt and step == KILL_AT and task_run.run_count == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a preemption before this step is saved
        seen.append(batch)
        manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave({"w": np.full(2, float(step))}),
                data=grain.checkpoint.CheckpointSave(iterator),
                seen=ocp.args.JsonSave(seen),
            ),
        )
        manager.wait_until_finished()
    return seen


@pytest.mark.parametrize("kind", ["local", "gcs"])
def test_a_killed_task_resumes_its_data_stream_exactly(kind: str, request: pytest.FixtureRequest):
    @flow(task_runner=_runner(kind, request))
    def streams() -> tuple[list[list[int]], list[list[int]], int]:
        interrupted = consume_stream.submit(True)
        whole = consume_stream.submit(False)
        interrupted.wait()
        return interrupted.result(), whole.result(), len(interrupted.job_ids)

    resumed, uninterrupted, pods = streams()

    assert pods == 2  # the first pod was killed at step 6, the second resumed
    assert len(uninterrupted) == STREAM_STEPS
    assert json.dumps(resumed) == json.dumps(uninterrupted)
