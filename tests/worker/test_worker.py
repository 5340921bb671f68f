"""`KineticWorker`: deployed flow runs in pods of their own, against a real `prefect server start`.

The module's server demands an auth string of every client. Pods on the local
backend inherit no `PREFECT_*` variable from the worker, so a flow pod (and
the task pods it launches) can only reach the API if the secret travelled
through the manifest's Secret refs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import kubernetes_validate
import pytest
import yaml
from prefect.client.schemas.actions import DeploymentScheduleCreate
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterTaskRunId,
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
)
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.schedules import IntervalSchedule
from prefect.settings import (
    PREFECT_API_AUTH_STRING,
    PREFECT_API_KEY,
    PREFECT_API_URL,
    temporary_settings,
)
from prefect.states import Cancelling, Scheduled

from kinetic_prefect.common.records import FINAL_STATE_JSON, FinalRecord
from kinetic_prefect.launch.manifest import (
    LABEL_FLOW_RUN_ID,
    LABEL_JOB_ID,
    LABEL_MANAGED_BY,
    LABEL_TASK_RUN_ID,
    container_of,
)
from kinetic_prefect.worker.flow_pod import record_key_secret
from kinetic_prefect.worker.worker import KineticJobConfiguration, KineticWorker, plan_flow_pod
from tests.support import deployed_flows
from tests.support.prefect_server import PrefectServer, prefect_server, prefect_worker
from tests.support.waiting import recorded_task_run, wait_until

REPO = Path(__file__).resolve().parents[2]
POOL = "kinetic"  # the pool deployments/prefect.yaml deploys to
SWEEP = "quickstart-sweep/sweep"
NIGHTLY = "quickstart-sweep/nightly-retrain"
AUTH_STRING = "kinetic:worker-test-secret"
SMALL_SWEEP = {"configs": [{"lr": 0.3, "hidden": 8}, {"lr": 1.0, "hidden": 16}], "steps": 20}
ONE_TRIAL = {"configs": [{"lr": 0.3, "hidden": 8}], "steps": 10}
# Enough SGD steps to keep a trial training for minutes.
ENDLESS_TRIAL = {"configs": [{"lr": 0.3, "hidden": 8}], "steps": 5_000_000}
JOB_VARIABLES = {
    "accelerator",
    "spot",
    "image",
    "env",
    "cluster",
    "timeout_seconds",
    "namespace",
    "cpu",
    "memory",
    "pod_overrides",
    "queue_name",
    "queued_provisioning",
    "job_labels",
    "job_annotations",
    "flow_service_account",
}
CANCEL_GRACE_SECONDS = 5
# How long a pod may take to hear of a cancellation through Prefect's events (over 15 s
# was seen with the suite's four workers on 2 cores): with the grace, the bound on the
# pods' end after a cancel (a loaded run here took 11.6 s of the 35). The grace itself
# is held by the conformance case that leaves a flow with a running pod.
CANCEL_NOTICE_SECONDS = 30
# How long a deployed flow run may take to end: a hang, not a speed, is what it catches
# (three flow runs took over 3 minutes beside the rest of the suite on 2 cores).
FLOW_RUN_TIMEOUT = 480
# The interval test's schedule: its second run falls due well after the worker took the first.
SCHEDULE_INTERVAL = timedelta(seconds=30)
GKE_POOL = "kinetic-gke"
DEADLINE_SECONDS = 15


@dataclass
class Stack:
    server: PrefectServer
    jobs_root: Path

    @property
    def outputs(self) -> Path:
        return self.jobs_root / "outputs"


def pod_processes(outputs: Path | str, flow_run_id: object = None) -> dict[int, str]:
    """Live processes of the flow run's pods (all runs' without an id), pid -> output key.

    Every process of a pod carries the pod's `KINETIC_OUTPUT_DIR`,
    `{outputs}/{flow_run_id}/{flow|task key}`, in its environment.
    """
    prefix = f"{outputs}/{flow_run_id}/" if flow_run_id else f"{outputs}/"
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path("/proc", entry, "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            name, _, value = item.decode(errors="replace").partition("=")
            if name == "KINETIC_OUTPUT_DIR" and value.startswith(prefix):
                found[int(entry)] = value.rsplit("/", 1)[-1]
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, prefect_database: Path) -> Iterator[Stack]:
    """Server, `kinetic` pool and the prefect.yaml deployments, all made through the CLI.

    `make test` keeps this module on one pytest-xdist worker (`ONE_WORKER_FOLDERS` in
    tests/support/scheduling.py), so the stack starts once per run.
    """
    root = tmp_path_factory.mktemp("kinetic-worker")
    work = root / "work"
    work.mkdir()
    jobs_root = work / ".kinetic"
    with prefect_server(
        root / "server", auth_string=AUTH_STRING, database=prefect_database
    ) as server:
        server.cli("work-pool", "create", "--type", "kinetic", POOL)
        server.cli(
            "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--all", cwd=REPO
        )
        with server.client() as client:
            # Its cron could fall due while the module runs.
            client.pause_deployment(client.read_deployment_by_name(NIGHTLY).id)
        try:
            with prefect_worker(
                server,
                POOL,
                "kinetic",
                work,
                KINETIC_JOBS_ROOT=str(jobs_root),
                KINETIC_CANCEL_GRACE_SECONDS=str(CANCEL_GRACE_SECONDS),
                PREFECT_WORKER_QUERY_SECONDS="1",
                # Prefect's opt-in: the worker stops pods of runs cancelled while Pending.
                PREFECT_WORKER_ENABLE_CANCELLATION="true",
            ) as worker:
                yield Stack(server=server, jobs_root=jobs_root)
                print(f"worker log:\n{worker.log_tail(200)}")
        finally:
            for pid in pod_processes(jobs_root / "outputs"):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def client_of(server: PrefectServer) -> Iterator[None]:
    """Settings that make this process a client of `server`, for Prefect's own calls.

    Prefect's events and API-log workers are per-process singletons bound to the API
    they first met; they are drained on the way in and out, so events sent under these
    settings go to `server` and later tests' events to the session's API.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    EventsWorker.drain_all()
    APILogWorker.drain_all()
    try:
        with temporary_settings(
            {PREFECT_API_URL: server.api_url, PREFECT_API_AUTH_STRING: server.auth_string}
        ):
            yield
    finally:
        EventsWorker.drain_all()
        APILogWorker.drain_all()


