"""The gke backend's deadlines on a fake clock: pending and queue timeouts, settle times, probes.

`OutcomeTracker` decides when a job fails to start, when a job whose two halves of the
story disagree ends with what is known, and when a pod's events are read. Each row
drives it through what the watch saw at given seconds and says what it did and when:
the timing claims the emulated-cluster cases make in their names, without a wall clock.
The scheduler's messages are kube-scheduler's FitError wording
(https://github.com/kubernetes/kubernetes/blob/master/pkg/scheduler/framework/types.go,
`FitError.Error`), with the preemption verdicts of Kubernetes 1.34.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kinetic_prefect.backends.gke.outcomes import OutcomeTracker
from kinetic_prefect.backends.gke.watch import TrackedJob
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.launch.slices import build_workload
from tests.support.kube_objects import gke_nodes, unschedulable_status
from tests.unit.test_manifest import _spec

PENDING = 10.0
GRACE = 10.0

# Four L4 nodes, each running a pod already: this one waits for one of them.
BUSY = (
    "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are "
    "available: 4 No preemption victims found for incoming pod."
)
# Three L4 nodes for a TPU pod: it can never be scheduled there.
NEVER = (
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. "
    "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)

# A TPU slice's four nodes turned it away for a taint (their unreachable one, or another
# kind's accelerator taint): whether it waits depends on those nodes, read with its events.
TAINTED = (
    "0/5 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 4 node(s) "
    "had untolerated taint(s). no new claims to deallocate, preemption: 0/5 nodes are "
    "available: 5 Preemption is not helpful for scheduling."
)


def _nodes(ready: str) -> list[dict[str, Any]]:
    """A tpu-v5e-16 slice's four GKE nodes, down (Ready Unknown, unreachable) or back."""
    nodes = gke_nodes("v5e-16", "tpu-v5e-16", 4)
    for node in nodes:
        if ready != "True":
            node.lose_contact()
    return [node.as_object() for node in nodes]


def _unschedulable(message: str) -> dict[str, Any]:
    return {"metadata": {"name": "kp-train-x7k2p"}, "status": unschedulable_status(message)}


def _running() -> dict[str, Any]:
    return {
        "metadata": {"name": "kp-train-x7k2p"},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {"name": "task", "ready": True, "state": {"running": {}}, "restartCount": 0}
            ],
        },
    }


def _job_with(condition: str, reason: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "kp-train"},
        "status": {"conditions": [{"type": condition, "status": "True", "reason": reason}]},
    }


# Kueue stops an evicted Job by suspending it (its job reconciler's eviction step).
SUSPENDED = {"metadata": {"name": "kp-train"}, "spec": {"suspend": True}}
ADMITTED = {"metadata": {"name": "kp-train"}, "spec": {"suspend": False}}
FAILED_POD = {
    "metadata": {"name": "kp-train-x7k2p"},
    "status": {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "task", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}
        ],
    },
}
# The same, deleted by the Job controller (a graceful deletion: deletionTimestamp set).
DELETED_POD = {
    "metadata": {"name": "kp-train-x7k2p", "deletionTimestamp": "2026-11-27T10:00:00Z"},
    "status": {
        "phase": "Failed",
        "containerStatuses": [
            {"name": "task", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}
        ],
    },
}


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Seen:
    """What the tracker did, and at which second."""

    clock: Clock
    said: list[tuple[float, str]] = field(default_factory=list)

    def note(self, what: str) -> None:
        self.said.append((self.clock.now, what))

    def concluded(self, job: TrackedJob, code: Any, signal: Any, reason: str) -> None:
        job.done = True  # as the backend marks it
        self.note(f"concluded: {reason or code}")

    def failed_to_start(self, job: TrackedJob, reason: str | None) -> None:
        job.failing_to_start = True  # as the backend marks it
        self.note(f"failed to start: {reason or 'past the pending timeout'}")


