"""What Kubernetes says about a Job and its pod, read from the objects alone (no API calls).

Owns the interpretation shared by the gke backend and `kinetic-prefect jobs`: whether a
pod ever started, how it ended (exit code, signal, and the most telling reason:
preempted, Evicted, OOMKilled, DeadlineExceeded), why a pending pod is not running
(image pull, container config, unschedulable, with what the pod asks of a node) and
whether it waits for capacity that exists or can never be scheduled, why
the Job controller cannot create its pod (and whether waiting can help) and the
one-line status a Job shows in `jobs ls`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kinetic_prefect.backends.base import WAITING_FOR_CAPACITY
from kinetic_prefect.launch.accelerators import parse_quantity
from kinetic_prefect.launch.manifest import (
    ANNOTATION_ACCELERATOR,
    CONTAINER_NAME,
    LABEL_QUEUE_NAME,
    container_of,
)
from kinetic_prefect.launch.slices import hosts_of

_IMAGE_WAITING_REASONS = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
}
# The ServiceAccount admission plugin's refusal, as a FailedCreate event of the Job quotes it.
_MISSING_SERVICE_ACCOUNT = re.compile(
    r"error looking up service account (?P<namespace>[^/\s]+)/(?P<name>[^:\s]+): "
    r'serviceaccount "[^"]*" not found'
)
_CONFIG_WAITING_REASONS = {"CreateContainerConfigError", "CreateContainerError"}
# The kubelet's eviction messages for a pod over its own limits (eviction manager's
# podEphemeralStorageMessageFmt, containerEphemeralStorageMessageFmt, emptyDirMessageFmt).
_OWN_LIMIT_EVICTIONS = (
    "exceeds the total limit of containers",
    "exceeded its local ephemeral storage limit",
    "Usage of EmptyDir volume",
)
_DISRUPTIONS = {
    "PreemptionByScheduler": "preempted by the scheduler for a higher-priority pod",
    "TerminationByKubelet": "preempted: the node is shutting down (spot or maintenance)",
    "DeletionByTaintManager": "preempted: the node was tainted (spot reclaim or node problem)",
    "EvictionByEvictionAPI": "evicted through the Eviction API (node drain or upgrade)",
    "DeletionByPodGC": "preempted: the node disappeared",
}


def _conditions(obj: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list(((obj or {}).get("status") or {}).get("conditions") or [])


def true_condition(obj: Mapping[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The condition of type `kind` whose status is True, if the object has one."""
    return _condition(obj, kind, "True")


