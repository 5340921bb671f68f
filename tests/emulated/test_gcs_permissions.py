"""GCS as strict as Cloud IAM: every identity holds exactly the roles docs/kubernetes.md grants.

The `gcs` fixture puts every client behind the IAM proxy (tests/support/gcs_iam.py):
this process acts as the user, each pod as its service account's Workload Identity.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prefect import flow, task
from prefect.cache_policies import INPUTS

from kinetic_prefect import Data, KineticTaskRunner
from kinetic_prefect.common import gcs as kgcs
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.preflight import check_jobs_root
from tests.conftest import ENVIRONMENTS_BUCKET
from tests.support.gcs_iam import PODS_MEMBER, USER_MEMBER, Grant, documented_grants
from tests.support.leaks import leaks, scanned_artifacts
from tests.support.oauth_tokens import TokenEndpoint

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

OBJECT_ADMIN = "roles/storage.objectAdmin"
BUCKET_READER = "roles/storage.legacyBucketReader"


@task
def cube(x: int) -> int:
    return x**3


@task
def file_count(folder: str) -> int:
    import os

    return len(os.listdir(folder))


@task(cache_policy=INPUTS, persist_result=True)
def cached_square(x: int) -> int:
    return x * x


def only_bucket(gcs, placeholder: str) -> str:
    """A new bucket with the documented grants of `placeholder` (JOBS_BUCKET or
    RESULTS_BUCKET) and nothing else."""
    import uuid

    kind = placeholder.split("_")[0].lower()
    name = gcs.client.create_bucket(f"kp-{kind}-{uuid.uuid4().hex[:8]}").name
    substitutions = {
        "JOBS_BUCKET": "not-this-bucket",
        "RESULTS_BUCKET": "not-this-bucket",
        "ENVIRONMENT_STORE": "nor-this-one",
        "PROJECT": kgcs.EMULATOR_PROJECT,
        placeholder: name,
    }
    gcs.iam.grant(documented_grants(substitutions))
    return name


def jobs_only_bucket(gcs) -> str:
    """A bucket with the documented grants of a jobs bucket and nothing else."""
    return only_bucket(gcs, "JOBS_BUCKET")


def results_only_bucket(gcs):  # type: ignore[no-untyped-def]
    """A saved GcsBucket on a bucket with the documented grants of a results bucket only."""
    from prefect_gcp.cloud_storage import GcsBucket

    from kinetic_prefect.blocks import KineticGcpCredentials

    name = only_bucket(gcs, "RESULTS_BUCKET")
    block = GcsBucket(bucket=name, bucket_folder="results", gcp_credentials=KineticGcpCredentials())
    block.save(name, overwrite=True)
    return GcsBucket.load(name)


def object_denials(gcs) -> list[tuple[str, str, str | None]]:
    """Denied requests but google-cloud-storage's background bucket-metadata fetches,
    which it makes for observability on its own and whose 403 it expects and ignores."""
    return [d for d in gcs.iam.denials if d[1] != "storage.buckets.get"]


# -- the proxy itself ---------------------------------------------------------------------------


def test_test_iam_permissions_answers_the_users_documented_roles_on_the_bucket(gcs):
    asked = [
        "storage.buckets.get",
        "storage.buckets.update",
        "storage.buckets.delete",
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.setRetention",
    ]

    granted = kgcs.storage_client().bucket(gcs.name).test_iam_permissions(asked)

    assert sorted(granted) == [
        "storage.buckets.get",
        "storage.objects.create",
        "storage.objects.delete",
        "storage.objects.setRetention",
    ]


def test_a_request_without_its_permission_gets_gcs_403_in_gcs_words(gcs):
    from google.api_core.exceptions import Forbidden

    client = kgcs.storage_client()
    with (
        gcs.iam.revoked(Grant(gcs.name, USER_MEMBER, BUCKET_READER)),
        pytest.raises(Forbidden) as denied,
    ):
        client.get_bucket(gcs.name)

    assert denied.value.code == 403
    assert denied.value.errors == [
        {
            "message": "YOU@EXAMPLE.COM does not have storage.buckets.get access to the Google "
            "Cloud Storage bucket. Permission 'storage.buckets.get' denied on resource (or it "
            "may not exist).",
            "domain": "global",
            "reason": "forbidden",
        }
    ]


def test_an_overwrite_needs_delete_as_well_as_create(gcs):
    from google.api_core.exceptions import Forbidden

    blob = kgcs.storage_client().bucket(gcs.name).blob("kinetic/job/payload.pkl")
    gcs.iam.grant([Grant(gcs.name, USER_MEMBER, "roles/storage.objectCreator")])
    with gcs.iam.revoked(Grant(gcs.name, USER_MEMBER, OBJECT_ADMIN)):
        blob.upload_from_string(b"first")
        with pytest.raises(Forbidden, match="storage.objects.delete"):
            blob.upload_from_string(b"second")

    assert gcs.client.bucket(gcs.name).blob("kinetic/job/payload.pkl").download_as_bytes() == (
        b"first"
    )


# -- the orchestrator ---------------------------------------------------------------------------


def test_jobs_bucket_check_passes_with_the_documented_jobs_bucket_roles_alone(gcs):
    bucket = jobs_only_bucket(gcs)

    check_jobs_root(f"gs://{bucket}/prefix", None)


def test_jobs_bucket_check_names_the_missing_permissions_and_the_grant(gcs):
    bucket = jobs_only_bucket(gcs)

    with (
        gcs.iam.revoked(Grant(bucket, USER_MEMBER, OBJECT_ADMIN)),
        pytest.raises(ConfigurationError) as refused,
    ):
        check_jobs_root(f"gs://{bucket}", None)

    message = str(refused.value)
    assert "lack storage.objects.create, storage.objects.delete, storage.objects.get, " in message
    assert f"on the jobs bucket gs://{bucket}" in message
    assert (
        f"gcloud storage buckets add-iam-policy-binding gs://{bucket} --member=MEMBER "
        f"--role={OBJECT_ADMIN}" in message
    )


@pytest.fixture
def oauth(gcs) -> Iterator[TokenEndpoint]:
    """Google's token endpoint for generated service-account keys, trusted by the IAM proxy."""
    with TokenEndpoint(gcs.iam.tokens) as endpoint:
        yield endpoint


