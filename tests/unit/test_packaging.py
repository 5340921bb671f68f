"""Code archive and payload packaging."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kinetic_prefect.errors import PayloadError
from kinetic_prefect.launch import packaging
from kinetic_prefect.launch.ignore import git_listing
from kinetic_prefect.launch.packaging import (
    build_context_zip,
    check_package_root,
    check_picklable,
    find_package_root,
    import_paths_under,
)


def _tree(root: Path) -> Path:
    for name in [
        "pkg/__init__.py",
        "pkg/model.py",
        "data/small.csv",
        ".git/HEAD",
        ".venv/lib/x.py",
        "pkg/__pycache__/model.cpython-311.pyc",
        "big/weights.bin",
    ]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    (root / "pyproject.toml").write_text("[project]\nname='x'\n")
    (root / ".kineticignore").write_text("# large files\nbig/\n")
    return root


def _names(path: Path) -> set[str]:
    return set(zipfile.ZipFile(path).namelist())


def test_context_zip_skips_default_exclusions_and_kineticignore(tmp_path: Path):
    archive = build_context_zip(_tree(tmp_path))

    assert _names(archive.path) == {
        "pkg/__init__.py",
        "pkg/model.py",
        "data/small.csv",
        "pyproject.toml",
        ".kineticignore",
    }


def test_context_zip_hash_depends_only_on_content(tmp_path: Path):
    root = _tree(tmp_path)
    first = build_context_zip(root)
    (root / "pkg" / "model.py").touch()

    assert build_context_zip(root).sha256 == first.sha256


def test_package_root_is_the_nearest_directory_with_a_project_marker(tmp_path: Path):
    root = _tree(tmp_path)

    assert find_package_root(str(root / "pkg" / "model.py")) == root


@pytest.mark.parametrize("cell_file", ["/tmp/ipykernel_26584/1203398474.py", "<stdin>", None])
def test_code_without_a_file_belongs_to_the_project_of_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cell_file: str | None
):
    root = _tree(tmp_path)
    monkeypatch.chdir(root / "pkg")

    assert find_package_root(cell_file) == root


def test_code_without_a_file_outside_any_project_ships_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)

    assert find_package_root("<string>") == tmp_path.resolve()


def test_import_paths_below_the_root_are_the_sessions_and_scripts_folders_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    root = _tree(tmp_path)
    (root / "notebooks").mkdir()
    monkeypatch.chdir(root / "pkg")
    site = root / ".venv" / "lib" / "python3.11" / "site-packages"
    entries = ["", str(root / "notebooks"), str(root), str(site), str(tmp_path.parent), ""]
    monkeypatch.setattr(sys, "path", entries)

    assert import_paths_under(root.resolve()) == ["pkg", "notebooks"]


def test_unpicklable_parameter_is_named_in_the_error():
    with pytest.raises(PayloadError, match="Parameter 'lock' of task 'train'"):
        check_picklable({"ok": 1, "lock": threading.Lock()}, "train")


_opened: list[str] | None = None


def _record_opens(event: str, args: tuple[object, ...]) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], str | bytes | Path):
        _opened.append(os.fsdecode(args[0]))  # type: ignore[arg-type]


sys.addaudithook(_record_opens)


@contextlib.contextmanager
def _files_opened() -> Iterator[list[str]]:
    """Every path this process opens inside the block (Python's `open` audit event)."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def _sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


def _git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args],
        cwd=root,
        check=True,
        capture_output=True,
    )


def test_a_folder_with_a_300_mb_file_is_refused_before_the_file_is_read(tmp_path: Path):
    root = tmp_path / "loose"
    (root / "train.py").parent.mkdir()
    (root / "train.py").write_text("print('train')\n")
    big = _sparse(root / "checkpoints" / "model.bin", 300 * 1000 * 1000)

    with _files_opened() as opened, pytest.raises(PayloadError) as refused:
        build_context_zip(find_package_root(str(root / "train.py")))

    assert "checkpoints/model.bin  ->  /checkpoints/model.bin" in str(refused.value)
    assert "checkpoints/ (1 files)  ->  /checkpoints/" in str(refused.value)
    assert str(big) not in opened
    assert not [p for p in opened if "kinetic-code-" in p]


def test_a_script_in_the_home_directory_is_refused_naming_package_root_and_the_markers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    home = tmp_path / "home"
    (home / "sweep.py").parent.mkdir()
    (home / "sweep.py").write_text("")
    monkeypatch.setenv("HOME", str(home))
    root = find_package_root(str(home / "sweep.py"))

    with pytest.raises(PayloadError, match="is your home directory") as refused:
        check_package_root(root, explicit=False)

    assert "package_root=" in str(refused.value)
    assert "pyproject.toml" in str(refused.value)
    assert ".kineticignore" in str(refused.value)
    check_package_root(root, explicit=True)


