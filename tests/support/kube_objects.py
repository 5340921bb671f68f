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

from tests.support.gke_machines import (
    GPU_RESOURCE,
    INSTANCE_TYPE_LABEL,
    MACHINES,
    NODE_POOL_LABEL,
    POOL_SHAPES,
    SPOT_LABEL,
    SystemPod,
    allocatable,
    extended_resources,
    held_by,
    quantity,
    system_pods,
    tolerates,
)

__all__ = ["INSTANCE_TYPE_LABEL", "NODE_POOL_LABEL"]

_SCHEDULED = {"type": "PodScheduled", "status": "True"}
# The taint the node lifecycle controller puts on a node whose Ready condition is Unknown.
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# The default cluster's node when a test sets none: an e2-standard-8 of the default pool.
_DEFAULT_CPU_MILLICORES, _DEFAULT_MEMORY_MIB = allocatable(MACHINES["e2-standard-8"])


@dataclass
class Node:
    """A node the kubelet's scheduler can place pods on.

    `allocatable` holds extended resources (google.com/tpu, nvidia.com/gpu); cpu and
    memory are `cpu_millicores` and `memory_mib`. Its system DaemonSets' pods hold
    `system` of them (in the units of `_amount`), and the pods bound to it use them up
    (`used`) until they end. A pod lands only where it tolerates every NoSchedule
    `taint`. An `unlimited` node (the default cluster's one) stands for a cluster big
    enough for any test: pods share it without using it up, and the scheduler only
    checks that one pod fits.
    """

    name: str = "node-1"
    labels: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, int] = field(default_factory=dict)
    cpu_millicores: int = _DEFAULT_CPU_MILLICORES
    memory_mib: int = _DEFAULT_MEMORY_MIB
    unlimited: bool = False
    taints: list[dict[str, str]] = field(default_factory=list)
    # Its system DaemonSets' pods, which the API lists too (`system_pod_objects`).
    system_pods: tuple[SystemPod, ...] = ()
    used: dict[str, int] = field(default_factory=dict)
    # Its Ready condition: "True", "False" or "Unknown" (its kubelet stopped reporting).
    ready: str = "True"
    # Cordoned (`kubectl cordon`: spec.unschedulable), with the taint Kubernetes adds for it.
    cordoned: bool = False

    @property
    def system(self) -> dict[str, int]:
        """What its system pods hold (in the units of `_amount`)."""
        return held_by(self.system_pods)

    def as_object(self) -> dict[str, Any]:
        resources = {k: str(v) for k, v in self.allocatable.items()}
        resources.update(cpu=f"{self.cpu_millicores}m", memory=f"{self.memory_mib}Mi")
        ready = {"type": "Ready", "status": self.ready, "lastTransitionTime": now()}
        if self.ready == "Unknown":
            ready.update(reason="NodeStatusUnknown", message="Kubelet stopped posting node status.")
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels},
            "spec": {
                **({"taints": self.taints} if self.taints else {}),
                **({"unschedulable": True} if self.cordoned else {}),
            },
            "status": {"allocatable": resources, "conditions": [ready]},
        }

    def lose_contact(self) -> None:
        """Its VM went away (a reclaimed spot VM, a slice being recreated): as the node
        lifecycle controller marks a node whose kubelet stopped posting status, Ready is
        Unknown and the node carries `node.kubernetes.io/unreachable` for NoSchedule and
        NoExecute (https://kubernetes.io/docs/concepts/scheduling-eviction/taint-and-toleration/
        #taint-nodes-by-condition)."""
        self.ready = "Unknown"
        self.taints = [t for t in self.taints if t["key"] != UNREACHABLE_TAINT]
        self.taints += [
            {"key": UNREACHABLE_TAINT, "effect": e} for e in ("NoSchedule", "NoExecute")
        ]

    def come_back(self) -> None:
        """Its kubelet reports Ready again, and the controller lifts the condition's taints."""
        self.ready = "True"
        self.taints = [t for t in self.taints if t["key"] != UNREACHABLE_TAINT]

    def system_pod_objects(self) -> list[dict[str, Any]]:
        """One Pod object per system DaemonSet pod bound to this node, as the API lists them.

        In `kube-system`, bound (`spec.nodeName`) and Running, each with its requests
        (tests/support/gke_machines.py).
        """
        pods = []
        for pod in self.system_pods:
            requests = {"cpu": f"{pod.cpu_millicores}m"}
            if pod.memory_mib:
                requests["memory"] = f"{pod.memory_mib}Mi"
            pods.append(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"{pod.name}-{self.name}",
                        "namespace": "kube-system",
                        "labels": {"k8s-app": pod.name},
                    },
                    "spec": {
                        "nodeName": self.name,
                        "containers": [
                            {
                                "name": pod.name,
                                "image": f"gke.gcr.io/{pod.name}",
                                "resources": {"requests": requests},
                            }
                        ],
                    },
                    "status": {"phase": "Running"},
                }
            )
        return pods

    def untolerated(self, pod_spec: dict[str, Any]) -> dict[str, str] | None:
        """The first NoSchedule taint of this node the pod does not tolerate, if any.

        A pod that requests GPUs tolerates GKE's GPU taint whatever it says: GKE adds
        that toleration itself (the ExtendedResourceToleration admission).
        """
        tolerations = list(pod_spec.get("tolerations") or [])
        if GPU_RESOURCE in pod_requests(pod_spec):
            tolerations.append({"key": GPU_RESOURCE, "operator": "Exists"})
        return next(
            (
                t
                for t in self.taints
                if t["effect"] in ("NoSchedule", "NoExecute") and not tolerates(tolerations, t)
            ),
            None,
        )

    def admits(self, pod_spec: dict[str, Any]) -> bool:
        """Whether the pod may land here at all: taints tolerated, node selector matched."""
        return self.untolerated(pod_spec) is None and self.matches(
            pod_spec.get("nodeSelector") or {}
        )

    @property
    def pool(self) -> str | None:
        return self.labels.get(NODE_POOL_LABEL)

    def matches(self, selector: dict[str, str]) -> bool:
        return all(self.labels.get(k) == v for k, v in selector.items())

    def short_of(self, requests: dict[str, str], empty: bool = False) -> list[str]:
        """The resources of `requests` this node cannot give one more pod (`empty`: even with
        no pod bound to it)."""
        short = []
        for resource, amount in requests.items():
            have = _capacity(self, resource)
            if not self.unlimited:
                have -= self.system.get(resource, 0)
            if not empty and not self.unlimited:
                have -= self.used.get(resource, 0)
            if _amount(resource, amount) > have:
                short.append(resource)
        return short

    def bind(self, requests: dict[str, str]) -> None:
        """A pod asking for `requests` was bound here: it holds them until `release`."""
        if not self.unlimited:
            for resource, amount in requests.items():
                self.used[resource] = self.used.get(resource, 0) + _amount(resource, amount)

    def release(self, requests: dict[str, str]) -> None:
        if not self.unlimited:
            for resource, amount in requests.items():
                self.used[resource] = self.used.get(resource, 0) - _amount(resource, amount)


