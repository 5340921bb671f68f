"""`kinetic-prefect doctor --accelerator`: whether the accelerator's nodes can hold its task pod.

On the strict cluster with GKE-sized nodes (tests/support/gke_machines.py): each node's
system DaemonSets' pods are Pod objects bound to it, and the doctor asks for the task pod
the product would launch with the cluster's settings.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kinetic_prefect.cli import app
from tests.support.clusters import gcs_cluster
from tests.support.kube import TESTER
from tests.support.kube_objects import gke_nodes
from tests.support.standins import apply

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

# What GKE's roles/container.viewer lets a user do to pods, as RBAC: list them everywhere.
POD_READER = [
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "pod-reader-tester"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "pod-reader",
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": TESTER}],
    },
]


@pytest.fixture
def doctor(cluster, gcs, monkeypatch) -> str:
    """One L4 node (a g2-standard-4: 3920m cpu allocatable, 504m of it held by its system
    pods) beside a default-pool node, and a saved gke cluster."""
    monkeypatch.setenv("KINETIC_ALLOW_LOOPBACK_API", "true")
    cluster.kubelet.nodes = [*gke_nodes("l4-pool", "l4", 1), *gke_nodes("default-pool", "cpu", 1)]
    cluster.publish_nodes()
    return gcs_cluster(gcs, "doctor-nodes", backend="gke")


def with_cpu(name: str, cpu: str) -> None:
    from kinetic_prefect.blocks import KineticCluster

    block = KineticCluster.load(name)
    block.cpu = cpu
    block.save(name, overwrite=True)


def run_doctor(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["doctor", "--no-pod-check", *args])
    return result.exit_code, " ".join(result.output.split())  # the console folds long lines


def test_a_cpu_request_the_system_pods_leave_no_room_for_fails_naming_the_node(doctor, cluster):
    apply(cluster.admin, "default", POD_READER)
    with_cpu(doctor, "3800m")  # under the node's 3920m, over what its system pods leave

    code, output = run_doctor("--cluster", doctor, "--accelerator", "l4")

    assert code == 1, output
    check = output[output.index("FAIL Node pools: l4: 1 node(s)") :]
    assert "none can hold its pod, which asks cpu 3800m, memory 12597Mi, nvidia.com/gpu 1" in check
    assert (
        "node gke-l4-pool-0 has allocatable cpu 3920m, memory 13621Mi; its other pods (GKE's "
        "system DaemonSets among them) request cpu 504m, memory 656Mi, which leaves cpu 3416m"
    ) in check
    assert "memory 12965Mi. Set a smaller cpu= (at most 3416m) on the runner" in check
    assert "bigger machine type" in check


def test_the_default_request_fits_the_smallest_l4_node_beside_its_system_pods(doctor, cluster):
    apply(cluster.admin, "default", POD_READER)

    code, output = run_doctor("--cluster", doctor, "--accelerator", "l4")

    assert code == 0, output
    assert (
        "ok Node pools: l4: 1 node(s) with cloud.google.com/gke-accelerator=nvidia-l4 "
        "(1 with nvidia.com/gpu >= 1); its pod (cpu 3220m, memory "
    ) in output
    assert "nvidia.com/gpu 1) fits node gke-l4-pool-0 now" in output


def test_credentials_that_may_not_list_pods_get_a_warning_and_allocatable_alone(doctor):
    with_cpu(doctor, "3800m")

    code, output = run_doctor("--cluster", doctor, "--accelerator", "l4")

    assert code == 0, output
    check = output[output.index("warn Node pools: l4:") :]
    assert "fits node gke-l4-pool-0 now" in check
    assert "the pods already on the nodes were not counted: " in check
    assert "may not list pods in all namespaces" in check
    assert "roles/container.viewer" in check


def test_nodes_of_its_kind_that_lost_contact_are_named_and_hold_no_pod_now(doctor, cluster):
    apply(cluster.admin, "default", POD_READER)
    cluster.run(cluster.kubelet.take_down(cluster.kubelet.nodes[:1]))

    code, output = run_doctor("--cluster", doctor, "--accelerator", "l4")

    assert code == 0, output
    check = output[output.index("warn Node pools: l4: 1 node(s)") :]
    assert (
        "1 not ready or cordoned, which take no pod now (gke-l4-pool-0: Ready=Unknown, "
        "node.kubernetes.io/unreachable)"
    ) in check
    assert "run doctor again once they are Ready" in check
