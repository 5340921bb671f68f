"""Admission profiles of the emulated cluster: GKE Autopilot's Warden and Pod Security "baseline".

Both refuse a pod create with a 403 before anything is stored, so a Job's pods are
never made and the Job controller records FailedCreate with the message. Each rule is
written from its documentation (docs/testing.md "Admission profiles"), never from the
product's code:

- Autopilot (`ClusterEmulator.admission = "autopilot"`, every namespace): a hostPath volume
  must be under `/var/log/` and every container (init containers too) must mount it
  read-only; GKE's Warden webhook names each violation under the constraint
  `autogke-no-write-mode-hostpath`.
- Pod Security "baseline" (a namespace labelled `pod-security.kubernetes.io/enforce` with
  `baseline` or `restricted`): no hostPath volume at all. Enforcement applies to pods only;
  workload objects (a Job) are at most warned about, so the Job is stored and its pod refused.
"""

from __future__ import annotations

import json
from typing import Any

from tests.support.kube_auth import forbidden, status

AUTOPILOT = "autopilot"
ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
_WARDEN_ALLOWED_PREFIXES = ("/var/log/",)
_WARDEN_CONSTRAINT = "autogke-no-write-mode-hostpath"


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _pod_name(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return meta.get("name") or meta.get("generateName") or "Unknown"


def warden_violations(pod: dict[str, Any]) -> list[str]:
    """Each hostPath use Autopilot forbids, in the words of Warden's violation details."""
    spec = pod.get("spec") or {}
    violations = []
    for volume in spec.get("volumes") or []:
        if "hostPath" not in volume:
            continue
        name, path = volume["name"], volume["hostPath"].get("path", "")
        for container in _containers(spec):
            for mount in container.get("volumeMounts") or []:
                if mount.get("name") == name and not mount.get("readOnly"):
                    violations.append(
                        f"hostPath volume {name} in container {container['name']} is accessed "
                        "in write mode; disallowed in Autopilot."
                    )
        if not path.rstrip("/").startswith(tuple(p.rstrip("/") for p in _WARDEN_ALLOWED_PREFIXES)):
            for container in _containers(spec):
                if any(m.get("name") == name for m in container.get("volumeMounts") or []):
                    allowed = ", ".join(_WARDEN_ALLOWED_PREFIXES)
                    violations.append(
                        f"hostPath volume {name} used in container {container['name']} uses "
                        f"path {path} which is not allowed in Autopilot. Allowed path prefixes "
                        f"for hostPath volumes are: [{allowed}]."
                    )
    return violations


def warden_refusal(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The 403 GKE Autopilot's Warden webhook answers a pod create it denies."""
    violations = warden_violations(pod)
    if not violations:
        return None
    details = json.dumps({f"[denied by {_WARDEN_CONSTRAINT}]": violations}, separators=(",", ":"))
    message = (
        'admission webhook "warden-validating.common-webhooks.networking.gke.io" denied the '
        "request: GKE Warden rejected the request because it violates one or more "
        f"constraints. Violations details: {details}"
    )
    return status(403, "Forbidden", message)


def pod_security_refusal(pod: dict[str, Any], labels: dict[str, str]) -> dict[str, Any] | None:
    """Pod Security admission's 403 for a pod with hostPath volumes, in an enforcing namespace."""
    level = labels.get(ENFORCE_LABEL)
    if level not in {"baseline", "restricted"}:
        return None
    version = labels.get(f"{ENFORCE_LABEL}-version") or "latest"
    names = [v["name"] for v in (pod.get("spec") or {}).get("volumes") or [] if "hostPath" in v]
    if not names:
        return None
    quoted = ", ".join(f'"{n}"' for n in names)
    detail = f"volume {quoted}" if len(names) == 1 else f"volumes {quoted}"
    message = f'violates PodSecurity "{level}:{version}": hostPath volumes ({detail})'
    return forbidden("pods", "", _pod_name(pod), message)
