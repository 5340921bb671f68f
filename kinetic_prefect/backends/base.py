"""The contract between the task runner and a backend."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# Secret name → key → value, as a Kubernetes Secret would hold them.
Secrets = Mapping[str, Mapping[str, str]]


@dataclass(frozen=True)
class PodExit:
    """How a pod ended, as the backend saw it (the pod's own report is read separately)."""

    job_id: str
    exit_code: int | None
    signal: int | None = None
    reason: str = ""
    cancelled: bool = False
    log_tail: str = ""
    # Set when the pod never started (image pull error, unschedulable past the
    # pending timeout, quota): the task run fails with this reason, no retry.
    start_failure: str | None = None
    # Set when the infrastructure took the pod away (preemption, eviction, node loss,
    # a SIGTERM from outside on the local backend): retried on its own budget.
    preempted: bool = False
    # The pod's final record, when whoever saw the end read it already (a warm pod's
    # task ends by its record, not by the pod's exit): not read a second time.
    final_record: bytes | None = None

    def describe(self) -> str:
        if self.start_failure:
            return f"the pod could not start: {self.start_failure}"
        if self.cancelled:
            return "the pod was cancelled"
        if self.preempted:
            return f"the pod was preempted ({self.reason or 'terminated by the infrastructure'})"
        if self.signal is not None:
            why = f": {self.reason}" if self.reason else ""
            return f"the pod was killed by signal {self.signal}{why}"
        if self.reason:
            return f"the pod ended: {self.reason} (exit code {self.exit_code})"
        return f"the pod exited with code {self.exit_code}"


@dataclass(frozen=True)
class FoundPod:
    """A pod of a flow run that a backend found, whichever process launched it."""

    job_id: str
    # The `kinetic-prefect.io/task-identity` label ("" on pods launched without one).
    identity: str
    # Its end is still to come: pending, running, or ending (e.g. in its SIGTERM grace).
    live: bool
    launched_at: float
    # A warm pod: it may be running any task run of its flow run, whatever its identity.
    warm: bool = False


OnExit = Callable[[PodExit], None]
# Called with a human-readable reason while a pod waits to start (or None once it runs).
OnPending = Callable[[str], None]
# How the reason of a pod queued for capacity that exists begins (busy nodes, a node on
# its way), as opposed to one that is pending for another reason.
WAITING_FOR_CAPACITY = "waiting for capacity"


def pending_message(job_id: str, reason: str) -> str:
    """A waiting pod's message: "Pod X is waiting for capacity: …" or "Pod X is pending: …"."""
    if reason.startswith(WAITING_FOR_CAPACITY):
        return f"Pod {job_id} is {reason}"
    return f"Pod {job_id} is pending: {reason}"


class Backend(Protocol):
    """Launch, watch, cancel and read the logs of pods described by Job manifests."""

    launch_count: int

    def launch(
        self,
        manifest: dict[str, Any],
        on_exit: OnExit,
        secrets: Secrets,
        on_pending: OnPending | None = None,
        extra_objects: Sequence[dict[str, Any]] = (),
    ) -> None:
        """Start the Job; call `on_exit` exactly once when its pod has ended for good.

        `extra_objects` (a multi-host slice's headless Service) live as long as the Job;
        a backend without a cluster ignores them.
        """
        ...

    def find_pods(self, flow_run_id: str, namespace: str) -> list[FoundPod]:
        """The pods of flow run `flow_run_id` that other processes launched, newest first."""
        ...

    def adopt(
        self,
        job_id: str,
        namespace: str,
        on_exit: OnExit,
        on_pending: OnPending | None = None,
    ) -> None:
        """Watch a live pod another process launched; call `on_exit` once when it has ended.

        From then on it is this backend's, as if launched here: `cancel`, `close`
        and `max_parallel` treat it alike.
        """
        ...

    def cancel(self, job_id: str) -> None: ...

    def logs(self, job_id: str, tail: int | None = None) -> str: ...

    def forget(self, job_id: str) -> None:
        """Drop what the backend keeps about a job that has ended; a live job stays.

        For a long-lived caller (a worker) that has had the job's `on_exit`: what is
        kept per job would otherwise grow with every job launched.
        """
        ...

    def kept_jobs(self) -> list[str]:
        """The jobs the backend keeps anything about: live ones and ended ones not forgotten."""
        ...

    def close(self) -> None: ...


def run_to_end(
    backend: Backend, manifest: dict[str, Any], timeout_seconds: float
) -> PodExit | None:
    """Launch a Job with no secrets and wait for its pod's end; None (the Job cancelled) when
    it has not ended within `timeout_seconds`, pending included."""
    import threading

    ended = threading.Event()
    outcome: list[PodExit] = []

    def on_exit(exit: PodExit) -> None:
        outcome.append(exit)
        ended.set()

    backend.launch(manifest, on_exit=on_exit, secrets={})
    if not ended.wait(timeout_seconds):
        backend.cancel(str(manifest["metadata"]["name"]))
        return None
    return outcome[0]
