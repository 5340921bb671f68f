"""Packaging a task run for a pod: the cloudpickle payload and the code archive.

The payload holds the task, its resolved parameters and Prefect's serialized
context (with secrets removed). Modules that live under the package root are
pickled by value so the pod does not need them importable; the same root is
also shipped as a code archive for data files and lazily imported code
(`kinetic_prefect.launch.ignore` decides which files), uploaded once per content to
`code-cache/{sha256}.zip` in the jobs store.

The archive is bounded and never held in memory: a root too broad to ship
(`/`, the home or the temporary directory, unless `package_root=` names it)
and a file list past the size or file-count limit are refused from names and
`stat` alone, before any file is read or anything uploaded; the archive is then
written to a temporary file and streamed to the store.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
import zipfile
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import packages_distributions
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

import cloudpickle
from prefect.logging import get_logger

from kinetic_prefect.common import layout
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.errors import PayloadError
from kinetic_prefect.launch.ignore import (
    CREDENTIAL_SCAN_BYTES,
    IGNORE_FILE,
    PackageFile,
    credential_content,
    ignore_line,
    iter_package_files,
)
from kinetic_prefect.launch.settings import LaunchSettings

logger = get_logger("kinetic_prefect.launch.packaging")


ROOT_MARKERS = ("pyproject.toml", "setup.py", "setup.cfg", ".git", IGNORE_FILE)
# Zip entries get a fixed timestamp so the archive's hash depends on content only.
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)
# How many of the largest files and directories a refusal names.
_LARGEST_LISTED = 5


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


def refused_root(root: Path, home: Path, temp: Path) -> str | None:
    """What `root` is when it is too broad to ship whole (`/`, `home`, `temp` or a directory
    holding one of them), else None. Pure: every path is already resolved."""
    if root == Path(root.anchor):
        return "the filesystem root"
    if root == home:
        return "your home directory"
    if home.is_relative_to(root):
        return f"a directory that holds your home directory ({home})"
    if root == temp or temp.is_relative_to(root):
        return "the system temporary directory"
    return None


def check_package_root(root: Path, explicit: bool) -> None:
    """Refuse, before anything is read or uploaded, a root found by default that is too broad.

    A root named with `package_root=` (`explicit`) is shipped as asked, within the
    archive limits.
    """
    if explicit:
        return
    what = refused_root(root, Path.home().resolve(), Path(tempfile.gettempdir()).resolve())
    if what is None:
        return
    markers = ", ".join(ROOT_MARKERS)
    raise PayloadError(
        f"The package root {root} is {what}: kinetic-prefect does not ship it whole with your "
        f"task. Add a project marker ({markers}) to the directory that holds your code, or name "
        'the directory to ship with KineticTaskRunner(package_root="/path/to/project").'
    )


@dataclass(frozen=True)
class ArchiveLimits:
    """The most a code archive may hold: bytes of its files before compression, and files."""

    max_bytes: int
    max_files: int

    @classmethod
    def of(cls, settings: LaunchSettings) -> ArchiveLimits:
        """From the `code_archive_max_mb` and `code_archive_max_files` settings."""
        return cls(int(settings.code_archive_max_mb * 1_000_000), settings.code_archive_max_files)


def _sized(files: Sequence[PackageFile]) -> list[tuple[str, bool, int, int]]:
    """(relative, is_dir, bytes, files) for every file and every directory above one."""
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for file in files:
        parts = file.relative.split("/")
        for depth in range(1, len(parts)):
            directory = "/".join(parts[:depth])
            sizes[directory] += file.size
            counts[directory] += 1
    return [(d, True, sizes[d], counts[d]) for d in sizes] + [
        (f.relative, False, f.size, 1) for f in files
    ]


def oversize_report(root: Path, files: Sequence[PackageFile], limits: ArchiveLimits) -> str | None:
    """Why the files would make an archive past `limits`, naming the largest files and
    directories with the `.kineticignore` line that leaves each out; None within them."""
    total = sum(f.size for f in files)
    too_big, too_many = total > limits.max_bytes, len(files) > limits.max_files
    if not (too_big or too_many):
        return None
    entries = _sized(files)
    if too_big:
        head = (
            f"The code archive of {root} would hold {total / 1e6:.1f} MB, over the "
            f"{limits.max_bytes / 1e6:g} MB limit (code_archive_max_mb)."
        )
        ranked = sorted(entries, key=lambda e: (-e[2], e[0]))
    else:
        head = (
            f"The code archive of {root} would hold {len(files)} files, over the "
            f"{limits.max_files} file limit (code_archive_max_files)."
        )
        ranked = sorted((e for e in entries if e[1]), key=lambda e: (-e[3], e[0]))
    lines = [head, "Largest, with the .kineticignore line that leaves each out:"]
    for is_dir in (True, False):
        for relative, _, size, count in [e for e in ranked if e[1] == is_dir][:_LARGEST_LISTED]:
            what = f"{relative}/ ({count} files)" if is_dir else relative
            lines.append(f"  {size / 1e6:10.1f} MB  {what}  ->  {ignore_line(relative, is_dir)}")
    lines.append(
        f"Add those lines to {root / IGNORE_FILE} and pass data with kinetic_prefect.Data, "
        'set KineticTaskRunner(package_root="...") to the directory that holds only your code, '
        "or raise code_archive_max_mb / code_archive_max_files (KINETIC_CODE_ARCHIVE_MAX_MB, "
        "KINETIC_CODE_ARCHIVE_MAX_FILES)."
    )
    return "\n".join(lines)


@dataclass(frozen=True)
class CodeArchive:
    """A code archive in a temporary file and its sha256.

    The file is removed once the archive is dropped; `build_context_zip` keeps the last
    one of each root until a newer one replaces it.
    """

    path: Path
    sha256: str
    size: int

    def __post_init__(self) -> None:
        weakref.finalize(self, _remove, self.path)

    def open(self) -> BinaryIO:
        return self.path.open("rb")


def _remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def _add_file(archive: zipfile.ZipFile, file: PackageFile) -> None:
    # O_NOFOLLOW: a file swapped for a symlink since it was listed is not followed out of the root.
    try:
        descriptor = os.open(file.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        logger.debug("Not shipping %s: it cannot be read (%s).", file.relative, exc)
        return
    with os.fdopen(descriptor, "rb") as source:
        head = source.read(CREDENTIAL_SCAN_BYTES + 1)
        reason = credential_content(file.relative, head, len(head) <= CREDENTIAL_SCAN_BYTES)
        if reason is not None:
            logger.debug("Not shipping %s: %s.", file.relative, reason)
            return
        info = zipfile.ZipInfo(file.relative, date_time=_ZIP_EPOCH)
        info.compress_type = zipfile.ZIP_DEFLATED
        info.external_attr = (0o755 if file.executable else 0o644) << 16
        info.file_size = file.size
        with archive.open(info, "w") as entry:
            entry.write(head)
            shutil.copyfileobj(source, entry, 1024 * 1024)


def build_context_zip(
    root: Path, extra_excludes: Collection[str] = (), limits: ArchiveLimits | None = None
) -> CodeArchive:
    """A deterministic zip of the files of `root` that are shipped (see `launch.ignore`).

    Refused with `PayloadError`, before any file is read, past `limits` (default:
    the settings' defaults). Entries
    are sorted, timestamps fixed and modes reduced to 644/755, so the same content
    always gives the same bytes and the same sha256. The zip is written to a
    temporary file, never held in memory. Asked again for a root whose listing has not
    changed since (no file added, removed or written: the ctimes are the same), it
    returns the archive it built then.

    Example:
        ```python
        archive = build_context_zip(Path("."), limits=ArchiveLimits(50_000_000, 5_000))
        ```
    """
    listed_at = time.time_ns()
    files = list(iter_package_files(root, extra_excludes))
    report = oversize_report(root, files, limits or ArchiveLimits.of(LaunchSettings()))
    if report is not None:
        raise PayloadError(report)
    # A flow run again in the same process (a notebook's next cell, a sweep of flow runs)
    # with no file added, removed or written since: the archive built then.
    where = (root.resolve(), tuple(sorted(extra_excludes)))
    listing = tuple((f.relative, f.path, f.size, f.executable, f.stamp) for f in files)
    with _LAST_BUILT_LOCK:
        last = _LAST_BUILT.get(where)
    if last is not None and last[0] == listing and last[1].path.is_file():
        return last[1]
    archive = _zip(files)
    # A file written within a timestamp's granularity of the listing (a kernel tick, or a
    # network file system's caching) could change again unseen: such a listing is not kept.
    newest = max((max(f.stamp) for f in files), default=0)
    with _LAST_BUILT_LOCK:
        _LAST_BUILT.pop(where, None)
        if newest < listed_at - _RACY_NS:
            _LAST_BUILT[where] = (listing, archive)
            while len(_LAST_BUILT) > _LAST_BUILT_ROOTS:
                del _LAST_BUILT[next(iter(_LAST_BUILT))]
    return archive


# The last archive built of each (root, excludes), with the listing it was built from: the
# most recent few roots only, each a temporary file.
_LAST_BUILT: dict[tuple[Path, tuple[str, ...]], tuple[tuple[Any, ...], CodeArchive]] = {}
_LAST_BUILT_LOCK = threading.Lock()
_LAST_BUILT_ROOTS = 8
_RACY_NS = 2_000_000_000


def _zip(files: Sequence[PackageFile]) -> CodeArchive:
    descriptor, name = tempfile.mkstemp(prefix="kinetic-code-", suffix=".zip")
    try:
        with os.fdopen(descriptor, "w+b") as handle:
            with zipfile.ZipFile(handle, "w", compression=zipfile.ZIP_DEFLATED) as archive:
                for file in files:
                    _add_file(archive, file)
            handle.seek(0)
            sha256 = hashlib.file_digest(handle, "sha256").hexdigest()
            size = handle.tell()
    except BaseException:
        os.unlink(name)
        raise
    return CodeArchive(Path(name), sha256, size)


context_keys = layout.code_archive_keys


_UPLOAD_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_UPLOAD_LOCKS_GUARD = threading.Lock()
# Archives this process uploaded or found, by (store root, sha256).
_PRESENT: set[tuple[str, str]] = set()


def upload_context(store: JobsStore, archive: CodeArchive) -> str:
    """Stream the code archive to the store once per content and return its URI.

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
            with archive.open() as stream:
                store.put_stream(key, stream, archive.size)
            store.put_bytes(marker, archive.sha256.encode())
            logger.debug("Uploaded the code archive %s (%d bytes).", key, archive.size)
        _PRESENT.add(where)
    return store.uri(key)


@lru_cache(maxsize=1)
def _installed_top_levels() -> frozenset[str]:
    # kinetic_prefect is always installed in the pod; an editable install of it
    # is missing from packages_distributions(), so name it explicitly.
    return frozenset(packages_distributions()) | {"kinetic_prefect"}


# A module's file, resolved once: every attempt looks at every imported module, and
# resolving a path costs a system call per folder (a sweep's submitting process has
# thousands of modules).
_RESOLVED: dict[str, Path | None] = {}


def _resolved(file: str) -> Path | None:
    if file not in _RESOLVED:
        try:
            _RESOLVED[file] = Path(file).resolve()
        except OSError:
            _RESOLVED[file] = None
    return _RESOLVED[file]


def modules_under(root: Path) -> list[ModuleType]:
    """Imported user modules whose source lives under `root` (not installed packages)."""
    installed = _installed_top_levels()
    found = []
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in installed or name == "__main__":
            continue
        file = getattr(module, "__file__", None)
        path = _resolved(file) if file else None
        if path is not None and path.is_relative_to(root) and "site-packages" not in path.parts:
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


PAYLOAD_WARNING_BYTES = 100 * 1024 * 1024


def payload_size_warning(task_name: str, payload: Artifact) -> str | None:
    """A warning to log when a task's payload (its pickled arguments) slows every launch."""
    if len(payload.data) <= PAYLOAD_WARNING_BYTES:
        return None
    return (
        f"The payload of task {task_name!r} is {len(payload.data) / 1e6:.1f} MB (over "
        f"{PAYLOAD_WARNING_BYTES / 1e6:.0f} MB); every launch uploads it. Pass large arrays "
        "and files as kinetic_prefect.Data instead of as arguments."
    )
