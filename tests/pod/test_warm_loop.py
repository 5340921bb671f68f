"""A warm pod's looks for its next task while it idles."""

from __future__ import annotations

from pathlib import Path

import pytest

from kinetic_prefect.common.handover import (
    Assignment,
    assignment_name,
    batch_to_json,
    claim,
    claimant,
    take_back,
)
from kinetic_prefect.common.layout import WARM_POD_JSON
from kinetic_prefect.common.storage import LocalStore
from kinetic_prefect.pod import warm


class Clock:
    """The pod's clock: `sleep` moves it on; `when_due` runs once it reaches a moment."""

    def __init__(self) -> None:
        self.now = 0.0
        self.due: list[tuple[float, object]] = []

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for moment, action in list(self.due):
            if self.now >= moment:
                self.due.remove((moment, action))
                action()  # type: ignore[operator]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(warm.time, "monotonic", lambda: clock.now)
    monkeypatch.setattr(warm.time, "sleep", clock.sleep)
    return clock


def _counting_loop(warm_dir: Path, idle_seconds: float, monkeypatch: pytest.MonkeyPatch):
    loop = warm.WarmLoop(f"gs://bucket/{warm_dir.name}", idle_seconds)
    looks: list[float] = []

    def read(name: str) -> bytes | None:
        looks.append(warm.time.monotonic())
        path = warm_dir / name
        return path.read_bytes() if path.exists() else None

    monkeypatch.setattr(loop, "_read", read)
    return loop, looks


def test_an_idle_pod_looks_less_often_as_it_idles_and_once_more_at_its_idle_time(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    loop, looks = _counting_loop(tmp_path, 60.0, monkeypatch)

    assert loop.wait_for_assignment() is None

    # Every 0.5 s for a bucket at first; 120 looks in 60 s at that pace.
    assert looks[1] - looks[0] == pytest.approx(0.5, rel=0.2)
    assert len(looks) < 40
    assert max(b - a for a, b in zip(looks, looks[1:], strict=False)) <= 5.0 + 1e-9
    assert looks[-1] == pytest.approx(60.0)


def test_an_assignment_written_late_in_the_idle_time_is_found_before_the_pod_ends(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    loop, looks = _counting_loop(tmp_path, 60.0, monkeypatch)
    task = _task(tmp_path, "kp-job")
    name = assignment_name(1)
    clock.due.append((59.5, lambda: (tmp_path / name).write_bytes(batch_to_json([task]))))

    assert loop.wait_for_assignment() == task
    assert looks[-1] <= 60.0


def _task(tmp_path: Path, job_id: str) -> Assignment:
    return Assignment(
        job_id=job_id,
        task_run_id="run",
        job_dir=str(tmp_path / "kinetic" / job_id),
        payload="",
        payload_sha256="",
        context="",
        context_sha256="",
    )


def test_a_pod_claims_each_task_and_skips_one_the_runner_took_back(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    loop, _ = _counting_loop(tmp_path, 60.0, monkeypatch)
    loop.pod_id = "kp-pod"
    batch = [_task(tmp_path, f"kp-{i}") for i in range(3)]
    (tmp_path / assignment_name(1)).write_bytes(batch_to_json(batch))
    store = LocalStore(tmp_path / "kinetic")
    assert take_back(store, f"kp-1/{WARM_POD_JSON}", "kp-other", 1) is None

    assert loop.wait_for_assignment() == batch[0]
    assert loop.take_next() == "kp-2"  # kp-1 is kept for another pod
    assert claimant(store, f"kp-0/{WARM_POD_JSON}") == "kp-pod"
    assert claimant(store, f"kp-1/{WARM_POD_JSON}") is None
    assert claimant(store, f"kp-2/{WARM_POD_JSON}") == "kp-pod"
    # The pod the runner kept it for claims it over the runner's claim.
    assert claim(store, f"kp-1/{WARM_POD_JSON}", "kp-other", 1)
    assert claimant(store, f"kp-1/{WARM_POD_JSON}") == "kp-other"
    assert not claim(store, f"kp-1/{WARM_POD_JSON}", "kp-pod", 1)


def test_a_claim_has_one_winner_and_the_runner_cancels_only_what_no_pod_took(tmp_path: Path):
    store = LocalStore(tmp_path)
    assert claim(store, "a/warm-pod.json", "kp-1", 0)
    assert claim(store, "a/warm-pod.json", "kp-1", 0)  # its own claim, again
    assert not claim(store, "a/warm-pod.json", "kp-2", 0)
    found = take_back(store, "a/warm-pod.json", "", 0)
    assert found is not None and found.pod == "kp-1" and not found.by_runner
    assert take_back(store, "b/warm-pod.json", "", 0) is None
    assert take_back(store, "b/warm-pod.json", "", 0) is None  # the runner's own, again
    assert not claim(store, "b/warm-pod.json", "kp-1", 0)
    assert claimant(store, "b/warm-pod.json") is None


def test_a_pod_runs_its_first_task_only_once_it_has_claimed_it(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    from kinetic_prefect.pod.runner import EXIT_COMPLETED, PodRun

    jobs = tmp_path / "kinetic"
    store = LocalStore(jobs)
    ran: list[str] = []
    monkeypatch.setattr(warm, "run_task", lambda run, *_: ran.append(run.job_dir) or (0, None))

    def serve(job_id: str) -> int:
        loop = warm.WarmLoop(str(jobs / job_id / "warm"), 5.0)
        loop.pod_id = job_id
        return loop.serve(PodRun(str(jobs / job_id), "", "", "", ""))

    # Taken for another pod while this one waited for a node: it ends, having run nothing.
    assert take_back(store, f"kp-late/{WARM_POD_JSON}", "kp-idle", 1) is None
    assert serve("kp-late") == EXIT_COMPLETED
    assert ran == []
    assert claimant(store, f"kp-late/{WARM_POD_JSON}") is None  # still kept for kp-idle
    # Its own: claimed, then run (and the pod idles out after it).
    assert serve("kp-own") == EXIT_COMPLETED
    assert ran == [str(jobs / "kp-own")]
    assert claimant(store, f"kp-own/{WARM_POD_JSON}") == "kp-own"


def test_a_pod_looks_for_its_next_task_at_each_report_but_its_first(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    loop, looks = _counting_loop(tmp_path, 60.0, monkeypatch)
    loop.pod_id = "kp-pod"
    batch = [_task(tmp_path, "kp-1")]

    # Its first report: nothing can be written for it yet, so it does not look.
    assert loop.take_next() is None
    assert looks == []
    (tmp_path / assignment_name(1)).write_bytes(batch_to_json(batch))
    assert loop.wait_for_assignment() == batch[0]
    # Later reports look, and take what the runner queued meanwhile.
    (tmp_path / assignment_name(2)).write_bytes(batch_to_json([_task(tmp_path, "kp-2")]))
    looked = len(looks)
    assert loop.take_next() == "kp-2"
    assert len(looks) == looked + 1
