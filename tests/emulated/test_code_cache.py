"""The code archive is uploaded once per content to `code-cache/` and carries no local state."""

from __future__ import annotations

import concurrent.futures
import importlib
import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.cli.jobs_store import cleanup_jobs
from kinetic_prefect.common.gcs import GcsStore
from kinetic_prefect.common.storage import LocalStore
from kinetic_prefect.launch.packaging import (
    CodeArchive,
    build_context_zip,
    context_keys,
    upload_context,
)
from tests.emulated.test_results_and_retries import cube
from tests.support.clusters import gcs_cluster
from tests.support.gcs import FaultInjectingProxy
from tests.support.modules import import_fresh

pytestmark = pytest.mark.usefixtures("workdir")

DEMO_TASKS = """
from prefect import task


@task
def shout(word: str) -> str:
    return word.upper()
"""


@pytest.fixture
def recording_proxy(gcs_server: str) -> Iterator[FaultInjectingProxy]:
    with FaultInjectingProxy(gcs_server, every=None) as proxy:
        yield proxy


@pytest.fixture
def gcs_endpoint(recording_proxy: FaultInjectingProxy) -> str:
    return recording_proxy.url


@pytest.fixture
def demo_project(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The shape `make demo` runs in: a project whose `.prefect/` holds SQLite files."""
    (workdir / "pyproject.toml").write_text("[project]\nname = 'demo'\n")
    (workdir / ".prefect").mkdir()
    (workdir / ".prefect" / "prefect.db").write_bytes(b"SQLite format 3\x00" + bytes(64))
    (workdir / ".prefect" / "prefect.db-wal").write_bytes(bytes(64))
    (workdir / "demo_tasks.py").write_text(DEMO_TASKS)
    import_fresh(workdir, "demo_tasks", monkeypatch)
    return workdir


def _archive(tmp_path: Path) -> CodeArchive:
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "m.py").write_text("x = 1\n")
    return build_context_zip(tmp_path / "code")


def test_concurrent_launches_upload_one_archive_once(gcs, tmp_path: Path):
    archive = _archive(tmp_path)
    stores = [GcsStore(gcs.uri) for _ in range(4)]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        uris = set(pool.map(lambda store: upload_context(store, archive), stores))

    assert uris == {f"{gcs.uri}/code-cache/{archive.sha256}.zip"}
    # The archive and its marker, each once, as the IAM proxy saw the uploads begin.
    assert sorted(gcs.iam.uploaded) == sorted(context_keys(archive.sha256))
    assert gcs.names("code-cache/") == sorted(context_keys(archive.sha256))


def test_an_archive_without_its_marker_is_uploaded_again(tmp_path: Path):
    archive = _archive(tmp_path)
    store = LocalStore(tmp_path / "jobs")
    key, marker = context_keys(archive.sha256)
    store.put_bytes(key, archive.path.read_bytes()[:10])

    upload_context(store, archive)

    assert store.get_bytes(key) == archive.path.read_bytes()
    assert store.exists(marker)


@pytest.mark.usefixtures("prefect_api")
def test_a_sweep_of_four_tasks_uploads_its_code_archive_once(gcs, recording_proxy):
    runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "code-cache-sweep"), warm_pods=True)

    @flow(task_runner=runner)
    def sweep() -> list[int]:
        return [future.result() for future in cube.map([1, 2, 3, 4])]

    assert sweep() == [1, 8, 27, 64]
    archives = [name for name in recording_proxy.uploaded if name.endswith(".zip")]
    assert len(archives) == 1
    assert archives[0].startswith("code-cache/")
    assert [name for name in gcs.names("code-cache/") if name.endswith(".zip")] == archives
    assert [name for name in gcs.names("kinetic/") if name.endswith("context.zip")] == []


@pytest.mark.usefixtures("prefect_api")
def test_demo_shaped_project_ships_no_prefect_state_with_the_local_backend(demo_project: Path):
    shout = importlib.import_module("demo_tasks").shout

    @flow(task_runner=KineticTaskRunner())
    def loud() -> list[str]:
        return [future.result() for future in shout.map(["a", "b"])]

    assert loud() == ["A", "B"]
    archives = sorted((demo_project / ".kinetic").rglob("*.zip"))
    entries = [n for a in archives for n in zipfile.ZipFile(io.BytesIO(a.read_bytes())).namelist()]
    assert len(archives) == 1
    assert "demo_tasks.py" in entries
    assert [n for n in entries if n.startswith(".prefect/") or ".db" in n] == []


@pytest.mark.usefixtures("prefect_api")
def test_jobs_cleanup_keeps_the_code_cache(demo_project: Path):
    shout = importlib.import_module("demo_tasks").shout

    @flow(task_runner=KineticTaskRunner())
    def once() -> str:
        future = shout.submit("a")
        future.wait()
        return future.job_id

    job_id = once()
    jobs = LocalStore(demo_project / ".kinetic")
    cached = jobs.list("code-cache")

    assert cleanup_jobs(str(demo_project / ".kinetic"), [job_id]) > 0
    assert jobs.list(f"kinetic/{job_id}") == []
    assert jobs.list("code-cache") == cached
    assert len(cached) == 2
