"""The bucket check before launching: what GCS's answers mean."""

from __future__ import annotations

import pytest

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
