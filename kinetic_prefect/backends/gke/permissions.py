"""What kinetic-prefect asks of the Kubernetes API, written once.

`RUNNER_ACCESS` is every (API group, resource, verb) the process that runs a flow
uses: the Role in `deployments/k8s/rbac.yaml` grants exactly these (a test holds
the two together), and `kinetic-prefect doctor` asks the API server about each
with a SelfSubjectAccessReview, so a missing grant is found before a flow run
needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RBAC_FILE = "deployments/k8s/rbac.yaml"
# Binds the Role to a person's own kubeconfig user.
USER_BINDING_FILE = "deployments/k8s/user-binding.yaml"
RUNNER_ROLE = "kinetic-prefect-runner"
RUNNER_SERVICE_ACCOUNT = "kinetic-prefect-runner"
PODS_SERVICE_ACCOUNT = "kinetic-prefect-pods"
# GKE Workload Identity: the Google service account a Kubernetes service account acts as.
WORKLOAD_IDENTITY_ANNOTATION = "iam.gke.io/gcp-service-account"


@dataclass(frozen=True)
class Access:
    """One verb on one resource, and what it is for."""

    group: str
    resource: str
    verb: str
    why: str
    # The setting that needs it, when only some runners do (doctor checks it only then).
    setting: str = ""

    @property
    def resource_name(self) -> str:
        """`jobs.batch`, `pods/log`: how kubectl and the API server's errors name it."""
        return f"{self.resource}.{self.group}" if self.group else self.resource


def _each(group: str, resource: str, verbs: str, why: str, setting: str = "") -> list[Access]:
    return [Access(group, resource, verb, why, setting) for verb in verbs.split()]


RUNNER_ACCESS: tuple[Access, ...] = (
    *_each("batch", "jobs", "create get list watch delete", "launch, follow and end task Jobs"),
    *_each("", "pods", "get list watch", "follow the task pods"),
    *_each("batch", "jobs", "patch", "a restarted flow process relabels its live Jobs"),
    *_each("", "pods", "patch", "... and their pods, to watch them"),
    *_each("", "pods", "create", "a dry-run pod: may pods mount the node's environment cache"),
    *_each("", "pods/log", "get", "show a pod's log in its task run"),
    *_each("", "events", "list", "say why a pod is pending or was not created"),
    *_each("", "services", "create get delete", "a multi-host slice's headless Service"),
    *_each("", "secrets", "create patch delete list", "the runner's Secret for its pods"),
    *_each("", "serviceaccounts", "get", "doctor: the pods' service account exists"),
    # Kueue (queue_name): where a queued Job stands; harmless where Kueue is not installed.
    *_each("kueue.x-k8s.io", "workloads", "list", "say why a queued Job waits", "queue_name"),
    *_each(
        "visibility.kueue.x-k8s.io",
        "localqueues/pendingworkloads",
        "get",
        "say where a queued Job stands in its LocalQueue",
        "queue_name",
    ),
)


def needed_access(settings: Any) -> tuple[Access, ...]:
    """The part of `RUNNER_ACCESS` a runner with `settings` uses."""
    return tuple(a for a in RUNNER_ACCESS if not a.setting or getattr(settings, a.setting, None))


def access_review(namespace: str, access: Access) -> dict[str, Any]:
    """The SelfSubjectAccessReview body that asks whether the caller may do `access`."""
    resource, _, subresource = access.resource.partition("/")
    attributes: dict[str, Any] = {
        "namespace": namespace,
        "group": access.group,
        "resource": resource,
        "verb": access.verb,
    }
    if subresource:
        attributes["subresource"] = subresource
    return {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attributes},
    }