def wait_for_final_state(stack: Stack, client: Any, flow_run_id: uuid.UUID) -> Any:
    def final() -> Any:
        state = client.read_flow_run(flow_run_id).state
        return state if state is not None and state.is_final() else None

    return wait_until(final, FLOW_RUN_TIMEOUT, f"flow run {flow_run_id} to end")


def task_runs_of(client: Any, flow_run_id: uuid.UUID) -> list[Any]:
    return client.read_task_runs(
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    )


def ended_task_runs_of(client: Any, flow_run_id: uuid.UUID, count: int) -> list[Any]:
    """The flow run's `count` task runs once the API shows each in a final state.

    Their states reach the API as events, recorded after the flow run's own state.
    """

    runs = wait_until(
        lambda: (found := task_runs_of(client, flow_run_id)) and len(found) == count and found,
        30,
        f"{count} task runs of flow run {flow_run_id} in the API",
        left=lambda: [(r.name, r.state_name) for r in task_runs_of(client, flow_run_id)],
    )
    return [recorded_task_run(run.id, client=client) for run in runs]


def pod_job_id(client: Any, task_run_id: uuid.UUID) -> str:
    """The job id in the "Kinetic pod" artifact the task runner attaches to a task run."""
    artifacts = client.read_artifacts(
        artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id]))
    )
    for artifact in artifacts:
        match = re.search(r"\| job id \| `([^`]+)` \|", str(artifact.data))
        if match:
            return match.group(1)
    raise AssertionError(f"task run {task_run_id} has no Kinetic pod artifact")


# Task pods that start as fresh processes: `pod_processes` finds pods by their environment
# in /proc, which for a pod forked from the local template is the template's.
FRESH_TASK_PODS = {"env": {"KINETIC_LOCAL_TEMPLATE": "0"}}


def deploy_sweep(client: Any, name: str, pool: str, **options: Any) -> uuid.UUID:
    """Another deployment of the sweep's flow and code, in `pool`."""
    sweep = client.read_deployment_by_name(SWEEP)
    deployment_id: uuid.UUID = client.create_deployment(
        flow_id=sweep.flow_id,
        name=name,
        work_pool_name=pool,
        entrypoint=sweep.entrypoint,
        pull_steps=sweep.pull_steps,
        parameter_openapi_schema=sweep.parameter_openapi_schema,
        **options,
    )
    return deployment_id


def run_sweep(client: Any, parameters: dict[str, Any], **job_variables: Any) -> FlowRun:
    deployment = client.read_deployment_by_name(SWEEP)
    return client.create_flow_run_from_deployment(
        deployment.id, parameters=parameters, job_variables=job_variables or None
    )