def test_in_a_git_checkout_an_ignored_1_gb_file_is_never_listed_nor_read(tmp_path: Path):
    root = tmp_path
    for name in ("pkg/__init__.py", "pkg/model.py", "data/small.csv", "big/weights.bin"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    (root / ".gitignore").write_text("*.bin\n")
    (root / ".kineticignore").write_text("data/\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "code")
    (root / "pkg" / "new.py").write_text("untracked, not ignored\n")
    (root / "pkg" / "model.py").unlink()  # tracked, deleted from the working tree
    huge = _sparse(root / "runs" / "huge.bin", 1 << 30)

    with _files_opened() as opened:
        archive = build_context_zip(root)

    listing = git_listing(root) or []
    assert "pkg/new.py" in listing and "runs/huge.bin" not in listing
    assert str(root / "pkg" / "new.py") in opened and str(huge) not in opened
    assert _names(archive.path) == {".gitignore", ".kineticignore", "pkg/__init__.py", "pkg/new.py"}


def test_a_symlink_is_shipped_only_as_a_file_inside_the_root(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    secret = tmp_path / "outside" / "prod.yaml"
    secret.parent.mkdir()
    secret.write_text("password: hunter2\n")
    root = tmp_path / "proj"
    (root / "conf").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    (root / "conf" / "base.yaml").write_text("lr: 0.1\n")
    (root / "conf" / "prod.yaml").symlink_to(secret)
    (root / "conf" / "default.yaml").symlink_to("base.yaml")
    (root / "everything").symlink_to(tmp_path)
    caplog.set_level(logging.DEBUG, logger="prefect.kinetic_prefect.launch.packaging")

    archive = build_context_zip(root)

    with zipfile.ZipFile(archive.path) as shipped:
        assert set(shipped.namelist()) == {"pyproject.toml", "conf/base.yaml", "conf/default.yaml"}
        assert shipped.read("conf/default.yaml") == b"lr: 0.1\n"
    assert b"hunter2" not in archive.path.read_bytes()
    left_out = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("conf/prod.yaml" in m and "outside the package root" in m for m in left_out)


def test_a_private_key_under_any_name_is_left_out_by_its_header_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    root = tmp_path
    caplog.set_level(logging.DEBUG, logger="prefect.kinetic_prefect.launch.packaging")
    (root / "pyproject.toml").write_text("")
    (root / "deploy_key").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nb3Blbg==\n")
    (root / "id_rsa.pub").write_text("ssh-ed25519 AAAA user@host\n")

    assert _names(build_context_zip(root).path) == {"pyproject.toml", "id_rsa.pub"}
    left_out = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("deploy_key" in m and "private-key header" in m for m in left_out)


def test_the_archive_is_a_temporary_file_removed_once_a_newer_one_of_its_root_replaces_it(
    tmp_path: Path,
):
    archive = build_context_zip(_tree(tmp_path))
    path = archive.path
    assert path.is_file() and path.stat().st_size == archive.size

    (tmp_path / "pkg" / "model.py").write_text("changed")
    newer = build_context_zip(tmp_path)
    del archive
    gc.collect()

    assert newer.path != path and not path.exists()


def test_a_root_unchanged_since_its_last_archive_is_not_zipped_again_and_any_write_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Files written just now count as settled (the next case keeps the default window).
    monkeypatch.setattr(packaging, "_RACY_NS", -(10**12))
    first = build_context_zip(_tree(tmp_path))
    again = build_context_zip(tmp_path)
    assert again.path == first.path  # the same file: nothing zipped

    # Same size, mtime put back: the ctime still changes with the write.
    model = tmp_path / "pkg" / "model.py"
    before = model.stat()
    model.write_text("pkg/modeX.py")
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    rewritten = build_context_zip(tmp_path)

    assert rewritten.sha256 != first.sha256
    with zipfile.ZipFile(rewritten.path) as zipped:
        assert zipped.read("pkg/model.py") == b"pkg/modeX.py"


def test_a_root_with_a_file_written_within_the_timestamp_window_is_zipped_again(tmp_path: Path):
    first = build_context_zip(_tree(tmp_path))  # every file written a moment ago
    again = build_context_zip(tmp_path)

    assert again.path != first.path and again.sha256 == first.sha256