def test_the_orchestrator_acts_as_the_clusters_gcp_credentials_and_pods_never_get_the_key(
    gke, cluster, gcs, oauth
):
    from prefect_gcp.credentials import GcpCredentials
    from typer.testing import CliRunner

    from kinetic_prefect.blocks import KineticCluster
    from kinetic_prefect.cli import app

    email = f"kinetic-ci@{kgcs.EMULATOR_PROJECT}.iam.gserviceaccount.com"
    key = oauth.key(email, kgcs.EMULATOR_PROJECT)
    GcpCredentials(service_account_info=key).save(f"{gke}-key")
    block = KineticCluster.load(gke)
    block.gcp_credentials = GcpCredentials.load(f"{gke}-key")
    block.save(gke, overwrite=True)
    # The key's account holds what the docs grant you; you (this process's ADC) hold nothing.
    yours = [g for g in gcs.iam.grants if g.member == USER_MEMBER]
    gcs.iam.grant(dataclasses.replace(g, member=f"serviceAccount:{email}") for g in yours)

    gcs.client.bucket(gcs.name).blob("inputs/a.txt").upload_from_string(b"a")
    inputs = f"gs://{gcs.name}/inputs/"  # the flow pickles with its task: no gcs in it

    @flow(task_runner=KineticTaskRunner(cluster=gke, allow_loopback_api=True))
    def cubes() -> list[int]:
        files = file_count.submit(Data(inputs))
        return [f.result() for f in cube.map([2, 3])] + [files.result()]

    with contextlib.ExitStack() as revoked:
        for grant in yours:
            revoked.enter_context(gcs.iam.revoked(grant))
        results = cubes()
        artifacts = scanned_artifacts(cluster, gcs)
        cleanup = CliRunner().invoke(app, ["jobs", "cleanup", "--cluster", gke])

    assert results == [8, 27, 1]
    assert cleanup.exit_code == 0, cleanup.output
    assert gcs.names("kinetic/") == []
    assert object_denials(gcs) == []
    assert email in gcs.iam.callers
    assert USER_MEMBER.partition(":")[2] not in gcs.iam.callers
    assert PODS_MEMBER.partition(":")[2] in gcs.iam.callers
    secret_parts = [key["private_key_id"], key["private_key"].splitlines()[5]]
    assert leaks(secret_parts, artifacts) == []


