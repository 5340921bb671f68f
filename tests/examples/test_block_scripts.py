"""The scripts under blocks/ save blocks that load and point where they say."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kinetic_prefect.blocks import KineticCluster

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


def _run(script: str, env: dict[str, str], *args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "blocks" / script), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_local_emulator_script_saves_a_cluster_with_gcs_jobs_and_results(gcs, prefect_api):
    env = {"PREFECT_API_URL": prefect_api}

    _run("save_local_emulator.py", env, "--jobs-bucket", gcs.name, "--results-bucket", gcs.name)
    cluster = KineticCluster.load("local-emulator")

    assert (cluster.backend, cluster.jobs_root()) == ("local", gcs.uri)
    assert cluster.result_storage is not None
    assert cluster.result_storage.bucket == gcs.name


def test_local_script_saves_a_local_cluster(prefect_api, workdir):
    _run("save_local.py", {"PREFECT_API_URL": prefect_api}, "--jobs-dir", str(workdir / "jobs"))

    cluster = KineticCluster.load("local")

    assert (cluster.backend, cluster.jobs_root()) == ("local", str(workdir / "jobs"))


def _service_accounts(rbac: Path) -> set[str]:
    import yaml

    return {
        doc["metadata"]["name"]
        for doc in yaml.safe_load_all(rbac.read_text())
        if doc and doc.get("kind") == "ServiceAccount"
    }


def test_gke_script_defaults_to_the_pod_service_account_rbac_yaml_creates(prefect_api):
    env = {"PREFECT_API_URL": prefect_api}
    required = ("--project", "p", "--cluster", "c", "--jobs-bucket", "j", "--results-bucket", "r")

    _run("save_gke.py", env, *required)
    cluster = KineticCluster.load("gke")

    assert cluster.service_account in _service_accounts(ROOT / "deployments/k8s/rbac.yaml")
