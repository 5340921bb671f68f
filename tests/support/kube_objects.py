"""What the test kubelet writes, shaped as the real kubelet, scheduler and Job controller do.

Pure builders: the pod a Job controller makes from a Job's template, the pod
statuses of each stage (waiting, unschedulable, running, terminated), a Job's
final status, the FailedCreate event of a Job whose pod the API refused (over
quota, a missing service account), the scheduler's message when no `Node` fits,
and the events the scheduler and the cluster autoscaler record about a pending pod.
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
    memory are `cpu_millicores` and `memory_mib`. The pods bound to it use them up
    (`used`, in the units of `_amount`) until they end. An `unlimited` node (the default
    cluster's one) stands for a cluster big enough for any test: pods share it without
    using it up, and the scheduler only checks that one pod fits.
    """

    name: str = "node-1"
    labels: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, int] = field(default_factory=dict)
    cpu_millicores: int = _DEFAULT_CPU_MILLICORES
    memory_mib: int = _DEFAULT_MEMORY_MIB
    unlimited: bool = False
    used: dict[str, int] = field(default_factory=dict)

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

    def matches(self, selector: dict[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in selector.items())

    def short_of(self, requests: dict[str, str], empty: bool = False) -> list[str]:
        """The resources of `requests` this node cannot give one more pod (`empty`: even with
        no pod bound to it)."""
        short = []
        for resource, quantity in requests.items():
            have = _capacity(self, resource)
            if not empty and not self.unlimited:
                have -= self.used.get(resource, 0)
            if _amount(resource, quantity) > have:
                short.append(resource)
        return short

    def bind(self, requests: dict[str, str]) -> None:
        """A pod asking for `requests` was bound here: it holds them until `release`."""
        if not self.unlimited:
            for resource, quantity in requests.items():
                self.used[resource] = self.used.get(resource, 0) + _amount(resource, quantity)

    def release(self, requests: dict[str, str]) -> None:
        if not self.unlimited:
            for resource, quantity in requests.items():
                self.used[resource] = self.used.get(resource, 0) - _amount(resource, quantity)


def _amount(resource: str, quantity: str) -> int:
    """A request in whole units: cpu in millicores, memory in bytes, extended resources as is."""
    from kinetic_prefect.launch.accelerators import parse_quantity

    if resource == "cpu":
        return round(parse_quantity(quantity) * 1000)
    if resource == "memory":
        return round(parse_quantity(quantity))
    return int(quantity)


def _capacity(node: Node, resource: str) -> int:
    if resource == "cpu":
        return node.cpu_millicores
    if resource == "memory":
        return node.memory_mib * 2**20
    return node.allocatable.get(resource, 0)


def gke_nodes(
    pool: str, accelerator: str, count: int, spot: bool = False, first: int = 0
) -> list[Node]:
    """`count` nodes of a GKE node pool for `accelerator`, labelled as GKE labels them.

    The accelerator's node labels (gke-tpu-accelerator and gke-tpu-topology, or
    gke-accelerator), the pool's name and machine type, and the machine's allocatable
    capacity (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes).
    `first`: the index of the first node's name (a pool that grows).
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
        for index in range(first, first + count)
    ]


@dataclass
class NodePool:
    """A GKE node pool the cluster autoscaler may grow up to `max_nodes` nodes."""

    name: str
    accelerator: str
    max_nodes: int
    spot: bool = False

    def new_node(self, index: int) -> Node:
        return gke_nodes(self.name, self.accelerator, 1, self.spot, first=index)[0]

    @property
    def group(self) -> str:
        """The pool's managed instance group, as the autoscaler's events name it."""
        return (
            "https://www.googleapis.com/compute/v1/projects/kinetic-test/zones/us-central1-a/"
            f"instanceGroups/gke-kinetic-{self.name}-grp"
        )


def pod_requests(pod_spec: dict[str, Any]) -> dict[str, str]:
    return dict((pod_spec["containers"][0].get("resources") or {}).get("requests") or {})


_MISMATCH = "node(s) didn't match Pod's node affinity/selector"
# The scheduler's preemption verdict per node: victims could make room, or nothing could
# (a node that does not match, or too small even when empty: Kubernetes 1.34 marks those
# UnschedulableAndUnresolvable, kubernetes/kubernetes#131345).
_NO_VICTIMS = "No preemption victims found for incoming pod"
_NOT_HELPFUL = "Preemption is not helpful for scheduling"


def _histogram(reasons: list[str]) -> str:
    """Reasons counted and sorted as the scheduler's FitError writes them."""
    counts: dict[str, int] = {}
    for reason in reasons:
        counts[reason] = counts.get(reason, 0) + 1
    return ", ".join(sorted(f"{count} {reason}" for reason, count in counts.items()))


def _fit_error(total: int, reasons: list[str], verdicts: list[str]) -> str:
    return (
        f"0/{total} nodes are available: {_histogram(reasons)}. preemption: 0/{total} nodes "
        f"are available: {_histogram(verdicts)}."
    )


def _node_verdict(
    node: Node, selector: dict[str, str], requests: dict[str, str]
) -> tuple[list[str], str]:
    """(the scheduler's reasons against `node`, its preemption verdict); no reasons: it fits."""
    if not node.matches(selector):
        return [_MISMATCH], _NOT_HELPFUL
    too_small = node.short_of(requests, empty=True)
    if too_small:
        return [f"Insufficient {r}" for r in too_small], _NOT_HELPFUL
    return [f"Insufficient {r}" for r in node.short_of(requests)], _NO_VICTIMS


def _affinity_key(pod_spec: dict[str, Any]) -> str | None:
    """The topology key of the pod's required pod affinity (a slice's node pool), if any."""
    terms = ((pod_spec.get("affinity") or {}).get("podAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or []
    return terms[0]["topologyKey"] if terms else None


def unschedulable_message(nodes: list[Node], pod_spec: dict[str, Any], pods: int = 1) -> str | None:
    """The scheduler's message when no node fits one more pod, else None.

    `pods` > 1 (a slice's pods, one per node): the message the pods left over get
    when no node pool has that many matching nodes.
    """
    selector = pod_spec.get("nodeSelector") or {}
    requests = pod_requests(pod_spec)
    total = len(nodes)
    verdicts = [_node_verdict(n, selector, requests) for n in nodes]
    if all(reasons for reasons, _ in verdicts):
        return _fit_error(
            total, [r for reasons, _ in verdicts for r in reasons], [v for _, v in verdicts]
        )
    matching = [n for n in nodes if n.matches(selector) and not n.short_of(requests, empty=True)]
    if pods > len(matching):
        others = total - len(matching)
        extended = [r for r in requests if "/" in r]
        resources = ", ".join(f"{len(matching)} Insufficient {r}" for r in extended)
        return (
            f"0/{total} nodes are available: {resources}, {others} {_MISMATCH}. preemption: "
            f"0/{total} nodes are available: {total} {_NOT_HELPFUL}."
        )
    return None


def _pool_of(
    nodes: list[Node], pod_spec: dict[str, Any], pods: int, count_busy: bool = False
) -> list[Node] | None:
    """`pods` nodes of one pool (the slice's pod affinity key) among `nodes`, if one has them;
    `count_busy`: whether it would, were its nodes free."""
    key = _affinity_key(pod_spec)
    requests = pod_requests(pod_spec)
    pools: dict[str, list[Node]] = {}
    for node in nodes:
        if count_busy or not node.short_of(requests):
            pools.setdefault(node.labels.get(key or "", "") if key else "", []).append(node)
    for pool, members in pools.items():
        if (pool or not key) and len(members) >= pods:
            return members[:pods]
    return None


def place(nodes: list[Node], pod_spec: dict[str, Any], pods: int) -> list[Node] | str:
    """One free node per pod, or the scheduler's message when they do not all fit.

    With a required pod affinity on the node pool (a slice's), all pods go to one pool
    whose nodes are all free (a running slice uses its pool's chips up), as the
    scheduler would place them; otherwise to any fitting nodes.
    """
    message = unschedulable_message(nodes, pod_spec, pods)
    if message:
        return message
    selector = pod_spec.get("nodeSelector") or {}
    requests = pod_requests(pod_spec)
    matching = [n for n in nodes if n.matches(selector) and not n.short_of(requests, empty=True)]
    found = _pool_of(matching, pod_spec, pods)
    if found is not None:
        return found
    total = len(nodes)
    if _pool_of(matching, pod_spec, pods, count_busy=True) is None:
        # Enough nodes, but no one pool has enough of them: the affinity rules say no.
        fitting = len(matching)
        return (
            f"0/{total} nodes are available: {fitting} node(s) didn't match pod affinity "
            f"rules, {fitting} node(s) didn't match pod anti-affinity rules. preemption: "
            f"0/{total} nodes are available: {total} {_NOT_HELPFUL}."
        )
    # A pool would do once the pods holding its nodes end.
    verdicts = [_node_verdict(n, selector, requests) for n in nodes]
    return _fit_error(
        total,
        [r for rs, _ in verdicts for r in (rs or ["node(s) didn't match pod affinity rules"])],
        [v for _, v in verdicts],
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
    return event(
        job, event_name, "FailedCreate", f"Error creating: {refusal}", "job-controller", "Warning"
    )


def event(
    about: dict[str, Any],
    event_name: str,
    reason: str,
    message: str,
    component: str,
    kind: str = "Normal",
) -> dict[str, Any]:
    """An event `component` records about the object `about` (a Job, a pod)."""
    meta = about["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": event_name, "namespace": meta["namespace"]},
        "involvedObject": {
            "kind": about["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "apiVersion": about["apiVersion"],
            "uid": meta.get("uid", ""),
        },
        "reason": reason,
        "type": kind,
        "message": message,
        "source": {"component": component},
        "reportingComponent": component,
        "lastTimestamp": now(),
    }


# The cluster autoscaler's events on a pending pod (the wording of its scale-up status
# processor: kubernetes/autoscaler FAQ "What events are emitted by CA?", #1607, #5692).
MAX_SIZE_REACHED = "max node group size reached"


def scale_up_refused(reasons: list[str]) -> str:
    """NotTriggerScaleUp's message: why each node group (pool) would not take the pod."""
    wouldnt_fit = "" if MAX_SIZE_REACHED in reasons else " (it wouldn't fit if a new node is added)"
    return f"pod didn't trigger scale-up{wouldnt_fit}: {_histogram(reasons)}"


def scale_up_triggered(pool: NodePool, size: int) -> str:
    """TriggeredScaleUp's message: the pool's instance group grows from `size` by one."""
    return f"pod triggered scale-up: [{{{pool.group} {size}->{size + 1} (max: {pool.max_nodes})}}]"


def pool_verdict(template: Node, pod_spec: dict[str, Any], size: int, max_nodes: int) -> str | None:
    """Why the autoscaler would not add a node like `template` for the pod; None: it would."""
    if not template.matches(pod_spec.get("nodeSelector") or {}):
        return _MISMATCH
    too_small = template.short_of(pod_requests(pod_spec), empty=True)
    if too_small:
        return f"Insufficient {too_small[0]}"
    return MAX_SIZE_REACHED if size >= max_nodes else None