# -- the work pool type and the block types, through Prefect's CLI ------------------------


def test_block_register_finds_the_kinetic_block_types_in_the_package(stack: Stack):
    result = stack.server.cli("block", "register", "-m", "kinetic_prefect")

    with stack.server.client() as client:
        block_type = client.read_block_type_by_slug("kinetic-cluster")
    assert "Kinetic Cluster" in result.stdout
    assert "Kinetic GCP Credentials" in result.stdout
    assert block_type.name == "Kinetic Cluster"


def test_work_pool_create_gives_a_kinetic_pool_the_kinetic_job_variables(stack: Stack):
    with stack.server.client() as client:
        pool = client.read_work_pool(POOL)

    template = pool.base_job_template
    assert pool.type == "kinetic"
    assert set(template["variables"]["properties"]) >= JOB_VARIABLES
    assert {template["job_configuration"][name] for name in JOB_VARIABLES} == {
        "{{ " + name + " }}" for name in JOB_VARIABLES
    }


def test_prefect_yaml_deploys_a_nightly_cron_retrain_and_an_on_demand_sweep(stack: Stack):
    with stack.server.client() as client:
        nightly = client.read_deployment_by_name(NIGHTLY)
        sweep = client.read_deployment_by_name(SWEEP)

    assert (nightly.work_pool_name, sweep.work_pool_name) == (POOL, POOL)
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"]
    assert sweep.schedules == []
    assert sweep.entrypoint == "flows/quickstart.py:quickstart_sweep"


# -- running deployments ---------------------------------------------------------------


def test_deployed_sweep_runs_in_a_flow_pod_whose_tasks_run_in_pods_of_their_own(stack: Stack):
    with stack.server.client() as client:
        flow_run = run_sweep(client, SMALL_SWEEP)
        final = wait_for_final_state(stack, client, flow_run.id)
        flow_job = client.read_flow_run(flow_run.id).infrastructure_pid
        task_runs = ended_task_runs_of(client, flow_run.id, len(SMALL_SWEEP["configs"]))
        task_jobs = [pod_job_id(client, task_run.id) for task_run in task_runs]

    records = [
        FinalRecord.decode((stack.jobs_root / "kinetic" / job / FINAL_STATE_JSON).read_bytes(), job)
        for job in task_jobs
    ]
    assert final.is_completed(), final.message
    assert [t.state.type.value for t in task_runs] == ["COMPLETED", "COMPLETED"]
    assert flow_job.startswith("kp-")
    assert (stack.jobs_root / "pods" / f"{flow_job}.log").exists()
    assert len({flow_job, *task_jobs}) == 3
    assert [r.state_type for r in records] == ["COMPLETED", "COMPLETED"]


def test_interval_schedule_runs_are_created_by_the_scheduler_and_run_by_the_worker(stack: Stack):
    # Prefect's scheduler makes runs only for dates at or after its pass, so a daily
    # schedule anchored a few seconds ahead is missed (its first run is tomorrow's) when
    # the pass comes late on a loaded machine. Every SCHEDULE_INTERVAL instead: the first
    # run after the pass, however late, falls due within one interval. The later runs it
    # makes ahead are left in a work queue of their own, paused once the worker has taken
    # the first: switching the schedule off instead races the scheduler's passes, which
    # can make again the runs it deletes.
    queue = "interval-sweep"
    with stack.server.client() as client:
        schedule = IntervalSchedule(interval=SCHEDULE_INTERVAL, anchor_date=datetime.now(UTC))
        deployment_id = deploy_sweep(
            client,
            "interval-sweep",
            POOL,
            work_queue_name=queue,
            parameters=ONE_TRIAL,
            schedules=[DeploymentScheduleCreate(schedule=schedule, active=True)],
        )
        by_deployment = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))

        def first_scheduled_run() -> Any:
            runs = client.read_flow_runs(deployment_filter=by_deployment)
            return min(runs, key=lambda r: r.expected_start_time) if runs else None

        scheduled = wait_until(first_scheduled_run, 30, "the scheduler to create a run")
        wait_until(
            lambda: not client.read_flow_run(scheduled.id).state.is_scheduled(),
            SCHEDULE_INTERVAL.total_seconds() + 60,
            f"the worker to take run {scheduled.id}, expected at {scheduled.expected_start_time}",
        )
        work_queue = client.read_work_queue_by_name(queue, work_pool_name=POOL)
        client.update_work_queue(id=work_queue.id, is_paused=True)
        final = wait_for_final_state(stack, client, scheduled.id)
        ran = client.read_flow_run(scheduled.id)
        # A later run the worker took before the pause ends before the next test.
        for other in client.read_flow_runs(deployment_filter=by_deployment):
            if other.state is not None and not other.state.is_scheduled():
                wait_for_final_state(stack, client, other.id)
        client.delete_deployment(deployment_id)

    assert scheduled.auto_scheduled
    assert final.is_completed(), final.message
    assert ran.infrastructure_pid.startswith("kp-")


