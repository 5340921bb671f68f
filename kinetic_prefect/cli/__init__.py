"""``kinetic-prefect`` command-line interface.

Top-level commands live on :data:`app`; command groups (for example a future ``jobs``
group) are separate ``typer.Typer`` instances attached with ``app.add_typer``. Heavy
modules are imported inside the commands so ``kinetic-prefect --help`` stays fast.

Example:
    $ kinetic-prefect accelerators --kind tpu
"""

from __future__ import annotations

import enum
import sys
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="kinetic-prefect",
    help="Run Prefect tasks on GKE TPU/GPU pods.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _main() -> None:
    """Run Prefect tasks on GKE TPU/GPU pods."""
    # An explicit callback keeps Typer in multi-command mode; with a single command it
    # would otherwise run that command directly instead of expecting its name.


class Kind(enum.StrEnum):
    """Accelerator kinds accepted by ``--kind``."""

    cpu = "cpu"
    gpu = "gpu"
    tpu = "tpu"


def _console() -> Console:
    # Piped output (grep, files, tests) should keep one accelerator per line rather than
    # wrapping the long node-selector keys at 80 columns.
    return Console(width=None if sys.stdout.isatty() else 1000)


_GKE_PREFIX = "cloud.google.com/"


def _pairs(mapping: dict[str, str]) -> str:
    # The shared GKE label prefix is named once in the caption so the values that tell
    # accelerators apart fit in a normal terminal.
    lines = (f"{key.removeprefix(_GKE_PREFIX)}: {value}" for key, value in mapping.items())
    return "\n".join(lines) or "-"


