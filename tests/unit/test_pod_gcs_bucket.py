"""The saved GCS bucket a task pod writes its results to, without prefect-gcp.

Checked against prefect-gcp's own `GcsBucket`: a pod must write a result record to the
object the orchestrator, holding the saved block, reads it from.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from prefect.filesystems import LocalFileSystem
from prefect_gcp.cloud_storage import GcsBucket

from kinetic_prefect.blocks.credentials import KineticGcpCredentials
from kinetic_prefect.common import prefect_results
from kinetic_prefect.common.prefect_pod_storage import PodGcsBucket

pytestmark = pytest.mark.lowest_prefect

SERVICE_ACCOUNT = {"type": "service_account", "client_email": "a@p.iam.gserviceaccount.com"}


@pytest.fixture(autouse=True)
def _emulator(monkeypatch: pytest.MonkeyPatch) -> None:
    # Credentials blocks look Application Default Credentials up unless emulated.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")


def _saved(storage: Any) -> Any:
    """`storage` as `Block.load` returns it: with its document's id and name."""
    storage._block_document_id = uuid.uuid4()
    storage._block_document_name = "results"
    return storage


@pytest.mark.parametrize(
    ("folder", "key"),
    [
        ("", "0f3a"),
        ("", "a/b/0f3a"),
        ("runs", "0f3a"),
        ("runs/", "0f3a"),
        ("runs", "runs/0f3a"),  # already below the folder: not nested twice
        ("runs/nightly", "0f3a"),
        ("runs", "runsx/0f3a"),
        ("a", "a0f3"),  # a folder that is a prefix of a hex key
    ],
)
def test_a_pod_resolves_result_keys_as_prefect_gcps_gcs_bucket_does(folder: str, key: str):
    bucket = GcsBucket(
        bucket="results", bucket_folder=folder, gcp_credentials=KineticGcpCredentials()
    )
    pod = PodGcsBucket.standing_in_for(_saved(bucket))

    assert pod._resolve_path(key) == bucket._resolve_path(key)
    assert pod.location(key) == f"gs://results/{bucket._resolve_path(key)}"
    # Where the orchestrator reads the record the pod wrote there.
    assert prefect_results._location(bucket, key) == pod.location(key)


def test_a_saved_bucket_reaches_pods_with_its_document_id_and_without_keyless_credentials():
    saved = _saved(GcsBucket(bucket="results", gcp_credentials=KineticGcpCredentials()))

    pod = PodGcsBucket.standing_in_for(saved)

    assert type(pod) is PodGcsBucket
    assert (pod.bucket, pod.bucket_folder, pod.gcp_credentials) == ("results", "", None)
    assert pod._block_document_id == saved._block_document_id
    assert pod._block_document_name == "results"


def test_credentials_holding_a_key_travel_with_the_bucket():
    credentials = KineticGcpCredentials(service_account_info=SERVICE_ACCOUNT)
    saved = _saved(GcsBucket(bucket="results", gcp_credentials=credentials))

    assert PodGcsBucket.standing_in_for(saved).gcp_credentials is credentials


class _OwnGcsBucket(GcsBucket):
    """A user's subclass, which may write or resolve keys its own way."""

    _block_type_slug = "test-own-gcs-bucket"


@pytest.mark.parametrize(
    "make",
    [
        lambda: None,
        lambda: GcsBucket(bucket="never-saved", gcp_credentials=KineticGcpCredentials()),
        lambda: _saved(LocalFileSystem(basepath="/tmp/results")),
        lambda: _saved(_OwnGcsBucket(bucket="results", gcp_credentials=KineticGcpCredentials())),
    ],
    ids=["none", "unsaved-gcs-bucket", "saved-local-file-system", "saved-gcs-bucket-subclass"],
)
def test_other_result_storage_reaches_pods_as_it_is(make: Callable[[], object]):
    storage = make()

    assert PodGcsBucket.standing_in_for(storage) is storage
