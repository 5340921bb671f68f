"""README's "Running on GKE" and docs/worker.md's "On GKE", run as written on a new strict cluster.

The cluster starts as a new one does (Kubernetes' bootstrap policy, nothing of
ours) and GCS with no grants at all. Then every command line of the section runs
in order, through bash: the cluster admin's block, the grants of
docs/kubernetes.md "Permissions" it points at, yours, then the worker guide's
(a deployed flow through a `kinetic` work pool's worker, left running in the
background as the guide says). `kubectl` and `gcloud` are stand-ins
(tests/support/standins.py) that make the requests the real ones make, against
the emulated cluster and the GCS IAM proxy; `python`, `kinetic-prefect` and
`prefect` are the real commands. Placeholders take this test's values. Pods,
and you, get Application Default Credentials from a metadata server stand-in
(tests/support/metadata_server.py), as Workload Identity and `gcloud auth
application-default login` give them.

What is this machine's and not a step: the pods reach the test's Prefect server
on a loopback address (KINETIC_ALLOW_LOOPBACK_API), your GCS credentials are the
proxy's port for `user:YOU@EXAMPLE.COM`, and the environment the pods ship is
the suite's one (its requirements' plan, the thin stand-in of
tests/support/thin_environment.py, kept in its store), as in every gke test.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kinetic_prefect.backends.gke.permissions import RUNNER_SERVICE_ACCOUNT
from kinetic_prefect.common.gcs import EMULATOR_PROJECT
from kinetic_prefect.launch.manifest import LABEL_TASK_RUN_ID
from tests.support.gcs_iam import (
    PODS_MEMBER,
    RUNNER_MEMBER,
    USER_MEMBER,
    WORKLOAD_IDENTITY_USER,
    Grant,
    IamProxy,
    doc_section,
    filled,
)
from tests.support.kube import ADMIN_TOKEN, running_cluster
from tests.support.kube_auth import User
from tests.support.metadata_server import MetadataServer
from tests.support.pod_env import service_account_token
from tests.support.standins import install_gcloud, install_kubectl, kubeconfig

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PERMISSIONS = ROOT / "docs" / "kubernetes.md"
WORKER_GUIDE = ROOT / "docs" / "worker.md"
USER = "YOU@EXAMPLE.COM"
USER_TOKEN = "you-token"
FLOW_SECONDS = 300

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


def _sh_blocks(section: str) -> list[list[str]]:
    """The command lines of each ```sh block, continuation lines joined, comments dropped."""
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [
        [
            line.strip()
            for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")
        ]
        for block in blocks
    ]


class Terminal:
    """Runs command lines through bash as the admin or as you, and applies gcloud's IAM."""

    def __init__(
        self,
        tmp: Path,
        cluster: Any,
        proxy: IamProxy,
        env: dict[str, str],
        values: dict[str, str],
    ) -> None:
        self.cluster = cluster
        self.values = values
        self.proxy = proxy
        self.gcloud_log = tmp / "gcloud.jsonl"
        self.gcloud_log.touch()
        self.applied = 0
        self.env = env
        self.admin_kubeconfig = tmp / "admin-kubeconfig.json"
        self.admin_kubeconfig.write_text(json.dumps(kubeconfig(cluster.url, "admin", ADMIN_TOKEN)))
        self.transcript: list[tuple[str, subprocess.CompletedProcess[str]]] = []
        self.background: list[subprocess.Popen[str]] = []
        self.tmp = tmp

    def run(self, line: str, as_admin: bool = False, timeout: float = 120) -> str:
        """`line`, its placeholders filled, run by bash from the repository's root."""
        line = filled(line, self.values)
        env = {**self.env, "KP_GCLOUD_LOG": str(self.gcloud_log)}
        if as_admin:
            env["KUBECONFIG"] = str(self.admin_kubeconfig)
        result = subprocess.run(
            ["bash", "-c", line],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        self.transcript.append((line, result))
        assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
        self._apply_iam()
        return result.stdout + result.stderr

    def start(self, line: str) -> Path:
        """`line` left running, as in a terminal of its own; returns its output's file."""
        output = self.tmp / f"background-{len(self.background)}.log"
        self.background.append(
            subprocess.Popen(
                ["bash", "-c", filled(line, self.values)],
                cwd=ROOT,
                start_new_session=True,
                env={**self.env, "KP_GCLOUD_LOG": str(self.gcloud_log)},
                stdout=output.open("w"),
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        return output

    def stop(self) -> None:
        """Ctrl-C in each background terminal: the whole process group gets SIGINT."""
        for process in self.background:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGINT)
        for process in self.background:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def _apply_iam(self) -> None:
        """What gcloud's IAM commands changed, made true in the IAM proxy."""
        records = self.gcloud_log.read_text().splitlines()
        for record in map(json.loads, records[self.applied :]):
            if "grant" in record:
                self.proxy.grant([Grant(*record["grant"])])
            elif "account_binding" in record:
                account, member, role = record["account_binding"]
                found = re.fullmatch(r"serviceAccount:[^\[]+\[[^/]+/([^\]]+)\]", member)
                assert found and role == WORKLOAD_IDENTITY_USER, record
                self.proxy.workload_identity_users.add((found[1], account))
        self.applied = len(records)


@pytest.fixture
def terminal(
    tmp_path: Path,
    gcs_server: str,
    suite_environment: str,
    shipped_requirements: Path,
    prefect_api: str,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Terminal]:
    from kinetic_prefect.common import gcs as kgcs

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    kgcs._clients.clear()
    admin = kgcs.storage_client()
    suffix = os.urandom(4).hex()
    jobs, results = (
        admin.create_bucket(f"kp-jobs-{suffix}"),
        admin.create_bucket(f"kp-results-{suffix}"),
    )
    bin_dir = tmp_path / "bin"
    install_kubectl(bin_dir)
    install_gcloud(bin_dir)
    with (
        running_cluster(tmp_path / "cluster", set_up=False) as cluster,
        IamProxy(gcs_server, project=EMULATOR_PROJECT) as proxy,
        MetadataServer(EMULATOR_PROJECT) as metadata,
    ):
        cluster.kubelet.gcs = proxy
        # A node of its own: the worker's pods sign with the pool's record key, so on the
        # shared test node they would refuse, and unpack again, other cases' copies.
        cluster.kubelet.node_root = tmp_path / "node"
        cluster.kubelet.metadata = metadata
        cluster.call(lambda: cluster.emulator.tokens.update({USER_TOKEN: User(USER)}))
        you = proxy.endpoint(USER_MEMBER)
        env = {
            "PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
            "HOME": os.environ["HOME"],
            "LANG": "C.UTF-8",
            "KUBECONFIG": str(tmp_path / "kube" / "config"),
            "KP_CLUSTER_SERVER": cluster.url,
            "KP_USER_TOKEN": USER_TOKEN,
            "PREFECT_API_URL": prefect_api,
            "STORAGE_EMULATOR_HOST": you,
            "TENSORSTORE_GCS_HTTP_URL": you,
            "KINETIC_ALLOW_LOOPBACK_API": "true",
            "KINETIC_REQUIREMENTS": str(shipped_requirements),
            "KINETIC_ENVIRONMENT_BUILDER": "local",
            "KINETIC_ENVIRONMENT_STORE": suite_environment,
            **metadata.env(),
        }
        for name in ("SSL_CERT_FILE", "UV_CACHE_DIR", "XDG_CACHE_HOME", "KINETIC_CACHE_DIR"):
            if name in os.environ:
                env[name] = os.environ[name]
        (tmp_path / "kube").mkdir()
        values = {
            "NAMESPACE": "default",
            "PROJECT": EMULATOR_PROJECT,
            "CLUSTER": "ml-cluster",
            "ZONE": "us-central2-b",
            "JOBS_BUCKET": jobs.name,
            "RESULTS_BUCKET": results.name,
            "ENVIRONMENT_STORE": suite_environment.removeprefix("gs://"),
        }
        terminal = Terminal(tmp_path, cluster, proxy, env, values)
        try:
            yield terminal
        finally:
            terminal.stop()
        # As the `cluster` fixture holds every other case: a permission the guides do not
        # grant cannot hide behind an error the product swallowed.
        refusals = cluster.refusals()
    kgcs._clients.clear()
    assert refusals == [], f"The cluster refused requests: {refusals}"


# Two flows of four pods and a worker's flow pod, start to end: longer than one case's default.
@pytest.mark.slow
@pytest.mark.timeout(3 * FLOW_SECONDS)
def test_the_gke_guides_run_as_written_on_a_new_strict_cluster(terminal: Terminal) -> None:
    admin_block, your_block = _sh_blocks(doc_section(README, "## Running on GKE"))
    (grants,) = _sh_blocks(doc_section(PERMISSIONS, "## Permissions"))

    for line in [*admin_block, *grants]:
        terminal.run(line, as_admin=True)
    outputs = [
        terminal.run(line, timeout=FLOW_SECONDS if "flows/" in line else 120) for line in your_block
    ]

    doctor = next(o for line, o in zip(your_block, outputs, strict=True) if "doctor" in line)
    assert "FAIL" not in doctor, doctor
    checks = " ".join(doctor.split())
    assert "RBAC: every verb the runner uses is granted" in checks
    # The identity the pod's metadata server answers (the stand-in's email is "default").
    assert (
        "ok Task pods' bucket access: task pods (kinetic-prefect-pods, acting as default) hold"
        in checks
    )
    cluster, proxy = terminal.cluster, terminal.proxy
    task_jobs = [
        (token, body)
        for token, body in cluster.job_creations()
        if LABEL_TASK_RUN_ID in body["metadata"]["labels"]
    ]
    assert len(task_jobs) == 4  # the quickstart's four trials
    assert {token for token, _ in task_jobs} == {USER_TOKEN}
    for _, body in task_jobs:
        pod = body["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "kinetic-prefect-pods"
        requests = pod["containers"][0]["resources"]["requests"]
        assert {"cpu", "memory"} <= set(requests)
    assert PODS_MEMBER.partition(":")[2] in proxy.callers
    assert [d for d in proxy.denials if d[1] != "storage.buckets.get"] == []

    # Then a deployed flow through the worker (docs/worker.md).
    (worker_guide,) = _sh_blocks(doc_section(WORKER_GUIDE, "## On GKE"))
    before = len(cluster.job_creations())
    for line in worker_guide:
        if "worker start" in line:
            worker_log = terminal.start(line)
        else:
            terminal.run(line, timeout=FLOW_SECONDS if "--watch" in line else 120)

    created = cluster.job_creations()[before:]
    flow_pods = [body for _, body in created if LABEL_TASK_RUN_ID not in body["metadata"]["labels"]]
    trials = [(t, body) for t, body in created if LABEL_TASK_RUN_ID in body["metadata"]["labels"]]
    assert len(flow_pods) == 1, worker_log.read_text()
    flow_pod = flow_pods[0]["spec"]["template"]["spec"]
    assert flow_pod["serviceAccountName"] == RUNNER_SERVICE_ACCOUNT
    assert len(trials) == 4
    assert {t for t, _ in trials} == {service_account_token("default", RUNNER_SERVICE_ACCOUNT)}
    assert RUNNER_MEMBER.partition(":")[2] in proxy.callers
    assert [d for d in proxy.denials if d[1] != "storage.buckets.get"] == []