@app.command("accelerators")
def accelerators(
    kind: Annotated[Kind | None, typer.Option("--kind", help="Only list this kind.")] = None,
) -> None:
    """List every accelerator spec and the GKE node selectors and limits it maps to.

    Example: kinetic-prefect accelerators --kind gpu
    """
    from kinetic_prefect.launch.accelerators import catalogue, tpu_aliases

    table = Table(
        title="Accelerators",
        caption=f"Node selector keys without a domain are under {_GKE_PREFIX}",
    )
    table.add_column("name", no_wrap=True)
    table.add_column("also", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("chips/GPUs\nper host", justify="right", no_wrap=True)
    table.add_column("hosts", justify="right", no_wrap=True)
    table.add_column("machine type", no_wrap=True)
    # Fold rather than truncate so no value is hidden in narrow terminals.
    table.add_column("node selector(s)", overflow="fold")
    table.add_column("resource limit", no_wrap=True)
    table.add_column("default requests", no_wrap=True)
    for acc in catalogue():
        if kind is not None and acc.kind != kind.value:
            continue
        table.add_row(
            acc.name,
            "\n".join(tpu_aliases(acc)) if acc.kind == "tpu" else "-",
            acc.kind,
            str(acc.count) if acc.count else "-",
            str(acc.hosts),
            acc.machine_type or "-",
            _pairs(acc.node_selector),
            _pairs(acc.resource_limits),
            _pairs(acc.default_requests),
        )
    _console().print(table)
    typer.echo("Append ':spot' to any name (e.g. 'l4x2:spot') to run on Spot VMs.")
    typer.echo(
        "TPU names are Cloud TPU's: v3, v4, v5p and tpu7x count TensorCores (2 per chip), "
        "v5e and v6e chips; a topology (tpu-v5p-2x2x1) names a slice too."
    )


# -- jobs --------------------------------------------------------------------------------------

jobs_app = typer.Typer(
    name="jobs",
    help=(
        "Follow, list, read, cancel and clean up Kinetic Jobs (ls, cancel and cleanup: gke "
        "backend only)."
    ),
    no_args_is_help=True,
)
app.add_typer(jobs_app)

ClusterOption = Annotated[
    str | None,
    typer.Option(
        "--cluster",
        envvar="KINETIC_CLUSTER",
        help="Name of a saved KineticCluster block (else KINETIC_* env).",
    ),
]
NamespaceOption = Annotated[
    str | None, typer.Option("--namespace", "-n", help="Namespace (default: the cluster's).")
]


def _target(cluster_name: str | None, namespace: str | None) -> tuple[Any, Any]:
    """The cluster block (or None) and the settings it resolves to."""
    from kinetic_prefect.launch.settings import resolve_settings

    block = None
    layer = None
    if cluster_name:
        from kinetic_prefect.blocks import cluster_settings, load_cluster

        block = load_cluster(cluster_name)
        layer = cluster_settings(block)
    settings = resolve_settings(block=layer, runner={"namespace": namespace})
    return block, settings


def _gke_target(command: str, cluster_name: str | None, namespace: str | None) -> tuple[Any, Any]:
    """As `_target`, for a command about Kubernetes Jobs: refused on the local backend."""
    block, settings = _target(cluster_name, namespace)
    if settings.backend == "local":
        _fail(
            f"`kinetic-prefect jobs {command}` works on Kubernetes Jobs (the gke backend), and "
            "the settings here name the local backend. Pass --cluster with a KineticCluster "
            "block of backend gke (or set KINETIC_BACKEND=gke). Local pods: "
            "`kinetic-prefect jobs logs JOB_ID`, `jobs attach`, and their records in "
            ".kinetic/pods/."
        )
    return block, settings


def _fail(message: str) -> NoReturn:
    typer.echo(message, err=True)
    raise typer.Exit(1)


def _run(coro: Any) -> Any:
    from kinetic_prefect.backends.gke.client import run_sync
    from kinetic_prefect.errors import ConfigurationError

    try:
        return run_sync(coro)
    except ConfigurationError as exc:
        _fail(str(exc))


async def _with_access(block: Any, settings: Any, work: Any) -> Any:
    from kinetic_prefect.backends.gke.client import connect

    access = await connect(block, settings.kube_context)
    try:
        return await work(access)
    finally:
        await access.close()


def _age(timestamp: str | None) -> str:
    import datetime

    if not timestamp:
        return "-"
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


@jobs_app.command("ls")
def jobs_ls(cluster: ClusterOption = None, namespace: NamespaceOption = None) -> None:
    """List the Jobs kinetic-prefect created, with their task, accelerator and status.

    Example: kinetic-prefect jobs ls --cluster gke
    """
    from kinetic_prefect.backends.gke.jobs import list_kinetic_jobs

    block, settings = _gke_target("ls", cluster, namespace)
    found = _run(_with_access(block, settings, lambda a: list_kinetic_jobs(a, settings.namespace)))
    table = Table(title=f"Kinetic Jobs in namespace {settings.namespace}")
    for column in ("job", "task", "accelerator", "status", "age", "flow run"):
        table.add_column(column, overflow="fold")
    for job in found:
        table.add_row(
            job.name, job.task, job.accelerator, job.status, _age(job.created), job.flow_run_id
        )
    _console().print(table)


def _with_source(cluster_name: str | None, namespace: str | None, work: Any) -> Any:
    """Run `work(source)` on the jobs of the backend the settings name (local or gke)."""
    from kinetic_prefect.cli import job_logs

    block, settings = _target(cluster_name, namespace)
    if settings.backend == "local":
        from kinetic_prefect.backends.local.pods import local_pods_dir

        pods = local_pods_dir(settings.resolved_jobs_root())
        return _run(work(job_logs.LocalJobs(pods)))
    return _run(
        _with_access(
            block, settings, lambda access: work(job_logs.ClusterJobs(access, settings.namespace))
        )
    )


@jobs_app.command("logs")
def jobs_logs(
    job_id: Annotated[str, typer.Argument(help="The Job's name (a future's job_id).")],
    tail: Annotated[int | None, typer.Option("--tail", help="Only the last N lines.")] = None,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Wait for the pod to start, stream until it ends."),
    ] = False,
    cluster: ClusterOption = None,
    namespace: NamespaceOption = None,
    host: Annotated[
        int, typer.Option("--host", help="A multi-host slice's host (0 reports to Prefect).")
    ] = 0,
) -> None:
    """Print the log of a Job's pod (of host K of a multi-host slice with --host K).

    On the local backend the logs are in the jobs root's pods/ folder. For a task run
    that ran in a warm pod, it prints that task's part of the pod's log.

    Example: kinetic-prefect jobs logs kp-train-1a2b3c4d --follow
    """
    from kinetic_prefect.cli.job_logs import JobSource, task_log, wait_until_started, warm_pod_for
    from kinetic_prefect.common.storage import JobsStore, open_store
    from kinetic_prefect.errors import ConfigurationError

    settings = _target(cluster, namespace)[1]
    try:
        jobs_root = settings.resolved_jobs_root()
        store: JobsStore | None = open_store(jobs_root, settings.gcp_credentials)
    except ConfigurationError:
        store = None  # no jobs store known: only pods' own logs can be shown

    async def show(source: JobSource) -> None:
        # A task that ran in a warm pod after its first task has no pod of its own to follow.
        pod = warm_pod_for(store, job_id)
        if not follow or pod is not None:
            typer.echo(await task_log(source, pod, job_id, tail, host), nl=False)
            return
        await wait_until_started(source, job_id)
        async for line in source.follow(job_id, host):
            typer.echo(line, nl=False)

    _with_source(cluster, namespace, show)


