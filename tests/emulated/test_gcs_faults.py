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


def test_a_write_if_absent_whose_answer_was_lost_is_still_its_writers(gcs, fault_proxy):
    """A warm pod's claim lands, its answer is lost and the retry is refused (412): the
    claim is still the pod's, and a second writer gets the first one's bytes."""
    from kinetic_prefect.common.gcs import GcsStore

    fault_proxy.every = None
    fault_proxy.lose_uploads = 1
    store = GcsStore(f"{gcs.uri}/jobs")

    assert store.put_if_absent("kinetic/kp-1/warm-pod.json", b"first") is None
    assert fault_proxy.lost == 1
    assert store.put_if_absent("kinetic/kp-1/warm-pod.json", b"second") == b"first"
    assert store.get_bytes("kinetic/kp-1/warm-pod.json") == b"first"
