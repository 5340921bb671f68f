"""The jobs store (`JobsStore`) over a local directory or a `gs://` prefix, and URI helpers.

Used on both sides: the orchestrator uploads payloads and reads final states;
the pod downloads payloads and writes final states. Keys are `/`-separated.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Protocol

_PARTIAL = ".kinetic-partial"  # a write in progress, not yet renamed into place


class JobsStore(Protocol):
    """What both stores offer; `key`s are relative to the store's root."""

    root: str
    bytes_uploaded: int
    # Whom the store acts as on GCS (a prefect-gcp `GcpCredentials` block); None: the default.
    gcp_credentials: Any

    def uri(self, key: str) -> str: ...
    def put_bytes(self, key: str, data: bytes) -> str: ...
    def put_stream(self, key: str, stream: BinaryIO, size: int) -> str: ...
    def put_if_absent(
        self, key: str, data: bytes, deadline: float | None = None
    ) -> bytes | None: ...
    def get_bytes(self, key: str) -> bytes: ...
    def get_file(self, key: str, destination: Path) -> None: ...
    def exists(self, key: str) -> bool: ...
    def list(self, prefix: str) -> list[tuple[str, int]]: ...
    def delete_prefix(self, prefix: str) -> int: ...


class LocalStore:
    """A directory on this machine; writes are atomic (temp file + rename)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = str(Path(root).absolute())
        self.bytes_uploaded = 0
        self.gcp_credentials = None

    def _path(self, key: str) -> Path:
        path = (Path(self.root) / key).resolve()
        if not path.is_relative_to(Path(self.root).resolve()):
            raise ValueError(f"Key {key!r} escapes the store root {self.root}.")
        return path

    def uri(self, key: str) -> str:
        return str(self._path(key))

    def put_bytes(self, key: str, data: bytes) -> str:
        return self.put_stream(key, io.BytesIO(data), len(data))

    def put_stream(self, key: str, stream: BinaryIO, size: int) -> str:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_PARTIAL)
        try:
            with os.fdopen(fd, "wb") as handle:
                shutil.copyfileobj(stream, handle, 1024 * 1024)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.bytes_uploaded += size
        return str(path)

    def put_if_absent(self, key: str, data: bytes, deadline: float | None = None) -> bytes | None:
        """Write the object only if there is none, in one step: None if this call wrote it,
        else the object that is there. A reader never sees it half written, and of two
        writers exactly one gets None. (`deadline`: for a remote store's retries.)"""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_PARTIAL)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.link(tmp, path)  # fails if `path` exists, unlike a rename
        except FileExistsError:
            return path.read_bytes()
        finally:
            Path(tmp).unlink(missing_ok=True)
        self.bytes_uploaded += len(data)
        return None

    def get_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def get_file(self, key: str, destination: Path) -> None:
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), destination)

    def list(self, prefix: str) -> list[tuple[str, int]]:
        base = self._path(prefix)
        if base.is_file():
            return [(prefix, base.stat().st_size)]
        root = Path(self.root).resolve()
        return sorted(
            (p.resolve().relative_to(root).as_posix(), p.stat().st_size)
            for p in base.rglob("*")
            if p.is_file() and not p.name.endswith(_PARTIAL)
        )

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def delete_prefix(self, prefix: str) -> int:
        path = self._path(prefix)
        if path.is_dir():
            count = sum(1 for p in path.rglob("*") if p.is_file())
            shutil.rmtree(path)
            return count
        if path.exists():
            path.unlink()
            return 1
        return 0


def open_store(root: str, gcp_credentials: Any = None) -> JobsStore:
    """The store for a root: `gs://bucket[/prefix]` or a local directory.

    `gcp_credentials` (a prefect-gcp `GcpCredentials` block) is whom a `gs://` store
    acts as; None: Application Default Credentials.
    """
    if root.startswith("gs://"):
        from kinetic_prefect.common.gcs import GcsStore

        return GcsStore(root, gcp_credentials=gcp_credentials)
    if "://" in root:
        raise ValueError(
            f"Unsupported storage location {root!r}: use a local path or gs://bucket/prefix."
        )
    return LocalStore(root)


def split_uri(uri: str) -> tuple[JobsStore, str]:
    """Split a full artifact URI into its store and key (the last path element)."""
    if uri.startswith("gs://"):
        head, _, key = uri.rpartition("/")
        return open_store(head), key
    path = Path(uri)
    return LocalStore(path.parent), path.name


def read_uri(uri: str) -> bytes:
    """Read one artifact by its full URI."""
    store, key = split_uri(uri)
    return store.get_bytes(key)


def write_uri(uri: str, data: bytes) -> str:
    """Write one artifact by its full URI."""
    store, key = split_uri(uri)
    return store.put_bytes(key, data)