@jobs_app.command("attach")
def jobs_attach(
    task_run_id: Annotated[
        str, typer.Argument(help="The task run's id (Prefect UI, or a future's task_run_id).")
    ],
    cluster: ClusterOption = None,
    namespace: NamespaceOption = None,
) -> None:
    """Follow a task run's pods, attempt after attempt, until the run is final.

    Prints each pod's log as it is written, then the task run's final state; exits 0
    when it is Completed, 1 otherwise.

    Example: kinetic-prefect jobs attach 7c8f5a56-6a43-4b8e-9b7a-1f0e1c2d3e4f --cluster gke
    """
    from kinetic_prefect.cli.job_logs import JobSource, attach

    async def follow(source: JobSource) -> Any:
        return await attach(
            source,
            task_run_id,
            emit=lambda line: typer.echo(line, nl=False),
            announce=lambda what: typer.echo(f"==> {what} <==", err=True),
        )

    state = _with_source(cluster, namespace, follow)
    message = f": {state.message}" if state.message else ""
    typer.echo(f"Task run {task_run_id} is {state.name or state.type.value}{message}")
    if not state.is_completed():
        raise typer.Exit(1)


@jobs_app.command("cancel")
def jobs_cancel(
    job_ids: Annotated[list[str], typer.Argument(help="Job names to cancel.")],
    cluster: ClusterOption = None,
    namespace: NamespaceOption = None,
) -> None:
    """Delete Jobs and their pods; the runner sees the pods end and reports the task runs.

    Example: kinetic-prefect jobs cancel kp-train-1a2b3c4d
    """
    from kinetic_prefect.backends.gke.client import delete_job

    block, settings = _gke_target("cancel", cluster, namespace)

    async def cancel(access: Any) -> list[bool]:
        return [await delete_job(access, settings.namespace, job) for job in job_ids]

    deleted = _run(_with_access(block, settings, cancel))
    for job, found in zip(job_ids, deleted, strict=True):
        typer.echo(f"{job}: {'deleted' if found else 'not found'}")
    if not all(deleted):
        raise typer.Exit(1)


