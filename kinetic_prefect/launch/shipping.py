"""Turning the `Data` in a task's parameters into `DataRef`s a pod can resolve.

Local data is content-hashed and uploaded once to the jobs store's data cache;
`gs://` data is passed through; `fuse=True` data on GCS becomes a CSI volume.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.data import data
from kinetic_prefect.data import upload as data_upload
from kinetic_prefect.launch.manifest import DataVolume


@dataclass(frozen=True)
class ShippedData:
    """Parameters with every `Data` replaced by a `DataRef`, and what that took."""

    parameters: dict[str, Any]
    refs: tuple[data.DataRef, ...]
    volumes: tuple[DataVolume, ...]
    local_paths: tuple[Path, ...]
    bytes_uploaded: int

    def rows(self) -> list[dict[str, Any]]:
        """One row per `Data` for the task run's artifact."""
        return [
            {"data": r.source, "uri": r.uri, "sha256": r.sha256 or "", "bytes": r.size or 0}
            for r in self.refs
        ]


def local_data_paths(parameters: dict[str, Any]) -> tuple[Path, ...]:
    """The local paths of the `Data` in `parameters`, which stay out of the code archive."""
    return tuple(Path(item.path_or_uri) for item in data.find_data(parameters) if not item.is_gcs)


def ship_parameters(
    store: JobsStore, parameters: dict[str, Any], hashes: data_upload.LocalDataHashes
) -> ShippedData:
    """Upload local `Data` in `parameters` once and describe each `Data` for the pod.

    `hashes` is the runner's cache of local content hashes, so a map over N
    tasks hashes its data once.
    """
    refs: dict[data.Data, data.DataRef] = {}
    volumes: list[DataVolume] = []
    uploaded = 0

    def to_ref(item: data.Data) -> data.DataRef:
        nonlocal uploaded
        if item in refs:
            return refs[item]
        ref, sent = data_upload.describe(item, store, hashes)
        uploaded += sent
        if item.fuse and ref.uri.startswith("gs://"):
            mount = f"data-{len(volumes)}"
            volumes.append(DataVolume.for_uri(mount, ref.uri, ref.is_dir))
            ref = ref.mounted_as(mount)
        refs[item] = ref
        return ref

    shipped: dict[str, Any] = data.visit_data(parameters, to_ref)
    local_paths = local_data_paths(parameters)
    return ShippedData(shipped, tuple(refs.values()), tuple(volumes), local_paths, uploaded)
