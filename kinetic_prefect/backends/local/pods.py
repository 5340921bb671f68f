"""What the local backend records of each pod, for tools that were not there when it ran.

A local pod has no API object, so the backend keeps one small JSON record per
pod next to its log, `{pods}/{job_id}.json` (a `LocalPodRecord`): the Job's labels, when it was
launched, the process id and start time once it runs, and its exit code and
end time once it has ended. It also names its watcher: the process that reaps
the pod and writes its last log line and its end. `kinetic-prefect jobs logs -f` and `jobs attach`
read them to find a task run's pod and to know when a log is complete; a
restarted flow process reads them to find its flow run's pods that still run.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prefect.logging import get_logger
from pydantic import Field

from kinetic_prefect.common.contract import Record
from kinetic_prefect.errors import RecordError

RECORD_SUFFIX = ".json"

logger = get_logger("kinetic_prefect.backends.local")


class LocalPodRecord(Record):
    """`{pods}/{job_id}.json`: what the local backend knows of one pod.

    `pid`, `pid_start` and `started_at` are added once the pod runs; `ended`,
    `exit_code` and `ended_at` once it has ended. `watcher` and `watcher_start`
    name the process that reaps it.
    """

    kind: Literal["local-pod"] = "local-pod"
    version: int = 1
    job_id: str
    labels: dict[str, str] = Field(default_factory=dict)
    launched_at: float
    watcher: int | None = None
    watcher_start: int | None = None
    pid: int | None = None
    pid_start: int | None = None
    started_at: float | None = None
    ended: bool = False
    exit_code: int | None = None
    ended_at: float | None = None


def local_pods_dir(jobs_root: str) -> Path:
    """Where the local backend keeps pod logs, scratch dirs and records for `jobs_root`."""
    if "://" in jobs_root:
        return Path.cwd() / ".kinetic" / "pods"
    return Path(jobs_root) / "pods"


def _write(path: Path, record: LocalPodRecord) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(record.encode())
    os.replace(temporary, path)


def _read(path: Path) -> LocalPodRecord | None:
    """The record at `path`; None when there is none. `RecordError` if it is not one."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return LocalPodRecord.decode(data, str(path))


def watched_here() -> dict[str, Any]:
    """Record fields naming this process as the one that records a pod's end."""
    return {"watcher": os.getpid(), "watcher_start": process_start_ticks(os.getpid())}


def record_launch(pods: Path, manifest: Mapping[str, Any]) -> None:
    """Record a pod the backend accepted (queued, not yet running), watched by this process."""
    meta = manifest["metadata"]
    record = LocalPodRecord(
        job_id=meta["name"],
        labels=dict(meta.get("labels") or {}),
        launched_at=time.time(),
        **watched_here(),
    )
    _write(pods / f"{meta['name']}{RECORD_SUFFIX}", record)


def record_update(pods: Path, job_id: str, **fields: Any) -> None:
    """Add `pid` (the pod runs) or `exit_code` and `ended` (it has ended) to a pod's record."""
    path = pods / f"{job_id}{RECORD_SUFFIX}"
    record = _read(path)
    if record is not None:
        _write(path, LocalPodRecord.from_fields({**record.fields(), **fields}, str(path)))


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (None: there is no such process)."""
    try:
        stat = Path("/proc", str(pid), "stat").read_text()
    except OSError:
        return None
    # Fields after the command name, which is in parentheses and may hold spaces.
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class LocalPod:
    """One local pod as its record and log show it."""

    job_id: str
    labels: dict[str, str]
    launched_at: float
    pid: int | None
    ended: bool
    exit_code: int | None
    log_path: Path
    # When the process started (`process_start_ticks`), to tell it from a later one with its pid.
    pid_start: int | None = None
    # The process that reaps the pod and records its end, and when it started.
    watcher: int | None = None
    watcher_start: int | None = None

    @property
    def started(self) -> bool:
        return self.pid is not None or self.ended

    def gone(self) -> bool:
        """Ended, or its process and its watcher are both no longer there.

        While the watcher lives, the pod is gone only once the watcher has
        recorded it so: it writes the log's last line before that.
        """
        if self.ended:
            return True
        if self.pid is None or self.alive():
            return False
        return self.watcher is None or not _runs(self.watcher, self.watcher_start)

    def alive(self) -> bool:
        """Its process runs (not ended, not a zombie left by a runner that died, pid not reused)."""
        if self.ended or self.pid is None:
            return False
        if self.pid_start is not None:
            return _runs(self.pid, self.pid_start)
        # A record written before start times were: the pod's env names its job.
        if not _runs(self.pid, None):
            return False
        with contextlib.suppress(OSError):
            environ = Path("/proc", str(self.pid), "environ").read_bytes().split(b"\0")
            return f"KINETIC_JOB_ID={self.job_id}".encode() in environ
        return True


def _runs(pid: int, start: int | None) -> bool:
    """Process `pid` runs (has not exited, even as a zombie) and started at `start` if given."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        # A pidfd is readable once the process has exited, even while it is a zombie.
        if select.select([pidfd], [], [], 0)[0]:
            return False
        # A reused pid belongs to another process.
        return start is None or process_start_ticks(pid) == start
    finally:
        os.close(pidfd)


def read_pod(pods: Path, job_id: str) -> LocalPod | None:
    """The record of pod `job_id`, or None when the backend never launched it here."""
    record = _read(pods / f"{job_id}{RECORD_SUFFIX}")
    if record is None:
        return None
    return LocalPod(
        job_id=job_id,
        labels=record.labels,
        launched_at=record.launched_at,
        pid=record.pid,
        ended=record.ended,
        exit_code=record.exit_code,
        log_path=pods / f"{job_id}.log",
        pid_start=record.pid_start,
        watcher=record.watcher,
        watcher_start=record.watcher_start,
    )


def pods_labelled(pods: Path, key: str, value: str) -> list[LocalPod]:
    """The recorded pods whose label `key` is `value`, newest first."""
    found = []
    for path in pods.glob(f"*{RECORD_SUFFIX}") if pods.is_dir() else []:
        try:
            pod = read_pod(pods, path.name.removesuffix(RECORD_SUFFIX))
        except RecordError as exc:
            logger.warning("Skipping a local pod record: %s", exc)
            continue
        if pod is not None and pod.labels.get(key) == value:
            found.append(pod)
    return sorted(found, key=lambda p: p.launched_at, reverse=True)
