"""Deciding, from what the watch last saw, when and how each gke job ended; and its deadlines.

Owns the rules. A pod in a terminal phase ends its job with the container's exit
code and the most telling reason (preempted, Evicted, OOMKilled, DeadlineExceeded).
When only one half of the story has arrived (the Job ended but its pod has not
reported, or the pod vanished before the Job said why), the job waits a bounded
time for the other stream, then ends with what is known. A pod that waits to start
reports why; past `pending_timeout_seconds` the job fails to start, and a Job that
gets no pod is probed for FailedCreate events meanwhile. A Job waiting in a Kueue
LocalQueue (suspended) is not pending: both clocks start when it is admitted.

A Job Kueue evicts after admission (preemption: it suspends the Job, whose pods the
Job controller deletes, and admits it again later) is not left to run again: the Job
is deleted (Foreground, so its pods go first, and asked again until it is seen gone)
and the job ends as preempted only once the Job is gone, so the runner's next attempt,
on the preemption budget, never runs beside this one's pod, and no suspended Job is
left behind. Whether its pod had started is not asked: the pod watch may not have
shown it yet when the Job's suspension arrives. A pod deleted while its Job goes on
waits for the Job's side of the story, which may name the eviction. A Job suspended
since its creation (never seen unsuspended) is waiting in a queue, not evicted.

A pod waiting for capacity that exists (nodes of its kind busy, or a node being added:
`status.Pending.waits_for_capacity`) is queued, not pending: that time does not count
toward `pending_timeout_seconds`, only toward `queue_timeout_seconds` (None: it waits as
long as it takes). When such a wait ends the pending clock starts again from zero: the
scheduler places the pod on the freed or returned nodes a moment later, and until then
its message still gives the old reason. An unschedulable pod that no node matches has
its own events read once it has been pending a probe interval, and again before it
fails: a TriggeredScaleUp there (a node pool growing from zero) makes it a capacity
wait. A pod the scheduler says is waiting for busy nodes costs no event reads. An
unschedulable pod that the scheduler turned away from nodes for a taint or a cordon has
the nodes of its kind read with its events: when some of them are not ready or cordoned
(a node pool being repaired or recreated, as GKE recreates a TPU slice's nodes together)
it waits for capacity too, and those nodes are read again every probe interval while it
waits for them.

Nothing here calls the API or runs callbacks: the backend passes in what to do
when a job ends, waits, fails to start or needs a probe.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Mapping

from kinetic_prefect.backends.gke.status import (
    Pending,
    pending,
    pod_outcome,
    pod_phase,
    pod_started,
    queue_name_of,
    suspended,
    true_condition,
)
from kinetic_prefect.backends.gke.watch import TrackedJob
from kinetic_prefect.common.intervals import Intervals

# (job, exit code, signal, reason)
Conclude = Callable[[TrackedJob, int | None, int | None, str], None]

EVICTED_REASON = (
    "Kueue evicted the Job while its pod ran (its Workload was preempted or its admission "
    "withdrawn); the Job was deleted so that it cannot run beside the next attempt"
)


def job_pending(job: TrackedJob) -> Pending | None:
    """Why the job's pod waits, from all that was read about it (`status.pending`)."""
    if job.pod is None:
        return None
    return pending(job.pod, job.manifest, job.pod_events, job.pod_nodes, job.nodes_refused)