def _tracker(
    accelerator: str = "l4", queue_timeout: float | None = None
) -> tuple[OutcomeTracker, TrackedJob, Clock, Seen]:
    clock = Clock()
    seen = Seen(clock)
    job = TrackedJob(
        "kp-train", "default", build_workload(_spec(accelerator)).job, print, None, created=True
    )
    tracker = OutcomeTracker(
        {job.job_id: job},
        cancel_grace_seconds=GRACE,
        pending_timeout_seconds=PENDING,
        queue_timeout_seconds=queue_timeout,
        conclude=seen.concluded,
        report_pending=lambda j, reason: None,
        fail_to_start=seen.failed_to_start,
        probe_events=lambda j: seen.note("probed events"),
        evict=lambda j: seen.note("deleted its Job"),
        intervals=Intervals(),
        clock=clock,
    )
    tracker.start_clock(job)
    return tracker, job, clock, seen


def _run(
    tracker: OutcomeTracker,
    job: TrackedJob,
    clock: Clock,
    steps: list[tuple[float, dict[str, Any]]],
    until: float,
) -> None:
    """At each (second, changes) the watch sees `changes`; deadlines fall in between."""
    for at, changes in [*steps, (until, {})]:
        while (moment := tracker.advance(clock.now)) is not None and moment <= at:
            clock.now = max(clock.now, moment)
        clock.now = at
        for name, value in changes.items():
            setattr(job, name, value)
        if changes:
            tracker.evaluate(job)
    tracker.advance(clock.now)


