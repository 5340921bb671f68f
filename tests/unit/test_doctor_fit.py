"""`kinetic_prefect.cli.node_fit`: whether a pod fits a node, as NodeResourcesFit decides.

Rows are Node and Pod objects in the shapes the API returns them; what should fit is
worked out from Kubernetes' rule (a pod fits when, for every resource, allocatable minus
the requests of the pods bound to the node is at least its request), not from the code.
"""

from __future__ import annotations

from typing import Any

import pytest

from kinetic_prefect.cli.node_fit import amount, node_fit, pod_requests

# A g2-standard-4 as GKE 1.36 lists it: allocatable from plan-node-sizes' reservation.
G2_STANDARD_4: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Node",
    "metadata": {
        "name": "gke-l4-pool-0",
        "labels": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
    },
    "status": {
        "allocatable": {
            "cpu": "3920m",
            "memory": "13948Mi",
            "nvidia.com/gpu": "1",
            "pods": "110",
            "ephemeral-storage": "47060071478",
        }
    },
}


def _pod(
    name: str,
    requests: dict[str, str] | None = None,
    limits: dict[str, str] | None = None,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if requests is not None:
        resources["requests"] = requests
    if limits is not None:
        resources["limits"] = limits
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "kube-system", "labels": labels or {}},
        "spec": {
            "nodeName": "gke-l4-pool-0",
            "containers": [{"name": name, "image": "img", "resources": resources}],
            **spec,
        },
        "status": {"phase": phase},
    }


# GKE's DaemonSets on a GPU node: 504m cpu, 656Mi between them.
SYSTEM = [
    _pod("kube-proxy", {"cpu": "100m"}),
    _pod("fluentbit-gke", {"cpu": "105m", "memory": "230Mi"}),
    _pod("gke-metrics-agent", {"cpu": "21m", "memory": "145Mi"}),
    _pod("pdcsi-node", {"cpu": "10m", "memory": "20Mi"}),
    _pod("netd", {"cpu": "8m", "memory": "65Mi"}),
    _pod("ip-masq-agent", {"cpu": "10m", "memory": "16Mi"}),
    _pod("gke-metadata-server", {"cpu": "100m", "memory": "100Mi"}),
    _pod("nvidia-gpu-device-plugin", {"cpu": "150m", "memory": "80Mi"}),
]
OURS = {"app.kubernetes.io/managed-by": "kinetic-prefect"}


def _task(requests: dict[str, str], gpus: str = "1", **spec: Any) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": gpus}
    return _pod("task", {**requests, **limits}, limits, **spec)["spec"]