def test_cancelling_a_running_flow_run_stops_its_flow_and_task_pods_and_cancels_its_task_runs(
    stack: Stack,
):
    with stack.server.client() as client:
        flow_run = run_sweep(client, ENDLESS_TRIAL, **FRESH_TASK_PODS)
        wait_until(
            lambda: (
                {"flow", "train"}
                <= {key.split("-")[0] for key in pod_processes(stack.outputs, flow_run.id).values()}
            ),
            FLOW_RUN_TIMEOUT,
            "the flow pod and its task pod to run",
        )

        client.set_flow_run_state(flow_run.id, Cancelling())

        wait_until(
            lambda: not pod_processes(stack.outputs, flow_run.id),
            CANCEL_GRACE_SECONDS + CANCEL_NOTICE_SECONDS,
            "every pod of the flow run to end",
        )
        final = wait_for_final_state(stack, client, flow_run.id)
        task_states = [t.state.type.value for t in ended_task_runs_of(client, flow_run.id, 1)]

    assert final.is_cancelled(), final.message
    assert task_states == ["CANCELLED"]


@pytest.mark.lowest_prefect
def test_cancelling_a_flow_run_whose_pod_has_not_started_the_flow_stops_the_pod(stack: Stack):
    # A pod stuck before `prefect flow-run execute` (as if pulling its image) keeps its
    # flow run Pending: only the worker can stop it.
    stuck = f"{shlex.quote(sys.executable)} -c 'import threading; threading.Event().wait()'"
    with stack.server.client() as client:
        flow_run = run_sweep(client, ONE_TRIAL, command=stuck)
        wait_until(
            lambda: (
                pod_processes(stack.outputs, flow_run.id)
                and client.read_flow_run(flow_run.id).infrastructure_pid
            ),
            60,
            "the worker to start the flow pod",
        )

        client.set_flow_run_state(flow_run.id, Cancelling())

        wait_until(
            lambda: not pod_processes(stack.outputs, flow_run.id),
            CANCEL_GRACE_SECONDS + CANCEL_NOTICE_SECONDS,
            "the flow pod to end",
        )
        final = wait_for_final_state(stack, client, flow_run.id)

    assert final.is_cancelled(), final.message


def test_a_flow_pod_past_its_deadline_is_stopped_with_its_pods_and_its_run_crashes(
    stack: Stack,
):
    with stack.server.client() as client:
        flow_run = run_sweep(
            client, ENDLESS_TRIAL, timeout_seconds=DEADLINE_SECONDS, **FRESH_TASK_PODS
        )

        final = wait_for_final_state(stack, client, flow_run.id)
        wait_until(
            lambda: not pod_processes(stack.outputs, flow_run.id),
            CANCEL_GRACE_SECONDS + CANCEL_NOTICE_SECONDS,
            "every pod of the flow run to end",
        )

    assert final.is_crashed()
    assert f"deadline of {DEADLINE_SECONDS}s" in final.message


IN_PROCESS_POOL = "kinetic-in-process"


async def _work_through(flow_run_ids: list[uuid.UUID], server: PrefectServer) -> list[str]:
    """Run a worker of `IN_PROCESS_POOL` in this process until the runs end and their pods
    are forgotten; what it still keeps about flow-run pods then."""

    def runs_final() -> bool:
        with server.client() as client:
            states = [client.read_flow_run(run_id).state for run_id in flow_run_ids]
        return all(state is not None and state.is_final() for state in states)

    async with KineticWorker(work_pool_name=IN_PROCESS_POOL) as worker:
        submitted = await worker.get_and_submit_flow_runs()
        assert {run.id for run in submitted} == set(flow_run_ids)
        await anyio.to_thread.run_sync(wait_until, runs_final, FLOW_RUN_TIMEOUT, "the runs to end")
        await anyio.to_thread.run_sync(
            wait_until,
            lambda: not worker.kept_jobs(),
            60,
            "the worker to forget every flow-run pod that ended",
        )
        return worker.kept_jobs()


