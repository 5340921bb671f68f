"""`kinetic-prefect doctor`'s pod: the task pods' own bucket access, asked from a pod.

On the strict cluster with GCS behind the IAM proxy: the doctor's pod runs as the
task pods' service account, so the proxy answers for that account's Workload
Identity, with the grants docs/kubernetes.md tells users to make.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kinetic_prefect.cli import app
from kinetic_prefect.cli.doctor import LABEL_DOCTOR
from tests.support.clusters import gcs_cluster
from tests.support.gcs_iam import PODS_MEMBER, Grant

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

BUCKET_READER = "roles/storage.legacyBucketReader"


@pytest.fixture
def doctor(cluster, gcs, monkeypatch) -> str:
    """A saved gke cluster as tests/support/clusters.py saves one; doctor's pods may use a
    loopback Prefect API (they never call it)."""
    monkeypatch.setenv("KINETIC_ALLOW_LOOPBACK_API", "true")
    return gcs_cluster(gcs, "doctor-pods", backend="gke")


def run_doctor(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["doctor", *args])
    return result.exit_code, " ".join(result.output.split())  # the console folds long lines


def test_doctor_pod_check_passes_with_the_documented_grants(doctor, cluster, gcs):
    code, output = run_doctor("--cluster", doctor)

    assert code == 0, output
    assert "ok Task pods' bucket access: task pods (kinetic-prefect-pods) hold what they " in (
        output
    )
    [job] = cluster.created_jobs()
    pod = job["spec"]["template"]["spec"]
    assert job["metadata"]["labels"][LABEL_DOCTOR] == "bucket-access"
    assert job["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kinetic-prefect"
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["ttlSecondsAfterFinished"] > 0
    assert pod["serviceAccountName"] == "kinetic-prefect-pods"
    assert set(pod["containers"][0]["resources"]["requests"]) == {"cpu", "memory"}
    assert gcs.iam.denials == []


def test_doctor_pod_check_fails_naming_the_grant_the_pods_account_lacks(doctor, gcs):
    with gcs.iam.revoked(Grant(gcs.name, PODS_MEMBER, BUCKET_READER)):
        code, output = run_doctor("--cluster", doctor)

    assert code == 1
    print("OUTPUT:", output)
    check = output[output.index("FAIL Task pods' bucket access") :]
    assert f"lack storage.buckets.get on gs://{gcs.name}" in check
    assert (
        f"gcloud storage buckets add-iam-policy-binding gs://{gcs.name} --member=MEMBER "
        f"--role={BUCKET_READER}"
    ) in check
    assert "storage.objects" not in check.partition("Grant")[0]


def test_doctor_pod_check_fails_naming_why_its_pod_cannot_start(doctor, cluster, gcs):
    from kinetic_prefect.blocks import KineticCluster

    block = KineticCluster.load(doctor)
    block.service_account = "kinetic-prefect-pod"  # rbac.yaml creates kinetic-prefect-pods
    block.save(doctor, overwrite=True)

    code, output = run_doctor("--cluster", doctor)

    assert code == 1
    print("OUTPUT:", output)
    check = output[output.index("FAIL Task pods' bucket access") :]
    assert "(service account kinetic-prefect-pod, image " in check
    assert "could not start" in check
    assert "kinetic-prefect-pod" in check.partition("could not start")[2]
    assert "--no-pod-check" in check


def test_doctor_no_pod_check_runs_no_pod(doctor, cluster):
    code, output = run_doctor("--cluster", doctor, "--no-pod-check")

    assert code == 0, output
    assert "Task pods' bucket access" not in output
    assert cluster.created_jobs() == []
