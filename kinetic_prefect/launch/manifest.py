"""The batch/v1 Job manifest for one launch: the single source for every backend.

The local backend runs the container's command and env as a process; the
Kubernetes backend sends the same dict to the API server.
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kinetic_prefect.common.env import (
    ENV_CACHE_ENV,
    JOB_ID_ENV,
    NODE_CACHE_MAX_GB_ENV,
    OUTPUT_DIR_ENV,
    POD_ACCELERATOR_ENV,
)
from kinetic_prefect.common.gcs import NO_BUCKET_METADATA_ENV
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.accelerators import Accelerator, machine_type
from kinetic_prefect.launch.environment import (
    ShippedEnvironment,
    bootstrap_command,
    unpack_command,
)
from kinetic_prefect.launch.pod_overrides import apply_pod_overrides

MANAGED_BY = "kinetic-prefect"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_JOB_ID = "kinetic-prefect.io/job-id"
LABEL_TASK_RUN_ID = "kinetic-prefect.io/task-run-id"
LABEL_FLOW_RUN_ID = "kinetic-prefect.io/flow-run-id"
# A digest of the flow run id and the task key (`identity.task_identity`): one live pod at most.
LABEL_TASK_IDENTITY = "kinetic-prefect.io/task-identity"
# On a warm pod's Job: after its first task it may run any task run of its flow run.
LABEL_WARM = "kinetic-prefect.io/warm"
# Kueue's batch/Job integration: the LocalQueue that admits the Job (docs/kueue.md).
LABEL_QUEUE_NAME = "kueue.x-k8s.io/queue-name"
# GKE taints the nodes DWS flex-start provisions for a queued request (queued provisioning)
# so that only the request's pods land there.
QUEUED_PROVISIONING_TOLERATION = {
    "key": "cloud.google.com/gke-queued",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}
ANNOTATION_ACCELERATOR = "kinetic-prefect.io/accelerator"
ANNOTATION_TASK_NAME = "kinetic-prefect.io/task-name"
ANNOTATION_OUTPUT_DIR = "kinetic-prefect.io/output-dir"
CONTAINER_NAME = "task"
POD_MODULE = "kinetic_prefect.pod"

_CPU_MEMORY = ("cpu", "memory")
_DNS_UNSAFE = re.compile(r"[^a-z0-9-]+")
_MAX_JOB_NAME = 52  # leaves room for the pod-name suffix Kubernetes appends


def new_job_id(task_name: str) -> str:
    """A DNS-1123 job name: `kp-{task}-{random}`, at most 52 characters."""
    stem = _DNS_UNSAFE.sub("-", task_name.lower()).strip("-") or "task"
    suffix = secrets.token_hex(4)
    stem = stem[: _MAX_JOB_NAME - len("kp--") - len(suffix)].strip("-") or "task"
    return f"kp-{stem}-{suffix}"


@dataclass(frozen=True)
class SecretRef:
    """An environment variable whose value comes from a Kubernetes Secret key."""

    env_name: str
    secret_name: str
    key: str


GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
GCSFUSE_ANNOTATION = "gke-gcsfuse/volumes"
DATA_MOUNT_ROOT = "/mnt/kinetic-data"
# The node's cache of unpacked shipped environments: every pod on a node after the first
# starts from the copy already there (docs/environments.md). One directory per namespace and
# service account (`node_cache_path`): a pod can only ever read what its own identity unpacked.
ENV_CACHE_VOLUME = "kinetic-env-cache"
ENV_CACHE_HOST_PATH = "/var/cache/kinetic-prefect/environments"
ENV_CACHE_MOUNT = "/var/cache/kinetic-prefect/environments"
# The init container that unpacks (or re-verifies) the environment before the task starts.
UNPACK_CONTAINER_NAME = "unpack-environment"


def node_cache_path(namespace: str, service_account: str | None) -> str:
    """The node directory of one namespace's and service account's unpacked environments."""
    scope = f"{namespace}/{service_account or 'default'}".encode()
    return f"{ENV_CACHE_HOST_PATH}/{hashlib.sha256(scope).hexdigest()[:16]}"


def uses_node_cache(manifest: Mapping[str, Any]) -> bool:
    """Whether the Job's pods mount the node's environment cache (a hostPath volume)."""
    volumes = manifest["spec"]["template"]["spec"].get("volumes") or []
    return any(v["name"] == ENV_CACHE_VOLUME and "hostPath" in v for v in volumes)


def without_node_cache(manifest: dict[str, Any]) -> dict[str, Any]:
    """The Job with its environment unpacked into the pod's own emptyDir instead of the node.

    For clusters whose admission refuses hostPath volumes (GKE Autopilot, Pod Security
    "baseline"): the init container unpacks into an emptyDir, which both allow.
    """
    job = copy.deepcopy(manifest)
    volumes = job["spec"]["template"]["spec"].get("volumes") or []
    for index, volume in enumerate(volumes):
        if volume["name"] == ENV_CACHE_VOLUME:
            volumes[index] = {"name": ENV_CACHE_VOLUME, "emptyDir": {}}
    return job


@dataclass(frozen=True)
class DataVolume:
    """A read-only GCS FUSE mount of one bucket folder (`only-dir`) for a `Data(fuse=True)`."""

    name: str
    bucket: str
    only_dir: str

    @classmethod
    def for_uri(cls, name: str, uri: str, is_dir: bool) -> DataVolume:
        bucket, _, key = uri[len("gs://") :].partition("/")
        folder = key.rstrip("/") if is_dir else key.rpartition("/")[0]
        return cls(name=name, bucket=bucket, only_dir=folder)

    @property
    def mount_path(self) -> str:
        return f"{DATA_MOUNT_ROOT}/{self.name}"

    def volume(self) -> dict[str, Any]:
        options = "implicit-dirs" + (f",only-dir={self.only_dir}" if self.only_dir else "")
        return {
            "name": self.name,
            "csi": {
                "driver": GCSFUSE_DRIVER,
                "readOnly": True,
                "volumeAttributes": {"bucketName": self.bucket, "mountOptions": options},
            },
        }


@dataclass(frozen=True)
class LaunchSpec:
    """Everything that decides one pod: what to run, where, and with what."""

    job_id: str
    task_name: str
    task_run_id: str | None
    flow_run_id: str | None
    accelerator: Accelerator
    image: str
    namespace: str
    output_dir: str
    payload_uri: str = ""
    payload_sha256: str = ""
    context_uri: str = ""
    context_sha256: str = ""
    job_dir_uri: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    secret_env: tuple[SecretRef, ...] = ()
    timeout_seconds: int | None = None
    ttl_seconds_after_finished: int = 3600
    service_account: str | None = None
    intervals: Intervals = field(default_factory=Intervals)
    # The node cache's size cap a shipped environment's pod prunes to (`node_cache_max_gb`).
    node_cache_max_gb: float = 20.0
    # Only a flow-run pod talks to the Kubernetes API (to launch its task pods);
    # task pods never get a service-account token.
    automount_service_account_token: bool = False
    data_volumes: tuple[DataVolume, ...] = ()
    # A flow-run pod runs Prefect's own command (`prefect flow-run execute`)
    # instead of the task pod entrypoint and its artifact arguments.
    command: tuple[str, ...] = ()
    extra_labels: Mapping[str, str] = field(default_factory=dict)
    # The task's shipped environment: the container runs the bootstrap, which unpacks it.
    environment: ShippedEnvironment | None = None
    # Requests that replace the accelerator's defaults (Kubernetes quantities).
    cpu: str | None = None
    memory: str | None = None
    # Merged into the pod spec (`kinetic_prefect.launch.pod_overrides`).
    pod_overrides: Mapping[str, Any] | None = None
    # A Kueue LocalQueue: the Job is created suspended, labelled for it, and Kueue admits
    # it (unsuspends it) when its ClusterQueue has quota for all of its pods.
    queue_name: str | None = None
    # The queue provisions nodes through DWS queued provisioning: pods tolerate its taint.
    queued_provisioning: bool = False
    # Added to the Job's metadata (never the runner's own keys).
    job_labels: Mapping[str, str] = field(default_factory=dict)
    job_annotations: Mapping[str, str] = field(default_factory=dict)

    def labels(self) -> dict[str, str]:
        labels = {**self.extra_labels, LABEL_MANAGED_BY: MANAGED_BY, LABEL_JOB_ID: self.job_id}
        if self.task_run_id:
            labels[LABEL_TASK_RUN_ID] = self.task_run_id
        if self.flow_run_id:
            labels[LABEL_FLOW_RUN_ID] = self.flow_run_id
        return labels


def pod_args(spec: LaunchSpec) -> list[str]:
    """The arguments of `python -m kinetic_prefect.pod` for this launch."""
    return [
        "--job-dir",
        spec.job_dir_uri,
        "--payload",
        spec.payload_uri,
        "--payload-sha256",
        spec.payload_sha256,
        "--context",
        spec.context_uri,
        "--context-sha256",
        spec.context_sha256,
    ]


def _env_list(spec: LaunchSpec) -> list[dict[str, Any]]:
    plain = {
        NO_BUCKET_METADATA_ENV: "true",
        **spec.env,
        JOB_ID_ENV: spec.job_id,
        OUTPUT_DIR_ENV: spec.output_dir,
        # The pod's own accelerator, for the task to read; deliberately not the
        # KINETIC_ACCELERATOR setting, so runners inside the pod do not inherit it.
        POD_ACCELERATOR_ENV: spec.accelerator.name,
        # The pod waits on the same intervals as its runner.
        **spec.intervals.to_env(),
    }
    secret_names = {ref.env_name for ref in spec.secret_env}
    env: list[dict[str, Any]] = [
        {"name": name, "value": str(value)}
        for name, value in sorted(plain.items())
        if name not in secret_names
    ]
    env += [
        {
            "name": ref.env_name,
            "valueFrom": {"secretKeyRef": {"name": ref.secret_name, "key": ref.key}},
        }
        for ref in spec.secret_env
    ]
    return env


def resources_of(spec: LaunchSpec) -> dict[str, dict[str, str]]:
    """The task container's resources: cpu and memory requests, accelerator limits.

    Every pod has requests (never BestEffort): the accelerator's defaults (most of its
    machine; a small share for cpu) unless `cpu=`/`memory=` say otherwise. GPUs and
    TPUs are extended resources, which Kubernetes takes from `limits` (requests must
    equal them).
    """
    accelerator = spec.accelerator
    requests = accelerator.default_requests
    if spec.cpu is not None:
        requests["cpu"] = spec.cpu
    if spec.memory is not None:
        requests["memory"] = spec.memory
    if accelerator.kind == "tpu" and accelerator.machine_type is not None:
        # A TPU's machine type is fixed (GPUs come on machines of several sizes).
        try:
            machine_type(accelerator.machine_type).refuse_larger_requests(
                requests, accelerator.name
            )
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
    limits = accelerator.resource_limits
    resources = {"requests": {**requests, **limits}}
    if limits:
        resources["limits"] = dict(limits)
    return resources


def build_job_manifest(spec: LaunchSpec) -> dict[str, Any]:
    """The batch/v1 Job for `spec`, its `pod_overrides` merged in.

    Retries belong to Prefect, so Kubernetes never restarts or re-creates the pod
    (`restartPolicy: Never`, `backoffLimit: 0`).

    Example:
        ```python
        manifest = build_job_manifest(spec)
        assert manifest["spec"]["backoffLimit"] == 0
        ```
    """
    return with_pod_overrides(base_job_manifest(spec), spec)


def with_pod_overrides(job: dict[str, Any], spec: LaunchSpec) -> dict[str, Any]:
    """`job` with `spec.pod_overrides` merged into its pod spec."""
    template = job["spec"]["template"]
    template["spec"] = apply_pod_overrides(template["spec"], spec.pod_overrides, CONTAINER_NAME)
    return job


def base_job_manifest(spec: LaunchSpec) -> dict[str, Any]:
    """The batch/v1 Job for `spec` before its `pod_overrides` (see `build_job_manifest`)."""
    accelerator = spec.accelerator
    command = list(spec.command) if spec.command else ["python", "-m", POD_MODULE]
    args = [] if spec.command else pod_args(spec)
    env = _env_list(spec)
    if spec.environment is not None:
        # The stock image has no kinetic-prefect: the bootstrap readies the environment
        # and then runs the same `python -m MODULE ARGS`.
        if command[:2] != ["python", "-m"]:
            raise ValueError(f"A shipped environment runs `python -m MODULE`, not {command}")
        shipped = bootstrap_command(spec.environment, command[2], [*command[3:], *args],
                                    spec.job_dir_uri)  # fmt: skip
        command, args = shipped[:3], shipped[3:]
        env.append({"name": ENV_CACHE_ENV, "value": ENV_CACHE_MOUNT})
        env.append({"name": NODE_CACHE_MAX_GB_ENV, "value": f"{spec.node_cache_max_gb:g}"})
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image,
        "command": command,
        "args": args,
        "env": env,
    }
    container["resources"] = resources_of(spec)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [container],
        # Within the share of a Spot VM's notice GKE gives pods (common/intervals.py).
        "terminationGracePeriodSeconds": math.ceil(spec.intervals.termination_grace_seconds),
    }
    if accelerator.node_selector:
        pod_spec["nodeSelector"] = dict(accelerator.node_selector)
    tolerations = [dict(t) for t in accelerator.tolerations]
    if spec.queued_provisioning:
        tolerations.append(dict(QUEUED_PROVISIONING_TOLERATION))
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.service_account:
        pod_spec["serviceAccountName"] = spec.service_account
    pod_spec["automountServiceAccountToken"] = spec.automount_service_account_token
    annotations = {
        ANNOTATION_ACCELERATOR: accelerator.name,
        ANNOTATION_TASK_NAME: spec.task_name,
        ANNOTATION_OUTPUT_DIR: spec.output_dir,
    }
    pod_annotations = dict(annotations)
    if spec.data_volumes:
        pod_spec["volumes"] = [v.volume() for v in spec.data_volumes]
        container["volumeMounts"] = [
            {"name": v.name, "mountPath": v.mount_path, "readOnly": True} for v in spec.data_volumes
        ]
        pod_annotations[GCSFUSE_ANNOTATION] = "true"
    if spec.environment is not None:
        _add_environment_unpacking(pod_spec, container, spec, spec.environment)
    job_spec: dict[str, Any] = {
        "backoffLimit": 0,
        "ttlSecondsAfterFinished": spec.ttl_seconds_after_finished,
        "template": {
            "metadata": {"labels": spec.labels(), "annotations": pod_annotations},
            "spec": pod_spec,
        },
    }
    if spec.timeout_seconds:
        job_spec["activeDeadlineSeconds"] = int(spec.timeout_seconds)
    job_labels = spec.labels()
    if spec.queue_name:
        # Kueue's Job integration: one Workload per Job (a slice's pods are its one pod set,
        # admitted whole), started by unsuspending it.
        job_labels[LABEL_QUEUE_NAME] = spec.queue_name
        job_spec["suspend"] = True
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": spec.job_id,
            "namespace": spec.namespace,
            "labels": _with_users(job_labels, spec.job_labels, "job_labels"),
            "annotations": _with_users(annotations, spec.job_annotations, "job_annotations"),
        },
        "spec": job_spec,
    }


def _with_users(own: dict[str, str], users: Mapping[str, str], setting: str) -> dict[str, str]:
    """The runner's metadata and the user's; a key the runner writes is not the user's."""
    # The queue's label too: Kueue would queue a Job the runner did not create suspended.
    taken = sorted((set(own) | {LABEL_QUEUE_NAME}) & set(users))
    if taken:
        fix = "use queue_name= for the Kueue queue" if LABEL_QUEUE_NAME in taken else "leave it out"
        raise ConfigurationError(
            f"{setting} sets {', '.join(taken)}, which kinetic-prefect writes itself on every "
            f"Job (its identity, queue or accelerator): {fix}."
        )
    return {**own, **users}