def _lease_look_seconds(job: dict[str, Any]) -> float:
    """How often the pod of `job` reads its lease: every min(orphan timeout / 4,
    watchdog_look_seconds) (docs/restarts.md), with the values its manifest gives it."""
    from kinetic_prefect.common.env import ORPHAN_TIMEOUT_ENV
    from kinetic_prefect.common.intervals import Intervals

    container = job["spec"]["template"]["spec"]["containers"][0]
    env = {item["name"]: item.get("value", "") for item in container["env"]}
    timeout = float(env.get(ORPHAN_TIMEOUT_ENV, "300"))
    return min(max(timeout / 4, 0.5), Intervals.from_environ(env).watchdog_look_seconds)


def test_a_cold_task_pod_makes_four_gcs_requests_and_its_paced_lease_reads_and_no_bucket_lookup(
    gke, cluster, gcs
):
    @flow(task_runner=KineticTaskRunner(cluster=gke, allow_loopback_api=True, warm_pods=False))
    def cubes() -> list[int]:
        return [f.result() for f in cube.map([1, 2, 3, 4])]

    started = time.monotonic()
    assert cubes() == [1, 8, 27, 64]
    wall = time.monotonic() - started

    # A node fetches the shipped environment once (whichever pod comes first): not per task.
    requests = [
        (m, p)
        for member, m, p in gcs.iam.requests
        if member == PODS_MEMBER and "env-cache" not in p and ENVIRONMENTS_BUCKET not in p
    ]
    lease_reads = [p for _, p in requests if "leases%2F" in p]
    pods = [(m, p) for m, p in requests if "leases%2F" not in p]
    # Each pod: payload and code down; the result record (its seal in its metadata) and the
    # final state up.
    assert len(pods) == 4 * 4, pods
    assert [p for _, p in pods if re.fullmatch(r"/storage/v1/b/[^/?]+(\?.*)?", p)] == []
    assert [p for _, p in pods if "result-seals" in p] == []
    # A pod's watchdog reads the lease once per look interval it lives (a pod that starts
    # slowly on a busy machine lives longer), and each of the four lived within the flow.
    (every,) = {_lease_look_seconds(job) for job in cluster.created_jobs()}
    assert len(lease_reads) <= 4 * (1 + wall / every), (len(lease_reads), wall, every)


def test_jobs_bucket_check_says_a_missing_bucket_does_not_exist(gcs):
    with pytest.raises(ConfigurationError, match="gs://kp-no-such-bucket does not exist"):
        check_jobs_root("gs://kp-no-such-bucket", None)


# -- pods ----------------------------------------------------------------------------------------


def test_task_pods_run_and_write_results_with_exactly_the_documented_roles(gke, cluster, gcs):
    @flow(task_runner=KineticTaskRunner(cluster=gke, allow_loopback_api=True))
    def cubes() -> list[int]:
        return [f.result() for f in cube.map([2, 3])]

    assert cubes() == [8, 27]
    assert object_denials(gcs) == []
    assert PODS_MEMBER.partition(":")[2] in gcs.iam.callers
    assert len(gcs.names("results/")) == 2


def test_a_task_pod_stores_its_result_without_the_bucket_lookup_prefects_block_makes(
    gke, cluster, gcs
):
    @flow(task_runner=KineticTaskRunner(cluster=gke, allow_loopback_api=True))
    def one_cube() -> int:
        return cube.submit(3).result()

    with gcs.iam.revoked(Grant(gcs.name, PODS_MEMBER, BUCKET_READER)):
        assert one_cube() == 27

    assert object_denials(gcs) == []
    assert len(gcs.names("results/")) == 1


def _refused_result_write(gcs, results, runner, member) -> str:  # type: ignore[no-untyped-def]
    """The error of a flow whose pod, acting as `member`, may not write `results`."""

    @flow(task_runner=runner)
    def one_cube() -> int:
        return cube.with_options(result_storage=results).submit(3).result()

    with (
        gcs.iam.revoked(Grant(results.bucket, member, OBJECT_ADMIN)),
        pytest.raises(Exception) as failed,
    ):
        one_cube()
    return str(failed.value)


