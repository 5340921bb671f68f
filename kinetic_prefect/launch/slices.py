"""Multi-host TPU slices: one task on every host of a slice, as one Kubernetes workload.

A slice such as ``tpu-v5e-16`` is 4 hosts of 4 chips. GKE schedules it as an
Indexed Job of one pod per host (``completions = parallelism = hosts``,
``completionMode: Indexed``) whose pods find each other through a headless
Service named by the pods' ``subdomain``: host K is ``{job}-{K}.{service}``.
Each pod asks for the chips of one host and the slice's topology, and an affinity
(`one_node_pool`) pins the N pods to the N nodes of one TPU slice node pool.

:func:`build_workload` returns that shape for a multi-host accelerator and exactly
:func:`~kinetic_prefect.launch.manifest.build_job_manifest`'s single Job otherwise.

Every host runs the task (SPMD). The pod learns its place from the env this module
writes into the template: ``TPU_WORKER_ID`` (the completion index),
``TPU_WORKER_HOSTNAMES`` and ``JAX_COORDINATOR_ADDRESS`` (host 0 through the
headless Service's DNS), and ``KINETIC_SLICE_HOSTS``. The local backend runs the same
Job as N local processes and rewrites the addresses to 127.0.0.1 (`local_host_env`).

Example:
    ```python
    workload = build_workload(spec)          # spec.accelerator = tpu-v5e-16
    workload.job["spec"]["completions"]      # 4
    workload.service["spec"]["clusterIP"]    # "None"
    ```
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kinetic_prefect.common.env import (
    COORDINATOR_ENV,
    HOST_INDEX_ENV,
    HOSTNAMES_ENV,
    SLICE_HOSTS_ENV,
)
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.accelerators import Accelerator
from kinetic_prefect.launch.manifest import (
    LABEL_JOB_ID,
    LaunchSpec,
    base_job_manifest,
    build_job_manifest,
    container_of,
    with_pod_overrides,
)

# The pod annotation the Job controller sets to the pod's completion index.
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
# The env var Kubernetes itself sets on every pod of an Indexed Job.
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
# The port jax.distributed's coordinator listens on for Cloud TPU clusters.
COORDINATOR_PORT = 8482
# Caps or overrides how many host processes the local backend runs for a slice.
LOCAL_HOSTS_ENV = "KINETIC_LOCAL_HOSTS"
# On every pod of a multi-host slice: its Job's name. The slice's pods attract each
# other and repel other slices' pods within one node pool.
LABEL_SLICE = "kinetic-prefect.io/slice"
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"


@dataclass(frozen=True)
class Workload:
    """The Kubernetes objects of one launch: the Job, and for a slice its headless Service."""

    job: dict[str, Any]
    service: dict[str, Any] | None = None

    @property
    def extra_objects(self) -> tuple[dict[str, Any], ...]:
        """Objects created next to the Job (and deleted with it)."""
        return (self.service,) if self.service is not None else ()


def hosts_of(manifest: Mapping[str, Any]) -> int:
    """How many hosts (pods) a Job manifest runs at once: 1 unless it is a slice."""
    spec = manifest.get("spec") or {}
    if spec.get("completionMode") != "Indexed":
        return 1
    return int(spec.get("completions") or 1)


def host_index(pod: Mapping[str, Any]) -> int:
    """The host (completion index) a slice's pod runs; 0 for a single pod."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return int(annotations.get(COMPLETION_INDEX_ANNOTATION) or 0)


def service_name(job_id: str) -> str:
    """The headless Service of a slice's Job (the pods' subdomain)."""
    return job_id


def hostnames(job_id: str, hosts: int) -> list[str]:
    """DNS names of the slice's hosts, host 0 first: `{job}-{K}.{service}`."""
    return [f"{job_id}-{index}.{service_name(job_id)}" for index in range(hosts)]


