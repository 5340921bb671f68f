"""Whether a pod fits a node, decided as kube-scheduler's NodeResourcesFit filter decides it.

A pod fits a node when, for every resource it requests, the node's `status.allocatable`
minus the requests of the pods already bound to it (`spec.nodeName`, not yet Succeeded or
Failed) is at least the pod's request
(https://kubernetes.io/docs/concepts/scheduling-eviction/kube-scheduler/#kube-scheduler-implementation,
https://kubernetes.io/docs/concepts/configuration/manage-resources-containers/#how-pods-with-resource-requests-are-scheduled).
Each pod also takes one of the node's `pods`. A container's request for a resource it only
limits is its limit (the API server defaults it so); a pod's request is its containers' and
sidecars' sum, or its largest init container if that is more, plus its `overhead`.

`kinetic-prefect doctor --accelerator` asks this of the nodes that match the task pod's node
selector; the pods kinetic-prefect runs there are told apart (they end), the rest
(GKE's system DaemonSets, other workloads) are taken to stay.

Example:
    >>> node = {"metadata": {"name": "n1"},
    ...         "status": {"allocatable": {"cpu": "3920m", "memory": "13034868Ki"}}}
    >>> pod = {"containers": [{"name": "task", "resources": {"requests": {"cpu": "4"}}}]}
    >>> node_fit(pod, node, []).short()
    ['cpu']
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kinetic_prefect.launch.accelerators import parse_quantity
from kinetic_prefect.launch.manifest import LABEL_MANAGED_BY, MANAGED_BY

__all__ = ["NodeFit", "amount", "listed", "node_fit", "pod_requests", "show"]

CPU, MEMORY, PODS = "cpu", "memory", "pods"
_ENDED = frozenset({"Succeeded", "Failed"})

Amounts = dict[str, int]


def amount(resource: str, quantity: Any) -> int:
    """`quantity` in the scheduler's units, rounded up: cpu in millicores, the rest whole.

    Example:
        >>> amount("cpu", "250m"), amount("memory", "1Ki")
        (250, 1024)
    """
    scale = 1000 if resource == CPU else 1
    # Rounded first: a float such as 3.92 * 1000 must not round up to 3921.
    return math.ceil(round(parse_quantity(str(quantity)) * scale, 6))


def show(resource: str, value: int) -> str:
    """An amount as kubectl would write it: ``3920m``, ``12597Mi``, ``4``."""
    if resource == CPU:
        return f"{value}m"
    if resource == MEMORY:
        mib = value / 2**20
        return f"{mib:.0f}Mi" if value % 2**20 == 0 else f"{mib:.1f}Mi"
    return str(value)


def listed(values: Mapping[str, int], which: Sequence[str] | None = None) -> str:
    """``cpu 3920m, memory 13621Mi, nvidia.com/gpu 1``: cpu and memory first, no `pods`
    unless `which` names it."""
    if which is None:
        which = sorted((r for r in values if r != PODS), key=lambda r: (r not in (CPU, MEMORY), r))
    return ", ".join(f"{r} {show(r, values.get(r, 0))}" for r in which)


def _container_requests(container: Mapping[str, Any]) -> Amounts:
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {resource: amount(resource, q) for resource, q in merged.items()}


def _add(total: Amounts, more: Mapping[str, int]) -> Amounts:
    return {k: total.get(k, 0) + more.get(k, 0) for k in {*total, *more}}


def _most(one: Amounts, other: Mapping[str, int]) -> Amounts:
    return {k: max(one.get(k, 0), other.get(k, 0)) for k in {*one, *other}}


def pod_requests(pod_spec: Mapping[str, Any]) -> Amounts:
    """What a pod asks of its node, in the units of :func:`amount`, as Kubernetes sums it.

    Init containers run one at a time before the others, next to the sidecars
    (`restartPolicy: Always`) started before them; sidecars keep running beside the
    containers.
    """
    running: Amounts = {}
    for container in pod_spec.get("containers") or []:
        running = _add(running, _container_requests(container))
    sidecars: Amounts = {}
    init_peak: Amounts = {}
    for container in pod_spec.get("initContainers") or []:
        own = _container_requests(container)
        if container.get("restartPolicy") == "Always":
            sidecars = _add(sidecars, own)
            init_peak = _most(init_peak, sidecars)
        else:
            init_peak = _most(init_peak, _add(own, sidecars))
    overhead = {r: amount(r, q) for r, q in (pod_spec.get("overhead") or {}).items()}
    asked = _add(_most(_add(running, sidecars), init_peak), overhead)
    return {r: v for r, v in asked.items() if v}


@dataclass(frozen=True)
class NodeFit:
    """What one node has for one more pod.

    `held` is what the node's pods that stay request (GKE's system DaemonSets among
    them); `ours` what kinetic-prefect's own pods there request (they end).
    """

    node: str
    labels: Mapping[str, str]
    asked: Amounts
    allocatable: Amounts
    held: Amounts = field(default_factory=dict)
    ours: Amounts = field(default_factory=dict)

    def free(self, resource: str, ours_gone: bool = False) -> int:
        """What the node can still give of `resource` (`ours_gone`: once our pods ended)."""
        taken = self.held.get(resource, 0) + (0 if ours_gone else self.ours.get(resource, 0))
        return self.allocatable.get(resource, 0) - taken

    def short(self, ours_gone: bool = False) -> list[str]:
        """The resources the pod asks for more of than the node can give now (or `ours_gone`)."""
        return [r for r, want in self.asked.items() if want > self.free(r, ours_gone)]

    def describe(self) -> str:
        """The node, what it has, what its pods take and what is left, for a message."""
        cpu_memory = [r for r in (CPU, MEMORY) if r in self.allocatable]
        shown = [*cpu_memory, *(r for r in self.short(ours_gone=True) if r not in cpu_memory)]
        held = {r: self.allocatable.get(r, 0) - self.free(r, ours_gone=True) for r in shown}
        left = {r: self.free(r, ours_gone=True) for r in shown}
        return (
            f"node {self.node} has allocatable {listed(self.allocatable, shown)}; its "
            f"other pods (GKE's system DaemonSets among them) request {listed(held, shown)}, "
            f"which leaves {listed(left, shown)}"
        )


def node_fit(
    pod_spec: Mapping[str, Any], node: Mapping[str, Any], pods_on_node: Sequence[Mapping[str, Any]]
) -> NodeFit:
    """How the pod of `pod_spec` fits `node`, given the pods bound to it.

    `node` and each of `pods_on_node` are objects as the API returns them; pods that
    ended (Succeeded, Failed) hold nothing.
    """
    asked = pod_requests(pod_spec)
    metadata = node.get("metadata") or {}
    allocatable = {
        r: amount(r, q) for r, q in ((node.get("status") or {}).get("allocatable") or {}).items()
    }
    if PODS in allocatable:
        asked[PODS] = 1
    held: Amounts = {}
    ours: Amounts = {}
    for pod in pods_on_node:
        if (pod.get("status") or {}).get("phase") in _ENDED:
            continue
        requests = {**pod_requests(pod.get("spec") or {}), PODS: 1}
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_MANAGED_BY) == MANAGED_BY:
            ours = _add(ours, requests)
        else:
            held = _add(held, requests)
    return NodeFit(
        node=str(metadata.get("name") or "?"),
        labels=dict(metadata.get("labels") or {}),
        asked=asked,
        allocatable=allocatable,
        held=held,
        ours=ours,
    )
