"""Looking for secret values where they must never be: manifests, payloads, records, archives."""

from __future__ import annotations

import json
import secrets
import zipfile
from collections.abc import Iterable
from io import BytesIO
from typing import Any

from prefect.settings import (
    PREFECT_API_AUTH_STRING,
    PREFECT_API_KEY,
    PREFECT_SERVER_API_AUTH_STRING,
    PREFECT_SERVER_DATABASE_PASSWORD,
)


def canary_settings() -> dict[Any, str]:
    """Secret Prefect settings with values made now (the archive ships test sources)."""
    return {
        PREFECT_API_KEY: f"pnu_{secrets.token_hex(12)}",
        PREFECT_API_AUTH_STRING: f"admin:{secrets.token_hex(12)}",
        PREFECT_SERVER_API_AUTH_STRING: f"admin:{secrets.token_hex(12)}",
        PREFECT_SERVER_DATABASE_PASSWORD: secrets.token_hex(12),
    }


def _archive_members(data: bytes) -> bytes:
    with zipfile.ZipFile(BytesIO(data)) as archive:
        return b"".join(archive.read(name) for name in archive.namelist())


def scanned_artifacts(cluster: Any, gcs: Any) -> dict[str, bytes]:
    """Every Job manifest the API accepted and every job, payload and archive object in GCS."""
    found = {f"job {j['metadata']['name']}": json.dumps(j).encode() for j in cluster.created_jobs()}
    bucket = gcs.client.bucket(gcs.name)
    for name in gcs.names():
        if name.startswith(("kinetic/", "code-cache/")):
            data = bucket.blob(name).download_as_bytes()
            found[name] = _archive_members(data) if name.endswith(".zip") else data
    return found


def leaks(values: Iterable[str], artifacts: dict[str, bytes]) -> list[tuple[str, str]]:
    """(value, where) for each secret value found in an artifact."""
    return [(v, where) for v in values for where, blob in artifacts.items() if v.encode() in blob]