def build_workload(spec: LaunchSpec) -> Workload:
    """The Job (and for a multi-host slice the headless Service) for `spec`."""
    hosts = spec.accelerator.hosts
    if hosts <= 1:
        return Workload(build_job_manifest(spec))
    job = base_job_manifest(spec)
    job_spec = job["spec"]
    job_spec.update(completions=hosts, parallelism=hosts, completionMode="Indexed")
    job_spec["template"]["metadata"]["labels"][LABEL_SLICE] = spec.job_id
    pod_spec = job_spec["template"]["spec"]
    pod_spec["subdomain"] = service_name(spec.job_id)
    pod_spec["affinity"] = one_node_pool(spec.job_id)
    names = hostnames(spec.job_id, hosts)
    slice_env: list[dict[str, Any]] = [
        {"name": SLICE_HOSTS_ENV, "value": str(hosts)},
        {
            "name": HOST_INDEX_ENV,
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}
            },
        },
        {"name": HOSTNAMES_ENV, "value": ",".join(names)},
        {"name": COORDINATOR_ENV, "value": f"{names[0]}:{COORDINATOR_PORT}"},
    ]
    container = container_of(job)
    taken = {item["name"] for item in slice_env}
    container["env"] = [e for e in container["env"] if e["name"] not in taken] + slice_env
    job = with_pod_overrides(job, spec)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(spec.job_id),
            "namespace": spec.namespace,
            "labels": spec.labels(),
        },
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB_ID: spec.job_id},
            # Hosts look each other up while they start, before any readiness.
            "publishNotReadyAddresses": True,
        },
    }
    return Workload(job, service)


def one_node_pool(job_id: str) -> dict[str, Any]:
    """The affinity that puts every host of a slice in one node pool, alone.

    GKE makes one multi-host TPU slice of each node pool: hosts in two pools are not
    one slice (their chips share no interconnect). The hosts require each other's pool
    (podAffinity on the slice's own label, topology key the node pool) and shun pools
    where another slice runs (podAntiAffinity), as JobSet's exclusive placement does
    (https://jobset.sigs.k8s.io/docs/concepts/#exclusive-job-placement-per-topology-domain).
    """
    return {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {LABEL_SLICE: job_id}},
                    "topologyKey": NODE_POOL_LABEL,
                }
            ]
        },
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {
                        "matchExpressions": [
                            {"key": LABEL_SLICE, "operator": "Exists"},
                            {"key": LABEL_SLICE, "operator": "NotIn", "values": [job_id]},
                        ]
                    },
                    "topologyKey": NODE_POOL_LABEL,
                }
            ]
        },
    }


def refuse_for_flow_runs(accelerator: Accelerator) -> None:
    """A whole flow run runs in one pod: a multi-host slice is for tasks only."""
    if accelerator.hosts > 1:
        raise ConfigurationError(
            f"Accelerator {accelerator.name} is a {accelerator.hosts}-host TPU slice; a flow "
            "run's pod runs on one host. Give the work pool a single-host accelerator (e.g. "
            "tpu-v5e-8 or cpu) and run the multi-host step as a task under "
            f"KineticTaskRunner(accelerator={accelerator.name!r})."
        )


def local_host_count(manifest: Mapping[str, Any]) -> int:
    """How many processes the local backend runs for `manifest` (`KINETIC_LOCAL_HOSTS` caps it)."""
    hosts = hosts_of(manifest)
    override = os.environ.get(LOCAL_HOSTS_ENV, "").strip()
    if hosts <= 1 or not override:
        return hosts
    try:
        count = int(override)
    except ValueError:
        raise ValueError(
            f"{LOCAL_HOSTS_ENV}={override!r} is not a whole number; set it to the number of "
            "local processes a multi-host slice should run (e.g. 2), or unset it"
        ) from None
    if count < 1:
        raise ValueError(f"{LOCAL_HOSTS_ENV} must be at least 1, got {count}")
    return count


def free_port() -> int:
    """A TCP port nothing listens on right now, for a local slice's coordinator."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def local_host_env(index: int, hosts: int, coordinator_port: int) -> dict[str, str]:
    """The env one local host process gets on top of its manifest's: all hosts are 127.0.0.1.

    Stands in for what the Job controller (the completion index) and cluster DNS (the
    hostnames) give pods on GKE.
    """
    return {
        COMPLETION_INDEX_ENV: str(index),
        HOST_INDEX_ENV: str(index),
        SLICE_HOSTS_ENV: str(hosts),
        HOSTNAMES_ENV: ",".join(["127.0.0.1"] * hosts),
        COORDINATOR_ENV: f"127.0.0.1:{coordinator_port}",
    }
