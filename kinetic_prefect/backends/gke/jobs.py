"""The Kinetic Jobs on a cluster, as `kinetic-prefect jobs ls` and `jobs cleanup` see them.

Owns one summary per Job (its task, accelerator, flow run, status and age, the
Secrets it names), built from a listing of the namespace's Jobs and pods that
kinetic-prefect created.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio import client

from kinetic_prefect.backends.gke.client import MANAGED_SELECTOR, ClusterAccess, read_json
from kinetic_prefect.backends.gke.status import job_status
from kinetic_prefect.launch.manifest import (
    ANNOTATION_ACCELERATOR,
    ANNOTATION_TASK_NAME,
    LABEL_FLOW_RUN_ID,
    LABEL_JOB_ID,
)


@dataclass(frozen=True)
class JobSummary:
    """One Kinetic Job as the cluster shows it."""

    name: str
    namespace: str
    status: str
    task: str
    accelerator: str
    flow_run_id: str
    created: str
    finished: bool
    finished_at: str | None
    pod: str | None
    uid: str = ""
    # The Secrets its pods' secretKeyRefs name.
    secrets: tuple[str, ...] = ()


def secrets_named(job: Mapping[str, Any]) -> tuple[str, ...]:
    """The Secrets the secretKeyRefs of a Job's containers name."""
    spec = ((job.get("spec") or {}).get("template") or {}).get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    names = {
        ref["name"]
        for container in containers
        for item in container.get("env") or []
        if (ref := (item.get("valueFrom") or {}).get("secretKeyRef"))
    }
    return tuple(sorted(names))


async def list_kinetic_jobs(access: ClusterAccess, namespace: str) -> list[JobSummary]:
    """Every Job kinetic-prefect created in `namespace`, oldest first."""
    batch, core = client.BatchV1Api(access.client), client.CoreV1Api(access.client)
    jobs = await read_json(
        await batch.list_namespaced_job(
            namespace, label_selector=MANAGED_SELECTOR, _preload_content=False
        )
    )
    pods = await read_json(
        await core.list_namespaced_pod(
            namespace, label_selector=MANAGED_SELECTOR, _preload_content=False
        )
    )
    pod_of = {
        (p["metadata"].get("labels") or {}).get(LABEL_JOB_ID): p for p in pods.get("items") or []
    }
    summaries = []
    for job in jobs.get("items") or []:
        meta = job["metadata"]
        labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
        pod = pod_of.get(labels.get(LABEL_JOB_ID, meta["name"]))
        status, finished, finished_at = job_status(job, pod)
        summaries.append(
            JobSummary(
                name=meta["name"],
                namespace=meta.get("namespace") or namespace,
                status=status,
                task=annotations.get(ANNOTATION_TASK_NAME, ""),
                accelerator=annotations.get(ANNOTATION_ACCELERATOR, ""),
                flow_run_id=labels.get(LABEL_FLOW_RUN_ID, ""),
                created=meta.get("creationTimestamp") or "",
                finished=finished,
                finished_at=finished_at,
                pod=(pod or {}).get("metadata", {}).get("name"),
                uid=meta.get("uid") or "",
                secrets=secrets_named(job),
            )
        )
    return sorted(summaries, key=lambda s: (s.created, s.name))
