"""The product's pods against GKE's nodes as its documentation describes them.

The nodes (tests/support/gke_machines.py) are written from GKE's and Compute Engine's
documentation, never from the product's catalogue: labels, taints, allocatable and the
system pods' requests. Each accelerator's pod, as the product builds it, must land on a
node pool made for that accelerator, and on no other.
"""

from __future__ import annotations

import pytest

from kinetic_prefect.launch.slices import build_workload
from tests.support.gke_machines import (
    MACHINES,
    POOL_SHAPES,
    allocatable,
    quantity,
    system_requests,
    tolerates,
)
from tests.support.kube_objects import gke_nodes, place
from tests.unit.test_manifest import _spec

# Nodes per slice of each pool shape (Cloud TPU: v5e 4x4 is four hosts of 4 chips, v5p
# 2x2x2 two hosts of 4 chips).
HOSTS = {"cpu": 1, "l4": 1, "l4x4": 1, "tpu-v5e-4": 1, "tpu-v5e-16": 4, "tpu-v5p-16": 2}


def _pod_spec(accelerator: str) -> dict:
    return build_workload(_spec(accelerator)).job["spec"]["template"]["spec"]


@pytest.mark.parametrize("accelerator", sorted(POOL_SHAPES))
def test_each_accelerators_pod_lands_on_a_fresh_node_pool_made_for_it(accelerator: str) -> None:
    hosts = HOSTS[accelerator]
    nodes = gke_nodes("pool", accelerator, hosts)

    placed = place(nodes, _pod_spec(accelerator), hosts)

    assert isinstance(placed, list), placed
    assert len({node.name for node in placed}) == hosts


@pytest.mark.parametrize("accelerator", sorted(set(POOL_SHAPES) - {"cpu"}))
def test_an_accelerators_pod_lands_on_no_other_accelerators_pool(accelerator: str) -> None:
    # One L4 fits a node with four as well (both are labelled nvidia-l4): not another pool.
    bigger = {"l4": {"l4x4"}}.get(accelerator, set())
    others = [
        node
        for other in sorted(set(POOL_SHAPES) - {accelerator, "cpu"} - bigger)
        for node in gke_nodes(f"pool-{other}", other, HOSTS[other])
    ]

    placed = place(others, _pod_spec(accelerator), HOSTS[accelerator])

    assert isinstance(placed, str) and placed.startswith(f"0/{len(others)} nodes are available")


def test_allocatable_is_gkes_worked_example_for_a_four_vcpu_node() -> None:
    # plan-node-sizes' example node of 4 vCPUs reports `cpu: 3920m`.
    assert allocatable(MACHINES["g2-standard-4"])[0] == 3920


def test_a_gpu_node_holds_the_gpu_device_plugin_and_a_cpu_node_does_not() -> None:
    (gpu,) = gke_nodes("l4", "l4", 1)
    (cpu,) = gke_nodes("default", "cpu", 1)
    assert gpu.system["cpu"] - cpu.system["cpu"] == 150
    assert system_requests({}) == cpu.system


@pytest.mark.parametrize(
    ("toleration", "tolerated"),
    [
        ({"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}, True),
        ({"key": "google.com/tpu", "operator": "Equal", "value": "present"}, True),
        ({"key": "google.com/tpu", "value": "absent", "effect": "NoSchedule"}, False),
        ({"key": "nvidia.com/gpu", "operator": "Exists"}, False),
        ({"operator": "Exists"}, True),
        ({"key": "google.com/tpu", "operator": "Exists", "effect": "NoExecute"}, False),
    ],
)
def test_tolerations_match_taints_as_kubernetes_documents(toleration, tolerated) -> None:
    taint = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}
    assert tolerates([toleration], taint) is tolerated


@pytest.mark.parametrize(
    ("text", "value"), [("500m", 0.5), ("2Gi", 2 * 2**30), ("4", 4.0), ("1k", 1000.0)]
)
def test_quantities_read_as_kubernetes_writes_them(text: str, value: float) -> None:
    assert quantity(text) == value