def in_process_deployment(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool: str, name: str
) -> uuid.UUID:
    """The sweep deployed to `pool` (made now), for a worker in this process in `tmp_path`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KINETIC_JOBS_ROOT", str(tmp_path / ".kinetic"))
    stack.server.cli("work-pool", "create", "--type", "kinetic", pool)
    with stack.server.client() as client:
        return deploy_sweep(client, name, pool)


def test_the_worker_keeps_nothing_about_flow_runs_that_have_ended(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    deployment_id = in_process_deployment(
        stack, tmp_path, monkeypatch, IN_PROCESS_POOL, "sweep-in-process"
    )
    with stack.server.client() as client:
        runs = [
            client.create_flow_run_from_deployment(deployment_id, parameters=ONE_TRIAL)
            for _ in range(3)
        ]

    with client_of(stack.server):
        kept = asyncio.run(_work_through([run.id for run in runs], stack.server))
    with stack.server.client() as client:
        finals = [client.read_flow_run(run.id).state for run in runs]
        client.delete_deployment(deployment_id)

    assert [state.type.value for state in finals] == ["COMPLETED"] * 3
    assert kept == []


PRUNE_POOL = "kinetic-prune"


async def _abandon_then_sync(flow_run: FlowRun, configuration: Any) -> tuple[list[str], list[str]]:
    """Launch the run's pod and stop following it at once, so the run ends before its pod;
    what the worker keeps then, and once its periodic syncs have seen the pod end."""
    async with KineticWorker(work_pool_name=PRUNE_POOL) as worker:
        with anyio.CancelScope() as following:
            async with anyio.create_task_group() as runs:
                await runs.start(worker.run, flow_run, configuration)
                following.cancel()
        abandoned = worker.kept_jobs()

        def synced_clean() -> bool:
            anyio.from_thread.run(worker.sync_with_backend)
            return not worker.kept_jobs()

        with contextlib.suppress(AssertionError):
            await anyio.to_thread.run_sync(
                wait_until, synced_clean, 30, "a sync to forget the abandoned flow-run pod"
            )
        return abandoned, worker.kept_jobs()


def test_the_periodic_sync_forgets_a_flow_pod_whose_run_ended_before_the_pod(
    stack: Stack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    deployment_id = in_process_deployment(stack, tmp_path, monkeypatch, PRUNE_POOL, "sweep-prune")
    with stack.server.client() as client:
        flow_run = client.create_flow_run_from_deployment(deployment_id, parameters=ONE_TRIAL)
    # A pod that ends on its own, without running the flow.
    configuration = KineticJobConfiguration(command="python -c pass")
    configuration.prepare_for_flow_run(flow_run)

    with client_of(stack.server):
        abandoned, kept = asyncio.run(_abandon_then_sync(flow_run, configuration))
    with stack.server.client() as client:
        client.delete_deployment(deployment_id)

    assert len(abandoned) == 1
    assert kept == []


def rbac_service_accounts() -> tuple[str, str]:
    """(flow pods' account, task pods' account) as deployments/k8s/rbac.yaml ships them.

    The first is the one bound to the runner Role; the second the one with no token.
    """
    documents = list(yaml.safe_load_all((REPO / "deployments/k8s/rbac.yaml").read_text()))
    (binding,) = [d for d in documents if d["kind"] == "RoleBinding"]
    (runner,) = [s["name"] for s in binding["subjects"] if s["kind"] == "ServiceAccount"]
    (pods,) = [
        d["metadata"]["name"]
        for d in documents
        if d["kind"] == "ServiceAccount" and d.get("automountServiceAccountToken") is False
    ]
    return runner, pods


@contextlib.contextmanager
def gke_pool_worker(stack: Stack, gcs: Any, worker_dir: Path) -> Iterator[Any]:
    """A `GKE_POOL` worker whose flow pods run on the emulated cluster; yields a client.

    The pool's deployments name the gke `KineticCluster` saved here, on the suite's
    shipped environment.
    """
    from prefect_gcp.cloud_storage import GcsBucket

    from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials
    from tests.support.clusters import SHIPPED_REQUIREMENTS

    _, pods_account = rbac_service_accounts()
    server = stack.server
    with client_of(server):
        GcsBucket(
            bucket=gcs.name, bucket_folder="results", gcp_credentials=KineticGcpCredentials()
        ).save(deployed_flows.GKE_RESULTS, overwrite=True)
        KineticCluster(
            backend="gke",
            jobs_bucket=gcs.uri,
            service_account=pods_account,
            result_storage=GcsBucket.load(deployed_flows.GKE_RESULTS),
            env=gcs.pod_env,
            # The suite's one shipped environment (tests/conftest.py: its thin stand-in).
            requirements=str(SHIPPED_REQUIREMENTS),
            environment_builder="local",
            environment_store=gcs.environment_store,
            accelerator_extras=[],
        ).save(deployed_flows.GKE_CLUSTER, overwrite=True)
    server.cli("work-pool", "create", "--type", "kinetic", "--overwrite", GKE_POOL)
    worker_dir.mkdir()
    with (
        server.client() as client,
        prefect_worker(server, GKE_POOL, "kinetic", worker_dir, KINETIC_ALLOW_LOOPBACK_API="true"),
    ):
        yield client


def deploy_to_gke_pool(client: Any, flow: Any, entrypoint: str) -> uuid.UUID:
    from prefect.utilities.callables import parameter_schema

    sweep = client.read_deployment_by_name(SWEEP)
    deployment_id: uuid.UUID = client.create_deployment(
        flow_id=client.create_flow_from_name(flow.name),
        name=flow.name,
        work_pool_name=GKE_POOL,
        entrypoint=f"tests/support/deployed_flows.py:{entrypoint}",
        pull_steps=sweep.pull_steps,
        parameter_openapi_schema=parameter_schema(flow).model_dump(),
        job_variables={"cluster": deployed_flows.GKE_CLUSTER},
    )
    return deployment_id


def _running_task_pod(cluster: Any, flow_run_id: uuid.UUID) -> str | None:
    """The Job name of the flow run's task pod once it runs."""
    for pod in cluster.pods():
        labels = pod["metadata"].get("labels") or {}
        running = (pod.get("status") or {}).get("phase") == "Running"
        ours = labels.get(LABEL_FLOW_RUN_ID) == str(flow_run_id)
        if running and ours and LABEL_TASK_RUN_ID in labels:
            return str(labels[LABEL_JOB_ID])
    return None


