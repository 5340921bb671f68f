"""Multi-host TPU slices on the gke backend: kmock, and a test kubelet with a process per host."""

from __future__ import annotations

import threading
from pathlib import Path

import kubernetes_validate
import pytest
from prefect import flow, task

from tests.emulated.test_kubernetes_backend import PENDING_TIMEOUT, _failed_run, _runner
from tests.runner.test_multihost import (
    CPU_JAX,
    DEADLINE,
    THE_WHOLE_SLICE_RETRIED,
    TWO_HOSTS,
    allgather_an_array_argument,
    gather_host_indices_and_pids,
    run_a_host_failing_once,
)
from tests.support.kube_objects import NODE_POOL_LABEL, Node, gke_nodes
from tests.support.waiting import wait_past_jobs, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

V5E_16 = {
    "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
    "cloud.google.com/gke-tpu-topology": "4x4",
}


def _tpu_nodes(count: int, pool: str = "v5e-16") -> list[Node]:
    return gke_nodes(pool, "tpu-v5e-16", count)


def _two_host_nodes(count: int = 2, pool: str = "v5p-16") -> list[Node]:
    """Nodes of a TPU v5p 2x2x2 pool: a slice of two hosts (TWO_HOSTS) needs two of them."""
    return gke_nodes(pool, TWO_HOSTS, count)


@task
def mark_then_wait(marks: str, gate: str) -> None:
    import jax

    Path(marks, str(jax.process_index())).write_text("running")
    pause = threading.Event()
    while not Path(gate).exists():
        pause.wait(0.05)


@pytest.mark.slow
def test_a_slice_is_created_in_the_documented_shape_and_runs_as_four_host_processes(gke, cluster):
    cluster.kubelet.nodes = _tpu_nodes(4)

    @flow(task_runner=_runner(gke, accelerator="tpu-v5e-16", env=CPU_JAX))
    def run() -> dict[str, object]:
        return gather_host_indices_and_pids.submit().result()

    result = run()

    (job,) = cluster.created_jobs()
    (service,) = cluster.created("services")
    pod = job["spec"]["template"]["spec"]
    assert (result["total"], result["processes"], len(set(result["pids"]))) == (6, 4, 4)  # type: ignore[arg-type]
    assert (job["spec"]["completions"], job["spec"]["parallelism"]) == (4, 4)
    assert job["spec"]["completionMode"] == "Indexed"
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert pod["nodeSelector"] == V5E_16
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": "4"}
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["ownerReferences"][0]["name"] == job["metadata"]["name"]
    kubernetes_validate.validate(service, kubernetes_validate.latest_version(), strict=True)
    wait_until(lambda: cluster.services() == [], 30, "the slice's Service to be deleted")


def test_a_jax_array_argument_reaches_every_host_of_a_slice_on_gke(gke, cluster):
    import jax.numpy as jnp

    cluster.kubelet.nodes = _two_host_nodes()

    @flow(task_runner=_runner(gke, accelerator=TWO_HOSTS, env=CPU_JAX))
    def run() -> dict[str, object]:
        return allgather_an_array_argument.submit(jnp.arange(8)).result()

    assert run() == {"shape": [2, 8], "sum": 28 * (1 + 2)}


def test_an_exception_on_host_0_retries_the_whole_slice_on_gke(gke, cluster, workdir):
    cluster.kubelet.nodes = _two_host_nodes()
    runner = _runner(gke, accelerator=TWO_HOSTS, env=CPU_JAX, timeout_seconds=DEADLINE)

    assert run_a_host_failing_once(runner, workdir) == THE_WHOLE_SLICE_RETRIED
    assert len(cluster.created_jobs()) == 2


@pytest.mark.slow
def test_leaving_a_running_slice_deletes_its_job_pods_and_service(gke, cluster, workdir):
    cluster.kubelet.nodes = _two_host_nodes()
    marks = workdir / "marks"
    marks.mkdir()

    @flow(task_runner=_runner(gke, accelerator=TWO_HOSTS, env=CPU_JAX))
    def leave_it_running() -> None:
        mark_then_wait.submit(str(marks), str(workdir / "never"))
        wait_until(lambda: len(list(marks.iterdir())) == 2, 120, "both hosts to run")

    leave_it_running()

    assert (len(cluster.created_jobs()), len(cluster.created("services"))) == (1, 1)
    wait_until(
        lambda: cluster.jobs() == [] and cluster.pods() == [] and cluster.services() == [],
        30,
        "the slice's Job, pods and Service to be deleted",
    )


