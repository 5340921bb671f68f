"""What a runner holds for all its task runs: backends, code archives, leases, hash caches, keys.

Created with the runner (no I/O until first used) and closed when the flow
leaves it: backends close (cancelling what still runs) and leases are released.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kinetic_prefect.backends import create_backend
from kinetic_prefect.backends.base import Backend
from kinetic_prefect.common.env import (
    FLOW_RUN_ID_ENV,
    LEASE_SINCE_ENV,
    LEASE_URI_ENV,
    ORPHAN_TIMEOUT_ENV,
)
from kinetic_prefect.common.layout import lease_key
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.data import upload as data_upload
from kinetic_prefect.launch.packaging import ArchiveLimits, CodeArchive, build_context_zip
from kinetic_prefect.launch.settings import LaunchSettings
from kinetic_prefect.runner import record_key
from kinetic_prefect.runner.lease import Lease
from kinetic_prefect.runner.warm_pods import WarmPods

if TYPE_CHECKING:
    from kinetic_prefect.runner.task_launch import TaskLaunch


class RunnerResources:
    """Shared by every task run of one runner; see the module docstring."""

    def __init__(
        self,
        cluster: Callable[[], Any],
        package_root: str | None,
        flow_run_over: Callable[[str], None] | None = None,
    ) -> None:
        """`flow_run_over(flow_run_id)` is called as a lease is marked ending, before any
        pod can read the mark (`runner.lease`)."""
        self._cluster = cluster
        self._flow_run_over = flow_run_over
        self.package_root = package_root
        self._lock = threading.Lock()
        self._backends: dict[tuple[str, str], Backend] = {}
        self._context_zips: dict[tuple[Path, tuple[str, ...], ArchiveLimits], CodeArchive] = {}
        self._archive_lock = threading.Lock()
        self._leases: dict[tuple[str, str], Lease] = {}
        self.data_hashes = data_upload.LocalDataHashes()
        self._master_key: str | None = None
        self.warm_pods = WarmPods()

    def backend_for(self, settings: LaunchSettings, jobs_root: str) -> Backend:
        key = (settings.backend, jobs_root)
        with self._lock:
            backend = self._backends.get(key)
            if backend is None:
                backend = create_backend(settings, jobs_root, self._cluster())
                self._backends[key] = backend
            return backend

    def context_zip(
        self, root: Path, limits: ArchiveLimits, exclude: tuple[Path, ...] = ()
    ) -> CodeArchive:
        """The code archive of `root`, built once per runner (`PayloadError` past `limits`)."""
        # Local Data travels through the data cache, never inside the code archive.
        excludes = tuple(
            sorted(
                p.resolve().relative_to(root).as_posix()
                for p in exclude
                if p.resolve().is_relative_to(root)
            )
        )
        key = (root, excludes, limits)
        with self._archive_lock:  # one build per archive, however many launches arrive
            cached = self._context_zips.get(key)
            if cached is None:
                cached = build_context_zip(root, excludes, limits)
                self._context_zips[key] = cached
        return cached

    def signing_key(self, launch: TaskLaunch) -> str:
        """The key of the flow run's final-state records; reaches pods only through their Secret.

        Derived from the persistent master key (`kinetic_prefect.runner.record_key`), so a
        restarted flow process verifies the records of pods launched before it.
        """
        return self.flow_run_key(str(launch.task_run.flow_run_id or "no-flow-run"))

    def flow_run_key(self, flow_run_id: str) -> str:
        """The record key of any flow run (a cached result may come from another one)."""
        return record_key.flow_run_key(self._master(), flow_run_id)

    def node_cache_key(self) -> str:
        """The key of the markers pods leave on the environments they unpack on a node."""
        return record_key.node_cache_key(self._master())

    def _master(self) -> str:
        with self._lock:
            if self._master_key is None:
                self._master_key = record_key.master_key()
            return self._master_key

    def flow_run_ending(self, launch: TaskLaunch) -> str | None:
        """What the runner's lease says of the launch's flow run ("cancelled", ...), or None."""
        flow_run_id = str(launch.task_run.flow_run_id or "no-flow-run")
        with self._lock:
            leases = [lease for (_, run), lease in self._leases.items() if run == flow_run_id]
        return next((lease.ending for lease in leases if lease.ending), None)

    def lease_env(self, launch: TaskLaunch, store: JobsStore) -> dict[str, str]:
        """What a pod needs to tell whether its flow run still has an owner (renewing it)."""
        flow_run_id = str(launch.task_run.flow_run_id or "no-flow-run")
        timeout = launch.settings.orphan_timeout_seconds
        signing_key = self.signing_key(launch)
        with self._lock:
            lease = self._leases.get((store.uri(""), flow_run_id))
            if lease is None:
                owner = str(launch.task_run.flow_run_id) if launch.task_run.flow_run_id else None
                over = self._flow_run_over
                lease = Lease(
                    store,
                    lease_key(flow_run_id),
                    owner,
                    signing_key,
                    timeout,
                    look_seconds=launch.settings.intervals.flow_run_look_seconds,
                    on_ending=functools.partial(over, flow_run_id) if over and owner else None,
                )
                self._leases[(store.uri(""), flow_run_id)] = lease
        env = {
            LEASE_URI_ENV: lease.uri,
            LEASE_SINCE_ENV: repr(lease.renewed_at),
            ORPHAN_TIMEOUT_ENV: str(timeout),
        }
        if launch.task_run.flow_run_id:
            env[FLOW_RUN_ID_ENV] = flow_run_id
        return env

    def close(self) -> None:
        self.warm_pods.close()
        with self._archive_lock:  # their temporary files go with them
            self._context_zips.clear()
        with self._lock:
            backends = list(self._backends.values())
            self._backends.clear()
            leases = list(self._leases.values())
            self._leases.clear()
        for backend in backends:
            backend.close()
        for lease in leases:
            lease.release()

    @property
    def launch_count(self) -> int:
        with self._lock:
            return sum(b.launch_count for b in self._backends.values())
