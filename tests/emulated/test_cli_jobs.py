"""`kinetic-prefect jobs ls|logs|cancel|cleanup` and `doctor` against the emulated cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, task
from prefect.runtime import task_run
from prefect_gcp.cloud_storage import GcsBucket
from prefect_kubernetes.credentials import KubernetesClusterConfig
from typer.testing import CliRunner

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.backends.local.pods import pods_labelled
from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials
from kinetic_prefect.cli import app
from kinetic_prefect.launch.accelerators import parse_accelerator
from kinetic_prefect.launch.manifest import (
    LABEL_JOB_ID,
    LABEL_MANAGED_BY,
    LABEL_TASK_RUN_ID,
    MANAGED_BY,
    LaunchSpec,
    SecretRef,
    build_job_manifest,
)
from kinetic_prefect.launch.slices import build_workload, host_index
from tests.emulated.test_multihost_gke import _tpu_nodes
from tests.support.kube import KubeCluster, running_cluster
from tests.support.kube_objects import gke_nodes
from tests.support.waiting import wait_until

pytestmark = pytest.mark.usefixtures("workdir")

cli = CliRunner()


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeCluster]:
    with running_cluster(tmp_path / "cluster", namespaces=("default", "ml")) as emulated:
        emulated.kubelet.run_containers = False
        monkeypatch.setenv("KUBECONFIG", str(emulated.kubeconfig))
        # `jobs logs` and `jobs attach` follow the configured backend (default local).
        monkeypatch.setenv("KINETIC_BACKEND", "gke")
        yield emulated
        refusals = emulated.refusals()
    # What the CLI does needs only what rbac.yaml and the user binding grant.
    assert emulated.refusals_expected or refusals == []


def _launch(cluster: KubeCluster, job_id: str, namespace: str = "default", fault: str = "") -> None:
    """Create a Kinetic Job as the runner would (pods end at once unless `fault` says else)."""
    if fault:
        cluster.kubelet.faults_by_job[job_id] = fault
    spec = _spec(job_id, namespace)
    cluster.create(f"/apis/batch/v1/namespaces/{namespace}/jobs", build_job_manifest(spec))


def _spec(job_id: str, namespace: str = "default") -> LaunchSpec:
    return LaunchSpec(
        job_id=job_id,
        task_name="train",
        task_run_id="00000000-0000-0000-0000-000000000001",
        flow_run_id="00000000-0000-0000-0000-000000000002",
        accelerator=parse_accelerator("cpu"),
        image="python:3.11-slim",
        namespace=namespace,
        payload_uri="gs://b/kinetic/x/payload.pkl",
        payload_sha256="0" * 64,
        context_uri="gs://b/kinetic/x/context.zip",
        context_sha256="0" * 64,
        job_dir_uri="gs://b/kinetic/x",
        output_dir="gs://b/outputs/x",
    )


def _plain_job(name: str) -> dict[str, Any]:
    """A Job someone else created in the same namespace."""
    pod_spec = {"restartPolicy": "Never", "containers": [{"name": "main", "image": "busybox"}]}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {"app": "other"}},
        "spec": {"template": {"metadata": {"labels": {"app": "other"}}, "spec": pod_spec}},
    }


def _pod(cluster: KubeCluster, job_id: str, phase: str) -> dict[str, Any] | None:
    for pod in cluster.pods():
        if pod["metadata"]["labels"].get(LABEL_JOB_ID) == job_id:
            return pod if pod.get("status", {}).get("phase") == phase else None
    return None


def _log_file(cluster: KubeCluster, pod: dict[str, Any]) -> Path:
    key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
    return cluster.call(lambda: cluster.emulator.log_files[key])


def test_jobs_ls_lists_kinetic_jobs_with_task_accelerator_and_status(cluster):
    _launch(cluster, "kp-train-0001")
    cluster.create("/apis/batch/v1/namespaces/default/jobs", _plain_job("not-ours"))
    wait_until(lambda: _pod(cluster, "kp-train-0001", "Succeeded"), 30, "the pod to succeed")

    result = cli.invoke(app, ["jobs", "ls"])

    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "kp-train-0001" in line)
    assert ("train" in row, "cpu" in row, "Succeeded" in row) == (True, True, True)
    assert "not-ours" not in result.output


def test_jobs_logs_prints_the_last_lines_of_the_pod_log(cluster):
    _launch(cluster, "kp-train-0002")
    pod = wait_until(lambda: _pod(cluster, "kp-train-0002", "Succeeded"), 30, "the pod")
    _log_file(cluster, pod).write_text("step 1\nstep 2\nstep 3\n")

    result = cli.invoke(app, ["jobs", "logs", "kp-train-0002", "--tail", "2"])

    assert result.exit_code == 0, result.output
    assert result.output == "step 2\nstep 3\n"


def test_jobs_logs_host_prints_the_log_of_that_host_of_a_slice(cluster):
    cluster.kubelet.nodes = _tpu_nodes(4)
    spec = replace(_spec("kp-slice-0001"), accelerator=parse_accelerator("tpu-v5e-16"))
    cluster.create("/apis/batch/v1/namespaces/default/jobs", build_workload(spec).job)
    pods = wait_until(lambda: _slice_pods(cluster, "kp-slice-0001"), 30, "the 4 pods to succeed")
    for pod in pods:
        _log_file(cluster, pod).write_text(f"host {host_index(pod)}\n")

    result = cli.invoke(app, ["jobs", "logs", "kp-slice-0001", "--host", "2"])

    assert result.exit_code == 0, result.output
    assert result.output == "host 2\n"


def _slice_pods(cluster: KubeCluster, job_id: str) -> list[dict[str, Any]] | None:
    pods = [p for p in cluster.pods() if p["metadata"]["labels"].get(LABEL_JOB_ID) == job_id]
    done = len(pods) == 4 and all(p.get("status", {}).get("phase") == "Succeeded" for p in pods)
    return pods if done else None


def test_jobs_logs_follow_streams_new_lines_until_the_container_ends(cluster):
    _launch(cluster, "kp-train-0003", fault="hang")
    pod = wait_until(lambda: _pod(cluster, "kp-train-0003", "Running"), 30, "the pod to run")
    log = _log_file(cluster, pod)
    key = (pod["metadata"]["namespace"], pod["metadata"]["name"])

    def write_while_followed() -> None:
        wait_until(
            lambda: any(r.params.get("follow") for r in cluster.client_requests()),
            30,
            "the log to be followed",
        )
        log.write_text(log.read_text() + "written while following\n")
        cluster.call(lambda: cluster.emulator.finished_logs.add(key))

    writer = threading.Thread(target=write_while_followed)
    writer.start()
    result = cli.invoke(app, ["jobs", "logs", "kp-train-0003", "--follow"])
    writer.join()

    assert result.exit_code == 0, result.output
    assert result.output.endswith("written while following\n")


def test_jobs_cancel_deletes_the_job_and_its_pod(cluster):
    _launch(cluster, "kp-train-0004", fault="hang")
    wait_until(lambda: _pod(cluster, "kp-train-0004", "Running"), 30, "the pod to run")

    result = cli.invoke(app, ["jobs", "cancel", "kp-train-0004"])

    assert result.exit_code == 0, result.output
    wait_until(lambda: cluster.jobs() == [] and cluster.pods() == [], 30, "Job and pod gone")


def test_jobs_cancel_of_an_unknown_job_fails(cluster):
    result = cli.invoke(app, ["jobs", "cancel", "kp-no-such-job"])

    assert (result.exit_code, "kp-no-such-job: not found" in result.output) == (1, True)


def test_jobs_cleanup_removes_finished_jobs_and_their_artifacts_but_not_running_ones(
    cluster, workdir, monkeypatch
):
    monkeypatch.setenv("KINETIC_JOBS_ROOT", str(workdir / "jobs"))
    for job_id in ("kp-done-0005", "kp-busy-0006"):
        (workdir / "jobs" / "kinetic" / job_id).mkdir(parents=True)
        (workdir / "jobs" / "kinetic" / job_id / "payload.pkl").write_bytes(b"payload")
    _launch(cluster, "kp-done-0005")
    _launch(cluster, "kp-busy-0006", fault="hang")
    wait_until(lambda: _pod(cluster, "kp-done-0005", "Succeeded"), 30, "the first pod to end")
    wait_until(lambda: _pod(cluster, "kp-busy-0006", "Running"), 30, "the second pod to run")

    result = cli.invoke(app, ["jobs", "cleanup"])

    assert result.exit_code == 0, result.output
    wait_until(
        lambda: [j["metadata"]["name"] for j in cluster.jobs()] == ["kp-busy-0006"],
        30,
        "only the running Job to remain",
    )
    assert sorted(p.name for p in (workdir / "jobs" / "kinetic").iterdir()) == ["kp-busy-0006"]


def _secret(name: str, ours: bool = True, owner: str = "", created: str = "") -> dict[str, Any]:
    """A Secret as a runner creates one (`ours`), owned by the Job with uid `owner`."""
    meta: dict[str, Any] = {"name": name, "labels": {LABEL_MANAGED_BY: MANAGED_BY} if ours else {}}
    if owner:
        meta["ownerReferences"] = [
            {"apiVersion": "batch/v1", "kind": "Job", "name": "kp-busy-0007", "uid": owner}
        ]
    if created:
        meta["creationTimestamp"] = created
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "data": {"k": "dg=="}}


def test_jobs_cleanup_removes_our_secrets_that_no_remaining_job_owns_or_names(cluster):
    spec = replace(_spec("kp-busy-0007"), secret_env=(SecretRef("TOKEN", "named-by-job", "t"),))
    cluster.kubelet.faults_by_job["kp-busy-0007"] = "hang"
    cluster.create("/apis/batch/v1/namespaces/default/jobs", build_job_manifest(spec))
    (job,) = cluster.jobs()
    an_hour_ago = "2020-01-01T00:00:00Z"
    for secret in (
        _secret("orphaned", created=an_hour_ago),
        _secret("owned-by-job", owner=job["metadata"]["uid"], created=an_hour_ago),
        _secret("named-by-job", created=an_hour_ago),
        _secret("just-created"),
        _secret("someone-elses", ours=False, created=an_hour_ago),
    ):
        cluster.create("/api/v1/namespaces/default/secrets", secret)

    result = cli.invoke(app, ["jobs", "cleanup"])

    assert result.exit_code == 0, result.output
    assert "deleted Secret orphaned" in result.output
    assert sorted(s["metadata"]["name"] for s in cluster.secrets()) == [
        "just-created",
        "named-by-job",
        "owned-by-job",
        "someone-elses",
    ]


@pytest.mark.parametrize("command", [["ls"], ["cancel", "kp-train-0005"], ["cleanup"]])
def test_job_commands_on_the_local_backend_say_they_need_the_gke_backend(command, monkeypatch):
    monkeypatch.setenv("KINETIC_BACKEND", "local")

    result = cli.invoke(app, ["jobs", *command])

    assert result.exit_code == 1
    assert f"`kinetic-prefect jobs {command[0]}` works on Kubernetes Jobs" in result.output
    assert "Pass --cluster with a KineticCluster block of backend gke" in result.output


def test_cluster_option_uses_the_saved_blocks_kube_config_and_namespace(
    cluster, prefect_api, tmp_path, monkeypatch
):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    KineticCluster(
        namespace="ml",
        kube_config=KubernetesClusterConfig(config=cluster.kubeconfig_dict(), context_name="kmock"),
    ).save("cli-ml", overwrite=True)
    _launch(cluster, "kp-train-0007", namespace="ml")

    result = cli.invoke(app, ["jobs", "ls", "--cluster", "cli-ml"])

    assert result.exit_code == 0, result.output
    assert "kp-train-0007" in result.output


# -- doctor ----------------------------------------------------------------------------------
# This module's pods run no containers, so doctor's pod check is left out here
# (--no-pod-check); tests/emulated/test_doctor_pods.py tests it.


@pytest.fixture
def gke_block(cluster, gcs, prefect_api) -> str:
    GcsBucket(bucket=gcs.name, gcp_credentials=KineticGcpCredentials()).save(
        "doctor-results", overwrite=True
    )
    KineticCluster(
        backend="gke", jobs_bucket=gcs.uri, result_storage=GcsBucket.load("doctor-results")
    ).save("doctor", overwrite=True)
    return "doctor"


def _doctor_block(gcs: Any, name: str, **fields: Any) -> str:
    KineticCluster(
        backend="gke",
        jobs_bucket=gcs.uri,
        result_storage=GcsBucket.load("doctor-results"),
        **fields,
    ).save(name, overwrite=True)
    return name


def test_doctor_passes_rbac_and_service_accounts_after_rbac_yaml(gke_block, gcs, monkeypatch):
    monkeypatch.setenv("KINETIC_ALLOW_LOOPBACK_API", "true")
    name = _doctor_block(gcs, "doctor-pods", service_account="kinetic-prefect-pods")

    result = cli.invoke(app, ["doctor", "--no-pod-check", "--cluster", name])

    assert "ok  RBAC: every verb the runner uses is granted" in result.output, result.output
    assert "Service account kinetic-prefect-pods: task pods" in result.output
    assert "FAIL" not in result.output


def test_doctor_fails_a_pods_service_account_that_does_not_exist_naming_the_fix(
    gke_block, gcs, monkeypatch
):
    monkeypatch.setenv("KINETIC_ALLOW_LOOPBACK_API", "true")
    # The account blocks/save_gke.py once defaulted to; rbac.yaml creates kinetic-prefect-pods.
    name = _doctor_block(gcs, "doctor-typo", service_account="kinetic-prefect-pod")

    result = cli.invoke(app, ["doctor", "--no-pod-check", "--cluster", name])

    assert result.exit_code == 1
    assert (
        "FAIL  Service account kinetic-prefect-pod: not found in default: kubectl apply -n "
        "default -f deployments/k8s/rbac.yaml, or set service_account="
    ) in result.output


def test_doctor_lists_every_verb_a_user_without_the_binding_lacks(gke_block, cluster, monkeypatch):
    monkeypatch.setenv("KINETIC_ALLOW_LOOPBACK_API", "true")
    cluster.refusals_expected = True
    cluster.unbind_user()

    result = cli.invoke(app, ["doctor", "--no-pod-check", "--cluster", gke_block])

    assert result.exit_code == 1
    assert "FAIL  Cluster access" in result.output
    flat = " ".join(result.output.split())  # the console folds long lines
    rbac = flat[flat.index("RBAC:") : flat.index("Service account")]
    for verb in ("create jobs.batch", "watch pods", "get pods/log", "create secrets"):
        assert verb in rbac
    assert "sed s/USER/YOUR_ACCOUNT/ deployments/k8s/user-binding.yaml | kubectl apply" in rbac
    # The cluster refused only the user's two direct looks (RBAC is asked by access review).
    assert sorted((c, m, p.partition("?")[0]) for c, m, p, _ in cluster.refusals()) == [
        (403, "GET", "/api/v1/namespaces/default/serviceaccounts/kinetic-prefect-runner"),
        (403, "GET", "/apis/batch/v1/namespaces/default/jobs"),
    ]


def test_doctor_fails_a_loopback_prefect_api_for_the_gke_backend(gke_block):
    result = cli.invoke(app, ["doctor", "--no-pod-check", "--cluster", gke_block])

    assert result.exit_code == 1
    assert "loopback address, which pods in the cluster cannot reach" in result.output


def test_doctor_counts_the_nodes_that_offer_the_accelerator(gke_block, cluster, monkeypatch):
    monkeypatch.setenv("KINETIC_ALLOW_LOOPBACK_API", "true")
    cluster.kubelet.nodes = [
        *gke_nodes("l4-pool", "l4", 1),
        *gke_nodes("default-pool", "cpu", 1),
    ]
    cluster.publish_nodes()

    result = cli.invoke(
        app, ["doctor", "--no-pod-check", "--cluster", gke_block, "--accelerator", "l4"]
    )

    assert result.exit_code == 0, result.output
    assert "1 node(s) with cloud.google.com/gke-accelerator=nvidia-l4" in result.output
    assert "1 with nvidia.com/gpu >= 1" in result.output


def test_doctor_warns_when_no_node_offers_the_accelerator(gke_block, cluster, monkeypatch):
    monkeypatch.setenv("KINETIC_ALLOW_LOOPBACK_API", "true")
    cluster.publish_nodes()

    result = cli.invoke(
        app, ["doctor", "--no-pod-check", "--cluster", gke_block, "--accelerator", "tpu-v5e-4"]
    )

    assert result.exit_code == 0, result.output
    assert "no node has cloud.google.com/gke-tpu-accelerator=tpu-v5-lite-podslice" in result.output


# -- following a task run's pods (local and gke backends) --------------------------------------

CLI_TIMEOUT = 120


@task
def gated(gate: str, fail: bool) -> int:
    """Prints, then blocks on the FIFO `gate` until the test writes to it."""
    print("before the gate", flush=True)
    Path(gate).with_suffix(".id").write_text(str(task_run.id))
    Path(gate).read_text()
    print("after the gate", flush=True)
    if fail:
        raise RuntimeError("the gated task failed")
    return 42


@dataclass
class GatedRun:
    """A flow run in the background whose one task waits at a gate the test opens."""

    gate: Path
    thread: threading.Thread

    @property
    def task_run_id(self) -> str:
        return wait_until(
            lambda: (
                self.gate.with_suffix(".id").exists() and self.gate.with_suffix(".id").read_text()
            ),
            CLI_TIMEOUT,
            "the task to start",
        )

    def open(self) -> None:
        self.gate.write_text("open")
        self.thread.join(timeout=CLI_TIMEOUT)


def _gated_run(workdir: Path, runner: KineticTaskRunner, fail: bool = False) -> GatedRun:
    gate = workdir / "gate"
    os.mkfifo(gate)

    @flow(task_runner=runner)
    def one_gated_task() -> object:
        return gated.submit(str(gate), fail).result(raise_on_failure=False)

    thread = threading.Thread(target=lambda: one_gated_task(return_state=True), daemon=True)
    thread.start()
    return GatedRun(gate, thread)


@dataclass
class CliProcess:
    """`kinetic-prefect ...` in a subprocess, its output collected as it comes."""

    process: subprocess.Popen[str]
    lines: list[str]

    def wait_for_output(self, text: str) -> None:
        wait_until(lambda: text in "".join(self.lines), CLI_TIMEOUT, f"{text!r} in the output")

    def finish(self) -> tuple[int, str]:
        code = self.process.wait(timeout=CLI_TIMEOUT)
        self.reader.join(timeout=10)
        return code, "".join(self.lines)

    def __post_init__(self) -> None:
        assert self.process.stdout is not None
        stream = self.process.stdout
        self.reader = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self.reader.start()


def _cli_process(prefect_api: str, *args: str) -> CliProcess:
    process = subprocess.Popen(
        [sys.executable, "-m", "kinetic_prefect.cli", *args],
        env={**os.environ, "PREFECT_API_URL": prefect_api},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return CliProcess(process, [])


@pytest.fixture(params=["local", "gke"])
def backend_target(request: pytest.FixtureRequest) -> tuple[str | None, list[str]]:
    """(the runner's cluster, the CLI's cluster arguments) for each backend."""
    if request.param == "local":
        return None, []
    cluster, gke = request.getfixturevalue("cluster"), request.getfixturevalue("gke")
    cluster.kubelet.run_containers = True
    request.getfixturevalue("monkeypatch").setenv("KINETIC_ALLOW_LOOPBACK_API", "true")
    return gke, ["--cluster", gke]


@pytest.mark.slow
def test_jobs_attach_follows_the_task_runs_pod_and_exits_0_once_it_completes(
    backend_target, workdir, prefect_api
):
    runner_cluster, cluster_args = backend_target
    run = _gated_run(workdir, KineticTaskRunner(cluster=runner_cluster))
    task_run_id = run.task_run_id

    attach = _cli_process(prefect_api, "jobs", "attach", task_run_id, *cluster_args)
    attach.wait_for_output("before the gate")
    run.open()
    code, output = attach.finish()

    assert code == 0, output
    assert output.index("before the gate") < output.index("after the gate")
    assert output.splitlines()[-1] == f"Task run {task_run_id} is Completed"


def test_jobs_attach_exits_non_zero_with_the_final_state_when_the_task_run_fails(
    workdir, prefect_api
):
    run = _gated_run(workdir, KineticTaskRunner(), fail=True)
    task_run_id = run.task_run_id

    attach = _cli_process(prefect_api, "jobs", "attach", task_run_id)
    attach.wait_for_output("before the gate")
    run.open()
    code, output = attach.finish()

    assert code == 1, output
    assert "RuntimeError: the gated task failed" in output
    assert output.splitlines()[-1].startswith(f"Task run {task_run_id} is Failed")


def test_jobs_logs_follow_on_the_local_backend_streams_until_the_pod_exits(workdir, prefect_api):
    run = _gated_run(workdir, KineticTaskRunner())
    (pod,) = pods_labelled(workdir / ".kinetic" / "pods", LABEL_TASK_RUN_ID, run.task_run_id)

    logs = _cli_process(prefect_api, "jobs", "logs", pod.job_id, "--follow")
    logs.wait_for_output("before the gate")
    run.open()
    code, output = logs.finish()

    assert code == 0, output
    assert "after the gate" in output
    assert "kinetic-prefect local backend: pod exited with code 0" in output.splitlines()[-1]