def test_a_slice_without_enough_tpu_nodes_fails_naming_its_size_and_topology(gke, cluster):
    cluster.kubelet.nodes = [*_tpu_nodes(2), Node("cpu-1")]
    runner = _runner(
        gke, accelerator="tpu-v5e-16", env=CPU_JAX, pending_timeout_seconds=PENDING_TIMEOUT
    )

    state, message, _ = _failed_run(runner)

    assert state == "FAILED"
    assert "2 Insufficient google.com/tpu" in message
    assert "the 4-host slice tpu-v5e-16 (topology 4x4) needs 4 nodes" in message
    assert f"longer than pending_timeout_seconds={PENDING_TIMEOUT:g}" in message
    wait_until(lambda: cluster.jobs() == [] and cluster.services() == [], 30, "all deleted")


def test_a_slice_split_over_two_node_pools_is_not_scheduled(gke, cluster):
    # Four nodes of the right shape, but two pools: no pool is one whole slice.
    cluster.kubelet.nodes = [*_tpu_nodes(2, "pool-a"), *_tpu_nodes(2, "pool-b")]
    runner = _runner(
        gke, accelerator="tpu-v5e-16", env=CPU_JAX, pending_timeout_seconds=PENDING_TIMEOUT
    )

    state, message, _ = _failed_run(runner)

    assert state == "FAILED"
    assert "didn't match pod affinity rules" in message
    assert "a TPU slice node pool of topology 4x4 with 4 free nodes" in message
    wait_until(lambda: cluster.jobs() == [] and cluster.services() == [], 30, "all deleted")


@pytest.mark.slow
def test_a_slices_hosts_land_on_the_nodes_of_one_node_pool(gke, cluster):
    # The pool listed first is too small: the hosts go to the whole one, both of them.
    cluster.kubelet.nodes = [*_two_host_nodes(1, "too-small"), *_two_host_nodes(2, "whole")]

    @flow(task_runner=_runner(gke, accelerator=TWO_HOSTS, env=CPU_JAX))
    def run() -> dict[str, object]:
        return gather_host_indices_and_pids.submit().result()

    result = run()

    pods = cluster.created("pods")
    nodes = {node.name: node for node in cluster.kubelet.nodes}
    assert result["processes"] == 2
    assert len(pods) == 2
    assert {nodes[p["spec"]["nodeName"]].labels[NODE_POOL_LABEL] for p in pods} == {"whole"}
    assert len({p["spec"]["nodeName"] for p in pods}) == 2


def test_a_reclaimed_slice_waits_for_its_nodes_past_the_pending_timeout_and_completes(gke, cluster):
    """GKE recreates a multi-host slice's nodes as a unit: until they are back, the
    relaunched slice waits for them as for capacity, however long that takes."""
    from tests.emulated.test_kubernetes_backend import _state_messages, alongside

    cluster.kubelet.nodes = [*_two_host_nodes(), Node("cpu-1")]
    cluster.publish_nodes()
    # The first slice's VMs are reclaimed under it: its pods end preempted, its nodes
    # lose contact (Ready Unknown, the unreachable taint) until the test brings them back.
    cluster.kubelet.fault, cluster.kubelet.fault_pods_left = "reclaim", 1
    # Once the nodes are back, the slice's host processes must start within the
    # pending timeout, which PENDING_TIMEOUT's 3 s does not always allow on a loaded machine.
    pending_timeout = 10.0
    runner = _runner(
        gke, accelerator=TWO_HOSTS, env=CPU_JAX, pending_timeout_seconds=pending_timeout
    )

    def bring_the_nodes_back_once_the_relaunch_waited_past_its_pending_timeout() -> None:
        try:
            wait_past_jobs(
                cluster, 2, 1.5 * pending_timeout, "the relaunched slice to wait past its timeout"
            )
            assert all(node.ready == "Unknown" for node in cluster.kubelet.nodes[:2])
        finally:
            cluster.run(cluster.kubelet.bring_back("v5p-16"))

    @flow(task_runner=runner)
    def run() -> tuple[dict[str, object], object]:
        future = gather_host_indices_and_pids.submit()
        return future.result(), future.task_run_id

    with alongside(bring_the_nodes_back_once_the_relaunch_waited_past_its_pending_timeout):
        result, task_run_id = run()

    assert result["processes"] == 2
    assert len(cluster.created_jobs()) == 2  # the preempted slice and the one that waited
    history = _state_messages(task_run_id)
    assert len([m for _, m in history if m.startswith("Preempted:")]) == 1
    assert any(
        "waiting for capacity: 2/2 tpu-v5p-16 nodes not ready" in m
        and "node.kubernetes.io/unreachable" in m
        for kind, m in history
        if kind == "PENDING"
    ), history
