"""Packaging a task run for a pod: the cloudpickle payload and the code archive.

The payload holds the task, its resolved parameters and Prefect's serialized
context (with secrets removed). Modules that live under the package root are
pickled by value so the pod does not need them importable; the same root is
also shipped as `context.zip` for data files and lazily imported code.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import os
import sys
import threading
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import packages_distributions
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle

from kinetic_prefect.errors import PayloadError

DEFAULT_EXCLUDES = (
    ".git",
    ".hg",
    ".svn",
    ".venv",
    "venv",
    ".tools",
    "__pycache__",
    "*.pyc",
    ".kinetic",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    "node_modules",
    ".ipynb_checkpoints",
    "*.egg-info",
    ".DS_Store",
)
IGNORE_FILE = ".kineticignore"
ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git", IGNORE_FILE)
SIZE_WARNING_BYTES = 100 * 1024 * 1024
# Zip entries get a fixed timestamp so the archive's hash depends on content only.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Artifact:
    """Bytes to upload and their sha256, checked in the pod before use."""

    data: bytes
    sha256: str

    @classmethod
    def of(cls, data: bytes) -> Artifact:
        return cls(data=data, sha256=hashlib.sha256(data).hexdigest())


def find_package_root(source_file: str | None, explicit: str | None = None) -> Path:
    """The directory shipped with the task: explicit, else the nearest project root.

    The nearest ancestor of the task's source file holding a project marker
    (pyproject.toml, setup.py, setup.cfg, .git, .kineticignore) wins; without
    one, the source file's own directory; without a source file, the cwd.
    """
    if explicit:
        return Path(explicit).resolve()
    if not source_file:
        return Path.cwd().resolve()
    start = Path(source_file).resolve().parent
    for candidate in (start, *start.parents):
        if any((candidate / marker).exists() for marker in ROOT_MARKERS):
            return candidate
    return start


def _ignore_patterns(root: Path, extra: Iterable[str]) -> list[str]:
    patterns = [*DEFAULT_EXCLUDES, *extra]
    ignore_file = root / IGNORE_FILE
    if ignore_file.exists():
        for line in ignore_file.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                patterns.append(line.rstrip("/"))
    return patterns


def _is_excluded(relative: str, patterns: list[str]) -> bool:
    parts = relative.split("/")
    for pattern in patterns:
        if "/" in pattern:
            if fnmatch.fnmatch(relative, pattern.lstrip("/")) or relative.startswith(
                pattern.lstrip("/") + "/"
            ):
                return True
        elif any(fnmatch.fnmatch(part, pattern) for part in parts):
            return True
    return False


def iter_package_files(root: Path, extra_excludes: Iterable[str] = ()) -> Iterator[Path]:
    """Files under `root` that go into `context.zip`, in a stable order."""
    patterns = _ignore_patterns(root, extra_excludes)
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if not _is_excluded(rel_dir + d, patterns))
        for name in sorted(filenames):
            if not _is_excluded(rel_dir + name, patterns):
                path = Path(dirpath) / name
                if path.is_file():
                    yield path


def build_context_zip(root: Path, extra_excludes: Iterable[str] = ()) -> Artifact:
    """A deterministic zip of the package root (same files, same bytes, same hash)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in iter_package_files(root, extra_excludes):
            info = zipfile.ZipInfo(path.relative_to(root).as_posix(), date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = (path.stat().st_mode & 0o777) << 16
            archive.writestr(info, path.read_bytes())
    return Artifact.of(buffer.getvalue())


@lru_cache(maxsize=1)
def _installed_top_levels() -> frozenset[str]:
    # kinetic_prefect is always installed in the pod; an editable install of it
    # is missing from packages_distributions(), so name it explicitly.
    return frozenset(packages_distributions()) | {"kinetic_prefect"}


def modules_under(root: Path) -> list[ModuleType]:
    """Imported user modules whose source lives under `root` (not installed packages)."""
    installed = _installed_top_levels()
    found = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file or name.split(".")[0] in installed or name == "__main__":
            continue
        try:
            path = Path(file).resolve()
        except OSError:
            continue
        if path.is_relative_to(root) and "site-packages" not in path.parts:
            found.append(module)
    return found


# cloudpickle's by-value registry is process-wide; serialise its use.
_PICKLE_LOCK = threading.Lock()


def build_payload(contents: Mapping[str, Any], root: Path) -> Artifact:
    """Cloudpickle `contents`, with modules under `root` pickled by value."""
    with _PICKLE_LOCK:
        registered = []
        for module in modules_under(root):
            try:
                cloudpickle.register_pickle_by_value(module)
                registered.append(module)
            except ValueError:
                continue
        try:
            return Artifact.of(cloudpickle.dumps(dict(contents)))
        finally:
            for module in registered:
                cloudpickle.unregister_pickle_by_value(module)


def check_picklable(parameters: Mapping[str, Any], task_name: str) -> None:
    """Fail at submit, naming the parameter, when an argument cannot be pickled."""
    for name, value in parameters.items():
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise PayloadError(
                f"Parameter {name!r} of task {task_name!r} cannot be sent to a pod: "
                f"{type(exc).__name__}: {exc}. Pass a picklable value instead (for open files, "
                "sockets or clients, pass a path or settings and create the object in the task)."
            ) from exc


def size_warning(label: str, artifact: Artifact, limit: int = SIZE_WARNING_BYTES) -> str | None:
    """A warning to log when an artifact is large enough to slow every launch."""
    if len(artifact.data) <= limit:
        return None
    return (
        f"{label} is {len(artifact.data) / 1e6:.1f} MB (over {limit / 1e6:.0f} MB); every launch "
        f"uploads it. Add large files to {IGNORE_FILE} and pass data with kinetic_prefect.Data."
    )
