"""Warm placement, as a table: the runner's pods and waiting attempts in, the plan out."""

from __future__ import annotations

import pytest

from kinetic_prefect.runner.warm_policy import (
    RAMP,
    Plan,
    PodView,
    WaitingAttempt,
    has_room,
    plan,
    retirable,
)

NOW = 1000.0
BATCH = 4


def busy(pod_id: str, key: str = "a", since: float = 900.0, **kw: object) -> PodView:
    return PodView(pod_id, key, "gke", busy=True, busy_since=since, **kw)  # type: ignore[arg-type]


def idle(pod_id: str, key: str = "a", since: float = 990.0, **kw: object) -> PodView:
    """Idle since `since`, with 30 s of its idle time left to be handed a task."""
    return PodView(
        pod_id,
        key,
        "gke",
        busy=False,
        idle_since=since,
        idle_window=40.0,
        proven=True,
        **kw,  # type: ignore[arg-type]
    )


def wait(*job_ids: str, key: str = "a") -> list[WaitingAttempt]:
    return [WaitingAttempt(job_id, key, "gke") for job_id in job_ids]


ROWS = {
    "an idle pod of the spec takes the attempt": (
        [idle("p1")],
        wait("j1"),
        None,
        Plan(hand=(("p1", "j1"),)),
    ),
    "an idle pod about to idle out takes nothing: a new pod starts": (
        [idle("p1", since=NOW - 41)],
        wait("j1"),
        None,
        Plan(start=("j1",)),
    ),
    "an idle pod of another spec takes nothing": (
        [idle("p1", key="b")],
        wait("j1"),
        None,
        Plan(start=("j1",)),
    ),
    "an idle pod that is retiring takes nothing": (
        [idle("p1", leaving=True)],
        wait("j1"),
        2,
        Plan(start=("j1",)),
    ),
    "each idle pod takes one attempt; the rest start pods": (
        [idle("p1"), idle("p2")],
        wait("j1", "j2", "j3"),
        None,
        Plan(hand=(("p1", "j1"), ("p2", "j2")), start=("j3",)),
    ),
    "no room: an idle pod of another spec ends for the new pod": (
        [busy("p1", proven=True), idle("p2", key="b")],
        wait("j1"),
        2,
        Plan(start=("j1",), retire=("p2",)),
    ),
    "no room: the pod idle longest ends first": (
        [idle("p1", key="b", since=995.0), idle("p2", key="c", since=980.0)],
        wait("j1"),
        2,
        Plan(start=("j1",), retire=("p2",)),
    ),
    "no room and nothing idle: the attempt waits": (
        [busy("p1"), busy("p2")],
        wait("j1"),
        2,
        Plan(),
    ),
    "a pod that is ending still takes its slot": (
        [busy("p1", leaving=True), busy("p2")],
        wait("j1"),
        2,
        Plan(),
    ),
    "an ended pod frees its slot": (
        [busy("p1", leaving=True, ended=True), busy("p2")],
        wait("j1"),
        2,
        Plan(start=("j1",)),
    ),
    "slow start: no more than RAMP pods of a spec starting at once": (
        [],
        wait(*(f"j{i}" for i in range(RAMP + 2))),
        None,
        Plan(start=tuple(f"j{i}" for i in range(RAMP))),
    ),
    "slow start: as many starting pods as pods that ran a task": (
        [busy(f"p{i}", proven=True) for i in range(6)],
        wait(*(f"j{i}" for i in range(8))),
        None,
        Plan(start=tuple(f"j{i}" for i in range(6)), queue=(("p0", ("j6",)), ("p1", ("j7",)))),
    ),
    "a limit set by the user: no slow start": (
        [],
        wait(*(f"j{i}" for i in range(RAMP + 2))),
        RAMP + 2,
        Plan(start=tuple(f"j{i}" for i in range(RAMP + 2))),
    ),
    "a pod of the spec waits for capacity: no new pod of the spec": (
        [busy("p1", capacity_wait=True)],
        wait("j1"),
        None,
        Plan(),
    ),
    "a pod of another spec waiting for capacity holds nothing back": (
        [busy("p1", key="b", capacity_wait=True)],
        wait("j1"),
        None,
        Plan(start=("j1",)),
    ),
    # Five waiting, two pods: the first gets its share of five (three), the second its
    # share of the two left (one); the last waits for a pod to free up.
    "queued on the busy pod that has run longest, shared among the spec's pods": (
        [busy("p1", since=950.0, proven=True), busy("p2", since=900.0, proven=True)],
        wait("j1", "j2", "j3", "j4", "j5"),
        2,
        Plan(queue=(("p2", ("j1", "j2", "j3")), ("p1", ("j4",)))),
    ),
    "a pod handed a task as it idles gets its share of the rest in the same plan": (
        [idle("p1")],
        wait(*(f"j{i}" for i in range(6))),
        1,
        Plan(hand=(("p1", "j0"),), queue=(("p1", ("j1", "j2", "j3", "j4")),)),
    ),
    "the rest shared among the busy pods, the one that has run longest first": (
        [idle("p1"), busy("p2", proven=True)],
        wait(*(f"j{i}" for i in range(7))),
        2,
        Plan(hand=(("p1", "j0"),), queue=(("p2", ("j1", "j2", "j3")), ("p1", ("j4", "j5")))),
    ),
    "at most a batch to one pod": (
        [busy("p1", proven=True)],
        wait(*(f"j{i}" for i in range(6))),
        1,
        Plan(queue=(("p1", tuple(f"j{i}" for i in range(BATCH))),)),
    ),
    "nothing queued on a pod that has not yet ended a task": (
        [busy("p1")],
        wait("j1"),
        1,
        Plan(),
    ),
    "more queued on a pod whose queue runs short, while half a batch waits": (
        [busy("p1", proven=True, queued=1, takeable=1)],
        wait(*(f"j{i}" for i in range(BATCH // 2))),
        1,
        Plan(queue=(("p1", tuple(f"j{i}" for i in range(BATCH // 2))),)),
    ),
    "nothing more queued on a pod with a queue while less than half a batch waits": (
        [busy("p1", proven=True, queued=1, takeable=1)],
        wait(*(f"j{i}" for i in range(BATCH // 2 - 1))),
        1,
        Plan(),
    ),
    "nothing more queued on a pod with half a batch queued": (
        [busy("p1", proven=True, queued=BATCH // 2)],
        wait(*(f"j{i}" for i in range(BATCH))),
        1,
        Plan(),
    ),
    "nothing queued on a pod whose hand-over failed": (
        [busy("p1", proven=True, handover_failed=True)],
        wait("j1"),
        1,
        Plan(),
    ),
    "an idle pod stays beside a pod waiting for a node that has claimed its task": (
        [idle("p1"), busy("p2", capacity_wait=True)],
        [],
        None,
        Plan(),
    ),
    "an idle pod whose spec is wanted stays (it takes the attempt)": (
        [idle("p1"), busy("p2", capacity_wait=True)],
        wait("j1"),
        None,
        Plan(hand=(("p1", "j1"),)),
    ),
    "an idle pod with a queued task to take stays, though a pod waits for capacity": (
        [
            idle("p1"),
            busy("p2", capacity_wait=True),
            busy("p3", proven=True, queued=1, takeable=1),
        ],
        [],
        None,
        Plan(take=(("p1", "p3"),)),
    ),
    "an idle pod takes the task of a pod of its spec waiting for a node, which ends": (
        [idle("p1"), idle("p3"), busy("p2", capacity_wait=True, takeable=1)],
        [],
        None,
        Plan(take=(("p1", "p2"),)),
    ),
    "an idle pod takes a queued task of a busy pod of its spec": (
        [idle("p1"), busy("p2", proven=True, queued=2, takeable=2)],
        [],
        None,
        Plan(take=(("p1", "p2"),)),
    ),
    "idle pods take from the longest queue first, one task each": (
        [
            idle("p1"),
            idle("p2"),
            idle("p3"),
            busy("b1", proven=True, queued=1, takeable=1),
            busy("b2", proven=True, queued=3, takeable=3),
        ],
        [],
        None,
        Plan(take=(("p1", "b2"), ("p2", "b2"), ("p3", "b1"))),
    ),
    "of equal queues, the one behind the task that has run longest": (
        [
            idle("p1"),
            busy("b1", since=950.0, proven=True, queued=2, takeable=2),
            busy("b2", since=900.0, proven=True, queued=2, takeable=2),
        ],
        [],
        None,
        Plan(take=(("p1", "b2"),)),
    ),
    "queued tasks the pod has claimed stay": (
        [idle("p1"), busy("p2", proven=True, queued=2)],
        [],
        None,
        Plan(),
    ),
    "an idle pod takes nothing of another spec": (
        [idle("p1", key="b"), busy("p2", proven=True, queued=2, takeable=2)],
        [],
        None,
        Plan(),
    ),
    "an idle pod about to idle out takes nothing": (
        [idle("p1", since=950.0), busy("p2", proven=True, queued=2, takeable=2)],
        [],
        None,
        Plan(),
    ),
}


@pytest.mark.parametrize("row", ROWS, ids=list(ROWS))
def test_placement(row: str) -> None:
    pods, waiting, limit, expected = ROWS[row]
    assert plan(pods, waiting, {"gke": limit}, NOW, max_batch=BATCH) == expected


def test_a_plan_never_places_an_attempt_twice_nor_overfills_a_backend() -> None:
    """Across a grid of pods and waiting attempts: each attempt in at most one place, and
    the live pods (less those ending) within the limit after the plan."""
    for limit in (1, 2, 3, None):
        for n_idle in range(3):
            for n_busy in range(3):
                for n_waiting in range(7):
                    pods = [idle(f"i{i}", key="ab"[i % 2]) for i in range(n_idle)] + [
                        busy(f"b{i}", proven=True) for i in range(n_busy)
                    ]
                    waiting = wait(*(f"j{i}" for i in range(n_waiting)))
                    got = plan(pods, waiting, {"gke": limit}, NOW, max_batch=BATCH)
                    placed = [j for _, j in got.hand] + list(got.start)
                    placed += [j for _, batch in got.queue for j in batch]
                    assert len(placed) == len(set(placed)), got
                    if limit is not None:
                        staying = len(pods) - len(got.retire) + len(got.start)
                        assert staying <= max(limit, len(pods)), got


def test_room_and_the_pod_to_retire_for_a_cold_pod() -> None:
    pods = [busy("p1"), idle("p2", since=980.0), idle("p3", since=970.0)]
    assert has_room(pods, "gke", None)
    assert has_room(pods, "gke", 4)
    assert not has_room(pods, "gke", 3)
    assert retirable(pods, "gke") == pods[2]
    assert retirable(pods[:1], "gke") is None
    assert retirable(pods, "local") is None


def test_a_plan_takes_only_what_a_pod_may_give_and_gives_each_idle_pod_one_thing() -> None:
    """Across a grid of idle pods, busy pods with queues, pods waiting for a node and
    waiting attempts: an idle pod is handed, or takes, at most one task; a pod gives no
    more than it may (a pod waiting for a node, its own task only); nothing is queued on
    a pod waiting for a node; and no attempt is placed twice."""
    for n_idle in range(3):
        for queued in range(4):
            for n_starving in range(3):
                for n_waiting in range(0, 2 * BATCH, 3):
                    pods = (
                        [idle(f"i{i}") for i in range(n_idle)]
                        + [busy("b0", proven=True, queued=queued, takeable=queued)]
                        + [busy(f"s{i}", capacity_wait=True, takeable=1) for i in range(n_starving)]
                    )
                    waiting = wait(*(f"j{i}" for i in range(n_waiting)))
                    got = plan(pods, waiting, {"gke": None}, NOW, max_batch=BATCH)
                    given = {p.pod_id: p.takeable for p in pods}
                    takers = [pod for pod, _ in got.take] + [pod for pod, _ in got.hand]
                    assert len(takers) == len(set(takers)) and set(takers) <= {
                        p.pod_id for p in pods if not p.busy
                    }, got
                    for donor in {d for _, d in got.take}:
                        assert sum(d == donor for _, d in got.take) <= given[donor], got
                    starving = {p.pod_id for p in pods if p.capacity_wait}
                    assert not starving & {pod for pod, _ in got.queue}, got
                    placed = [j for _, j in got.hand] + list(got.start)
                    placed += [j for _, batch in got.queue for j in batch]
                    assert len(placed) == len(set(placed)), got
