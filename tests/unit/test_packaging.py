"""Code archive and payload packaging."""

from __future__ import annotations

import io
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from kinetic_prefect.errors import PayloadError
from kinetic_prefect.launch.packaging import (
    build_context_zip,
    check_picklable,
    find_package_root,
    import_paths_under,
    size_warning,
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


def _names(data: bytes) -> set[str]:
    return set(zipfile.ZipFile(io.BytesIO(data)).namelist())


def test_context_zip_skips_default_exclusions_and_kineticignore(tmp_path: Path):
    archive = build_context_zip(_tree(tmp_path))

    assert _names(archive.data) == {
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


def test_large_artifact_gets_a_size_warning_that_says_what_to_do(tmp_path: Path):
    root = _tree(tmp_path)
    archive = build_context_zip(root)

    assert size_warning("code", archive, limit=10) is not None
    assert ".kineticignore" in (size_warning("code", archive, limit=10) or "")
    assert size_warning("code", archive) is None
