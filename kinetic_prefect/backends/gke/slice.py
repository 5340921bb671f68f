"""A multi-host slice on the gke backend: its N pods seen as one, and its headless Service.

The rest of the backend reasons about one pod per job. For a slice (an Indexed Job
of N pods) `slice_pod` picks the pod that tells the slice's story: the first host
that failed or vanished (the attempt is lost with it), else a host that has not
started (the slice is pending until every host runs: its pending reason and timeout
are that host's), else a running host, and only once all N succeeded, host 0.

The headless Service is created right after its Job (through transient API errors,
see `client.create_idempotently`), owned by it (so Kubernetes' garbage collector
deletes it with the Job, also after `ttlSecondsAfterFinished`), and deleted by the
backend when the job ends.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from kinetic_prefect.backends.gke.client import create_idempotently, owner_reference, read_json
from kinetic_prefect.backends.gke.status import pod_phase, pod_started
from kinetic_prefect.launch.manifest import LABEL_JOB_ID
from kinetic_prefect.launch.slices import host_index


def _unscheduled(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in conditions)


def slice_pod(
    pods: Mapping[str, dict[str, Any]], gone: set[str], hosts: int
) -> tuple[dict[str, Any] | None, bool]:
    """(the pod that speaks for the slice, whether it is gone); see the module docstring."""
    by_host = sorted(pods.items(), key=lambda item: host_index(item[1]))
    for name, pod in by_host:
        if pod_phase(pod) == "Failed":
            return pod, name in gone
    for name, pod in by_host:
        if name in gone and pod_phase(pod) != "Succeeded":
            return pod, True
    waiting = [pod for _, pod in by_host if not pod_started(pod)]
    if waiting:
        return next((p for p in waiting if _unscheduled(p)), waiting[0]), False
    running = [pod for _, pod in by_host if pod_phase(pod) != "Succeeded"]
    if running or len(pods) < hosts:
        return (running or [pod for _, pod in by_host])[0], False
    return by_host[0][1], False


def owned_by(obj: dict[str, Any], job: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` with an ownerReference to the created Job, for the garbage collector."""
    owned = copy.deepcopy(obj)
    owned["metadata"]["ownerReferences"] = [owner_reference(job)]
    return owned


async def create_services(
    core: Any, namespace: str, services: Sequence[dict[str, Any]], job: Mapping[str, Any]
) -> None:
    """Create a slice's Services, owned by its created Job, through transient errors.

    One already there counts as created when it is this Job's (same job-id label).
    """
    for service in services:
        await _create_service(core, namespace, owned_by(service, job))


async def _create_service(core: Any, namespace: str, body: dict[str, Any]) -> None:
    meta = body["metadata"]
    job_id = (meta.get("labels") or {}).get(LABEL_JOB_ID)

    def ours(found: Mapping[str, Any]) -> bool:
        return bool(((found.get("metadata") or {}).get("labels") or {}).get(LABEL_JOB_ID) == job_id)

    await create_idempotently(
        lambda: core.create_namespaced_service(namespace, body=body, _preload_content=False),
        lambda: core.read_namespaced_service(meta["name"], namespace, _preload_content=False),
        ours,
        f"Service {namespace}/{meta['name']}",
    )


async def delete_services(core: Any, namespace: str, services: Sequence[dict[str, Any]]) -> None:
    """Delete a slice's Services; one already gone is fine."""
    for service in services:
        try:
            await read_json(
                await core.delete_namespaced_service(
                    service["metadata"]["name"], namespace, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
