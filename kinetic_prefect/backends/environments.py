"""Shipped environments made ready for a launch: found in the store, or built.

Both the task runner and the worker's flow pods come here: the environment is
planned (`launch.environment`), looked up in the jobs store, and built when it
is missing, by a builder Job on the launch's backend (`environment_builder=
"cluster"`, the default on gke) or on this machine (`"local"`).
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect.logging import get_logger

from kinetic_prefect.backends.base import Backend, run_to_end
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.errors import EnvironmentBuildError
from kinetic_prefect.launch.accelerators import Accelerator, parse_accelerator
from kinetic_prefect.launch.environment import (
    ClusterBuilder,
    EnvironmentPlan,
    Environments,
    ShippedEnvironment,
    builder_command,
)
from kinetic_prefect.launch.manifest import LaunchSpec, build_job_manifest, new_job_id
from kinetic_prefect.launch.pod_secrets import split_env
from kinetic_prefect.launch.settings import LaunchSettings

logger = get_logger("kinetic_prefect.backends.environments")

UV_VERSION_ENV = "KINETIC_UV_VERSION"
# This process's environments: a sweep plans and checks each one once.
ENVIRONMENTS = Environments()


def _uv_version() -> str:
    from importlib.metadata import version

    return version("uv")


def builder_spec(
    settings: LaunchSettings, plan: EnvironmentPlan, spec_uri: str, destination: str
) -> LaunchSpec:
    """The builder Job of `plan`: a cpu pod on the stock image, under the runner's settings."""
    plain_env, _ = split_env(settings.env)
    env = {**plain_env, UV_VERSION_ENV: _uv_version(), "PYTHONUNBUFFERED": "1"}
    if plan.index_url:
        env["PIP_INDEX_URL"] = plan.index_url
    return LaunchSpec(
        job_id=new_job_id(f"env-{plan.key[:8]}"),
        task_name=f"environment {plan.key[:12]}",
        task_run_id=None,
        flow_run_id=None,
        accelerator=parse_accelerator("cpu"),
        image=settings.container_image or f"python:{plan.python}-slim",
        namespace=settings.namespace,
        output_dir="",
        env=env,
        ttl_seconds_after_finished=settings.ttl_seconds_after_finished,
        intervals=settings.intervals,
        # Not the task pods' account: only a builder writes the environment store.
        service_account=settings.builder_service_account,
        command=tuple(builder_command(spec_uri, destination)),
        # The task's tolerations, pull secrets, ... apply to its builder too; its cpu
        # and memory do not (a builder is a cpu pod).
        pod_overrides=settings.pod_overrides,
        # The user's Job metadata (cost labels, a priority class) too; not the queue: a
        # builder runs at once, outside any Kueue LocalQueue.
        job_labels=settings.job_labels,
        job_annotations=settings.job_annotations,
    )


def cluster_builder(settings: LaunchSettings, backend: Backend) -> ClusterBuilder:
    """Build environments with a builder Job on `backend`, on the stock image."""

    def build(plan: EnvironmentPlan, spec_uri: str, destination: str) -> None:
        spec = builder_spec(settings, plan, spec_uri, destination)
        job_id = spec.job_id
        logger.info(
            "Building environment %s (%d packages) with builder Job %s",
            plan.key[:12],
            len(plan.pins),
            job_id,
        )
        started = time.monotonic()
        # Pending included: a cold build of a TPU stack takes a while.
        timeout = settings.intervals.build_timeout_seconds
        result = run_to_end(backend, build_job_manifest(spec), timeout)
        if result is None:
            raise EnvironmentBuildError(f"Builder Job {job_id} did not finish in {timeout:g}s.")
        if result.exit_code != 0:
            tail = result.log_tail or backend.logs(job_id, tail=40)
            raise EnvironmentBuildError(
                f"Builder Job {job_id} failed ({result.describe()}):\n{tail.strip()}"
            )
        logger.info("Built environment %s in %.0fs", plan.key[:12], time.monotonic() - started)

    return build


def ready_environment(
    settings: LaunchSettings,
    accelerator: Accelerator,
    root: Path,
    store: JobsStore,
    backend: Backend,
    environments: Environments | None = None,
) -> ShippedEnvironment:
    """The launch's environment in the jobs store, built first if it is not there."""
    environments = environments or ENVIRONMENTS
    plan = environments.plan(
        root,
        accelerator,
        requirements=settings.requirements,
        index_url=settings.package_index_url,
        extras=settings.accelerator_extras,
    )
    builder = None
    if settings.environment_builder == "cluster" and settings.backend == "gke":
        builder = cluster_builder(settings, backend)
    return environments.ensure(plan, store, builder)
