"""The bucket check before launching: what GCS's answers mean."""

from __future__ import annotations

from pathlib import Path

import pytest

from kinetic_prefect.common.gcs import grant_hint, viewer_enough
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.preflight import bucket_verdict

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
        # GCS's 403 to a caller without storage.buckets.get says nothing of existence.
        (None, 403, ("missing", [])),
    ],
)
def test_bucket_verdict(granted, read_status, verdict):
    assert bucket_verdict(WANTED, granted, read_status) == verdict


# What the task pods need where, and the role docs/kubernetes.md "Permissions" grants for it.
JOBS = ["storage.objects.create", "storage.objects.delete", "storage.objects.get"]


@pytest.mark.parametrize(
    ("wanted", "missing", "role"),
    [
        # The jobs or results bucket: read and written, so a denied read is objectAdmin's.
        (JOBS, ["storage.objects.get"], "roles/storage.objectAdmin"),
        (JOBS, ["storage.objects.create"], "roles/storage.objectAdmin"),
        # The environment store: task pods only read it.
        (["storage.objects.get"], ["storage.objects.get"], "roles/storage.objectViewer"),
        (["storage.buckets.get"], ["storage.buckets.get"], "roles/storage.legacyBucketReader"),
    ],
)
def test_the_grant_hint_names_the_role_the_docs_grant(wanted, missing, role):
    hint = grant_hint("b", missing, "serviceAccount:p@x", read_only=viewer_enough(wanted))

    assert f"--role={role}" in hint
    assert hint.count("--role=") == 1


@pytest.mark.parametrize(
    ("basepath", "refused"),
    [
        pytest.param("./results", True, id="relative: refused"),
        pytest.param("results/run-1", True, id="relative without a dot: refused"),
        pytest.param("/srv/results", False, id="absolute"),
        pytest.param("~/results", False, id="under the home directory"),
        pytest.param("gs://bucket/results", False, id="a URL"),
    ],
)
def test_a_local_result_storage_with_a_relative_basepath_is_refused_naming_an_absolute_one(
    basepath: str, refused: bool
):
    from prefect.filesystems import LocalFileSystem

    from kinetic_prefect.launch.preflight import check_relative_result_storage

    storage = LocalFileSystem(basepath=basepath)
    if not refused:
        check_relative_result_storage(storage)
        return
    with pytest.raises(ConfigurationError, match="relative path") as refusal:
        check_relative_result_storage(storage)
    assert repr(str(Path(basepath).resolve())) in str(refusal.value)


def test_result_storage_without_a_basepath_or_not_local_is_not_checked_for_one():
    from kinetic_prefect.launch.preflight import check_relative_result_storage

    check_relative_result_storage(None)
    check_relative_result_storage("local-file-system/results")
