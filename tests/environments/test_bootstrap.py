"""The pod bootstrap against fake-gcs-server and the test metadata server, without a cluster."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kinetic_prefect.pod import bootstrap
from tests.support.gcs import FaultInjectingProxy
from tests.support.metadata_server import MetadataServer

OBJECT_BYTES = 3 << 20
RESET_AFTER = 1 << 20


@pytest.fixture
def archive(gcs_server: str) -> tuple[str, bytes]:
    """A 3 MB object in a fresh bucket of fake-gcs-server: its gs:// URI and content."""
    bucket = f"kp-bootstrap-{uuid.uuid4().hex[:8]}"
    create = urllib.request.Request(
        f"{gcs_server}/storage/v1/b?project=test",
        data=json.dumps({"name": bucket}).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(create).close()
    content = os.urandom(OBJECT_BYTES)
    upload = urllib.request.Request(
        f"{gcs_server}/upload/storage/v1/b/{bucket}/o?uploadType=media&name=env.tar.gz",
        data=content,
        headers={"Content-Type": "application/octet-stream"},
    )
    urllib.request.urlopen(upload).close()
    return f"gs://{bucket}/env.tar.gz", content


@pytest.fixture
def resetting_proxy(
    gcs_server: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FaultInjectingProxy]:
    with FaultInjectingProxy(gcs_server, every=None, reset_after=RESET_AFTER) as proxy:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
        for name in bootstrap.METADATA_HOST_ENVS:
            monkeypatch.delenv(name, raising=False)
        yield proxy


def test_a_download_reset_mid_body_resumes_from_where_it_stopped(
    archive: tuple[str, bytes], resetting_proxy: FaultInjectingProxy, tmp_path: Path
):
    uri, content = archive

    arrived = bootstrap.download(uri, tmp_path / "env.tar.gz")

    assert arrived == hashlib.sha256(content).hexdigest()
    assert (tmp_path / "env.tar.gz").read_bytes() == content
    assert resetting_proxy.resets == 1
    first, resumed = resetting_proxy.ranges
    start = int(resumed.removeprefix("bytes=").removesuffix("-"))
    assert first is None and 0 <= start <= RESET_AFTER


def test_a_resumed_download_that_changed_is_refused_by_its_sha256(
    archive: tuple[str, bytes],
    resetting_proxy: FaultInjectingProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    uri, content = archive
    wrong = hashlib.sha256(content[::-1]).hexdigest()
    cache = tmp_path / "node"
    monkeypatch.setenv(bootstrap.ENV_CACHE_ENV, str(cache))

    with pytest.raises(bootstrap.EnvironmentFailure, match="it changed after it was"):
        bootstrap.ready_environment(uri, wrong, "k" * 64)

    assert resetting_proxy.resets == 1
    assert not (cache / ("k" * 64)).exists()


def test_the_token_comes_from_a_metadata_server_that_refuses_a_new_pod_at_first(
    monkeypatch: pytest.MonkeyPatch,
):
    with MetadataServer("test-project", new_pod_seconds=1.0) as metadata:
        for name, value in metadata.pod_env("pod-a").items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:1")  # emulator or not

        token = bootstrap._token()

    statuses = metadata.token_requests("pod-a")
    assert token == "metadata-token"
    assert statuses[0] == "refused" and statuses[-1] == 200


def test_the_token_comes_from_a_metadata_server_that_answers_a_new_pod_503_at_first(
    monkeypatch: pytest.MonkeyPatch,
):
    with MetadataServer("test-project", new_pod_seconds=1.0, new_pod_status=503) as metadata:
        for name, value in metadata.pod_env("pod-c").items():
            monkeypatch.setenv(name, value)

        token = bootstrap._token()

    statuses = metadata.token_requests("pod-c")
    assert token == "metadata-token"
    assert statuses[0] == 503 and statuses[-1] == 200


def test_a_metadata_server_that_never_answers_fails_after_the_metadata_wait(
    monkeypatch: pytest.MonkeyPatch,
):
    with MetadataServer("test-project", new_pod_seconds=60.0) as metadata:
        for name, value in metadata.pod_env("pod-b").items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("KINETIC_INTERVALS", json.dumps({"metadata_wait_seconds": 1}))

        with pytest.raises(bootstrap.EnvironmentFailure, match="did not give a token within 1s"):
            bootstrap._token()

    assert set(metadata.token_requests("pod-b")) == {"refused"}