def false_condition(obj: Mapping[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The condition of type `kind` whose status is False, if the object has one."""
    return _condition(obj, kind, "False")


def _condition(obj: Mapping[str, Any] | None, kind: str, status: str) -> dict[str, Any] | None:
    for condition in _conditions(obj):
        if condition.get("type") == kind and condition.get("status") == status:
            return condition
    return None


def queue_name_of(job: Mapping[str, Any] | None) -> str | None:
    """The Kueue LocalQueue a Job (or Job manifest) is labelled for, if any."""
    labels = ((job or {}).get("metadata") or {}).get("labels") or {}
    name = labels.get(LABEL_QUEUE_NAME)
    return str(name) if name else None


def suspended(job: Mapping[str, Any] | None) -> bool:
    """Whether a Job is suspended (for a Job of a Kueue LocalQueue: not admitted yet)."""
    return bool(((job or {}).get("spec") or {}).get("suspend"))


def _task_container_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        if status.get("name") == CONTAINER_NAME:
            return dict(status)
    return dict(statuses[0]) if statuses else {}


def _terminated(pod: Mapping[str, Any]) -> dict[str, Any]:
    status = _task_container_status(pod)
    state = status.get("state") or {}
    return dict(state.get("terminated") or (status.get("lastState") or {}).get("terminated") or {})


def pod_phase(pod: Mapping[str, Any] | None) -> str:
    return str(((pod or {}).get("status") or {}).get("phase") or "")


def pod_started(pod: Mapping[str, Any] | None) -> bool:
    """Whether the container ever ran (a pod past Pending)."""
    if pod is None:
        return False
    if pod_phase(pod) in {"Running", "Succeeded", "Failed"}:
        return True
    state = _task_container_status(pod).get("state") or {}
    return "running" in state or "terminated" in state


def job_failure(job: Mapping[str, Any] | None) -> str:
    """The Job controller's reason for failing a Job, when it says more than the pod does.

    Past `activeDeadlineSeconds` it names the deadline and how Kubernetes counts it: from
    the Job's start, so time its pod waited for a node counts too.
    """
    condition = true_condition(job, "FailureTarget") or true_condition(job, "Failed")
    if condition is None or condition.get("reason") in {None, "", "BackoffLimitExceeded"}:
        return ""
    text = f"{condition.get('reason')}: {condition.get('message') or ''}".strip().rstrip(":")
    deadline = ((job or {}).get("spec") or {}).get("activeDeadlineSeconds")
    if condition.get("reason") == "DeadlineExceeded" and deadline is not None:
        text += (
            f" (activeDeadlineSeconds={deadline}, from timeout_seconds; Kubernetes counts it "
            "from the Job's start, time the pod waited for a node included)"
        )
    return text


def pod_outcome(
    pod: Mapping[str, Any] | None, job: Mapping[str, Any] | None = None
) -> tuple[int | None, int | None, str]:
    """(exit code, signal, reason) of a pod that ended, from its status and its Job's.

    The reason names what Kubernetes did to the pod (preempted, Evicted,
    OOMKilled, DeadlineExceeded); without one, an exit code above 128 is
    reported as the signal that killed the container.
    """
    pod = pod or {}
    status = pod.get("status") or {}
    terminated = _terminated(pod)
    exit_code = terminated.get("exitCode")
    signal = terminated.get("signal")
    disruption = true_condition(pod, "DisruptionTarget")
    # A node-pressure eviction carries TerminationByKubelet too: its own reason says more.
    if status.get("reason") == "Evicted":
        reason = f"Evicted: {status.get('message') or 'the node ran out of resources'}"
    elif disruption is not None:
        what = _DISRUPTIONS.get(str(disruption.get("reason")), "preempted")
        reason = f"{what} ({disruption.get('reason')}: {disruption.get('message') or ''})"
    elif terminated.get("reason") == "OOMKilled":
        reason = "OOMKilled: the container exceeded its memory limit"
    elif job_failure(job):
        reason = job_failure(job)
    elif status.get("reason"):
        reason = f"{status.get('reason')}: {status.get('message') or ''}".strip().rstrip(":")
    else:
        reason = ""
    if reason:
        signal = None
    elif signal is None and isinstance(exit_code, int) and exit_code > 128:
        signal = exit_code - 128
    return exit_code, signal, reason


def infrastructure_took(pod: Mapping[str, Any] | None) -> bool:
    """True when Kubernetes took the pod away (preemption, eviction, node loss), not the task.

    A pod evicted for going over its own ephemeral-storage limits is the task's doing:
    it would be again on any node (the kubelet gives it no DisruptionTarget for that).
    """
    status = (pod or {}).get("status") or {}
    if status.get("reason") == "Evicted" and any(
        words in str(status.get("message") or "") for words in _OWN_LIMIT_EVICTIONS
    ):
        return False
    return true_condition(pod, "DisruptionTarget") is not None or status.get("reason") in (
        "Evicted",
        "NodeLost",
        # A node shutting down (a reclaimed spot VM) rejects the pod at admission.
        "NodeShutdown",
        "Shutdown",
        "Terminated",
    )


def accelerator_hint(manifest: Mapping[str, Any]) -> str:
    """What the pod asks of a node, to name in an unschedulable message."""
    pod_spec = manifest["spec"]["template"]["spec"]
    accelerator = (manifest["metadata"].get("annotations") or {}).get(ANNOTATION_ACCELERATOR)
    selectors = ", ".join(f"{k}={v}" for k, v in (pod_spec.get("nodeSelector") or {}).items())
    limits = ", ".join(
        f"{k}: {v}"
        for k, v in ((container_of(manifest).get("resources") or {}).get("limits") or {}).items()
    )
    hosts = hosts_of(manifest)
    nodes = f"{hosts} nodes (one per host), each" if hosts > 1 else "a node"
    parts = [f"{nodes} with {selectors}" if selectors else "", f"{limits} free" if limits else ""]
    wants = " and ".join(part for part in parts if part)
    if not wants:
        return ""
    what = f"accelerator {accelerator or 'requested'}"
    if hosts > 1:
        topology = (pod_spec.get("nodeSelector") or {}).get("cloud.google.com/gke-tpu-topology")
        what = f"the {hosts}-host slice {accelerator} (topology {topology})"
        pool = f"a TPU slice node pool of topology {topology} with {hosts} free nodes"
    else:
        pool = "a node pool offers it"
    return (
        f"{what} needs {wants}; check that {pool} "
        f"(kinetic-prefect doctor --accelerator {accelerator or 'NAME'})"
    )


def _asked(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """What the task container asks for (a limit without a request is its request)."""
    resources = container_of(manifest).get("resources") or {}
    return {**(resources.get("limits") or {}), **(resources.get("requests") or {})}


def _could_hold(node: Mapping[str, Any], manifest: Mapping[str, Any]) -> bool:
    """Whether `node`'s allocatable covers what the task container asks, were it empty."""
    asked = _asked(manifest)
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    try:
        return all(
            resource in allocatable
            and parse_quantity(allocatable[resource]) >= parse_quantity(amount)
            for resource, amount in asked.items()
        )
    except ValueError:
        return True  # a quantity this cannot read: let the scheduler's word stand


@dataclass(frozen=True)
class Pending:
    """Why a pod waits to start: `reason` to show, and whether it `waits_for_capacity`.

    A pod waiting for capacity that exists (nodes of its kind are busy, or the cluster
    autoscaler is adding one) will start once capacity frees; any other pending reason
    (no node pool matches, a request no node can hold, an image that cannot be pulled)
    will not go away by waiting.
    """

    reason: str
    waits_for_capacity: bool = False
    # The scheduler said Unschedulable (the pod's events may tell more).
    unschedulable: bool = False
    # It waits for nodes of its kind that are not ready or cordoned (`nodes_down`): a
    # node pool being repaired or recreated, which may come back without any pod ending.
    waits_for_nodes: bool = False


def pending(
    pod: Mapping[str, Any],
    manifest: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]] = (),
    nodes: Sequence[Mapping[str, Any]] | None = None,
    nodes_refused: bool = False,
) -> Pending | None:
    """Why a pending pod is not running, when Kubernetes says so; None while it just starts.

    `events`: the pod's own events, when they were read: the cluster autoscaler's
    TriggeredScaleUp / NotTriggerScaleUp tell whether a node is on its way.
    `nodes`: the nodes its node selector matches, when they were read (`reads_nodes`):
    nodes of its kind that could hold it but are not ready or cordoned will take it once
    they are back. `nodes_refused`: listing them was forbidden (the reason says what to grant).
    """
    container = _task_container_status(pod)
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason")
    message = waiting.get("message") or ""
    if reason in _IMAGE_WAITING_REASONS:
        image = container_of(manifest).get("image") or container.get("image")
        return Pending(f"cannot pull image {image} ({reason}: {message})".replace(": )", ")"))
    if reason in _CONFIG_WAITING_REASONS:
        return Pending(f"cannot create the container ({reason}: {message})".replace(": )", ")"))
    for condition in _conditions(pod):
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            if condition.get("reason") != "Unschedulable":
                continue
            message = str(condition.get("message") or "")
            return _unschedulable(message, manifest, events, nodes, nodes_refused)
    return None