@jobs_app.command("cleanup")
def jobs_cleanup(
    older_than: Annotated[
        float, typer.Option("--older-than", help="Only Jobs finished this many hours ago.")
    ] = 0.0,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only say what would go.")] = False,
    cluster: ClusterOption = None,
    namespace: NamespaceOption = None,
) -> None:
    """Delete finished Jobs and their `kinetic/{job}/` artifacts, and Secrets no Job owns.

    Outputs and code-cache are kept. Kubernetes already removes finished Jobs after
    `ttl_seconds_after_finished`, and with them the Secret their flow process gave
    their pods (the Jobs own it); this is for clusters without the TTL controller, to
    clean up sooner, and for the Secrets of flow processes killed before their first
    Job owned them (kinetic-prefect's Secrets that no remaining Job owns or names and
    that are older than ten minutes).

    Example: kinetic-prefect jobs cleanup --older-than 24
    """
    import datetime

    from kubernetes_asyncio import client

    from kinetic_prefect.backends.gke.client import delete_job, delete_secret
    from kinetic_prefect.backends.gke.jobs import list_kinetic_jobs
    from kinetic_prefect.backends.gke.secrets import list_kinetic_secrets, orphaned_secrets
    from kinetic_prefect.cli.jobs_store import cleanup_jobs

    block, settings = _gke_target("cleanup", cluster, namespace)
    now = datetime.datetime.now(datetime.UTC)
    cutoff = now - datetime.timedelta(hours=older_than)

    def due(finished_at: str | None) -> bool:
        if not finished_at:
            return older_than <= 0
        return datetime.datetime.fromisoformat(finished_at.replace("Z", "+00:00")) <= cutoff

    async def cleanup(access: Any) -> tuple[list[str], list[str]]:
        found = await list_kinetic_jobs(access, settings.namespace)
        chosen = [j.name for j in found if j.finished and due(j.finished_at)]
        remaining = [j for j in found if j.name not in chosen]
        orphans = orphaned_secrets(
            await list_kinetic_secrets(access, settings.namespace),
            {j.uid for j in remaining},
            {name for j in remaining for name in j.secrets},
            # A flow process creates its Secret just before its first Job and makes that
            # Job its owner right after: an unowned Secret younger than this is left alone.
            now - datetime.timedelta(seconds=settings.intervals.secret_orphan_grace_seconds),
        )
        if not dry_run:
            core = client.CoreV1Api(access.client)
            for name in chosen:
                await delete_job(access, settings.namespace, name)
            for name in orphans:
                await delete_secret(core, settings.namespace, name)
        return chosen, orphans

    chosen, orphans = _run(_with_access(block, settings, cleanup))
    jobs_root = settings.jobs_root
    removed = (
        0
        if dry_run or not jobs_root or not chosen
        else cleanup_jobs(jobs_root, chosen, settings.gcp_credentials)
    )
    verb = "would delete" if dry_run else "deleted"
    for name in chosen:
        typer.echo(f"{verb} {name}")
    for name in orphans:
        typer.echo(f"{verb} Secret {name}")
    typer.echo(
        f"{len(chosen)} Job(s) {verb}; {removed} artifact file(s) removed; "
        f"{len(orphans)} Secret(s) no Job owns {verb}."
    )


# -- doctor ------------------------------------------------------------------------------------


@app.command("doctor")
def doctor(
    cluster: ClusterOption = None,
    accelerator: Annotated[
        str | None, typer.Option("--accelerator", help="Check node pools for this accelerator.")
    ] = None,
    namespace: NamespaceOption = None,
    pod_check: Annotated[
        bool,
        typer.Option(
            "--pod-check/--no-pod-check",
            help="Run a short pod as the task pods' service account to check their bucket "
            "access (gke).",
        ),
    ] = True,
) -> None:
    """Check the configuration: Prefect API for pods, buckets, cluster access, node pools,
    and (in a short pod) the task pods' own bucket access.

    Example: kinetic-prefect doctor --cluster gke --accelerator tpu-v5e-4
    """
    from kinetic_prefect.cli.doctor import doctor_checks as run_checks

    block, settings = _target(cluster, namespace)
    failed = False
    for check in run_checks(block, settings, accelerator, pod_check):
        label, colour = {
            "ok": ("ok", "green"),
            "warn": ("warn", "yellow"),
            "fail": ("FAIL", "red"),
        }[check.level]
        _console().print(f"[{colour}]{label:>4}[/]  {check.name}: {check.detail}", highlight=False)
        failed = failed or check.level == "fail"
    if failed:
        raise typer.Exit(1)


# -- env ---------------------------------------------------------------------------------------

