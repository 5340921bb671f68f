"""GCS answering 503 to one request in five does not fail a task."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prefect import flow, task

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.outputs.checkpoint import checkpoint_manager
from tests.support.clusters import gcs_cluster
from tests.support.gcs import FaultInjectingProxy

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


@task
def checkpoint_and_restore() -> float:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    manager = checkpoint_manager()
    manager.save(0, args=ocp.args.StandardSave({"w": jnp.full((8,), 1.0)}))
    manager.wait_until_finished()
    template = {"w": jnp.zeros((8,))}
    restored = checkpoint_manager().restore(0, args=ocp.args.StandardRestore(template))
    return float(restored["w"].sum())


@pytest.fixture
def fault_proxy(gcs_server: str) -> Iterator[FaultInjectingProxy]:
    with FaultInjectingProxy(gcs_server, every=5) as proxy:
        yield proxy


@pytest.fixture
def gcs_endpoint(fault_proxy: FaultInjectingProxy) -> str:
    return fault_proxy.url


@pytest.mark.slow
def test_uploads_result_writes_and_checkpoints_survive_one_503_in_five(gcs, fault_proxy):
    runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "flaky-gcs"))

    @flow(task_runner=runner)
    def train() -> float:
        return checkpoint_and_restore.submit().result()

    assert train() == 8.0
    assert fault_proxy.injected >= 5
    assert len(gcs.names("results/")) >= 1
    assert len(gcs.names("outputs/")) >= 1