def _kill_flow_pod(gcs: Any, flow_run_id: uuid.UUID) -> None:
    """SIGKILL every process of the flow run's flow pod (the flow runs in a group of its own)."""
    processes = pod_processes(f"{gcs.uri}/outputs", flow_run_id)
    flow_pids = [pid for pid, key in processes.items() if key == "flow"]
    assert flow_pids, processes
    for pid in flow_pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _reattached(client: Any, flow_run_id: uuid.UUID) -> bool:
    return any(
        (run.state and run.state.message or "").startswith("Reattached")
        for run in task_runs_of(client, flow_run_id)
    )


def test_a_flow_pod_restarted_for_its_flow_run_reattaches_to_its_running_task_pod(
    stack: Stack, gcs, cluster, suite_environment, tmp_path: Path
):
    gate = tmp_path / "gate"
    # A node of its own: these pods sign with the pool's record key, so on the shared test
    # node they would refuse, and unpack again, the copies other cases' pods run on.
    cluster.kubelet.node_root = tmp_path / "node"
    with gke_pool_worker(stack, gcs, tmp_path / "gke-worker") as client:
        deployment_id = deploy_to_gke_pool(
            client, deployed_flows.gated_cube_on_gke, "gated_cube_on_gke"
        )
        flow_run = client.create_flow_run_from_deployment(
            deployment_id, parameters={"x": 2, "gate": str(gate)}
        )
        task_job = wait_until(
            lambda: _running_task_pod(cluster, flow_run.id), FLOW_RUN_TIMEOUT, "the task pod"
        )
        _kill_flow_pod(gcs, flow_run.id)
        crashed = wait_for_final_state(stack, client, flow_run.id)
        # What a retry of the crashed flow run does: the worker gives it a new flow pod.
        client.set_flow_run_state(flow_run.id, Scheduled(), force=True)
        wait_until(lambda: _reattached(client, flow_run.id), FLOW_RUN_TIMEOUT, "a reattach")
        gate.touch()
        final = wait_for_final_state(stack, client, flow_run.id)
    with client_of(stack.server):
        result = final.result()

    created = cluster.created_jobs()
    flow_jobs = [job for job in created if LABEL_TASK_RUN_ID not in job["metadata"]["labels"]]
    task_jobs = [job for job in created if LABEL_TASK_RUN_ID in job["metadata"]["labels"]]
    key_secret = cluster.secret("default", f"kinetic-record-key-{GKE_POOL}")
    assert crashed.is_crashed(), crashed.message
    assert final.is_completed(), final.message
    assert result == 8
    assert len(flow_jobs) == 2
    assert [job["metadata"]["name"] for job in task_jobs] == [task_job]
    assert key_secret is not None and "record-key" in key_secret["data"]
    assert "ownerReferences" not in key_secret["metadata"]