@pytest.mark.parametrize(
    ("pod_spec", "pods_on_node", "short_now", "short_ours_gone"),
    [
        pytest.param(_task({"cpu": "3220m", "memory": "12597Mi"}), SYSTEM, [], [], id="default"),
        # 3920m - 504m = 3416m free: 3416m is the most that fits.
        pytest.param(_task({"cpu": "3416m"}), SYSTEM, [], [], id="exactly-what-is-left"),
        pytest.param(_task({"cpu": "3417m"}), SYSTEM, ["cpu"], ["cpu"], id="a-millicore-more"),
        pytest.param(_task({"cpu": "3800m"}), [], [], [], id="allocatable-alone-fits"),
        pytest.param(_task({"cpu": "3.8"}), SYSTEM, ["cpu"], ["cpu"], id="system-pods-take-it"),
        # 13948Mi - 656Mi = 13292Mi.
        pytest.param(_task({"memory": "13292Mi"}), SYSTEM, [], [], id="memory-left"),
        pytest.param(_task({"memory": "13Gi"}), SYSTEM, ["memory"], ["memory"], id="13Gi"),
        pytest.param(_task({"memory": "15e9"}), [], ["memory"], ["memory"], id="decimal-memory"),
        pytest.param(
            _task({}, gpus="2"), SYSTEM, ["nvidia.com/gpu"], ["nvidia.com/gpu"], id="gpus"
        ),
        # A container with a limit and no request requests its limit.
        pytest.param(
            _pod("task", limits={"cpu": "4"})["spec"], [], ["cpu"], ["cpu"], id="limit-only"
        ),
        pytest.param(
            _task({"cpu": "3416m"}),
            [
                *SYSTEM,
                _pod("done", {"cpu": "2"}, phase="Succeeded"),
                _pod("x", {"cpu": "2"}, phase="Failed"),
            ],
            [],
            [],
            id="ended-pods-hold-nothing",
        ),
        pytest.param(
            _task({"cpu": "3220m"}),
            [*SYSTEM, _pod("kp-train-1", {"cpu": "3220m", "nvidia.com/gpu": "1"}, labels=OURS)],
            ["cpu", "nvidia.com/gpu"],
            [],
            id="busy-with-our-pod",
        ),
        pytest.param(
            _task({"cpu": "1"}),
            [*SYSTEM, _pod("someone-else", {"cpu": "3"})],
            ["cpu"],
            ["cpu"],
            id="other-workloads-stay",
        ),
        # The largest init container counts when it asks more than the containers.
        pytest.param(
            _task(
                {"cpu": "1"},
                initContainers=[{"name": "unpack", "resources": {"requests": {"cpu": "3500m"}}}],
            ),
            SYSTEM,
            ["cpu"],
            ["cpu"],
            id="init-container",
        ),
        # A sidecar (an init container that keeps running) adds to the containers.
        pytest.param(
            _task(
                {"cpu": "3"},
                initContainers=[
                    {
                        "name": "fuse",
                        "restartPolicy": "Always",
                        "resources": {"requests": {"cpu": "500m"}},
                    }
                ],
            ),
            SYSTEM,
            ["cpu"],
            ["cpu"],
            id="sidecar",
        ),
        pytest.param(
            _task({"cpu": "3"}, overhead={"cpu": "500m"}), SYSTEM, ["cpu"], ["cpu"], id="overhead"
        ),
        pytest.param(
            _task({"cpu": "1"}),
            [_pod(f"p{i}", {"cpu": "1m"}) for i in range(110)],
            ["pods"],
            ["pods"],
            id="no-pod-left",
        ),
    ],
)
def test_node_fit(
    pod_spec: dict[str, Any],
    pods_on_node: list[dict[str, Any]],
    short_now: list[str],
    short_ours_gone: list[str],
) -> None:
    fit = node_fit(pod_spec, G2_STANDARD_4, pods_on_node)

    assert sorted(fit.short()) == short_now
    assert sorted(fit.short(ours_gone=True)) == short_ours_gone


def test_describe_names_the_node_what_it_has_what_its_pods_take_and_what_is_left() -> None:
    fit = node_fit(_task({"cpu": "3800m"}), G2_STANDARD_4, SYSTEM)

    assert fit.describe() == (
        "node gke-l4-pool-0 has allocatable cpu 3920m, memory 13948Mi; its other pods (GKE's "
        "system DaemonSets among them) request cpu 504m, memory 656Mi, which leaves cpu 3416m, "
        "memory 13292Mi"
    )


@pytest.mark.parametrize(
    ("resource", "quantity", "expected"),
    [
        ("cpu", "3920m", 3920),
        ("cpu", "0.1", 100),
        ("cpu", "2", 2000),
        ("memory", "13034868Ki", 13034868 * 1024),
        ("memory", "1.5Gi", 3 * 2**29),
        ("memory", "129M", 129_000_000),
        ("memory", "1G", 10**9),
        ("nvidia.com/gpu", "4", 4),
    ],
)
def test_amount_is_in_the_schedulers_units(resource: str, quantity: str, expected: int) -> None:
    assert amount(resource, quantity) == expected


def test_a_pods_requests_are_its_containers_summed() -> None:
    spec = {
        "containers": [
            {"name": "a", "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}},
            {"name": "b", "resources": {"limits": {"cpu": "1", "memory": "512Mi"}}},
        ]
    }

    assert pod_requests(spec) == {"cpu": 1250, "memory": 1536 * 2**20}