def _scheduled_condition_message(pod: Mapping[str, Any]) -> str:
    for condition in _conditions(pod):
        if condition.get("type") == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return str(condition.get("message") or "")
    return ""


def reads_nodes(pod: Mapping[str, Any] | None, manifest: Mapping[str, Any]) -> bool:
    """Whether telling why the pod waits needs the nodes of its kind read: the scheduler
    turned nodes away for a taint or a cordon, which a node that is not ready carries. A
    pod without a node selector (any node is of its kind) is not worth listing them all."""
    if not node_selector_of(manifest):
        return False
    fit = _FIT_ERROR.match(_scheduled_condition_message(pod or {}))
    reasons = _histogram(fit.group("reasons")) if fit else {}
    return any(_UNTOLERATED in r or _CORDONED in r for r in reasons)


def node_selector_of(manifest: Mapping[str, Any]) -> str:
    """The pod's node selector as a label selector (which nodes are of its kind)."""
    selector = manifest["spec"]["template"]["spec"].get("nodeSelector") or {}
    return ",".join(f"{key}={value}" for key, value in sorted(selector.items()))


def nodes_down(nodes: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The nodes that take no new pod until they are back, by name, each with why.

    A node whose Ready condition is not True, or that carries one of the taints the node
    lifecycle controller puts on such a node (`node.kubernetes.io/not-ready`,
    `unreachable`, and `unschedulable` for a cordon), or that is cordoned
    (`spec.unschedulable`). A node under pressure (memory, disk, pids) is Ready: it is
    not down, and may stay so.
    """
    down: dict[str, str] = {}
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        spec = node.get("spec") or {}
        ready = true_condition(node, "Ready") is not None
        said = [c for c in _conditions(node) if c.get("type") == "Ready"]
        taints = [
            str(t.get("key"))
            for t in spec.get("taints") or []
            if t.get("key") in _DOWN_TAINTS and t.get("effect") in {"NoSchedule", "NoExecute"}
        ]
        why = sorted(set(taints))
        if said and not ready:
            why.insert(0, f"Ready={said[0].get('status')}")
        if spec.get("unschedulable") and _CORDON_TAINT not in why:
            why.append("cordoned")
        if why:
            down[name] = ", ".join(why)
    return down


def pending_reason(pod: Mapping[str, Any], manifest: Mapping[str, Any]) -> str | None:
    """`pending(pod, manifest)`'s reason alone."""
    found = pending(pod, manifest)
    return found.reason if found is not None else None


# The scheduler's message: "0/9 nodes are available: 1 node(s) didn't match Pod's node
# affinity/selector, 8 Insufficient google.com/tpu. preemption: 0/9 nodes are available:
# 1 Preemption is not helpful for scheduling, 8 No preemption victims found for incoming pod."
# With dynamic resource allocation on (Kubernetes 1.34 and later, as on GKE) its PostFilter
# adds a clause before the preemption part: "... . no new claims to deallocate, preemption: ...".
_FIT_ERROR = re.compile(
    r"0/(?P<total>\d+) nodes are available: (?P<reasons>.*?)\.(?: [^.:,]*,)?(?: preemption: "
    r"0/\d+ nodes are available: (?P<preemption>.*?)\.)?\s*$",
    re.DOTALL,
)
_COUNTED = re.compile(r"(?:^|, )(\d+) ((?:(?!, \d+ ).)+)")
# Nodes that match and could hold the pod once pods on them end (kube-scheduler marks
# nodes too small even when empty "not helpful", kubernetes/kubernetes#131345).
_NO_VICTIMS = "No preemption victims found for incoming pod"
_MISMATCH = "didn't match Pod's node affinity/selector"
# A node whose NoSchedule taint the pod does not tolerate (GKE taints GPU and TPU nodes):
# "node(s) had untolerated taint {google.com/tpu: present}", kube-scheduler's TaintToleration.
_UNTOLERATED = "had untolerated taint"
# A cordoned node (`spec.unschedulable`), kube-scheduler's NodeUnschedulable.
_CORDONED = "were unschedulable"
# The taints Kubernetes puts on a node that is not ready, unreachable or cordoned:
# https://kubernetes.io/docs/concepts/scheduling-eviction/taint-and-toleration/
# #taint-nodes-by-condition
_CORDON_TAINT = "node.kubernetes.io/unschedulable"
_DOWN_TAINTS = {"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable", _CORDON_TAINT}
_TRIGGERED_SCALE_UP = "TriggeredScaleUp"
_NOT_TRIGGERED_SCALE_UP = "NotTriggerScaleUp"
_MAX_SIZE = "max node group size reached"


def _histogram(text: str | None) -> dict[str, int]:
    return {reason: int(count) for count, reason in _COUNTED.findall(text or "")}


def _latest_autoscaler_event(events: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    found = [e for e in events if e.get("reason") in {_TRIGGERED_SCALE_UP, _NOT_TRIGGERED_SCALE_UP}]
    return max(found, key=_event_time) if found else None


def _event_time(event: Mapping[str, Any]) -> str:
    return str(event.get("lastTimestamp") or event.get("eventTime") or "")


def _unschedulable(
    message: str,
    manifest: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    nodes: Sequence[Mapping[str, Any]] | None = None,
    nodes_refused: bool = False,
) -> Pending:
    """Capacity that exists (busy nodes of its kind, a node on its way, nodes of its kind
    down for repair), or never fitting."""
    autoscaler = _latest_autoscaler_event(events)
    said = str((autoscaler or {}).get("message") or "")
    scaling_up = autoscaler is not None and autoscaler.get("reason") == _TRIGGERED_SCALE_UP
    fit = _FIT_ERROR.match(message)
    reasons = _histogram(fit.group("reasons")) if fit else {}
    total = int(fit.group("total")) if fit else 0
    short = sorted(r for r in reasons if r.startswith("Insufficient "))
    # An accelerator's pod is short of cpu and memory too: name what it waits for.
    short = [r for r in short if "/" in r] or short
    if fit is not None and fit.group("preemption") is not None:
        busy = _histogram(fit.group("preemption")).get(_NO_VICTIMS, 0)
    else:  # an older scheduler: every node short of a resource is taken for a busy one
        busy = max((n for r, n in reasons.items() if r.startswith("Insufficient ")), default=0)
    if busy or scaling_up:
        accelerator = (manifest["metadata"].get("annotations") or {}).get(ANNOTATION_ACCELERATOR)
        kind = f"{accelerator} " if accelerator else ""
        # Nodes of its kind: those neither its selector nor a taint turned it away from.
        matching = total - sum(n for r, n in reasons.items() if _MISMATCH in r or _UNTOLERATED in r)
        parts = []
        if busy:
            what = f" ({', '.join(short)})" if short else ""
            parts.append(
                f"{busy}/{matching} {kind}nodes busy{what}{_beside_system_pods(short, manifest)}"
            )
        if scaling_up:
            parts.append(f"the cluster autoscaler is adding a node ({said})")
        elif _MAX_SIZE in said:
            parts.append("its node pools are at their maximum size")
        return Pending(
            f"{WAITING_FOR_CAPACITY}: {'; '.join(parts)}",
            waits_for_capacity=True,
            unschedulable=True,
        )
    turned_away = sum(n for r, n in reasons.items() if _UNTOLERATED in r or _CORDONED in r)
    # Down nodes it waits for: of its kind, big enough once back, and enough of them.
    able = [node for node in nodes or () if _could_hold(node, manifest)]
    down = nodes_down(able) if turned_away and len(able) >= hosts_of(manifest) else {}
    if down:
        accelerator = (manifest["metadata"].get("annotations") or {}).get(ANNOTATION_ACCELERATOR)
        kind = f"{accelerator} " if accelerator else ""
        named = "; ".join(f"{name}: {why}" for name, why in sorted(down.items())[:4])
        more = f"; and {len(down) - 4} more" if len(down) > 4 else ""
        return Pending(
            f"{WAITING_FOR_CAPACITY}: {len(down)}/{len(nodes or ())} {kind}nodes not ready "
            f"({named}{more}); the pod starts once they are back (GKE repairs or recreates a "
            "node pool's nodes, a TPU slice's all at once)",
            waits_for_capacity=True,
            unschedulable=True,
            waits_for_nodes=True,
        )
    hint = accelerator_hint(manifest)
    if turned_away and nodes_refused:
        repair = (
            "nodes a taint or cordon turned away may be down for repair: to wait for them "
            "instead, let the runner list nodes (the ClusterRole kinetic-prefect-node-reader "
            "in deployments/k8s/rbac.yaml, bound by deployments/k8s/node-reader-binding.yaml)"
        )
        hint = "; ".join(part for part in (hint, repair) if part)
    text = f"unschedulable: {message or 'no node fits the pod'}"
    if autoscaler is not None:
        text += f" (cluster autoscaler: {said})"
    return Pending(f"{text} — {hint}" if hint else text, unschedulable=True)


_ACCELERATORS = ("nvidia.com/gpu", "google.com/tpu")
_HOST_RESOURCES = {"Insufficient cpu": "cpu", "Insufficient memory": "memory"}


def _beside_system_pods(short: list[str], manifest: Mapping[str, Any]) -> str:
    """A note for a GPU or TPU pod whose nodes are short of cpu or memory alone.

    kube-scheduler says `No preemption victims found` both for nodes other pods hold and
    for a request that fits a node's allocatable but not beside its system pods, which are
    never preempted for it (kubernetes#131345 marks only requests over the allocatable as
    unresolvable). With the accelerator itself free, the second is likely.
    """
    if (
        not short
        or not set(short) <= set(_HOST_RESOURCES)
        or not set(_asked(manifest)) & set(_ACCELERATORS)
    ):
        return ""
    what = " and ".join(_HOST_RESOURCES[r] for r in short)
    return (
        f" — their accelerators are free, so if nothing else runs there the pod asks for "
        f"more {what} than a node has beside its system pods (`kubectl describe node`, "
        f"Allocated resources): lower its {what}"
    )


def _latest_failed_create(events: list[dict[str, Any]]) -> str | None:
    failures = [e for e in events if e.get("reason") == "FailedCreate"]
    if not failures:
        return None
    latest = max(failures, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return str(latest.get("message") or "FailedCreate")


def failed_create_reason(events: list[dict[str, Any]]) -> str | None:
    """Why the Job controller cannot create a pod (quota, admission), from the Job's events."""
    message = _latest_failed_create(events)
    return f"cannot create the pod: {message}" if message is not None else None


def lasting_failed_create(events: list[dict[str, Any]]) -> str | None:
    """A reason from the Job's events that waiting will not fix, with the fix; else None.

    The pod's service account does not exist: the Job controller retries until someone
    creates it, so the pod would stay uncreated until the pending timeout.
    """
    message = _latest_failed_create(events)
    found = _MISSING_SERVICE_ACCOUNT.search(message or "")
    if found is None:
        return None
    namespace, name = found.group("namespace"), found.group("name")
    return (
        f"cannot create the pod: its service account {name} does not exist in namespace "
        f"{namespace} ({message}). Apply deployments/k8s/rbac.yaml to the namespace "
        f"(kubectl apply -n {namespace} -f deployments/k8s/rbac.yaml creates the accounts "
        "kinetic-prefect-runner and kinetic-prefect-pods), or set KineticCluster.service_account "
        f"to an account that exists (kubectl get serviceaccounts -n {namespace})"
    )


def job_status(
    job: Mapping[str, Any], pod: Mapping[str, Any] | None
) -> tuple[str, bool, str | None]:
    """(status, finished, when it finished) of a Job and its newest pod, as `jobs ls` shows it."""
    if job.get("metadata", {}).get("deletionTimestamp"):
        return "Deleting", False, None
    complete = true_condition(job, "Complete")
    if complete is not None:
        return "Succeeded", True, complete.get("lastTransitionTime")
    failed = true_condition(job, "Failed")
    if failed is not None:
        _, _, reason = pod_outcome(pod, job)
        detail = reason or job_failure(job) or failed.get("reason") or ""
        return (
            f"Failed: {detail}" if detail else "Failed",
            True,
            failed.get("lastTransitionTime"),
        )
    queue = queue_name_of(job)
    if queue is not None and suspended(job) and pod is None:
        return f"Queued: waiting for Kueue to admit it from LocalQueue {queue}", False, None
    if pod is not None:
        phase = pod_phase(pod) or "Pending"
        if phase == "Pending":
            manifest = {"metadata": job.get("metadata") or {}, "spec": job.get("spec") or {}}
            waiting = pending_reason(pod, manifest)
            return f"Pending: {waiting}" if waiting else "Pending", False, None
        return phase, phase in {"Succeeded", "Failed"}, None
    return "Pending", False, None