# -- the flow pod's manifest -----------------------------------------------------------


@pytest.fixture
def prepared(workdir: Path) -> Iterator[tuple[FlowRun, KineticJobConfiguration]]:
    """A flow run and its job configuration as the worker prepares them, API secrets set."""
    flow_run = FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4())
    configuration = KineticJobConfiguration(
        accelerator="l4", timeout_seconds=600, labels={"team": "ml"}
    )
    with temporary_settings(
        {
            PREFECT_API_URL: "https://prefect.example.com/api",
            PREFECT_API_KEY: "pnu_not-for-manifests",
            PREFECT_API_AUTH_STRING: "admin:not-for-manifests",
        }
    ):
        configuration.prepare_for_flow_run(flow_run)
        yield flow_run, configuration


def test_flow_pod_manifest_carries_prefect_secrets_only_as_secret_refs(prepared):
    flow_run, configuration = prepared

    plan = plan_flow_pod(flow_run, configuration)

    env = {item["name"]: item for item in container_of(plan.manifest)["env"]}
    (secret_name,) = plan.backend_secrets()
    assert "not-for-manifests" not in json.dumps(plan.manifest)
    assert env["PREFECT_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": secret_name,
        "key": "prefect-api-key",
    }
    assert env["PREFECT_API_AUTH_STRING"]["valueFrom"]["secretKeyRef"] == {
        "name": secret_name,
        "key": "prefect-api-auth-string",
    }
    assert plan.backend_secrets()[secret_name] == {
        "prefect-api-key": "pnu_not-for-manifests",
        "prefect-api-auth-string": "admin:not-for-manifests",
    }


def test_flow_pod_runs_prefect_flow_run_execute_with_flow_labels_and_the_flow_output_dir(
    prepared, workdir: Path
):
    flow_run, configuration = prepared

    manifest = plan_flow_pod(flow_run, configuration).manifest

    container = container_of(manifest)
    env = {item["name"]: item.get("value") for item in container["env"]}
    labels = manifest["spec"]["template"]["metadata"]["labels"]
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    assert container["command"] == ["python", "-m", "prefect", "flow-run", "execute"]
    assert env["PREFECT__FLOW_RUN_ID"] == str(flow_run.id)
    assert env["PREFECT_API_URL"] == "https://prefect.example.com/api"
    assert env["KINETIC_OUTPUT_DIR"] == f"{workdir}/.kinetic/outputs/{flow_run.id}/flow"
    assert labels[LABEL_FLOW_RUN_ID] == str(flow_run.id)
    assert labels[LABEL_JOB_ID] == manifest["metadata"]["name"]
    assert labels[LABEL_MANAGED_BY] == "kinetic-prefect"
    assert labels["team"] == "ml"
    assert LABEL_TASK_RUN_ID not in labels
    assert not any(key.startswith("prefect.io/") for key in labels)


