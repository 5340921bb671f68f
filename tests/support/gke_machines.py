"""GKE nodes as GKE makes them, written from its documentation alone.

Nothing here comes from kinetic-prefect's accelerator catalogue: a node pool the tests
create is described as `gcloud container node-pools create` would make it (machine
type, labels, taints), its allocatable is GKE's documented reservation applied to the
machine, and its system DaemonSets hold part of that, as on a real node. A wrong label,
chip count, toleration or default request in the product then meets a node it does not
fit, as it would on GKE. Sources are cited in docs/testing.md ("The emulated GKE nodes").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
GPU_LABEL = "cloud.google.com/gke-accelerator"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
GPU_RESOURCE = "nvidia.com/gpu"
TPU_RESOURCE = "google.com/tpu"
# GKE taints GPU and TPU nodes so that only pods tolerating them land there.
GPU_TAINT = {"key": GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
TPU_TAINT = {"key": TPU_RESOURCE, "value": "present", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Machine:
    """A Compute Engine machine type: vCPUs, memory (GiB) and the accelerators attached."""

    name: str
    vcpus: int
    memory_gib: int
    gpus: int = 0
    tpu_chips: int = 0


MACHINES = {
    m.name: m
    for m in (
        Machine("e2-standard-8", 8, 32),
        Machine("g2-standard-4", 4, 16, gpus=1),
        Machine("g2-standard-48", 48, 192, gpus=4),
        Machine("ct5lp-hightpu-4t", 112, 192, tpu_chips=4),
        Machine("ct5p-hightpu-4t", 208, 448, tpu_chips=4),
    )
}


def _by_tiers(amount: float, tiers: list[tuple[float, float]]) -> float:
    """Sum of `share` × the part of `amount` inside each successive tier of `size`."""
    total, start = 0.0, 0.0
    for size, share in tiers:
        total += max(0.0, min(amount, start + size) - start) * share
        start += size
    return total


# GKE's kube-reserved for a Standard node: CPU in cores, memory in GiB, by tiers of the
# machine (plan-node-sizes, "Memory and CPU reservations"), and the eviction threshold.
_CPU_TIERS = [(1, 0.06), (1, 0.01), (2, 0.005), (float("inf"), 0.0025)]
_MEMORY_TIERS = [(4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02)]
EVICTION_THRESHOLD_MIB = 100


def allocatable(machine: Machine) -> tuple[int, int]:
    """(cpu in millicores, memory in MiB) a node of `machine` reports as allocatable."""
    cpu = machine.vcpus * 1000 - round(_by_tiers(machine.vcpus, _CPU_TIERS) * 1000)
    memory = machine.memory_gib * 1024 - _by_tiers(machine.memory_gib, _MEMORY_TIERS) * 1024
    return cpu, int(memory - EVICTION_THRESHOLD_MIB)


@dataclass(frozen=True)
class SystemPod:
    """A system DaemonSet's pod on every node (or on nodes with `needs` in their labels)."""

    name: str
    cpu_millicores: int
    memory_mib: int
    needs: str | None = None


# What GKE's own DaemonSets request on a Standard node with Workload Identity, as a
# GKE 1.36 node lists them (docs/testing.md gives the sources). No figure was found for
# the TPU device plugin's requests, so it holds none here.
SYSTEM_PODS = (
    SystemPod("kube-proxy", 100, 0),
    SystemPod("fluentbit-gke", 105, 230),
    SystemPod("gke-metrics-agent", 21, 145),
    SystemPod("pdcsi-node", 10, 20),
    SystemPod("netd", 8, 65),
    SystemPod("ip-masq-agent", 10, 16),
    SystemPod("gke-metadata-server", 100, 100),
    SystemPod("nvidia-gpu-device-plugin", 150, 80, needs=GPU_LABEL),
)


@dataclass(frozen=True)
class PoolShape:
    """What `gcloud container node-pools create` makes for one kind of accelerator."""

    machine: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()


def _tpu(machine: str, accelerator: str, topology: str) -> PoolShape:
    return PoolShape(
        machine,
        {TPU_ACCELERATOR_LABEL: accelerator, TPU_TOPOLOGY_LABEL: topology},
        (TPU_TAINT,),
    )


# The node pools tests make, by the accelerator their tasks ask for: cpu nodes of the
# default pool, L4 GPUs on G2 machines (one, or four on a g2-standard-48), TPU v5e
# slices of 2x2 (one node, 4 chips) and 4x4 (four nodes of 4 chips), and a TPU v5p slice
# of 2x2x2 (two nodes of 4 chips).
POOL_SHAPES = {
    "cpu": PoolShape("e2-standard-8"),
    "l4": PoolShape("g2-standard-4", {GPU_LABEL: "nvidia-l4"}, (GPU_TAINT,)),
    "l4x4": PoolShape("g2-standard-48", {GPU_LABEL: "nvidia-l4"}, (GPU_TAINT,)),
    "tpu-v5e-4": _tpu("ct5lp-hightpu-4t", "tpu-v5-lite-podslice", "2x2"),
    "tpu-v5e-16": _tpu("ct5lp-hightpu-4t", "tpu-v5-lite-podslice", "4x4"),
    "tpu-v5p-16": _tpu("ct5p-hightpu-4t", "tpu-v5p-slice", "2x2x2"),
}


def extended_resources(machine: Machine) -> dict[str, int]:
    """The device plugins' resources a node of `machine` offers."""
    found = {GPU_RESOURCE: machine.gpus, TPU_RESOURCE: machine.tpu_chips}
    return {k: v for k, v in found.items() if v}


def system_pods(labels: dict[str, str]) -> tuple[SystemPod, ...]:
    """The system DaemonSets' pods on a node with `labels`."""
    return tuple(p for p in SYSTEM_PODS if p.needs is None or p.needs in labels)


def held_by(pods: tuple[SystemPod, ...]) -> dict[str, int]:
    """What `pods` request between them: {"cpu": m, "memory": bytes}."""
    return {
        "cpu": sum(p.cpu_millicores for p in pods),
        "memory": sum(p.memory_mib for p in pods) * 2**20,
    }


def system_requests(labels: dict[str, str]) -> dict[str, int]:
    """What the system pods on a node with `labels` hold: {"cpu": m, "memory": bytes}."""
    return held_by(system_pods(labels))


def tolerates(tolerations: list[dict[str, str]], taint: dict[str, str]) -> bool:
    """Whether one of `tolerations` matches `taint`, as Kubernetes matches them.

    Same key (an empty key with Exists matches every key), same effect (an empty
    effect matches every effect), and Exists, or Equal (the default) with the same value.
    """
    for toleration in tolerations:
        key, effect = toleration.get("key", ""), toleration.get("effect", "")
        operator = toleration.get("operator") or "Equal"
        if key and key != taint["key"]:
            continue
        if not key and operator != "Exists":
            continue
        if effect and effect != taint["effect"]:
            continue
        if operator == "Exists" or toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


_QUANTITY = re.compile(r"([0-9.]+)([a-zA-Z]*)")
_QUANTITY_SUFFIXES = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity(text: str) -> float:
    """A Kubernetes resource quantity (`500m`, `2Gi`, `4`) as a plain number."""
    found = _QUANTITY.fullmatch(str(text).strip())
    if found is None or found[2] not in _QUANTITY_SUFFIXES:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return float(found[1]) * _QUANTITY_SUFFIXES[found[2]]
