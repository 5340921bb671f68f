"""How the gke backend's jobs end: cancelling, deleting, giving up on a pod, reporting the exit.

`JobEnding` is the half of `KubernetesBackend` (see `backends/kubernetes.py`) that
ends jobs: a cancel deletes the Job and waits for its pod's last word, a pod past
its pending timeout has its Job deleted, and every job's end is reported exactly
once, with its log tail when the pod failed, to the runner's `on_exit` (off the
loop, through the backend's callback queue). Everything here runs on the
backend's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Coroutine, MutableMapping
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from prefect.logging import get_logger

from kinetic_prefect.backends.base import PodExit
from kinetic_prefect.backends.gke.client import (
    api_error_message,
    delete_job,
    job_events,
    list_nodes,
    pod_log,
    pods_of_job,
)
from kinetic_prefect.backends.gke.loop_thread import LoopThread
from kinetic_prefect.backends.gke.outcomes import OutcomeTracker, job_pending
from kinetic_prefect.backends.gke.secrets import JobSecrets
from kinetic_prefect.backends.gke.slice import delete_services
from kinetic_prefect.backends.gke.status import (
    failed_create_reason,
    infrastructure_took,
    lasting_failed_create,
    node_selector_of,
    reads_nodes,
)
from kinetic_prefect.backends.gke.watch import TrackedJob
from kinetic_prefect.launch.slices import host_index

logger = get_logger("kinetic_prefect.backends.gke.ending")

LOG_TAIL_LINES = 20


class JobEnding:
    """Ending jobs, for `KubernetesBackend`; the attributes below are the backend's."""

    pending_timeout_seconds: float
    _runtime: LoopThread
    _access: Any
    _core: Any
    _jobs: MutableMapping[str, TrackedJob]
    _queued: collections.deque[TrackedJob]
    _active: int
    _outcomes: OutcomeTracker
    _secrets: JobSecrets
    _dispatch: Callable[[TrackedJob, Callable[[Any], None], Any], None]
    _create_queued: Callable[[], Coroutine[Any, Any, None]]

    async def _cancel(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is None or job.done or job.cancelled:
            return
        job.cancelled = True
        if not job.created:
            self._conclude(job, None, None, "")
            return
        await self._delete_job(job)
        self._outcomes.settle_after_cancel(job)

    async def _delete_job(self, job: TrackedJob) -> None:
        try:
            existed = await delete_job(self._access, job.namespace, job.job_id)
        except ApiException as exc:
            logger.warning("Could not delete Job %s: %s", job.job_id, api_error_message(exc))
            return
        if not existed:
            job.job_gone = True

    def _evict(self, job: TrackedJob) -> None:
        """Kueue evicted the job's Job: delete it; the tracker ends the job once it is gone."""
        logger.info("Kueue evicted Job %s; deleting it before the task run goes on", job.job_id)

        async def delete() -> None:
            await self._delete_job(job)  # a 404 marks it gone
            self._outcomes.evaluate(job)

        self._runtime.spawn(delete())

    async def _delete_services(self, job: TrackedJob) -> None:
        try:
            await delete_services(self._core, job.namespace, job.extra_objects)
        except Exception:
            logger.warning("Could not delete the Service of %s", job.job_id, exc_info=True)

    async def _logs(self, job_id: str, tail: int | None) -> str:
        job = self._jobs.get(job_id)
        namespace = job.namespace if job else "default"
        pod: str | None = job.pod_name if job else None
        try:
            if pod is None:
                pods = await pods_of_job(self._core, namespace, job_id)
                if not pods:
                    return ""
                pod = min(pods, key=host_index)["metadata"]["name"]
            return await pod_log(self._core, namespace, pod, tail)
        except Exception as exc:
            logger.debug("No log for %s: %s", job_id, exc)
            return ""

    async def _drain(self, timeout: float) -> None:
        # Jobs still waiting in a Kueue queue first: deleting an admitted Job frees quota,
        # and Kueue would admit a queued one (its pod starting) before its own delete.
        for job in sorted(self._jobs.values(), key=lambda j: j.admitted_at is not None):
            if not job.done:
                await self._cancel(job.job_id)
        deadline = time.monotonic() + timeout
        # Exits arrive through the watch; a short poll keeps this independent of it.
        while any(not j.done for j in self._jobs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self._jobs.values()):
            if not job.done:
                self._conclude(job, None, None, "the pod did not end within the cancel grace")
        finishing = [t for t in self._runtime.tasks if t.get_name().startswith("kinetic-finish")]
        await asyncio.gather(*finishing, return_exceptions=True)
        await self._secrets.delete_all(self._core)

    def _conclude(
        self,
        job: TrackedJob,
        exit_code: int | None,
        signal: int | None,
        reason: str,
        start_failure: str | None = None,
    ) -> None:
        """Mark the job done now; fetch its log tail and report it without blocking the loop."""
        if job.done:
            return
        job.done = True
        job.ended_at = time.monotonic()
        if job.extra_objects:
            self._runtime.spawn(self._delete_services(job), name=f"kinetic-finish-svc-{job.job_id}")
        if job.counted:
            job.counted = False
            self._active -= 1
            if self._queued:
                self._runtime.spawn(self._create_queued())
        wants_log = (
            start_failure is None
            and not job.cancelled
            and exit_code != 0
            and job.pod_name is not None
            and not job.pod_gone
        )

        async def report() -> None:
            log_tail = ""
            if wants_log:
                log_tail = await self._logs(job.job_id, LOG_TAIL_LINES)
            outcome = PodExit(
                job_id=job.job_id,
                exit_code=exit_code,
                signal=signal,
                reason=reason,
                cancelled=job.cancelled and start_failure is None,
                log_tail=log_tail,
                start_failure=start_failure,
                preempted=not job.cancelled and (job.evicted or infrastructure_took(job.pod)),
            )
            self._dispatch(job, job.on_exit, outcome)

        self._runtime.spawn(report(), name=f"kinetic-finish-{job.job_id}")

    # -- what the outcome tracker asks for ---------------------------------------------

    def _report_pending(self, job: TrackedJob, reason: str) -> None:
        if reason != job.pending_reason:
            job.pending_reason = reason
            if job.on_pending is not None and not job.cancelled:
                self._dispatch(job, job.on_pending, reason)

    def _start_failing(self, job: TrackedJob, reason: str | None = None) -> None:
        """Give up on a job whose pod cannot start (or cannot be watched): delete its Job.
        A job that ended or is being cancelled meanwhile is left to that."""
        if job.done or job.cancelled:
            return
        job.failing_to_start = True
        self._runtime.spawn(self._fail_to_start(job, reason))

    async def _fail_to_start(self, job: TrackedJob, reason: str | None = None) -> None:
        if reason is None:
            if job.pod is None or job.unschedulable:
                await self._probe_events(job)
            waiting = job_pending(job)
            if waiting is not None and waiting.waits_for_capacity:
                # Its events say a node is on its way: it waits for capacity after all.
                job.failing_to_start = False
                self._outcomes.evaluate(job)
                return
            waited = time.monotonic() - (job.pending_since or job.created_at)
            reason = (job.pending_reason or "the pod did not start") + (
                f" (pending for {waited:.0f}s, longer than "
                f"pending_timeout_seconds={self.pending_timeout_seconds:g}; the Job was deleted)"
            )
        await self._delete_job(job)
        self._conclude(job, None, None, "", start_failure=reason)

    async def _probe_events(self, job: TrackedJob) -> None:
        """Look for FailedCreate events on a Job that has no pod (quota, admission, RBAC), or
        for the autoscaler's events on an unschedulable pod (a node on its way) and, when the
        scheduler turned nodes away for a taint or cordon, for the nodes of its kind (nodes
        down for repair)."""
        pod_name = job.pod_name
        try:
            if pod_name is not None:
                job.pod_events = await job_events(self._core, job.namespace, pod_name, "Pod")
                if reads_nodes(job.pod, job.manifest):
                    await self._read_nodes_of_kind(job)
            else:
                events = await job_events(self._core, job.namespace, job.job_id)
        except Exception as exc:
            logger.debug("Could not read the events of %s: %s", job.job_id, exc)
            return
        if pod_name is not None:
            self._outcomes.evaluate(job)
            return
        reason = failed_create_reason(events)
        if reason is None or job.done or job.failing_to_start:
            return
        lasting = lasting_failed_create(events)
        if lasting is not None:
            self._start_failing(job, lasting)
            return
        self._report_pending(job, reason)

    async def _read_nodes_of_kind(self, job: TrackedJob) -> None:
        """The nodes the job's node selector matches, into `job.pod_nodes`. Refused (the
        runner's identity may not list nodes), the job says so in its pending reason; any
        other failure keeps what was last read."""
        try:
            job.pod_nodes = await list_nodes(self._access, node_selector_of(job.manifest))
            job.nodes_refused = False
        except ApiException as exc:
            job.nodes_refused = exc.status == 403
            logger.debug("Could not list the nodes of %s: %s", job.job_id, exc)
        except Exception as exc:
            logger.debug("Could not list the nodes of %s: %s", job.job_id, exc)
