"""Warm placement as a pure function: given the runner's warm pods and the attempts
waiting for one, which pod takes which attempt, which attempts start pods of their own,
and which pods end.

`warm_pods.WarmPods` builds the views under its lock, asks `plan`, and carries the
plan out; the rules are the module docstring of `warm_pods`, in this order:

1. An idle pod of an attempt's spec takes it, unless it is about to idle out.
2. Else a new pod starts for it where its backend has room (an idle pod nobody
   wants ends to make room), unless pods of its spec are starting in a slow start
   or one of them waits for capacity.
3. Else it is queued on the busy pod of its spec that has run longest, once that
   pod has ended a task and has nothing queued, or fewer than half of `max_batch`
   queued while at least that many wait (so that it finds its next batch written
   before it runs out, however far the runner lags behind its reports; a trickle of
   attempts waits to go in one batch): the waiting attempts of the spec shared among
   its pods, up to `max_batch` to a pod at a time.
4. An idle pod of a spec nobody waits for takes the last queued task of the busy
   pod of its spec with the longest queue, if that pod has not claimed it; or the
   task of a pod of its spec that waits for a node (which then ends), so no task
   waits for a node while a pod of its spec idles on one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

# Pods of a spec that may be starting (no task ended yet) however few pods have run one.
RAMP = 4


@dataclass(frozen=True)
class PodView:
    """What the policy reads of one warm pod."""

    pod_id: str
    key: str
    backend: Hashable
    busy: bool = True  # it runs a task (or is starting with one)
    busy_since: float = 0.0
    idle_since: float | None = None
    # How long after `idle_since` it may still be handed a task: its idle time, less a
    # margin for the hand-over (it could idle out meanwhile).
    idle_window: float = 0.0
    queued: int = 0
    proven: bool = False  # it has ended a task: it runs
    leaving: bool = False  # retiring or ended: it takes nothing
    ended: bool = False
    capacity_wait: bool = False  # not yet running: the nodes of its kind are busy
    handover_failed: bool = False
    # Tasks another pod may take: queued ones the pod is not known to have claimed, or
    # its own while it waits for a node (unless it has claimed it).
    takeable: int = 0

    def usable_for(self, key: str, now: float) -> bool:
        """Idle, of this spec, and not about to idle out."""
        if self.busy or self.idle_since is None or self.leaving or self.key != key:
            return False
        return now - self.idle_since < self.idle_window


@dataclass(frozen=True)
class WaitingAttempt:
    job_id: str
    key: str
    backend: Hashable


@dataclass(frozen=True)
class Plan:
    hand: tuple[tuple[str, str], ...] = ()  # (pod id, job id): an idle pod takes it
    start: tuple[str, ...] = ()  # job ids that start a pod of their own
    queue: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (busy pod id, job ids)
    retire: tuple[str, ...] = ()  # pod ids that end
    # (idle pod id, busy pod id): the idle pod takes the last queued task of the busy one,
    # or its own task if it waits for a node
    take: tuple[tuple[str, str], ...] = ()


def has_room(pods: Iterable[PodView], backend: Hashable, limit: int | None) -> bool:
    """Whether another pod may start on `backend` (pods that are ending still count)."""
    return limit is None or sum(1 for p in pods if p.backend == backend and not p.ended) < limit


def retirable(pods: Iterable[PodView], backend: Hashable) -> PodView | None:
    """The idle pod on `backend` that has idled longest, to end for a pod that needs room."""
    idle = [p for p in pods if p.backend == backend and not p.busy and not p.leaving]
    return min(idle, key=lambda p: p.idle_since or 0.0) if idle else None


def plan(
    pods: Sequence[PodView],
    waiting: Sequence[WaitingAttempt],
    capacity: Mapping[Hashable, int | None],
    now: float,
    *,
    max_batch: int,
    ramp: int = RAMP,
) -> Plan:
    """The next placements (see the module docstring); `capacity`: pods a backend may
    run at once (None: no limit), keyed like `PodView.backend`."""
    live = {pod.pod_id: pod for pod in pods}
    left = list(waiting)
    hand: list[tuple[str, str]] = []
    start: list[str] = []
    queue: list[tuple[str, tuple[str, ...]]] = []
    retire: list[str] = []

    def update(pod: PodView, **changes: object) -> None:
        live[pod.pod_id] = dataclasses.replace(pod, **changes)  # type: ignore[arg-type]

    def may_grow(attempt: WaitingAttempt) -> bool:
        alike = [p for p in live.values() if p.key == attempt.key and not p.leaving]
        if any(p.capacity_wait for p in alike):
            return False
        if capacity.get(attempt.backend) is not None:
            return True  # the user said how many pods may run at once
        proven = sum(1 for p in alike if p.proven)
        return len(alike) - proven < max(ramp, proven)

    for attempt in list(left):
        idle = next((p for p in live.values() if p.usable_for(attempt.key, now)), None)
        if idle is not None:
            left.remove(attempt)
            update(idle, busy=True, idle_since=None, busy_since=now)
            hand.append((idle.pod_id, attempt.job_id))

    for attempt in list(left):
        if not may_grow(attempt):
            continue
        if not has_room(live.values(), attempt.backend, capacity.get(attempt.backend)):
            victim = retirable(live.values(), attempt.backend)
            if victim is None:
                continue  # wait for a pod of this backend to free up
            update(victim, leaving=True)
            retire.append(victim.pod_id)
        left.remove(attempt)
        live[attempt.job_id] = PodView(attempt.job_id, attempt.key, attempt.backend, True, now)
        start.append(attempt.job_id)

    half = -(-max_batch // 2)
    queued_now: set[str] = set()  # job ids queued by this plan
    for key in dict.fromkeys(a.key for a in left):
        alike = [a for a in left if a.key == key]
        pods_of_spec = sum(1 for p in live.values() if p.key == key and not p.ended)
        while alike:
            busy = [
                p
                for p in live.values()
                if p.key == key
                and p.busy
                and p.proven
                and (p.queued == 0 or (p.queued < half and len(alike) >= half))
                and p.pod_id not in {pod_id for pod_id, _ in queue}
                and not (p.leaving or p.capacity_wait or p.handover_failed)
            ]
            if not busy:
                break
            pod = min(busy, key=lambda p: p.busy_since)  # likely to end its task first
            share = alike[: min(max_batch, -(-len(alike) // max(pods_of_spec, 1)))]
            alike = alike[len(share) :]
            queued_now.update(a.job_id for a in share)
            update(pod, queued=pod.queued + len(share), takeable=pod.takeable + len(share))
            queue.append((pod.pod_id, tuple(a.job_id for a in share)))
    left = [a for a in left if a.job_id not in queued_now]

    wanted = {a.key for a in left}
    take: list[tuple[str, str]] = []
    for pod in list(live.values()):
        if pod.key in wanted or not pod.usable_for(pod.key, now):
            continue
        donors = [p for p in live.values() if p.key == pod.key and p.takeable and not p.leaving]
        if not donors:
            continue
        # The longest queue; of equal ones, the one behind the task that has run longest.
        donor = max(donors, key=lambda p: (p.takeable, -p.busy_since))
        if donor.capacity_wait:  # its own task: it is not needed any more
            update(donor, takeable=0, leaving=True)
        else:
            update(donor, takeable=donor.takeable - 1, queued=donor.queued - 1)
        update(pod, busy=True, idle_since=None, busy_since=now)
        take.append((pod.pod_id, donor.pod_id))

    return Plan(tuple(hand), tuple(start), tuple(queue), tuple(retire), tuple(take))
