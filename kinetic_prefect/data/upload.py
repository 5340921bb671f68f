"""Orchestrator side of `Data`: content hashes (computed once per file state) and uploads.

A runner owns one `LocalDataHashes`: every submission of the same local path
reuses its hash while no file's size, mtime or inode changed, and concurrent
submissions of the same content upload it once. Files are streamed: hashed in
parallel threads in 1 MiB reads, uploaded in parallel with resumable uploads
whose re-sent chunks are hashed as they were last sent, so what is stored is
checked against the hash taken at submission without holding a file in memory.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from prefect.logging import get_logger

from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.data.data import Data, DataRef
from kinetic_prefect.data.marker import (
    DataError,
    DataIntegrityError,
    FileDigest,
    cache_key,
    combined_digest,
    decode_marker,
    encode_marker,
    file_sha256,
    marker_key,
    parallel_map,
)

logger = get_logger("kinetic_prefect.data.data")


@dataclass(frozen=True)
class LocalFile:
    relative: str
    path: str  # a str: building a Path per file would dominate a cache hit's cost
    stat: tuple[int, int, int]  # size, mtime_ns, inode


@dataclass(frozen=True)
class LocalContent:
    """A local file or directory with the content hash it had when it was read."""

    root: Path
    is_dir: bool
    sha256: str
    files: tuple[FileDigest, ...]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    def path_of(self, item: FileDigest) -> Path:
        return self.root / item.relative if self.is_dir else self.root


def scan(root: Path) -> list[LocalFile]:
    """The files of a file or directory (sorted, symlinked directories not followed)."""
    if root.is_file():
        info = root.stat()
        return [LocalFile(root.name, str(root), (info.st_size, info.st_mtime_ns, info.st_ino))]
    found: list[LocalFile] = []

    def walk(folder: str, relative: str) -> None:
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                name = f"{relative}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    walk(entry.path, f"{name}/")
                elif entry.is_file():
                    info = entry.stat()
                    stat = (info.st_size, info.st_mtime_ns, info.st_ino)
                    found.append(LocalFile(name, entry.path, stat))

    walk(str(root), "")
    return found


def hash_local(path: Path, workers: int = 4, files: list[LocalFile] | None = None) -> LocalContent:
    """Content hash of a file or directory: relative paths, sizes and bytes.

    Files are hashed in parallel threads (hashlib releases the GIL on large
    reads); see `data_marker.combined_digest` for how they combine.
    """
    listed = scan(path) if files is None else files
    digests = parallel_map(lambda f: file_sha256(f.path), listed, workers)
    named = tuple(
        FileDigest(f.relative, d.size, d.sha256) for f, d in zip(listed, digests, strict=True)
    )
    is_dir = path.is_dir()
    return LocalContent(path, is_dir, combined_digest(is_dir, named), named)


class HashingReader:
    """Reads a file for an uploader while hashing the bytes that end up stored.

    A resumable upload rewinds to the last byte the server confirmed (at most
    back to the start of the chunk in flight) and sends again from there; the
    hash rewinds with it, so each byte counts once, as it was last sent.
    """

    def __init__(self, handle: BinaryIO) -> None:
        self._handle = handle
        self._position = 0
        self._state: Any = hashlib.sha256()  # hash of bytes [0, position), None if unknown
        self._last: tuple[int, Any, bytes] = (0, self._state.copy(), b"")

    def read(self, size: int | None = -1) -> bytes:
        start, state = self._position, self._state
        chunk = self._handle.read(-1 if size is None else size)
        self._last = (start, None if state is None else state.copy(), chunk)
        if state is not None:
            state.update(chunk)
        self._position += len(chunk)
        return chunk

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        target = self._handle.seek(offset, whence)
        start, state, chunk = self._last
        if target == self._position:
            pass
        elif state is not None and start <= target <= start + len(chunk):
            self._state = state.copy()
            self._state.update(chunk[: target - start])
        else:
            self._state = None
        self._position = target
        return target

    def sha256(self) -> str | None:
        """The hash of everything read so far; None if a seek made it unknowable."""
        return None if self._state is None else self._state.hexdigest()


def _upload_file(store: JobsStore, content: LocalContent, item: FileDigest) -> int:
    key = cache_key(content.sha256, item.relative)
    path = content.path_of(item)
    changed = DataError(
        f"{path} changed while it was being uploaded; its content no longer matches the "
        "hash taken at submission. Submit again once it is stable."
    )
    with open(path, "rb") as handle:
        reader = HashingReader(handle)
        try:
            store.put_stream(key, reader, item.size)  # type: ignore[arg-type]
        except Exception:
            if os.fstat(handle.fileno()).st_size != item.size:
                store.delete_prefix(key)
                raise changed from None
            raise
    if reader.tell() != item.size or reader.sha256() != item.sha256:
        store.delete_prefix(key)
        raise changed
    return item.size


def _files_to_upload(store: JobsStore, content: LocalContent) -> list[FileDigest]:
    """The files the cache lacks: all without a marker, else those missing or of the wrong size."""
    marker = marker_key(content.sha256)
    if not store.exists(marker):
        return list(content.files)
    try:
        listed = decode_marker(store.get_bytes(marker), content.sha256)
    except DataIntegrityError as exc:
        logger.warning("%s Uploading the data again.", exc)
        return list(content.files)
    stored = dict(store.list(cache_key(content.sha256) + "/"))
    missing = [f for f in listed if stored.get(cache_key(content.sha256, f.relative)) != f.size]
    if missing:
        logger.warning(
            "The data cache for %s (%s) lacks %d of its %d files or has them at the wrong "
            "size; uploading those again.",
            content.root,
            content.sha256[:12],
            len(missing),
            len(listed),
        )
    return missing


def upload_local(store: JobsStore, content: LocalContent, workers: int = 4) -> int:
    """Make `data-cache/{sha256}/` a complete copy of `content`; returns bytes transferred.

    A file whose bytes no longer match its hash is refused (and its partial
    upload removed): nothing is ever stored under a hash it does not have.
    The marker goes last, so a marker always means a complete copy.
    """
    todo = _files_to_upload(store, content)
    if not todo:
        return 0
    marker = marker_key(content.sha256)
    store.delete_prefix(marker)
    largest_first = sorted(todo, key=lambda f: -f.size)
    transferred = sum(
        parallel_map(lambda f: _upload_file(store, content, f), largest_first, workers)
    )
    store.put_bytes(marker, encode_marker(content.sha256, content.is_dir, content.files))
    return transferred


class LocalDataHashes:
    """Content hashes of local data for one runner, recomputed only when a file changed.

    The key is the resolved path and, for every file, its size, mtime and inode.
    `hash_count` counts the hashes actually computed.
    """

    def __init__(self, workers: int = 4) -> None:
        self.workers = workers
        self.hash_count = 0
        self._entries: dict[tuple[Path, str], tuple[tuple[object, ...], LocalContent]] = {}
        self._locks: dict[object, threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, key: object) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())

    def content(self, path: Path) -> LocalContent:
        key = (path.resolve(), path.name)
        with self._lock(("hash", key)):
            files = scan(path)
            signature = (key[0], *((f.relative, *f.stat) for f in files))
            cached = self._entries.get(key)
            if cached is not None and cached[0] == signature:
                return cached[1]
            content = hash_local(path, self.workers, files)
            with self._guard:
                self._entries[key] = (signature, content)
                self.hash_count += 1
            logger.debug("Hashed %s: %d files, %d bytes", path, len(files), content.size)
            return content

    def ship(self, store: JobsStore, path: Path) -> tuple[LocalContent, int]:
        """Hash `path` (or reuse its hash) and make sure the data cache holds it."""
        content = self.content(path)
        with self._lock(("upload", store.root, content.sha256)):
            return content, upload_local(store, content, self.workers)


def gcs_size(uri: str, gcp_credentials: Any = None) -> tuple[int, bool]:
    """Total size of a `gs://` object or prefix, and whether it is a directory.

    Asked as `gcp_credentials` (a prefect-gcp `GcpCredentials` block), else the default.
    """
    from kinetic_prefect.common.gcs import GcsStore, split_gs_uri

    bucket, key = split_gs_uri(uri)
    store = GcsStore(f"gs://{bucket}", gcp_credentials=gcp_credentials)
    if uri.endswith("/") or not key:
        return sum(size for _, size in store.list(f"{key}/" if key else "")), True
    entries = [size for name, size in store.list(key) if name == key]
    if not entries:
        raise DataError(f"{uri} does not exist (for a directory, end the URI with '/').")
    return entries[0], False


def describe(item: Data, store: JobsStore, hashes: LocalDataHashes) -> tuple[DataRef, int]:
    """The `DataRef` a pod needs for `item` (uploading local data if the cache lacks it),
    and the bytes uploaded for it."""
    if item.is_gcs:
        # Asked as the jobs store acts: the orchestrator's one identity.
        size, is_dir = gcs_size(item.path_or_uri, store.gcp_credentials)
        return DataRef(item.path_or_uri, item.path_or_uri, is_dir, None, size, item.fuse), 0
    content, uploaded = hashes.ship(store, Path(item.path_or_uri))
    single = "" if content.is_dir else content.files[0].relative
    ref = DataRef(
        source=item.path_or_uri,
        uri=store.uri(cache_key(content.sha256, single)),
        is_dir=content.is_dir,
        sha256=content.sha256,
        size=content.size,
        fuse=item.fuse,
        marker=store.uri(marker_key(content.sha256)),
    )
    return ref, uploaded