def test_a_task_pod_that_cannot_write_the_results_bucket_fails_naming_storage_objects_create(
    gke, cluster, gcs
):
    results = results_only_bucket(gcs)
    runner = KineticTaskRunner(cluster=gke, allow_loopback_api=True)

    message = _refused_result_write(gcs, results, runner, PODS_MEMBER)

    assert f"could not store its result at gs://{results.bucket}/results/" in message
    assert "storage.objects.create" in message
    assert (PODS_MEMBER.partition(":")[2], "storage.objects.create", results.bucket) in (
        gcs.iam.denials
    )


@pytest.mark.lowest_prefect
def test_a_local_pod_that_cannot_write_a_gcs_results_bucket_fails_naming_storage_objects_create(
    gcs, workdir
):
    # The pod side of the same rule without a cluster (or a shipped environment): the
    # local backend's pods act as the user here, who may read the results but not write.
    results = results_only_bucket(gcs)
    gcs.iam.grant([Grant(results.bucket, USER_MEMBER, "roles/storage.objectViewer")])

    message = _refused_result_write(gcs, results, KineticTaskRunner(env=gcs.pod_env), USER_MEMBER)

    assert f"could not store its result at gs://{results.bucket}/results/" in message
    assert "storage.objects.create" in message
    assert (USER_MEMBER.partition(":")[2], "storage.objects.create", results.bucket) in (
        gcs.iam.denials
    )


def test_a_pod_whose_service_account_has_no_workload_identity_fails_with_gcs_403(gke, cluster, gcs):
    @flow(
        task_runner=KineticTaskRunner(
            cluster=gke, service_account="default", allow_loopback_api=True
        )
    )
    def one_cube() -> int:
        return cube.submit(3).result()

    with pytest.raises(Exception) as failed:
        one_cube()

    message = str(failed.value)
    principal = f"{kgcs.EMULATOR_PROJECT}.svc.id.goog[default/default]"
    assert f"{principal} does not have storage.objects.get access" in message
    # The bucket: the shipped environment's, or the jobs bucket's once the node has that.
    assert re.search(rf"gs://kp-environments/|/b/kp-environments/o/|/b/{gcs.name}/o/", message)
    assert "Workload Identity" in message


def test_a_denied_result_cache_lookup_names_the_permission_instead_of_running_again(
    gke, cluster, gcs
):
    results = results_only_bucket(gcs)

    @flow(task_runner=KineticTaskRunner(cluster=gke, allow_loopback_api=True))
    def square() -> int:
        return cached_square.with_options(result_storage=results).submit(4).result()

    assert square() == 16
    with (
        gcs.iam.revoked(Grant(results.bucket, USER_MEMBER, OBJECT_ADMIN)),
        pytest.raises(ConfigurationError) as refused,
    ):
        square()

    message = str(refused.value)
    assert f"GCS denied storage.objects.get on the result bucket gs://{results.bucket}" in message
    assert f"--role={OBJECT_ADMIN}" in message
    assert len(cluster.created_jobs()) == 1


@task
def plant_in(bucket: str) -> int:
    """Try to write an object into `bucket` as this pod: the HTTP status GCS answers."""
    import os
    import urllib.error
    import urllib.request

    host = os.environ["STORAGE_EMULATOR_HOST"].rstrip("/")
    request = urllib.request.Request(
        f"{host}/upload/storage/v1/b/{bucket}/o?uploadType=media&name=env-cache/planted",
        data=b"import os\n",
        headers={"Content-Type": "application/octet-stream"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status
    except urllib.error.HTTPError as refused:
        return refused.code


def test_a_task_pod_may_read_its_environment_but_not_write_the_environment_store(
    gke, cluster, gcs, tmp_path
):
    # A node of its own: the pod downloads its environment rather than finding it unpacked.
    cluster.kubelet.node_root = tmp_path / "node"

    @flow(task_runner=KineticTaskRunner(cluster=gke, allow_loopback_api=True))
    def plant() -> int:
        return plant_in.submit(ENVIRONMENTS_BUCKET).result()

    assert plant() == 403
    pods = PODS_MEMBER.partition(":")[2]
    assert (pods, "storage.objects.create", ENVIRONMENTS_BUCKET) in gcs.iam.denials
    # It did read its environment from there, as that account.
    assert any(
        member == PODS_MEMBER and f"/b/{ENVIRONMENTS_BUCKET}/o/" in path and method == "GET"
        for member, method, path in gcs.iam.requests
    )
