"""`pod_overrides`: what a user adds to the pod spec kinetic-prefect writes, by one rule.

For what the runner has no setting for: tolerations of a tainted node pool, a
`priorityClassName`, `imagePullSecrets`, a memory-backed `/dev/shm`, a reservation's
node selector or affinity, a sidecar. The overrides are a (part of a) Kubernetes
PodSpec, merged into the runner's pod spec:

1. a mapping merges into the runner's mapping key by key, recursively;
2. a list of named objects (``containers``, ``volumes``, ``env``, ``volumeMounts``,
   ``imagePullSecrets``, ...) merges by ``name``: a new name is appended; a container
   the runner wrote (``task``) is merged into by rules 1-4; any other name the runner
   already uses (a volume, an env var, a mount) is an error;
3. any other list (``tolerations``, ``nodeSelectorTerms``, ...) is appended to,
   leaving out items already there;
4. a value the runner wrote is never changed: a different value at the same place is
   an error. So is anything under the task container's ``command``, ``args``,
   ``image`` and ``resources``, and the pod's ``restartPolicy`` and ``resources``:
   the runner owns them (use ``accelerator=``, ``cpu=``, ``memory=``,
   ``container_image=``, ``env=``).

Top-level keys must be PodSpec fields, so a typo is an error here rather than a field
the API server drops.

Example:
    ```python
    KineticTaskRunner(
        accelerator="tpu-v5e-4",
        pod_overrides={
            "priorityClassName": "training",
            "tolerations": [{"key": "team", "operator": "Equal", "value": "ml",
                             "effect": "NoSchedule"}],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
            "containers": [{"name": "task",
                            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
        },
    )
    ```
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from typing import Any

from kinetic_prefect.errors import ConfigurationError

# The PodSpec fields of Kubernetes' core/v1 API.
POD_SPEC_FIELDS = (
    "activeDeadlineSeconds",
    "affinity",
    "automountServiceAccountToken",
    "containers",
    "dnsConfig",
    "dnsPolicy",
    "enableServiceLinks",
    "ephemeralContainers",
    "hostAliases",
    "hostIPC",
    "hostNetwork",
    "hostPID",
    "hostUsers",
    "hostname",
    "imagePullSecrets",
    "initContainers",
    "nodeName",
    "nodeSelector",
    "os",
    "overhead",
    "preemptionPolicy",
    "priority",
    "priorityClassName",
    "readinessGates",
    "resourceClaims",
    "resources",
    "restartPolicy",
    "runtimeClassName",
    "schedulerName",
    "schedulingGates",
    "securityContext",
    "serviceAccount",
    "serviceAccountName",
    "setHostnameAsFQDN",
    "shareProcessNamespace",
    "subdomain",
    "terminationGracePeriodSeconds",
    "tolerations",
    "topologySpreadConstraints",
    "volumes",
)
_POD_OWNED = {
    "restartPolicy": "retries are Prefect's (restartPolicy is always Never)",
    "resources": "use cpu= and memory= (and accelerator=) instead",
}
_TASK_CONTAINER_OWNED = {
    "command": "the runner starts the task",
    "args": "the runner starts the task",
    "image": "use container_image= instead",
    "resources": "use accelerator=, cpu= and memory= instead",
}
_MERGED_BY_NAME = ("containers", "initContainers")


class PodOverrideError(ConfigurationError):
    """A `pod_overrides` entry that is not a PodSpec field or changes what the runner owns."""


def check_pod_overrides(overrides: Any) -> dict[str, Any]:
    """`overrides` as a plain dict, or an error naming what is wrong with it."""
    if not isinstance(overrides, Mapping):
        raise PodOverrideError(
            f"pod_overrides must be a mapping of PodSpec fields, got {type(overrides).__name__}."
        )
    for key in overrides:
        if key not in POD_SPEC_FIELDS:
            close = difflib.get_close_matches(str(key), POD_SPEC_FIELDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PodOverrideError(
                f"pod_overrides has {key!r}, which is not a PodSpec field{hint}; see "
                "https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1/"
                "#PodSpec for the fields."
            )
        if key in _POD_OWNED:
            raise PodOverrideError(f"pod_overrides may not set {key}: {_POD_OWNED[key]}.")
    return copy.deepcopy(dict(overrides))


def apply_pod_overrides(
    pod_spec: Mapping[str, Any], overrides: Mapping[str, Any] | None, task_container: str
) -> dict[str, Any]:
    """`pod_spec` with `overrides` merged in by the module's rule (a new dict)."""
    merged = copy.deepcopy(dict(pod_spec))
    if not overrides:
        return merged
    for key, value in check_pod_overrides(overrides).items():
        merged[key] = _merge(merged.get(key), value, key, task_container)
    return merged


def _merge(ours: Any, theirs: Any, path: str, task_container: str) -> Any:
    if ours is None:
        return theirs
    if isinstance(ours, dict) and isinstance(theirs, Mapping):
        for key, value in theirs.items():
            ours[key] = _merge(ours.get(key), value, f"{path}.{key}", task_container)
        return ours
    if isinstance(ours, list) and isinstance(theirs, list):
        return _merge_list(ours, theirs, path, task_container)
    if ours != theirs:
        raise PodOverrideError(
            f"pod_overrides would change {path} from {ours!r} to {theirs!r}; kinetic-prefect "
            "sets it. Overrides may add to the pod spec but not change what the runner wrote."
        )
    return ours


def _named(item: Any) -> bool:
    return isinstance(item, Mapping) and isinstance(item.get("name"), str)


def _merge_list(ours: list[Any], theirs: list[Any], path: str, task_container: str) -> list[Any]:
    by_name = {item["name"]: item for item in ours if _named(item)}
    for item in theirs:
        if not _named(item) or item["name"] not in by_name:
            if item not in ours:
                ours.append(copy.deepcopy(item))
            continue
        name = item["name"]
        here = f"{path}[{name}]"
        if path.rsplit(".", 1)[-1] not in _MERGED_BY_NAME:
            if item == by_name[name]:
                continue
            raise PodOverrideError(
                f"pod_overrides sets {here}, which kinetic-prefect already sets; give it "
                "another name (or, for environment variables, use env=)."
            )
        if name == task_container:
            for key in item:
                if key in _TASK_CONTAINER_OWNED:
                    raise PodOverrideError(
                        f"pod_overrides may not set {here}.{key}: {_TASK_CONTAINER_OWNED[key]}."
                    )
        _merge(by_name[name], item, here, task_container)
    return ours
