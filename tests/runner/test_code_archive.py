"""End to end on the local backend: what a flow's code archive refuses and never carries."""

from __future__ import annotations

import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.errors import PayloadError
from tests.support.modules import import_fresh

pytestmark = pytest.mark.usefixtures("prefect_api")

TASKS = """
from prefect import task


@task
def shout(word: str) -> str:
    return word.upper()
"""


def _import_task(directory: Path, module: str, monkeypatch: pytest.MonkeyPatch) -> object:
    (directory / f"{module}.py").write_text(TASKS)
    return import_fresh(directory, module, monkeypatch).shout


def _store_files(workdir: Path) -> list[Path]:
    return sorted(p for p in (workdir / ".kinetic").rglob("*") if p.is_file())


def _every_byte_under(workdir: Path) -> Iterator[tuple[str, bytes]]:
    """Every file of the local jobs store, and every member of the zips among them, unpacked."""
    for path in _store_files(workdir):
        yield str(path), path.read_bytes()
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                for name in archive.namelist():
                    yield f"{path}!{name}", archive.read(name)


def test_a_script_beside_a_300_mb_file_without_a_project_marker_fails_before_any_upload(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
):
    loose = workdir / "loose"
    (loose / "checkpoints").mkdir(parents=True)
    with (loose / "checkpoints" / "model.bin").open("wb") as big:
        big.truncate(300 * 1000 * 1000)
    shout = _import_task(loose, "loose_tasks", monkeypatch)

    @flow(task_runner=KineticTaskRunner())
    def loud() -> str:
        return shout.submit("hi").result()  # type: ignore[attr-defined]

    with pytest.raises(PayloadError) as refused:
        loud()

    assert "checkpoints/model.bin  ->  /checkpoints/model.bin" in str(refused.value)
    assert "code_archive_max_mb" in str(refused.value)
    assert _store_files(workdir) == []


def test_a_checkouts_keys_netrc_envrc_and_outside_symlink_never_reach_the_jobs_store(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
):
    secrets = {name: f"secret-{name}-{uuid.uuid4().hex}" for name in ("envrc", "netrc", "rsa")}
    secrets |= {name: f"secret-{name}-{uuid.uuid4().hex}" for name in ("ed25519", "target")}
    project = workdir / "project"
    (project / ".ssh").mkdir(parents=True)
    (project / "conf").mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'project'\n")
    (project / ".envrc").write_text(f"export API_TOKEN={secrets['envrc']}\n")
    (project / ".netrc").write_text(f"machine example.com login me password {secrets['netrc']}\n")
    (project / ".ssh" / "id_rsa").write_text(f"ssh-rsa-private {secrets['rsa']}\n")
    (project / "id_ed25519").write_text(
        f"-----BEGIN OPENSSH PRIVATE KEY-----\n{secrets['ed25519']}\n"
        "-----END OPENSSH PRIVATE KEY-----\n"
    )
    (workdir / "prod-password.yaml").write_text(f"password: {secrets['target']}\n")
    (project / "conf" / "prod.yaml").symlink_to(workdir / "prod-password.yaml")
    shout = _import_task(project, "project_tasks", monkeypatch)

    @flow(task_runner=KineticTaskRunner())
    def loud() -> str:
        return shout.submit("hi").result()  # type: ignore[attr-defined]

    assert loud() == "HI"
    archives = [
        p for p in _store_files(workdir) if p.parent.name == "code-cache" and p.suffix == ".zip"
    ]
    assert len(archives) == 1
    assert set(zipfile.ZipFile(archives[0]).namelist()) == {"pyproject.toml", "project_tasks.py"}
    found = [
        (where, name)
        for where, content in _every_byte_under(workdir)
        for name, secret in secrets.items()
        if secret.encode() in content
    ]
    assert found == []
