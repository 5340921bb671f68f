"""The data cache's layout and its marker: what a complete, verifiable copy looks like.

Local `Data` is stored under `data-cache/{sha256}/` (one object per file, named
by its path relative to the data root; a single file keeps its own name).
`data-markers/{sha256}` (a `DataMarker` record) is written last and lists every
file with its size and sha256; the content hash is the sha256 of that listing, so
the pod can check a marker against the hash it was given and every file against the marker.
Shared by the orchestrator and the pod.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from kinetic_prefect.common import layout
from kinetic_prefect.common.contract import Record
from kinetic_prefect.errors import RecordError

READ_CHUNK = 1024 * 1024
_T = TypeVar("_T")
_R = TypeVar("_R")


class DataError(ValueError):
    """A `Data` location is invalid or its content cannot be shipped as it is."""


class DataIntegrityError(DataError):
    """Cached data does not match the content hash it was submitted with; `hint` says what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class FileDigest:
    """One file of a `Data`: its `/`-separated path relative to the data root, size, sha256."""

    relative: str
    size: int
    sha256: str


def combined_digest(is_dir: bool, files: Iterable[FileDigest]) -> str:
    """The content hash of a file or directory: independent of file order and timestamps."""
    listing = "".join(
        f"{f.sha256} {f.size} {f.relative}\n" for f in sorted(files, key=lambda f: f.relative)
    )
    kind = "dir" if is_dir else "file"
    return hashlib.sha256(f"{kind}\n{listing}".encode()).hexdigest()


def file_sha256(path: str | Path) -> FileDigest:
    """Size and sha256 of a file, read in chunks (never whole into memory)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return FileDigest(os.path.basename(path), size, digest.hexdigest())


cache_key = layout.data_cache_key
marker_key = layout.data_marker_key


class DataMarker(Record):
    """`data-markers/{sha256}`: the files of a cached `Data`, each as [path, size, sha256]."""

    kind: Literal["data-marker"] = "data-marker"
    version: int = 2
    sha256: str
    content: Literal["dir", "file"]
    files: list[tuple[str, int, str]]


def encode_marker(digest: str, is_dir: bool, files: Iterable[FileDigest]) -> bytes:
    return DataMarker(
        sha256=digest,
        content="dir" if is_dir else "file",
        files=[(f.relative, f.size, f.sha256) for f in files],
    ).encode()


def decode_marker(raw: bytes, digest: str) -> list[FileDigest]:
    """The files a marker lists, checked against the content hash `digest`.

    Raises `DataIntegrityError` for a marker that is unreadable, of another
    version, or whose listing does not hash to `digest`.
    """
    try:
        body = DataMarker.decode(raw, marker_key(digest))
    except RecordError as exc:
        raise DataIntegrityError(f"The data-cache marker is unreadable: {exc}") from exc
    files = [FileDigest(*entry) for entry in body.files]
    is_dir = body.content == "dir"
    if combined_digest(is_dir, files) != digest:
        raise DataIntegrityError(
            f"The data-cache marker {marker_key(digest)} lists files whose combined hash is "
            f"not {digest}: the marker was modified after upload."
        )
    return files


def parallel_map(fn: Callable[[_T], _R], items: Iterable[_T], workers: int) -> list[_R]:
    """`fn` over `items` in threads, in order; the first failure cancels what has not started."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
    try:
        return list(pool.map(fn, items))
    finally:
        pool.shutdown(cancel_futures=True)
