"""The bucket check before launching: what GCS's answers mean, and a plain fake-gcs-server."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest

from kinetic_prefect.common import gcs as kgcs
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.preflight import bucket_verdict, check_jobs_root

WANTED = ("storage.objects.create", "storage.objects.get")


@pytest.mark.parametrize(
    ("granted", "read_status", "verdict"),
    [
        # testIamPermissions answered: it alone decides.
        (set(WANTED), None, ("granted", [])),
        ({"storage.objects.get"}, None, ("lacking", ["storage.objects.create"])),
        # It answered 404: the bucket read decides whether the bucket exists.
        (None, 404, ("missing", [])),
        (None, 200, ("unknown", [])),
        # GCS answers 403 only for a bucket that exists.
        (None, 403, ("unknown", [])),
    ],
)
def test_bucket_verdict(granted, read_status, verdict):
    assert bucket_verdict(WANTED, granted, read_status) == verdict


@pytest.fixture
def plain_gcs(gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Emulator mode straight on fake-gcs-server (no IAM proxy), with a new bucket."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    kgcs._clients.clear()
    bucket = kgcs.storage_client().create_bucket(f"kp-{uuid.uuid4().hex[:12]}")
    yield bucket.name
    kgcs._clients.clear()


def test_jobs_bucket_check_passes_on_an_emulator_without_test_iam_permissions(
    plain_gcs: str, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="prefect.kinetic_prefect.launch.preflight"):
        check_jobs_root(f"gs://{plain_gcs}/jobs", None)

    assert f"cannot tell the permissions on the jobs bucket gs://{plain_gcs}" in caplog.text


def test_jobs_bucket_check_on_an_emulator_still_says_a_missing_bucket_does_not_exist(
    plain_gcs: str,
):
    with pytest.raises(ConfigurationError, match="gs://kp-no-such-bucket does not exist"):
        check_jobs_root("gs://kp-no-such-bucket", None)
