"""Code archive and payload packaging."""

from __future__ import annotations

import threading
import zipfile
from pathlib import Path

import pytest

from kinetic_prefect.errors import PayloadError
from kinetic_prefect.launch.packaging import (
    build_context_zip,
    check_picklable,
    find_package_root,
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


def test_unpicklable_parameter_is_named_in_the_error():
    with pytest.raises(PayloadError, match="Parameter 'lock' of task 'train'"):
        check_picklable({"ok": 1, "lock": threading.Lock()}, "train")