env_app = typer.Typer(
    name="env",
    help="The Python environment tasks ship with (environment='ship'): show it, build it.",
    no_args_is_help=True,
)
app.add_typer(env_app)

AcceleratorOption = Annotated[
    str | None,
    typer.Option("--accelerator", help="Plan for this accelerator (its jax extras)."),
]


def _env_plan(cluster: str | None, accelerator: str | None) -> tuple[Any, Any, Any]:
    """The settings, the accelerator and the plan of the environment for the cwd's project."""
    from kinetic_prefect.backends.environments import ENVIRONMENTS
    from kinetic_prefect.errors import EnvironmentBuildError
    from kinetic_prefect.launch.accelerators import parse_accelerator
    from kinetic_prefect.launch.packaging import find_package_root

    _, settings = _target(cluster, None)
    chosen = parse_accelerator(accelerator or settings.accelerator)
    try:
        plan = ENVIRONMENTS.plan(
            find_package_root(None),
            chosen,
            requirements=settings.requirements,
            index_url=settings.package_index_url,
            extras=settings.accelerator_extras,
        )
    except EnvironmentBuildError as exc:
        _fail(str(exc))
    return settings, chosen, plan


@env_app.command("show")
def env_show(cluster: ClusterOption = None, accelerator: AcceleratorOption = None) -> None:
    """The environment's key, pins and size, and whether the jobs store has it.

    Example: kinetic-prefect env show --accelerator tpu-v5e-4
    """
    from kinetic_prefect.common.storage import open_store
    from kinetic_prefect.launch.environment import stored_environment

    settings, chosen, plan = _env_plan(cluster, accelerator)
    typer.echo(f"key:          {plan.key}")
    typer.echo(f"accelerator:  {chosen.name}")
    typer.echo(f"python:       {plan.python} ({plan.platform})")
    typer.echo(f"requirements: {plan.requirements_source}")
    typer.echo(f"extras:       {', '.join(plan.extras) or '-'}")
    store_root = settings.resolved_environment_store()
    stored = stored_environment(open_store(store_root, settings.gcp_credentials), plan.key)
    if stored is None:
        typer.echo(f"store:        not in {store_root} yet (kinetic-prefect env build)")
    else:
        typer.echo(
            f"store:        {stored.archive_uri} ({stored.size / 1e6:.1f} MB, {stored.files} files)"
        )
    typer.echo(f"pins ({len(plan.pins)}):")
    for pin in plan.pins:
        typer.echo(f"  {pin}")
    for wheel in plan.wheels:
        typer.echo(f"  {wheel.name} (built here, sha256 {wheel.sha256[:12]})")


@env_app.command("build")
def env_build(cluster: ClusterOption = None, accelerator: AcceleratorOption = None) -> None:
    """Build the environment and put it in the jobs store ahead of the first flow run.

    Example: kinetic-prefect env build --cluster gke --accelerator tpu-v5e-4
    """
    from kinetic_prefect.backends import create_backend
    from kinetic_prefect.backends.environments import ENVIRONMENTS, cluster_builder
    from kinetic_prefect.common.storage import open_store
    from kinetic_prefect.errors import EnvironmentBuildError

    block, settings = _target(cluster, None)
    settings, chosen, plan = _env_plan(cluster, accelerator)
    jobs_root = settings.resolved_jobs_root()
    builder = None
    backend = None
    if settings.backend == "gke" and settings.environment_builder == "cluster":
        backend = create_backend(settings, jobs_root, block)
        builder = cluster_builder(settings, backend)
    try:
        store = open_store(settings.resolved_environment_store(), settings.gcp_credentials)
        shipped = ENVIRONMENTS.ensure(plan, store, builder)
    except EnvironmentBuildError as exc:
        _fail(str(exc))
    finally:
        if backend is not None:
            backend.close()
    typer.echo(
        f"environment {shipped.key} for {chosen.name}: {shipped.archive_uri} "
        f"({shipped.size / 1e6:.1f} MB, {shipped.files} files)"
    )
