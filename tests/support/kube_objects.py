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


@dataclass
class Node:
    """A node the kubelet's scheduler can place pods on."""

    name: str = "node-1"
    labels: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, int] = field(default_factory=dict)

    def as_object(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": self.name, "labels": self.labels},
            "status": {"allocatable": {k: str(v) for k, v in self.allocatable.items()}},
        }


def unschedulable_message(nodes: list[Node], pod_spec: dict[str, Any], pods: int = 1) -> str | None:
    """The scheduler's message when no node fits, else None.

    `pods` > 1 (a slice's pods, one per node): the message the pods left over get
    when fewer nodes than pods fit.
    """
    selector = pod_spec.get("nodeSelector") or {}
    limits = (pod_spec["containers"][0].get("resources") or {}).get("limits") or {}
    total = len(nodes)
    matching = [n for n in nodes if all(n.labels.get(k) == v for k, v in selector.items())]
    if not matching:
        return (
            f"0/{total} nodes are available: {total} node(s) didn't match Pod's node "
            f"affinity/selector. preemption: 0/{total} nodes are available: {total} "
            "Preemption is not helpful for scheduling."
        )
    for resource, amount in limits.items():
        if "/" in resource and not any(
            n.allocatable.get(resource, 0) >= int(amount) for n in matching
        ):
            return f"0/{total} nodes are available: {len(matching)} Insufficient {resource}."
    if pods > len(matching):
        others = total - len(matching)
        resources = ", ".join(f"{len(matching)} Insufficient {r}" for r in limits if "/" in r)
        return (
            f"0/{total} nodes are available: {resources}, {others} node(s) didn't match "
            f"Pod's node affinity/selector. preemption: 0/{total} nodes are available: "
            f"{total} Preemption is not helpful for scheduling."
        )
    return None


def pod_of_job(
    job: dict[str, Any], name: str, namespace: str, index: int | None = None
) -> dict[str, Any]:
    """The pod the Job controller creates from the Job's template (`index`: of an Indexed Job)."""
    job_name = job["metadata"]["name"]
    template = job["spec"]["template"]
    annotations = dict(template["metadata"].get("annotations") or {})
    spec = dict(template["spec"])
    if index is not None:
        annotations["batch.kubernetes.io/job-completion-index"] = str(index)
        spec["hostname"] = f"{job_name}-{index}"
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
