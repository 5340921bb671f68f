"""A deployed flow run's pod: its Job manifest, settings and how its end is judged.

`plan_flow_pod` resolves a flow run's job configuration into launch settings
exactly as the task runner does (job variables > `KineticCluster` block >
`KINETIC_*` variables > defaults) and builds the Job manifest with the same
builder as task pods, with Prefect's `prefect flow-run execute` as the
container command. The cluster block's `env` reaches the flow pod as it reaches
task pods, under the `env` job variable. The flow pod runs as
`flow_service_account` with its token mounted, since it launches the flow's
task pods; those run as the cluster's `service_account`, without a token.

On gke the flow pod's record key (`KINETIC_RECORD_KEY`, the master key its task
runner derives the flow run's signing key from) comes from the work pool's Secret
`kinetic-record-key-{pool}` through a secretKeyRef, so a flow pod restarted for the
same flow run derives the same key and can reattach to its task pods (docs/worker.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kinetic_prefect.backends.base import PodExit
from kinetic_prefect.common.env import SIGNING_KEY_ENV
from kinetic_prefect.launch import prefect_context
from kinetic_prefect.launch.accelerators import parse_accelerator
from kinetic_prefect.launch.environment import ShippedEnvironment
from kinetic_prefect.launch.manifest import LaunchSpec, SecretRef, build_job_manifest, new_job_id
from kinetic_prefect.launch.pod_secrets import PodSecrets, split_env
from kinetic_prefect.launch.pod_settings import secret_setting_paths
from kinetic_prefect.launch.settings import (
    RESULT_STORAGE_ENV,
    LaunchSettings,
    env_variable_names,
    join_uri,
    resolve_settings,
    saved_block_reference,
    spot_request,
)
from kinetic_prefect.launch.slices import refuse_for_flow_runs

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun


class FlowPodJob(Protocol):
    """What a flow pod is planned from: the worker's job configuration, as this module reads it."""

    accelerator: str | None
    spot: bool | None
    image: str | None
    timeout_seconds: int | None
    namespace: str | None
    cpu: str | None
    memory: str | None
    pod_overrides: dict[str, Any] | None
    queue_name: str | None
    queued_provisioning: bool | None
    job_labels: dict[str, str] | None
    job_annotations: dict[str, str] | None
    flow_service_account: str
    name: str | None
    command: str | None
    env: dict[str, str | None]

    @property
    def user_labels(self) -> dict[str, str]: ...

    @property
    def flow_name(self) -> str | None: ...


FLOW_OUTPUT_KEY = "flow"
# `python -m` so that the local backend runs this interpreter's Prefect even when
# the `prefect` script is not on PATH; in an image it is the same command.
FLOW_RUN_COMMAND = "python -m prefect flow-run execute"
# `prefect flow-run execute` runs the flow in a process group of its own. With an
# intent set, a SIGTERM to the pod (cancel, deadline) is passed on to that group and
# the engine unwinds, stopping the flow's task pods, instead of being orphaned.
SIGTERM_BEHAVIOR_ENV = "PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"
SIGTERM_BEHAVIOR = "relinquish"
# Settings that say where pods run, inherited by the flow's own task pods.
INHERITED_SETTINGS = (
    "backend",
    "jobs_root",
    "output_root",
    "namespace",
    "container_image",
    "service_account",
    "max_parallel",
    "ttl_seconds_after_finished",
    "cancel_grace_seconds",
    "pending_timeout_seconds",
    "queue_timeout_seconds",
    # The flow's task pods wait in the flow pod's Kueue LocalQueue unless its runner names one.
    "queue_name",
    "queued_provisioning",
    "job_labels",
    "job_annotations",
    "credentials_denied_timeout_seconds",
    "allow_loopback_api",
    # Where the environments the flow pod's runner ships to its task pods are kept and built.
    "environment",
    "environment_builder",
    "environment_store",
    "package_index_url",
    "accelerator_extras",
)
# The work pool's record key: one Secret per pool and namespace, created by the worker.
RECORD_KEY_SECRET_PREFIX = "kinetic-record-key-"
RECORD_KEY_SECRET_KEY = "record-key"
_NOT_IN_NAMES = re.compile(r"[^a-z0-9-]+")


def record_key_secret(pool: str) -> str:
    """The name of the Secret that holds work pool `pool`'s record key (DNS-1123)."""
    stem = _NOT_IN_NAMES.sub("-", pool.lower()).strip("-")[:200]
    if stem != pool:  # two pools whose names differ only in case or punctuation
        stem = f"{stem}-{hashlib.sha256(pool.encode()).hexdigest()[:8]}".lstrip("-")
    return RECORD_KEY_SECRET_PREFIX + stem


def inherited_settings_env(settings: LaunchSettings) -> dict[str, str]:
    """`KINETIC_*` variables that send the flow's task pods where its flow pod went."""
    values: dict[str, Any] = {name: getattr(settings, name) for name in INHERITED_SETTINGS}
    values["jobs_root"] = settings.resolved_jobs_root()
    values["output_root"] = settings.resolved_output_root()
    env: dict[str, str] = {}
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (tuple, list)):
            text = ",".join(map(str, value))  # empty: unset, the accelerator's default
        elif isinstance(value, Mapping):
            if not value:
                continue
            text = json.dumps(dict(value), sort_keys=True)
        else:
            text = str(value)
        env[env_variable_names(name)[0]] = text
    return env


def crash_message(job_id: str, outcome: PodExit, deadline_seconds: int | None) -> str | None:
    """Why the flow run crashed, when the pod's end says more than its exit code."""
    if outcome.start_failure:
        return f"Flow-run pod {job_id} could not start: {outcome.start_failure}"
    if outcome.reason == "DeadlineExceeded":
        return (
            f"Flow-run pod {job_id} was stopped at its deadline of {deadline_seconds}s "
            "(timeout_seconds)."
        )
    return None


