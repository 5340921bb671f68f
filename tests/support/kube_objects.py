"""What the test kubelet writes, shaped as the real kubelet, scheduler and Job controller do.

Pure builders: the pod a Job controller makes from a Job's template, the pod
statuses of each stage (waiting, unschedulable, running, terminated), a Job's
final status, the FailedCreate event of a Job whose pod the API refused (over
quota, a missing service account), and the scheduler's
message when no `Node` fits.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

_SCHEDULED = {"type": "PodScheduled", "status": "True"}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
# What GKE leaves to pods on an e2-standard-8 (8 vCPU, 32 GiB): cpu-only nodes.
_DEFAULT_CPU_MILLICORES = 7910
_DEFAULT_MEMORY_MIB = 28360


@dataclass
class Node:
    """A node the kubelet's scheduler can place pods on.

    `allocatable` holds extended resources (google.com/tpu, nvidia.com/gpu); cpu and
    memory are `cpu_millicores` and `memory_mib`. Pods do not use them up: the scheduler
    only checks that one pod fits.
    """

    name: str = "node-1"
    labels: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, int] = field(default_factory=dict)
    cpu_millicores: int = _DEFAULT_CPU_MILLICORES
    memory_mib: int = _DEFAULT_MEMORY_MIB

    def as_object(self) -> dict[str, Any]:
        allocatable = {k: str(v) for k, v in self.allocatable.items()}
        allocatable.update(cpu=f"{self.cpu_millicores}m", memory=f"{self.memory_mib}Mi")
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels},
            "status": {"allocatable": allocatable},
        }

    @property
    def pool(self) -> str | None:
        return self.labels.get(NODE_POOL_LABEL)


def gke_nodes(pool: str, accelerator: str, count: int, spot: bool = False) -> list[Node]:
    """`count` nodes of a GKE node pool for `accelerator`, labelled as GKE labels them.

    The accelerator's node labels (gke-tpu-accelerator and gke-tpu-topology, or
    gke-accelerator), the pool's name and machine type, and the machine's allocatable
    capacity (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes).
    """
    from kinetic_prefect.launch.accelerators import machine_type, parse_accelerator

    acc = parse_accelerator(accelerator, spot=spot)
    labels = {**acc.node_selector, NODE_POOL_LABEL: pool}
    extended: dict[str, int] = {}
    cpu, memory = _DEFAULT_CPU_MILLICORES, _DEFAULT_MEMORY_MIB
    if acc.machine_type is not None:
        labels[INSTANCE_TYPE_LABEL] = acc.machine_type
        cpu, memory = machine_type(acc.machine_type).allocatable()
        extended = {k: int(v) for k, v in acc.resource_limits.items()}
    if acc.kind == "gpu":
        labels["cloud.google.com/gke-accelerator-count"] = str(acc.count)
    return [
        Node(f"gke-{pool}-{index}", dict(labels), dict(extended), cpu, memory)
        for index in range(count)
    ]


def _short_of(node: Node, requests: dict[str, str]) -> list[str]:
    """The resources of `requests` that `node` cannot give one pod."""
    from kinetic_prefect.launch.accelerators import parse_quantity

    short = []
    for resource, amount in requests.items():
        if resource == "cpu":
            enough = parse_quantity(amount) * 1000 <= node.cpu_millicores
        elif resource == "memory":
            enough = parse_quantity(amount) <= node.memory_mib * 2**20
        else:
            enough = node.allocatable.get(resource, 0) >= int(amount)
        if not enough:
            short.append(resource)
    return short


def _affinity_key(pod_spec: dict[str, Any]) -> str | None:
    """The topology key of the pod's required pod affinity (a slice's node pool), if any."""
    terms = ((pod_spec.get("affinity") or {}).get("podAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or []
    return terms[0]["topologyKey"] if terms else None


def unschedulable_message(nodes: list[Node], pod_spec: dict[str, Any], pods: int = 1) -> str | None:
    """The scheduler's message when no node fits, else None.

    `pods` > 1 (a slice's pods, one per node): the message the pods left over get
    when fewer nodes than pods fit.
    """
    selector = pod_spec.get("nodeSelector") or {}
    requests = (pod_spec["containers"][0].get("resources") or {}).get("requests") or {}
    total = len(nodes)
    matching = [n for n in nodes if all(n.labels.get(k) == v for k, v in selector.items())]
    if not matching:
        return (
            f"0/{total} nodes are available: {total} node(s) didn't match Pod's node "
            f"affinity/selector. preemption: 0/{total} nodes are available: {total} "
            "Preemption is not helpful for scheduling."
        )
    shortages = [_short_of(n, requests) for n in matching]
    if all(shortages):
        counts = ", ".join(
            f"{sum(r in short for short in shortages)} Insufficient {r}"
            for r in requests
            if any(r in short for short in shortages)
        )
        return f"0/{total} nodes are available: {counts}."
    if pods > len(matching):
        others = total - len(matching)
        extended = [r for r in requests if "/" in r]
        resources = ", ".join(f"{len(matching)} Insufficient {r}" for r in extended)
        return (
            f"0/{total} nodes are available: {resources}, {others} node(s) didn't match "
            f"Pod's node affinity/selector. preemption: 0/{total} nodes are available: "
            f"{total} Preemption is not helpful for scheduling."
        )
    return None


def place(
    nodes: list[Node], pod_spec: dict[str, Any], pods: int, busy_pools: set[str]
) -> list[Node] | str:
    """One node per pod, or the scheduler's message when they do not all fit.

    With a required pod affinity on the node pool (a slice's), all pods go to one pool
    that no other slice uses (the slice's anti-affinity), as the scheduler would place
    them; otherwise to any fitting nodes.
    """
    message = unschedulable_message(nodes, pod_spec, pods)
    if message:
        return message
    selector = pod_spec.get("nodeSelector") or {}
    requests = (pod_spec["containers"][0].get("resources") or {}).get("requests") or {}
    fitting = [
        n
        for n in nodes
        if all(n.labels.get(k) == v for k, v in selector.items()) and not _short_of(n, requests)
    ]
    key = _affinity_key(pod_spec)
    if key is None:
        return fitting[:pods]
    pools: dict[str, list[Node]] = {}
    for node in fitting:
        pools.setdefault(node.labels.get(key, ""), []).append(node)
    for pool, members in pools.items():
        if pool and pool not in busy_pools and len(members) >= pods:
            return members[:pods]
    total = len(nodes)
    return (
        f"0/{total} nodes are available: {len(fitting)} node(s) didn't match pod affinity "
        f"rules, {len(fitting)} node(s) didn't match pod anti-affinity rules. preemption: "
        f"0/{total} nodes are available: {total} Preemption is not helpful for scheduling."
    )


def pod_of_job(
    job: dict[str, Any],
    name: str,
    namespace: str,
    index: int | None = None,
    node_name: str | None = None,
) -> dict[str, Any]:
    """The pod the Job controller creates from the Job's template (`index`: of an Indexed Job).

    `node_name`: the node the scheduler bound it to.
    """
    job_name = job["metadata"]["name"]
    template = job["spec"]["template"]
    annotations = dict(template["metadata"].get("annotations") or {})
    spec = dict(template["spec"])
    if index is not None:
        annotations["batch.kubernetes.io/job-completion-index"] = str(index)
        spec["hostname"] = f"{job_name}-{index}"
    if node_name is not None:
        spec["nodeName"] = node_name
    labels = {
        **(template["metadata"].get("labels") or {}),
        "batch.kubernetes.io/job-name": job_name,
        "job-name": job_name,
        "controller-uid": job["metadata"]["uid"],
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "generateName": f"{job_name}-" if index is None else f"{job_name}-{index}-",
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": job_name,
                    "uid": job["metadata"]["uid"],
                    "controller": True,
                }
            ],
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


def unschedulable_status(message: str) -> dict[str, Any]:
    return {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
            }
        ],
    }


def _task_container(image: str, ready: bool, state: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": "task", "image": image, "ready": ready, "state": state}]


def waiting_status(image: str, reason: str, message: str) -> dict[str, Any]:
    return {
        "phase": "Pending",
        "conditions": [_SCHEDULED],
        "containerStatuses": _task_container(
            image, False, {"waiting": {"reason": reason, "message": message}}
        ),
    }


def running_status(image: str) -> dict[str, Any]:
    return {
        "phase": "Running",
        "startTime": now(),
        "conditions": [_SCHEDULED],
        "containerStatuses": _task_container(image, True, {"running": {"startedAt": now()}}),
    }


def terminated_status(
    image: str, exit_code: int, reason: str | None = None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A pod that ended; `extra` adds or replaces pod status fields (reason, conditions)."""
    terminated = {
        "exitCode": exit_code,
        "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        "finishedAt": now(),
    }
    return {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "conditions": [_SCHEDULED],
        "containerStatuses": _task_container(image, False, {"terminated": terminated}),
        **(extra or {}),
    }


def finished_job_status(exit_code: int) -> dict[str, Any]:
    """The Job controller's status for a Job whose one pod ended with `exit_code`."""
    condition = (
        {"type": "Complete", "status": "True", "lastTransitionTime": now()}
        if exit_code == 0
        else {
            "type": "Failed",
            "status": "True",
            "reason": "BackoffLimitExceeded",
            "message": "Job has reached the specified backoff limit",
        }
    )
    return {"conditions": [condition], "succeeded" if exit_code == 0 else "failed": 1}


def quota_refusal(pod_name: str) -> str:
    """The API server's 403 message for a pod a GPU ResourceQuota forbids."""
    return (
        f'pods "{pod_name}" is forbidden: exceeded quota: gpu-quota, '
        "requested: nvidia.com/gpu=1, used: nvidia.com/gpu=8, limited: nvidia.com/gpu=8"
    )


def failed_create_event(job: dict[str, Any], event_name: str, refusal: str) -> dict[str, Any]:
    """The Job controller's FailedCreate event: the API server refused its pod with `refusal`."""
    namespace = job["metadata"]["namespace"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name, "namespace": namespace},
        "involvedObject": {
            "kind": "Job",
            "name": job["metadata"]["name"],
            "namespace": namespace,
            "apiVersion": "batch/v1",
            "uid": job["metadata"]["uid"],
        },
        "reason": "FailedCreate",
        "type": "Warning",
        "message": f"Error creating: {refusal}",
        "lastTimestamp": now(),
    }