def _add_environment_unpacking(
    pod_spec: dict[str, Any],
    container: dict[str, Any],
    spec: LaunchSpec,
    environment: ShippedEnvironment,
) -> None:
    """The init container that readies the environment, and the task's read-only view of it.

    Only the init container writes to the cache: the task code never can, so nothing it
    does reaches the next pod that reuses the node's copy.
    """
    path = node_cache_path(spec.namespace, spec.service_account)
    pod_spec.setdefault("volumes", []).append(
        {"name": ENV_CACHE_VOLUME, "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    )
    command = unpack_command(environment, spec.job_dir_uri)
    requests = container["resources"]["requests"]
    pod_spec["initContainers"] = [
        {
            "name": UNPACK_CONTAINER_NAME,
            "image": spec.image,
            "command": command[:3],
            "args": command[3:],
            # The task's own env: the same store, credentials and record key.
            "env": copy.deepcopy(container["env"]),
            # The pod requests the larger of the two, so the task's cpu and memory cost nothing.
            "resources": {"requests": {k: v for k, v in requests.items() if k in _CPU_MEMORY}},
            "volumeMounts": [{"name": ENV_CACHE_VOLUME, "mountPath": ENV_CACHE_MOUNT}],
        }
    ]
    container.setdefault("volumeMounts", []).append(
        {"name": ENV_CACHE_VOLUME, "mountPath": ENV_CACHE_MOUNT, "readOnly": True}
    )


def container_of(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The task container of a Job manifest."""
    containers = manifest["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == CONTAINER_NAME)
