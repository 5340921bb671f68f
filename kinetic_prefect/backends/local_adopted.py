"""Local pods another process launched, taken over by this one until they end.

A restarted flow process finds its predecessor's pods in `.kinetic/pods` and
waits for them here: not being their parent, it watches each through a pidfd,
which becomes readable when the process ends, and cannot learn its exit code
(the pod's own final record says how the task ended).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prefect.logging import get_logger

from kinetic_prefect.backends.base import FoundPod, OnExit, PodExit
from kinetic_prefect.local_pods import pods_labelled, read_pod, record_update
from kinetic_prefect.manifest import LABEL_FLOW_RUN_ID, LABEL_TASK_IDENTITY, LABEL_WARM

logger = get_logger("kinetic_prefect.backends.local")

UNKNOWN_EXIT = "it was launched by an earlier flow process, so its exit code is unknown"


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal a pod's process group, if it is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass
class AdoptedPod:
    """A pod another process launched, watched here until it ends (not this process's child)."""

    job_id: str
    pid: int
    pidfd: int
    on_exit: OnExit
    cancelled: bool = False
    kill_at: float | None = None


class AdoptedPods:
    """The adopted pods of one local backend: found, watched, cancelled, finished."""

    def __init__(
        self, workspace: Path, cancel_grace_seconds: float, logs: Callable[[str], str]
    ) -> None:
        self.workspace = workspace
        self.cancel_grace_seconds = cancel_grace_seconds
        self._logs = logs
        self._lock = threading.Lock()
        self._pods: dict[str, AdoptedPod] = {}

    def find(self, flow_run_id: str, launched_here: Callable[[str], bool]) -> list[FoundPod]:
        """The recorded pods of the flow run that were not launched or adopted here."""
        return [
            FoundPod(
                p.job_id,
                p.labels.get(LABEL_TASK_IDENTITY, ""),
                p.alive(),
                p.launched_at,
                warm=p.labels.get(LABEL_WARM) == "true",
            )
            for p in pods_labelled(self.workspace, LABEL_FLOW_RUN_ID, flow_run_id)
            if not launched_here(p.job_id) and p.job_id not in self
        ]

    def adopt(self, job_id: str, on_exit: OnExit) -> bool:
        """Watch the pod from now on; False (its end already reported) if it is gone."""
        record = read_pod(self.workspace, job_id)
        pidfd = None
        if record is not None and record.alive() and record.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(record.pid)
        if record is None or record.pid is None or pidfd is None:
            self.finish(AdoptedPod(job_id, 0, -1, on_exit))
            return False
        with self._lock:
            self._pods[job_id] = AdoptedPod(job_id, record.pid, pidfd, on_exit)
        return True

    def cancel(self, job_id: str) -> bool:
        """SIGTERM the pod now and SIGKILL it after the grace; False if it is not adopted."""
        with self._lock:
            pod = self._pods.get(job_id)
            if pod is None:
                return False
            if not pod.cancelled:
                pod.cancelled = True
                signal_group(pod.pid, signal.SIGTERM)
                pod.kill_at = time.monotonic() + self.cancel_grace_seconds
        return True

    def by_fd(self) -> dict[int, AdoptedPod]:
        with self._lock:
            return {pod.pidfd: pod for pod in self._pods.values()}

    def kill_moments(self) -> list[float]:
        with self._lock:
            return [pod.kill_at for pod in self._pods.values() if pod.kill_at is not None]

    def kill_overdue(self, now: float) -> None:
        """SIGKILL the cancelled pods whose grace is over."""
        with self._lock:
            for pod in self._pods.values():
                if pod.kill_at is not None and now >= pod.kill_at:
                    signal_group(pod.pid, signal.SIGKILL)
                    pod.kill_at = None

    def finish(self, pod: AdoptedPod) -> None:
        """The pod ended: record it and report its end as far as it is known."""
        with self._lock:
            self._pods.pop(pod.job_id, None)
        if pod.pidfd >= 0:
            os.close(pod.pidfd)
            # What the task left behind in the pod's process group goes with it.
            signal_group(pod.pid, signal.SIGKILL)
        record_update(self.workspace, pod.job_id, ended=True, ended_at=time.time())
        outcome = PodExit(
            job_id=pod.job_id,
            exit_code=None,
            reason=UNKNOWN_EXIT,
            cancelled=pod.cancelled,
            log_tail=self._logs(pod.job_id),
        )
        try:
            pod.on_exit(outcome)
        except Exception:
            logger.exception("Handling the exit of pod %s failed", pod.job_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._pods)

    def __contains__(self, job_id: object) -> bool:
        with self._lock:
            return job_id in self._pods

    def __len__(self) -> int:
        with self._lock:
            return len(self._pods)