@pytest.mark.parametrize(
    ("accelerator", "queue_timeout", "steps", "until", "said"),
    [
        pytest.param(
            "tpu-v5e-4",
            None,
            [(1.0, {"pod": _unschedulable(NEVER)})],
            30.0,
            [(5.0, "probed events"), (10.0, "failed to start: past the pending timeout")],
            id="a pod no node can hold fails at its pending timeout, events read halfway",
        ),
        pytest.param(
            "l4",
            None,
            [(1.0, {"pod": _unschedulable(BUSY)}), (25.0, {"pod": _unschedulable(NEVER)})],
            60.0,
            [(25.0, "probed events"), (35.0, "failed to start: past the pending timeout")],
            id="time waiting for busy nodes does not count; its end starts the pending clock again",
        ),
        pytest.param(
            "l4",
            8.0,
            [(1.0, {"pod": _unschedulable(BUSY)})],
            60.0,
            [(9.0, "longer than queue_timeout_seconds=8")],
            id="waiting for busy nodes past the queue timeout fails it",
        ),
        pytest.param(
            "l4",
            None,
            [(1.0, {"pod": _unschedulable(BUSY)})],
            3600.0,
            [],
            id="without a queue timeout a pod waits for busy nodes as long as it takes",
        ),
        pytest.param(
            "tpu-v5e-16",
            None,
            [(1.0, {"pod": _unschedulable(TAINTED)}), (5.0, {"pod_nodes": _nodes("Unknown")})],
            60.0,
            [
                (5.0, "probed events"),
                (20.0, "probed events"),
                (35.0, "probed events"),
                (50.0, "probed events"),
            ],
            id="a slice whose nodes are not ready waits for them, reading them again meanwhile",
        ),
        pytest.param(
            "tpu-v5e-16",
            None,
            [
                (1.0, {"pod": _unschedulable(TAINTED)}),
                (5.0, {"pod_nodes": _nodes("Unknown")}),
                (35.0, {"pod_nodes": _nodes("True")}),
            ],
            100.0,
            [
                (5.0, "probed events"),
                (20.0, "probed events"),
                (35.0, "probed events"),
                (45.0, "failed to start: past the pending timeout"),
            ],
            id="nodes back and still turning it away fail a whole pending timeout after the wait",
        ),
        pytest.param(
            "tpu-v5e-16",
            None,
            [
                (1.0, {"pod": _unschedulable(TAINTED)}),
                (9.5, {"pod_nodes": _nodes("Unknown")}),
                (35.0, {"pod_nodes": _nodes("True")}),
                (37.0, {"pod": _running()}),
            ],
            100.0,
            [(5.0, "probed events"), (24.5, "probed events")],
            id="nodes back after the pod's pending timeout: the scheduler places it a moment later",
        ),
        pytest.param(
            "l4",
            None,
            [],
            40.0,
            [(5.0, "probed events"), (10.0, "failed to start: past the pending timeout")],
            id="a Job that gets no pod has its events probed, and fails at the pending timeout",
        ),
        pytest.param(
            "l4",
            None,
            [(1.0, {"pod": _running()}), (50.0, {"job": _job_with("Complete", "")})],
            200.0,
            [(50.0 + GRACE + 30.0, "concluded: the pod did not report how it ended")],
            id="a Job that ended gives its running pod the grace and the settle margin to report",
        ),
        pytest.param(
            "l4",
            None,
            [
                (1.0, {"pod": _running()}),
                (50.0, {"pod_gone": True}),
                (53.0, {"job": _job_with("Failed", "DeadlineExceeded")}),
            ],
            200.0,
            [(53.0, "concluded: DeadlineExceeded")],
            id="a pod gone without a status waits for its Job's reason",
        ),
        pytest.param(
            "l4",
            None,
            [(1.0, {"pod": _running()}), (50.0, {"pod_gone": True})],
            200.0,
            [(55.0, "concluded: the pod was deleted before it finished")],
            id="a pod gone and no Job reason within the pod-gone settle time",
        ),
        pytest.param(
            "l4",
            None,
            [
                (1.0, {"pod": _running(), "job": ADMITTED}),
                (50.0, {"job": SUSPENDED}),
                (52.0, {"pod": FAILED_POD}),
                (53.0, {"job_gone": True}),
            ],
            200.0,
            [(50.0, "deleted its Job"), (53.0, "concluded: Kueue evicted the Job")],
            id="a Job Kueue suspends while its pod runs is deleted and ends once it is gone",
        ),
        pytest.param(
            "l4",
            None,
            [(1.0, {"pod": _running(), "job": ADMITTED}), (50.0, {"job": SUSPENDED})],
            200.0,
            [(50.0 + 40.0 * n, "deleted its Job") for n in range(4)],
            id="an evicted Job not seen gone is deleted again at each settle time, never ended",
        ),
        pytest.param(
            "l4",
            None,
            [(1.0, {"job": ADMITTED}), (2.0, {"job": SUSPENDED}), (3.0, {"job_gone": True})],
            200.0,
            [(2.0, "deleted its Job"), (3.0, "concluded: Kueue evicted the Job")],
            id="a Job Kueue suspends before its pod is seen is deleted all the same",
        ),
        pytest.param(
            "l4",
            None,
            [(2.0, {"job": SUSPENDED})],
            200.0,
            [],
            id="a Job suspended since its creation (Kueue's webhook) waits in its queue",
        ),
        pytest.param(
            "l4",
            None,
            [
                (1.0, {"pod": _running(), "job": ADMITTED}),
                (50.0, {"pod": DELETED_POD}),
                (52.0, {"job": SUSPENDED}),
                (53.0, {"job_gone": True}),
            ],
            200.0,
            [(52.0, "deleted its Job"), (53.0, "concluded: Kueue evicted the Job")],
            id="a pod deleted while its Job goes on waits for the Job to say it was evicted",
        ),
        pytest.param(
            "l4",
            None,
            [(1.0, {"pod": _running(), "job": ADMITTED}), (50.0, {"pod": DELETED_POD})],
            200.0,
            [(55.0, "concluded: 143")],
            id="a pod deleted while its Job goes on ends as it exited once the settle is up",
        ),
    ],
)
def test_deadlines_on_a_fake_clock(accelerator, queue_timeout, steps, until, said):
    tracker, job, clock, seen = _tracker(accelerator, queue_timeout)

    _run(tracker, job, clock, steps, until)

    assert [at for at, _ in seen.said] == [at for at, _ in said]
    assert [part in what for (_, what), (_, part) in zip(seen.said, said, strict=True)] == [
        True
    ] * len(said)
