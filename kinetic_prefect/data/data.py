"""`Data`: hand a local path or a `gs://` location to a task; it arrives as a plain path.

Orchestrator side (`data_upload`), local data is hashed by content and uploaded
once to `data-cache/{sha256}/`, with `data-markers/{sha256}` (every file's size
and sha256, see `data_marker`) written last. `gs://` data is passed through.
Pod side (here), every `Data` becomes a `str` path: downloaded into scratch
space, or, with `fuse=True`, a read-only GCS FUSE mount. Downloaded local data
is verified file by file against the marker, and the marker against the hash
the orchestrator sent, before the task sees it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from kinetic_prefect.common.env import MOUNT_ROOT_ENV
from kinetic_prefect.data.marker import (
    DataError,
    DataIntegrityError,
    FileDigest,
    combined_digest,
    decode_marker,
    file_sha256,
    parallel_map,
)

__all__ = ["Data", "DataError", "DataIntegrityError", "DataRef"]

DEFAULT_MOUNT_ROOT = "/mnt/kinetic-data"


class Data:
    """A local file or directory, or a `gs://` prefix or object, for a task parameter.

    In the task it arrives as a plain `str` path with the same content.

    Args:
        path_or_uri: a local file or directory (must exist), `gs://bucket/prefix/`
            (a directory: note the trailing slash) or `gs://bucket/object` (one file).
        fuse: on GKE, mount the data read-only with GCS FUSE instead of downloading it.

    `gs://bucket/p/` means exactly the objects whose names start with `p/`, at
    their paths relative to `p/` (never a sibling such as `p-extra/`).

    Local data is uploaded once per content (a second submission of unchanged
    files uploads nothing) and, when downloaded, every file is checked against
    the sha256 taken at submission before the task runs; a mismatch fails the
    pod's `data` phase naming the file. With `fuse=True` nothing is checked:
    verifying a mount would mean reading all of it, which is what FUSE avoids.

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
    marker: str | None = None  # the data-cache marker of local data (its file list)

    def mounted_as(self, volume: str) -> DataRef:
        return replace(self, mount=volume)


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


# -- pod: turning references into paths ---------------------------------------------


def _destination(target: Path, relative: str) -> Path:
    destination = (target / relative).resolve()
    if not destination.is_relative_to(target.resolve()):
        raise DataError(f"Object {relative!r} would land outside the data directory; refused.")
    return destination


def _download_gcs(uri: str, is_dir: bool, target: Path, workers: int = 8) -> Path:
    """Download a `gs://` object, or exactly the objects under a `gs://…/prefix/`."""
    from kinetic_prefect.common.gcs import GcsStore, split_gs_uri

    bucket, key = split_gs_uri(uri)
    store = GcsStore(f"gs://{bucket}")
    if not is_dir:
        destination = target / PurePosixPath(key).name
        store.get_file(key, destination)
        return destination
    prefix = f"{key}/" if key else ""
    jobs = [
        (name, _destination(target, name[len(prefix) :]))
        for name, _ in store.list(prefix)
        if not name.endswith("/")
    ]
    parallel_map(lambda job: store.get_file(*job), jobs, workers)
    target.mkdir(parents=True, exist_ok=True)
    return target


def _download_verified(ref: DataRef, target: Path, workers: int = 8) -> Path:
    """Download local-origin data from the data cache, checking every file's sha256."""
    from kinetic_prefect.common.gcs import GcsStore
    from kinetic_prefect.common.storage import read_uri

    assert ref.sha256 and ref.marker
    resubmit = f"delete {ref.marker} so that the next submission uploads the data again, then rerun"
    try:
        listed = decode_marker(read_uri(ref.marker), ref.sha256)
    except DataIntegrityError as exc:
        raise DataIntegrityError(f"{ref.source}: {exc}", resubmit) from exc
    except Exception as exc:
        raise DataIntegrityError(
            f"{ref.source}: cannot read the data-cache marker {ref.marker} ({exc}).",
            "the data cache may have been cleaned up after submission; resubmit the task",
        ) from exc
    folder = ref.uri if ref.is_dir else ref.uri.rpartition("/")[0]
    store = GcsStore(folder)

    def fetch(expected: FileDigest) -> FileDigest:
        destination = _destination(target, expected.relative)
        store.get_file(expected.relative, destination)
        got = file_sha256(destination)
        if (got.size, got.sha256) != (expected.size, expected.sha256):
            raise DataIntegrityError(
                f"{expected.relative} of {ref.source} does not match what was submitted: "
                f"{store.uri(expected.relative)} has sha256 {got.sha256} ({got.size} bytes), "
                f"expected {expected.sha256} ({expected.size} bytes). The cached copy was "
                "changed after upload.",
                resubmit,
            )
        return FileDigest(expected.relative, got.size, got.sha256)

    verified = parallel_map(fetch, listed, workers)
    if combined_digest(ref.is_dir, verified) != ref.sha256:
        raise DataIntegrityError(
            f"The files downloaded for {ref.source} do not hash to {ref.sha256}.", resubmit
        )
    target.mkdir(parents=True, exist_ok=True)
    return target if ref.is_dir else target / listed[0].relative


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
    if ref.sha256:
        return str(_download_verified(ref, scratch / "data" / ref.sha256[:16]))
    name = hashlib.sha256(ref.uri.encode()).hexdigest()
    return str(_download_gcs(ref.uri, ref.is_dir, scratch / "data" / name[:16]))


def resolve_parameters(parameters: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """Replace every `DataRef` in the parameters by its local path (downloads in parallel);
    `parameters` itself when it holds none."""
    from prefect.utilities.collections import visit_collection

    refs: list[DataRef] = []
    visit_collection(
        parameters,
        visit_fn=lambda item: refs.append(item) if isinstance(item, DataRef) else None,
        return_data=False,
    )
    if not refs:
        return parameters
    unique = list(dict.fromkeys(refs))
    paths = dict(
        zip(unique, parallel_map(lambda r: resolve_ref(r, scratch), unique, 4), strict=True)
    )
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