def exit_status(outcome: PodExit) -> int:
    """The status code Prefect judges the flow-run pod by (non-zero: the run crashed)."""
    if outcome.exit_code is not None:
        return outcome.exit_code
    if outcome.signal is not None:
        return -outcome.signal
    # Never started (start failure) or cancelled before it started.
    return 0 if outcome.cancelled and not outcome.start_failure else 1


@dataclass(frozen=True)
class FlowPodPlan:
    """Everything that decides one flow run's pod, before any backend sees it."""

    settings: LaunchSettings
    spec: LaunchSpec
    manifest: dict[str, Any]
    # The manifest only refers to them through `SecretRef`s.
    secrets: PodSecrets

    def with_environment(self, environment: ShippedEnvironment) -> FlowPodPlan:
        """The same plan with its pod starting from the stock image and `environment`."""
        spec = dataclasses.replace(self.spec, environment=environment)
        return dataclasses.replace(self, spec=spec, manifest=build_job_manifest(spec))

    def backend_secrets(self) -> dict[str, dict[str, str]]:
        """The secrets as the backend stores them: one Secret, a key per value."""
        return self.secrets.contents()


def flow_pod_settings(configuration: FlowPodJob, cluster: Any = None) -> LaunchSettings:
    """Job variables > cluster block > `KINETIC_*` variables > defaults, as for task pods."""
    block: dict[str, Any] | None = None
    if cluster is not None:
        from kinetic_prefect.blocks import cluster_settings

        block = cluster_settings(cluster)
    return resolve_settings(
        runner={
            "accelerator": configuration.accelerator,
            "spot": configuration.spot,
            "container_image": configuration.image,
            "timeout_seconds": configuration.timeout_seconds,
            "namespace": configuration.namespace,
            "cpu": configuration.cpu,
            "memory": configuration.memory,
            "pod_overrides": configuration.pod_overrides,
            "queue_name": configuration.queue_name,
            "queued_provisioning": configuration.queued_provisioning,
            "job_labels": configuration.job_labels,
            "job_annotations": configuration.job_annotations,
        },
        block=block,
    )


def plan_flow_pod(
    flow_run: FlowRun,
    configuration: FlowPodJob,
    cluster: Any = None,
    record_key_secret: str | None = None,
) -> FlowPodPlan:
    """The Job manifest (and its secrets) for a flow run's pod.

    `configuration` must have been prepared for `flow_run` (Prefect's worker does
    that); `cluster` is the loaded `KineticCluster` its `cluster` variable names.
    `record_key_secret` names the Secret the pod's `KINETIC_RECORD_KEY` comes from,
    unless the job variables set that variable themselves.

    Example:
        ```python
        plan = plan_flow_pod(flow_run, configuration)
        assert plan.manifest["spec"]["backoffLimit"] == 0
        ```
    """
    settings = flow_pod_settings(configuration, cluster)
    accelerator = parse_accelerator(settings.accelerator, spot=spot_request(settings.spot))
    refuse_for_flow_runs(accelerator)
    flow_run_id = str(flow_run.id)
    cluster_env, cluster_secrets = split_env(settings.env)
    result_storage = saved_block_reference(getattr(cluster, "result_storage", None))
    env = {
        **inherited_settings_env(settings),
        **({RESULT_STORAGE_ENV: result_storage} if result_storage else {}),
        SIGTERM_BEHAVIOR_ENV: SIGTERM_BEHAVIOR,
        "PYTHONUNBUFFERED": "1",
        **cluster_env,
        **{name: value for name, value in configuration.env.items() if value is not None},
    }
    # A secret given as a job variable travels like the worker's own: as a Secret ref.
    values = prefect_context.secret_values()
    values.update({k: v for k, v in cluster_secrets.items() if k not in env})
    values.update({name: env.pop(name) for name in secret_setting_paths() if name in env})
    secrets = PodSecrets(values)
    secret_env = secrets.refs()
    if record_key_secret and SIGNING_KEY_ENV not in env and SIGNING_KEY_ENV not in values:
        secret_env += (SecretRef(SIGNING_KEY_ENV, record_key_secret, RECORD_KEY_SECRET_KEY),)
    output_root = settings.output_dir or settings.resolved_output_root()
    spec = LaunchSpec(
        job_id=new_job_id(configuration.name or flow_run.name or "flow"),
        task_name=configuration.flow_name or flow_run.name,
        task_run_id=None,
        flow_run_id=flow_run_id,
        accelerator=accelerator,
        image=settings.resolved_image(),
        namespace=settings.namespace,
        output_dir=join_uri(output_root, flow_run_id, FLOW_OUTPUT_KEY),
        env=env,
        secret_env=secret_env,
        timeout_seconds=settings.timeout_seconds,
        ttl_seconds_after_finished=settings.ttl_seconds_after_finished,
        intervals=settings.intervals,
        node_cache_max_gb=settings.node_cache_max_gb,
        service_account=configuration.flow_service_account,
        automount_service_account_token=True,
        command=tuple(shlex.split(configuration.command or FLOW_RUN_COMMAND)),
        extra_labels=configuration.user_labels,
        cpu=settings.cpu,
        memory=settings.memory,
        pod_overrides=settings.pod_overrides,
        queue_name=settings.queue_name,
        queued_provisioning=settings.queued_provisioning,
        job_labels=settings.job_labels,
        job_annotations=settings.job_annotations,
    )
    return FlowPodPlan(settings, spec, build_job_manifest(spec), secrets)
