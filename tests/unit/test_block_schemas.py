"""The suite's block-saving shortcut saves what Prefect would have saved without it."""

from __future__ import annotations

import uuid

from prefect_gcp.cloud_storage import GcsBucket

from kinetic_prefect.blocks import KineticGcpCredentials
from tests.support.clusters import schemas_built_once


def test_a_gcs_bucket_document_is_the_same_with_its_schema_built_once() -> None:
    bucket = GcsBucket(bucket="b", bucket_folder="results", gcp_credentials=KineticGcpCredentials())
    ids = {"block_schema_id": uuid.uuid4(), "block_type_id": uuid.uuid4()}

    def saved() -> tuple[str, dict[str, object]]:
        document = bucket._to_block_document(name="results", **ids)
        return GcsBucket._calculate_schema_checksum(), document.data

    plain = saved()
    with schemas_built_once(GcsBucket):
        once = [saved(), saved()]

    assert once == [plain, plain]
    assert "model_json_schema" not in GcsBucket.__dict__
    assert saved() == plain