def test_flow_pod_takes_accelerator_and_deadline_from_job_variables(prepared):
    flow_run, configuration = prepared

    manifest = plan_flow_pod(flow_run, configuration).manifest

    pod_spec = manifest["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert container_of(manifest)["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    assert manifest["spec"]["activeDeadlineSeconds"] == 600


def test_flow_pod_takes_cpu_memory_and_pod_overrides_from_job_variables(workdir: Path):
    flow_run = FlowRun(id=uuid.uuid4(), name="calm-heron", flow_id=uuid.uuid4())
    toleration = {"key": "team", "operator": "Exists", "effect": "NoSchedule"}
    configuration = KineticJobConfiguration(
        cpu="2", memory="8Gi", pod_overrides={"tolerations": [toleration]}
    )
    configuration.prepare_for_flow_run(flow_run)

    manifest = plan_flow_pod(flow_run, configuration).manifest

    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    assert container_of(manifest)["resources"]["requests"] == {"cpu": "2", "memory": "8Gi"}
    assert manifest["spec"]["template"]["spec"]["tolerations"] == [toleration]


def test_flow_pod_waits_in_the_job_variables_kueue_queue_and_its_task_pods_inherit_it(
    workdir: Path,
):
    flow_run = FlowRun(id=uuid.uuid4(), name="quiet-lynx", flow_id=uuid.uuid4())
    configuration = KineticJobConfiguration(queue_name="cpu")
    configuration.prepare_for_flow_run(flow_run)

    manifest = plan_flow_pod(flow_run, configuration).manifest

    env = {item["name"]: item.get("value") for item in container_of(manifest)["env"]}
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    assert manifest["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "cpu"
    assert manifest["spec"]["suspend"] is True
    assert env["KINETIC_QUEUE_NAME"] == "cpu"


def test_flow_pod_hands_its_cluster_settings_down_to_the_flows_task_pods(prepared, workdir):
    flow_run, configuration = prepared

    manifest = plan_flow_pod(flow_run, configuration).manifest

    env = {item["name"]: item.get("value") for item in container_of(manifest)["env"]}
    assert env["KINETIC_BACKEND"] == "local"
    assert env["KINETIC_JOBS_ROOT"] == f"{workdir}/.kinetic"
    assert env["KINETIC_OUTPUT_ROOT"] == f"{workdir}/.kinetic/outputs"


def test_the_worker_acts_as_its_clusters_gcp_credentials_and_its_flow_pod_never_gets_them(
    prepared, workdir
):
    from prefect_gcp.credentials import GcpCredentials

    from kinetic_prefect.blocks import KineticCluster
    from tests.support.oauth_tokens import TokenEndpoint

    flow_run, configuration = prepared
    with TokenEndpoint({}) as endpoint:
        key = endpoint.key("kinetic-ci@my-project.iam.gserviceaccount.com", "my-project")
    cluster = KineticCluster(
        backend="local",
        jobs_bucket=str(workdir / ".kinetic"),
        gcp_credentials=GcpCredentials(service_account_info=key),
    )

    plan = plan_flow_pod(flow_run, configuration, cluster)

    # The worker's own stores and checks use the plan's settings.
    assert plan.settings.gcp_credentials == cluster.gcp_credentials
    shipped = json.dumps([plan.manifest, plan.backend_secrets()])
    assert key["private_key_id"] not in shipped
    assert key["client_email"] not in shipped


def test_flow_pod_runs_as_the_runner_with_its_token_and_its_task_pods_keep_the_clusters_account(
    prepared, monkeypatch
):
    flow_run, configuration = prepared
    monkeypatch.setenv("KINETIC_SERVICE_ACCOUNT", "kinetic-prefect-pods")

    manifest = plan_flow_pod(flow_run, configuration).manifest

    pod_spec = manifest["spec"]["template"]["spec"]
    env = {item["name"]: item.get("value") for item in container_of(manifest)["env"]}
    assert pod_spec["serviceAccountName"] == "kinetic-prefect-runner"
    assert pod_spec["automountServiceAccountToken"] is True
    assert env["KINETIC_SERVICE_ACCOUNT"] == "kinetic-prefect-pods"


@pytest.mark.parametrize(
    "variable", ["KINETIC_CREDENTIALS_DENIED_TIMEOUT_SECONDS", "KINETIC_QUEUE_TIMEOUT_SECONDS"]
)
def test_flow_pod_hands_its_timeouts_down_to_the_flows_task_pods(prepared, monkeypatch, variable):
    flow_run, configuration = prepared
    monkeypatch.setenv(variable, "600")

    manifest = plan_flow_pod(flow_run, configuration).manifest

    env = {item["name"]: item.get("value") for item in container_of(manifest)["env"]}
    assert env[variable] == "600.0"


def test_a_gke_flow_pod_reads_its_record_key_from_its_pools_secret(prepared):
    flow_run, configuration = prepared

    manifest = plan_flow_pod(flow_run, configuration, None, record_key_secret("gpu-pool")).manifest

    env = {item["name"]: item for item in container_of(manifest)["env"]}
    assert env["KINETIC_RECORD_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "kinetic-record-key-gpu-pool",
        "key": "record-key",
    }


def test_a_record_key_set_in_the_env_job_variable_wins_over_the_pools_secret(prepared):
    flow_run, configuration = prepared
    configuration.env["KINETIC_RECORD_KEY"] = "k" * 64

    manifest = plan_flow_pod(flow_run, configuration, None, record_key_secret("gpu-pool")).manifest

    env = [item for item in container_of(manifest)["env"] if item["name"] == "KINETIC_RECORD_KEY"]
    assert env == [{"name": "KINETIC_RECORD_KEY", "value": "k" * 64}]


def test_pool_names_that_are_not_dns_names_get_distinct_dns_secret_names():
    names = {record_key_secret(pool) for pool in ("GPU pool", "gpu-pool", "gpu_pool")}

    assert len(names) == 3
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) for name in names)


def test_kinetic_worker_is_the_kinetic_work_pool_type():
    from prefect.workers.base import BaseWorker

    assert BaseWorker.get_worker_class_from_type("kinetic") is KineticWorker