class OutcomeTracker:
    """Applies the rules of the module docstring to the backend's tracked jobs.

    `conclude` ends a job; `report_pending(job, reason)` says why its pod waits;
    `fail_to_start(job, reason)` gives up on a pod past its pending timeout (reason
    None: the backend words it) or its queue timeout; `probe_events(job)` reads the
    events of a Job without a pod (FailedCreate) or of an unschedulable pod (autoscaler).
    """

    def __init__(
        self,
        jobs: Mapping[str, TrackedJob],
        *,
        cancel_grace_seconds: float,
        pending_timeout_seconds: float,
        queue_timeout_seconds: float | None = None,
        conclude: Conclude,
        report_pending: Callable[[TrackedJob, str], None],
        fail_to_start: Callable[[TrackedJob, str | None], None],
        probe_events: Callable[[TrackedJob], None],
        on_queued: Callable[[TrackedJob], None] | None = None,
        evict: Callable[[TrackedJob], None] | None = None,
        intervals: Intervals | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._jobs = jobs
        # Every deadline here is on this clock (tests drive a fake one through `advance`).
        self._clock = clock
        # The settle margins and event probes (docs/intervals.md).
        self.intervals = intervals or Intervals()
        self.cancel_grace_seconds = cancel_grace_seconds
        self.pending_timeout_seconds = pending_timeout_seconds
        self.queue_timeout_seconds = queue_timeout_seconds
        self._conclude = conclude
        self._report_pending = report_pending
        self._fail_to_start = fail_to_start
        self._probe_events = probe_events
        self._on_queued = on_queued
        self._evict = evict
        self._wake = asyncio.Event()

    def start_clock(self, job: TrackedJob) -> None:
        """The job's Job was just created: its pending timeout and event probes count from now."""
        job.created_at = self._clock()
        if suspended(job.manifest):
            self._queued(job)
        else:
            self._admitted(job, job.created_at)

    def _admitted(self, job: TrackedJob, now: float) -> None:
        job.admitted_at = job.pending_since = now
        job.next_probe = now + min(
            self.intervals.events_probe_seconds, self.pending_timeout_seconds / 2
        )
        self.poke()

    def _queued(self, job: TrackedJob) -> None:
        job.admitted_at = None
        if self._on_queued is not None:
            self._on_queued(job)

    def _note_admission(self, job: TrackedJob) -> None:
        """Kueue admitted the job's Job (unsuspended it), or put it back in its queue."""
        if job.job is None or job.job_gone:
            return
        if suspended(job.job):
            if job.evicted or job.cancelled:
                return
            if not job.seen_unsuspended:
                # Suspended since its creation (Kueue's webhook queues Jobs created
                # without a queue name where its configuration says so): it waits.
                if job.admitted_at is not None:
                    self._queued(job)
                return
            job.evicted = True
            # Its end is the Job's deletion; a settle begun on the pod's exit is void.
            job.settle_by = self._clock() + self.settle_seconds()
            self.poke()
            if self._evict is not None:
                self._evict(job)
        else:
            job.seen_unsuspended = True
            if job.admitted_at is not None:
                return
            self._admitted(job, self._clock())
            queue = queue_name_of(job.job)
            if queue:
                self._report_pending(job, f"admitted by Kueue from LocalQueue {queue}")

    def settle_after_cancel(self, job: TrackedJob) -> None:
        """The job's Job was deleted: give its pod the cancel grace to report how it ended."""
        job.settle_by = self._clock() + self.settle_seconds()
        self.evaluate(job)
        self.poke()

    def settle_seconds(self) -> float:
        """How long a live pod gets to report how it ended once its Job has."""
        return self.cancel_grace_seconds + self.intervals.settle_margin_seconds

    def evaluate(self, job: TrackedJob) -> None:
        """Decide from the job's last seen Job and pod whether it ended, waits, or is pending."""
        if job.done or job.failing_to_start:
            return
        self._note_admission(job)
        if job.evicted:
            if job.job_gone:
                self._conclude_as_known(job)
            return
        pod = job.pod
        ended = bool(
            job.job_gone
            or true_condition(job.job, "Complete")
            or true_condition(job.job, "Failed")
            or true_condition(job.job, "FailureTarget")
        )
        if pod_phase(pod) in {"Succeeded", "Failed"}:
            deleted = bool(((pod or {}).get("metadata") or {}).get("deletionTimestamp"))
            if deleted and not ended and not job.cancelled:
                # Deleted while its Job goes on (the Job suspended by an eviction, whose
                # event may come later on the other stream): the Job's side says why.
                if job.settle_by is None:
                    job.settle_by = self._clock() + self.intervals.pod_gone_settle_seconds
                    self.poke()
                return
            self._conclude(job, *pod_outcome(pod, job.job))
            return
        if pod is None and true_condition(job.job, "Complete"):
            self._conclude(job, 0, None, "")
            return
        if (job.pod_gone and (ended or job.cancelled)) or (pod is None and job.job_gone):
            self._conclude_as_known(job)
            return
        if job.pod_gone or ended:
            # The rest of the story is on its way on the other stream: the Job's reason
            # after its pod vanished (DeadlineExceeded), or the pod's final status after
            # its Job ended. Wait for it, but not forever.
            if job.settle_by is None:
                alive = pod is not None and not job.pod_gone
                wait = self.settle_seconds() if alive else self.intervals.pod_gone_settle_seconds
                job.settle_by = self._clock() + wait
                self.poke()
            return
        waiting = job_pending(job)
        self._track_capacity_wait(job, waiting is not None and waiting.waits_for_capacity)
        job.unschedulable = waiting is not None and waiting.unschedulable
        job.waits_for_nodes = waiting is not None and waiting.waits_for_nodes
        if waiting is not None and not pod_started(pod):
            reason = waiting.reason
            if waiting.waits_for_capacity:
                since = time.gmtime(job.capacity_since_wall)
                reason += time.strftime("; waiting since %H:%M:%S UTC", since)
            self._report_pending(job, reason)

    def _track_capacity_wait(self, job: TrackedJob, waits: bool) -> None:
        """Open or close the job's current wait for capacity. The wait stops the pending
        clock; its end starts it again from zero: the capacity the pod waited for (nodes back
        from repair, a node freed) takes the scheduler a moment to use, and its message says
        the old reason until then."""
        now = self._clock()
        if waits and job.capacity_since is None:
            job.capacity_since, job.capacity_since_wall = now, time.time()
            self.poke()
        elif not waits and job.capacity_since is not None:
            job.capacity_waited += now - job.capacity_since
            job.capacity_since = None
            job.pending_since = now
            self.poke()

    def capacity_waited(self, job: TrackedJob, now: float | None = None) -> float:
        """Seconds the job has waited for capacity, the current wait included."""
        ongoing = 0.0
        if job.capacity_since is not None:
            ongoing = (self._clock() if now is None else now) - job.capacity_since
        return job.capacity_waited + ongoing

    def _conclude_as_known(self, job: TrackedJob) -> None:
        """End a job from whatever was last seen of its pod and Job."""
        code, sig, reason = pod_outcome(job.pod, job.job)
        if job.evicted:
            code, sig, reason = None, None, EVICTED_REASON
        ended_itself = pod_phase(job.pod) in {"Succeeded", "Failed"}
        if not reason and not job.cancelled and not ended_itself:
            if job.pod_gone:
                reason = "the pod was deleted before it finished"
            elif job.pod is None and job.job_gone:
                reason = "the Job was deleted before its pod started"
            elif job.pod is None:
                reason = "the Job ended before its pod was seen"
            else:
                reason = "the pod did not report how it ended"
        self._conclude(job, code, sig, reason)

    # -- deadlines ------------------------------------------------------------------------

    def poke(self) -> None:
        """A deadline changed: recompute when the timers next need to run."""
        self._wake.set()

    def advance(self, now: float | None = None) -> float | None:
        """Act on every deadline due by `now` (the clock's time by default): fail a pod
        past its pending or queue timeout, probe events, conclude a job whose settle time
        is up. Returns when the next deadline falls, None when none is pending."""
        now = self._clock() if now is None else now
        moments = [self._tick(job, now) for job in list(self._jobs.values())]
        upcoming = [moment for moment in moments if moment is not None]
        return min(upcoming) if upcoming else None

    async def run(self) -> None:
        """Pending timeouts, event probes for pod-less Jobs, and settle deadlines."""
        while True:
            moment = self.advance()
            self._wake.clear()
            timeout = max(0.0, moment - self._clock()) if moment is not None else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _tick(self, job: TrackedJob, now: float) -> float | None:
        if job.done or not job.created:
            return None
        if job.evicted:
            # It ends when its Job is seen gone; until then its delete is asked again at
            # every settle time (a delete the API refused, a deletion the watch missed).
            if job.settle_by is not None and now >= job.settle_by:
                job.settle_by = now + self.settle_seconds()
                if self._evict is not None:
                    self._evict(job)
            return job.settle_by
        moments: list[float] = []
        if job.settle_by is not None:
            if now >= job.settle_by:
                self._conclude_as_known(job)
                return None
            moments.append(job.settle_by)
        if job.failing_to_start:
            return None
        admitted = job.admitted_at  # None: waiting in a Kueue queue, which is not pending
        if admitted is not None and not (job.cancelled or pod_started(job.pod) or job.job_gone):
            waited = self.capacity_waited(job, now)
            if job.capacity_since is not None:
                if job.waits_for_nodes:
                    # Nodes down for repair: read them again now and then, so that a pod
                    # they come back unfit for is not left waiting on them.
                    again = now + self.intervals.events_probe_interval_seconds
                    if job.next_probe == math.inf:
                        job.next_probe = again
                    elif now >= job.next_probe:
                        job.next_probe = again
                        self._probe_events(job)
                    moments.append(job.next_probe)
                if self.queue_timeout_seconds is None:
                    return min(moments) if moments else None
                deadline = job.capacity_since + self.queue_timeout_seconds - job.capacity_waited
                if now >= deadline:
                    self._fail_to_start(job, self._queue_timeout_reason(job, waited))
                    return None
                return min([*moments, deadline])
            deadline = job.pending_since + self.pending_timeout_seconds
            if now >= deadline:
                self._fail_to_start(job, None)
                return None
            moments.append(deadline)
            if job.pod is None or job.unschedulable:
                if now >= job.next_probe:
                    # A pod's events are read once here and once more before it fails.
                    again = (
                        self.intervals.events_probe_interval_seconds
                        if job.pod is None
                        else math.inf
                    )
                    job.next_probe = now + again
                    self._probe_events(job)
                if job.next_probe < math.inf:
                    moments.append(job.next_probe)
        return min(moments) if moments else None

    def _queue_timeout_reason(self, job: TrackedJob, waited: float) -> str:
        return (
            f"{job.pending_reason or 'waiting for capacity'} (waited {waited:.0f}s for "
            f"capacity, longer than queue_timeout_seconds={self.queue_timeout_seconds:g}; the "
            "Job was deleted). Raise queue_timeout_seconds, or leave it unset to wait as long "
            "as capacity takes to free; or free or add nodes of this kind"
        )
