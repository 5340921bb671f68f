"""`Data`: hand a local path or a `gs://` location to a task; it arrives as a plain path.

Orchestrator side, local data is hashed by content and uploaded once to
`data-cache/{sha256}/` (with `data-markers/{sha256}` written last, so a marker
always means a complete copy). `gs://` data is passed through. Pod side,
every `Data` becomes a `str` path: downloaded into scratch space, or, with
`fuse=True`, a read-only GCS FUSE mount.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

CACHE_PREFIX = "data-cache"
MARKER_PREFIX = "data-markers"
MOUNT_ROOT_ENV = "KINETIC_DATA_MOUNT_ROOT"
DEFAULT_MOUNT_ROOT = "/mnt/kinetic-data"
_CHUNK = 1024 * 1024


class DataError(ValueError):
    """A `Data` location is invalid or its content cannot be shipped as it is."""


class Data:
    """A local file or directory, or a `gs://` prefix or object, for a task parameter.

    In the task it arrives as a plain `str` path with the same content.

    Args:
        path_or_uri: a local file or directory (must exist), `gs://bucket/prefix/`
            (a directory: note the trailing slash) or `gs://bucket/object` (one file).
        fuse: on GKE, mount the data read-only with GCS FUSE instead of downloading it.

    Example:
        ```python
        @task
        def train(data_dir: str): ...

        train.submit(Data("gs://my-bucket/datasets/digits/"))
        ```
    """

    __slots__ = ("fuse", "path_or_uri")
    path_or_uri: str
    fuse: bool

    def __init__(self, path_or_uri: str | os.PathLike[str], fuse: bool = False) -> None:
        text = os.fspath(path_or_uri)
        if not text:
            raise DataError("Data() needs a local path or a gs://bucket/... URI.")
        if text.startswith("gs://"):
            bucket, _, _ = text[len("gs://") :].partition("/")
            if not bucket:
                raise DataError(
                    f"{text!r} has no bucket name: use gs://BUCKET/prefix/ or gs://BUCKET/object."
                )
        elif "://" in text:
            raise DataError(f"Unsupported location {text!r}: use a local path or a gs:// URI.")
        else:
            path = Path(text).expanduser().absolute()
            if not path.exists():
                raise DataError(f"Local data {path} does not exist.")
            text = str(path)
        object.__setattr__(self, "path_or_uri", text)
        object.__setattr__(self, "fuse", bool(fuse))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Data is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_data, (self.path_or_uri, self.fuse))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Data) and (self.path_or_uri, self.fuse) == (
            other.path_or_uri,
            other.fuse,
        )

    def __hash__(self) -> int:
        return hash((self.path_or_uri, self.fuse))

    def __repr__(self) -> str:
        return f"Data({self.path_or_uri!r}" + (", fuse=True)" if self.fuse else ")")

    @property
    def is_gcs(self) -> bool:
        return self.path_or_uri.startswith("gs://")


def _rebuild_data(path_or_uri: str, fuse: bool) -> Data:
    # Pods rebuild without re-checking that a local path exists on their side.
    data = object.__new__(Data)
    object.__setattr__(data, "path_or_uri", path_or_uri)
    object.__setattr__(data, "fuse", fuse)
    return data


@dataclass(frozen=True)
class DataRef:
    """What a pod needs to turn one `Data` into a path; built on the orchestrator."""

    source: str  # what the user passed
    uri: str  # gs://… or a local directory/file in the jobs store
    is_dir: bool
    sha256: str | None  # content hash of local data; None for gs:// data
    size: int | None
    fuse: bool = False
    mount: str | None = None  # volume name when mounted with GCS FUSE


# -- hashing ---------------------------------------------------------------------


@dataclass(frozen=True)
class FileDigest:
    relative: str
    size: int
    sha256: str


def _local_files(root: Path) -> list[tuple[str, Path]]:
    if root.is_file():
        return [(root.name, root)]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return found


def _file_sha256(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def hash_local(path: Path, workers: int = 4) -> tuple[str, list[FileDigest]]:
    """Content hash of a file or directory: relative paths, sizes and bytes.

    Files are hashed in parallel (hashlib releases the GIL on large updates);
    the result is the sha256 of the sorted per-file lines, so it is independent
    of file order and timestamps.
    """
    files = _local_files(path)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(lambda item: _file_sha256(item[1]), files))
    digests = [
        FileDigest(relative, size, sha)
        for (relative, _), (size, sha) in zip(files, results, strict=True)
    ]
    listing = "".join(f"{d.sha256} {d.size} {d.relative}\n" for d in digests)
    kind = "file" if path.is_file() else "dir"
    return hashlib.sha256(f"{kind}\n{listing}".encode()).hexdigest(), digests


class _HashingReader:
    """Reads a file while hashing exactly the bytes handed to the uploader."""

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self.digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        chunk = self._handle.read(size)
        self.digest.update(chunk)
        return chunk


def upload_local(store: Any, path: Path, digest: str, files: list[FileDigest]) -> int:
    """Upload local data to `data-cache/{digest}/` once; returns bytes transferred.

    A file whose bytes no longer match its hash is refused (and its partial
    upload removed): nothing is ever stored under a hash it does not have.
    """
    marker = f"{MARKER_PREFIX}/{digest}"
    if store.exists(marker):
        return 0
    root = path if path.is_dir() else path.parent
    transferred = 0
    for item in files:
        key = f"{CACHE_PREFIX}/{digest}/{item.relative}"
        with open(root / item.relative, "rb") as handle:
            reader = _HashingReader(handle)
            store.put_stream(key, reader, item.size)  # type: ignore[arg-type]
        if reader.digest.hexdigest() != item.sha256:
            store.delete_prefix(key)
            raise DataError(
                f"{root / item.relative} changed while it was being uploaded; its content no "
                "longer matches the hash taken at submission. Submit again once it is stable."
            )
        transferred += item.size
    store.put_bytes(marker, digest.encode())
    return transferred


# -- orchestrator: finding Data in parameters and resolving it ----------------------


def visit_data(value: Any, fn: Callable[[Data], Any]) -> Any:
    """Replace every `Data` inside `value` (lists, tuples, dicts, dataclasses, pydantic
    models, any nesting) by `fn(data)`."""
    from prefect.utilities.collections import visit_collection

    return visit_collection(
        value, visit_fn=lambda item: fn(item) if isinstance(item, Data) else item, return_data=True
    )


def find_data(parameters: dict[str, Any]) -> list[Data]:
    found: list[Data] = []

    def collect(data: Data) -> Data:
        found.append(data)
        return data

    visit_data(parameters, collect)
    return found


def gcs_size(uri: str) -> tuple[int, bool]:
    """Total size of a `gs://` object or prefix, and whether it is a directory."""
    from kinetic_prefect.gcs import GcsStore, split_gs_uri

    bucket, key = split_gs_uri(uri)
    store = GcsStore(f"gs://{bucket}")
    if uri.endswith("/") or not key:
        entries = store.list(key.rstrip("/") + "/" if key else "")
        return sum(size for _, size in entries), True
    entries = [(name, size) for name, size in store.list(key) if name == key]
    if not entries:
        raise DataError(f"{uri} does not exist (for a directory, end the URI with '/').")
    return entries[0][1], False


# -- pod: turning references into paths ---------------------------------------------


def _download_gcs(uri: str, is_dir: bool, target: Path, workers: int = 8) -> Path:
    from kinetic_prefect.gcs import GcsStore, split_gs_uri

    bucket, key = split_gs_uri(uri)
    store = GcsStore(f"gs://{bucket}")
    if not is_dir:
        destination = target / PurePosixPath(key).name
        store.get_file(key, destination)
        return destination
    prefix = key.rstrip("/") + "/" if key else ""
    entries = [name for name, _ in store.list(prefix) if not name.endswith("/")]
    jobs = []
    for name in entries:
        destination = (target / name[len(prefix) :]).resolve()
        if not destination.is_relative_to(target.resolve()):
            raise DataError(f"Object {name!r} would land outside the data directory; refused.")
        jobs.append((name, destination))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda job: store.get_file(*job), jobs))
    target.mkdir(parents=True, exist_ok=True)
    return target


def _make_read_only(path: Path) -> None:
    paths: Iterator[Path] = path.rglob("*") if path.is_dir() else iter(())
    for item in [*paths, path]:
        mode = item.stat().st_mode
        item.chmod(mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def resolve_ref(ref: DataRef, scratch: Path) -> str:
    """The local path a task sees for `ref`."""
    if ref.mount:
        mount_root = Path(os.environ.get(MOUNT_ROOT_ENV, DEFAULT_MOUNT_ROOT))
        mounted = mount_root / ref.mount
        if not ref.is_dir:
            return str(mounted / PurePosixPath(ref.uri).name)
        return str(mounted)
    if "://" not in ref.uri:
        # The jobs store is on this machine (local backend): the cache is the data.
        return ref.uri
    name = ref.sha256 or hashlib.sha256(ref.uri.encode()).hexdigest()
    return str(_download_gcs(ref.uri, ref.is_dir, scratch / "data" / name[:16]))


def resolve_parameters(parameters: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Replace every `DataRef` in the parameters by its local path (downloads in parallel)."""
    from prefect.utilities.collections import visit_collection

    refs: list[DataRef] = []
    visit_collection(
        parameters,
        visit_fn=lambda item: refs.append(item) if isinstance(item, DataRef) else None,
        return_data=False,
    )
    unique = list(dict.fromkeys(refs))
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        paths = dict(zip(unique, pool.map(lambda r: resolve_ref(r, scratch), unique), strict=True))
    result: dict[str, Any] = visit_collection(
        parameters,
        visit_fn=lambda item: paths[item] if isinstance(item, DataRef) else item,
        return_data=True,
    )
    return result


def materialise_fuse_volume(bucket: str, only_dir: str, target: Path) -> None:
    """The local backend's stand-in for a GCS FUSE mount: a read-only copy of the objects."""
    folder = only_dir.strip("/")
    _download_gcs(f"gs://{bucket}/" + (f"{folder}/" if folder else ""), True, target)
    _make_read_only(target)
