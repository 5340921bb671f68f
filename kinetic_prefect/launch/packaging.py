"""Packaging a task run for a pod: the cloudpickle payload and the code archive.

The payload holds the task, its resolved parameters and Prefect's serialized
context (with secrets removed). Modules that live under the package root are
pickled by value so the pod does not need them importable; the same root is
also shipped as a code archive for data files and lazily imported code
(`kinetic_prefect.launch.ignore` decides which files), uploaded once per content to
`code-cache/{sha256}.zip` in the jobs store.
"""

from __future__ import annotations

import hashlib
import io
import sys
import threading
import zipfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import packages_distributions
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle
from prefect.logging import get_logger

from kinetic_prefect.common import layout
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.errors import PayloadError
from kinetic_prefect.launch.ignore import IGNORE_FILE, iter_package_files

logger = get_logger("kinetic_prefect.launch.packaging")


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

    The nearest ancestor holding a project marker (pyproject.toml, setup.py,
    setup.cfg, .git, .kineticignore) of the task's source file wins; without
    one, the source file's own directory. A task with no source file on disk
    (a notebook cell, IPython, `python -c`, stdin) belongs to the session's
    working directory: the nearest marked ancestor of the cwd, else the cwd.
    """
    if explicit:
        return Path(explicit).resolve()
    if source_file and Path(source_file).is_file():
        start = Path(source_file).resolve().parent
    else:
        start = Path.cwd().resolve()
    for candidate in (start, *start.parents):
        if any((candidate / marker).exists() for marker in ROOT_MARKERS):
            return candidate
    return start


def build_context_zip(root: Path, extra_excludes: Collection[str] = ()) -> Artifact:
    """A deterministic zip of the files of `root` that are shipped (see `launch.ignore`).

    Entries are sorted, timestamps fixed and modes reduced to 644/755, so the
    same content always gives the same bytes and the same sha256.
    """
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for path in iter_package_files(root, extra_excludes):
            info = zipfile.ZipInfo(path.relative_to(root).as_posix(), date_time=_ZIP_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            executable = path.stat().st_mode & 0o111
            info.external_attr = (0o755 if executable else 0o644) << 16
            archive.writestr(info, path.read_bytes())
    return Artifact.of(buffer.getvalue())


context_keys = layout.code_archive_keys


_UPLOAD_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_UPLOAD_LOCKS_GUARD = threading.Lock()
# Archives this process uploaded or found, by (store root, sha256).
_PRESENT: set[tuple[str, str]] = set()


def upload_context(store: JobsStore, archive: Artifact) -> str:
    """Upload the code archive once per content and return its URI.

    The archive goes to `code-cache/{sha256}.zip`; the marker
    `code-cache/{sha256}.done` is written only after it, so an interrupted
    upload is redone. Concurrent launches of one archive upload it once, and a
    process asks the store about an archive once: cleanup keeps the code cache.

    Example:
        ```python
        uri = upload_context(open_store("gs://my-jobs"), build_context_zip(root))
        ```
    """
    key, marker = context_keys(archive.sha256)
    where = (store.root, archive.sha256)
    with _UPLOAD_LOCKS_GUARD:
        lock = _UPLOAD_LOCKS.setdefault(where, threading.Lock())
    with lock:
        if where not in _PRESENT and not (store.exists(marker) and store.exists(key)):
            store.put_bytes(key, archive.data)
            store.put_bytes(marker, archive.sha256.encode())
            logger.debug("Uploaded the code archive %s (%d bytes).", key, len(archive.data))
        _PRESENT.add(where)
    return store.uri(key)


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


def import_paths_under(root: Path) -> list[str]:
    """This process's import path entries below `root`, relative to it, in order.

    A notebook's, a session's or a script's own folder is on its import path (`''`
    or the script's directory); below its project root, the pod puts the same folder
    of the code archive on its own, so the modules beside the code import there too.
    """
    found: list[str] = []
    for entry in sys.path:
        try:
            path = Path(entry or ".").resolve()
        except OSError:
            continue
        if path == root or not path.is_relative_to(root) or "site-packages" in path.parts:
            continue
        relative = path.relative_to(root).as_posix()
        if relative not in found:
            found.append(relative)
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