def _amount(resource: str, amount: str) -> int:
    """A request in whole units: cpu in millicores, memory in bytes, extended resources as is."""
    if resource == "cpu":
        return round(quantity(amount) * 1000)
    if resource == "memory":
        return round(quantity(amount))
    return int(amount)


def _capacity(node: Node, resource: str) -> int:
    if resource == "cpu":
        return node.cpu_millicores
    if resource == "memory":
        return node.memory_mib * 2**20
    return node.allocatable.get(resource, 0)


def gke_nodes(
    pool: str, accelerator: str, count: int, spot: bool = False, first: int = 0
) -> list[Node]:
    """`count` nodes of a GKE node pool made for `accelerator` (a key of `POOL_SHAPES`).

    Labelled and tainted as GKE does, with the machine's allocatable and its system
    pods' requests (tests/support/gke_machines.py). `first`: the index of the first
    node's name (a pool that grows).
    """
    shape = POOL_SHAPES[accelerator]
    machine = MACHINES[shape.machine]
    labels = {**shape.labels, NODE_POOL_LABEL: pool, INSTANCE_TYPE_LABEL: machine.name}
    if spot:
        labels[SPOT_LABEL] = "true"
    cpu, memory = allocatable(machine)
    return [
        Node(
            f"gke-{pool}-{index}",
            dict(labels),
            extended_resources(machine),
            cpu,
            memory,
            taints=[dict(t) for t in shape.taints],
            system_pods=system_pods(labels),
        )
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
    """The container's requests; a resource with a limit and no request requests its limit,
    as the API server defaults it."""
    resources = pod_spec["containers"][0].get("resources") or {}
    return {**(resources.get("limits") or {}), **(resources.get("requests") or {})}


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
    # Kubernetes 1.34 and later (GKE's versions) enable dynamic resource allocation, whose
    # PostFilter clause comes before the preemption verdicts.
    return (
        f"0/{total} nodes are available: {_histogram(reasons)}. no new claims to deallocate, "
        f"preemption: 0/{total} nodes are available: {_histogram(verdicts)}."
    )


# kube-scheduler's TaintToleration reason as GKE's current versions print it (Kubernetes
# 1.34 and later name no taint: kubernetes/kubernetes#134740; before, "node(s) had
# untolerated taint {KEY: VALUE}").
UNTOLERATED_TAINT = "node(s) had untolerated taint(s)"
# kube-scheduler's NodeUnschedulable reason for a cordoned node, and the taint a cordon adds
# (a pod tolerating it may land there all the same).
CORDONED = "node(s) were unschedulable"
CORDON_TAINT = "node.kubernetes.io/unschedulable"


def _node_verdict(node: Node, pod_spec: dict[str, Any]) -> tuple[list[str], str]:
    """(the scheduler's reasons against `node`, its preemption verdict); no reasons: it fits.

    Filters run in kube-scheduler's default order, the first that fails giving the
    node's reason: NodeUnschedulable (a cordon), TaintToleration, then NodeAffinity (the
    node selector), then NodeResourcesFit. A cordon, a taint or a selector no pod's end
    can change is "not helpful".
    """
    if node.cordoned and not tolerates(
        list(pod_spec.get("tolerations") or []), {"key": CORDON_TAINT, "effect": "NoSchedule"}
    ):
        return [CORDONED], _NOT_HELPFUL
    if node.untolerated(pod_spec) is not None:
        return [UNTOLERATED_TAINT], _NOT_HELPFUL
    requests = pod_requests(pod_spec)
    if not node.matches(pod_spec.get("nodeSelector") or {}):
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
    requests = pod_requests(pod_spec)
    total = len(nodes)
    verdicts = [_node_verdict(n, pod_spec) for n in nodes]
    if all(reasons for reasons, _ in verdicts):
        return _fit_error(
            total, [r for reasons, _ in verdicts for r in reasons], [v for _, v in verdicts]
        )
    matching = [n for n in nodes if n.admits(pod_spec) and not n.short_of(requests, empty=True)]
    if pods > len(matching):
        # The slice's pods past the matching nodes: each other node turned them away.
        others = [r for n in nodes if n not in matching for r in _node_verdict(n, pod_spec)[0]]
        extended = [f"Insufficient {r}" for r in requests if "/" in r]
        reasons = [r for r in extended for _ in matching] + others
        return _fit_error(total, reasons, [_NOT_HELPFUL] * total)
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
    requests = pod_requests(pod_spec)
    matching = [n for n in nodes if n.admits(pod_spec) and not n.short_of(requests, empty=True)]
    found = _pool_of(matching, pod_spec, pods)
    if found is not None:
        return found
    total = len(nodes)
    if _pool_of(matching, pod_spec, pods, count_busy=True) is None:
        # Enough nodes, but no one pool has enough of them: the affinity rules say no.
        fitting = len(matching)
        reasons = ["node(s) didn't match pod affinity rules"] * fitting
        reasons += ["node(s) didn't match pod anti-affinity rules"] * fitting
        return _fit_error(total, reasons, [_NOT_HELPFUL] * total)
    # A pool would do once the pods holding its nodes end.
    verdicts = [_node_verdict(n, pod_spec) for n in nodes]
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
    if template.untolerated(pod_spec) is not None:
        return UNTOLERATED_TAINT
    if not template.matches(pod_spec.get("nodeSelector") or {}):
        return _MISMATCH
    too_small = template.short_of(pod_requests(pod_spec), empty=True)
    if too_small:
        return f"Insufficient {too_small[0]}"
    return MAX_SIZE_REACHED if size >= max_nodes else None
