"""A warm pod's looks for its next task while it idles."""

from __future__ import annotations

from pathlib import Path

import pytest

from kinetic_prefect.common.handover import Assignment, assignment_name, batch_to_json
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

    assert loop._wait_for(assignment_name(1)) is None

    # Every 0.5 s for a bucket at first; 120 looks in 60 s at that pace.
    assert looks[1] - looks[0] == pytest.approx(0.5, rel=0.2)
    assert len(looks) < 40
    assert max(b - a for a, b in zip(looks, looks[1:], strict=False)) <= 5.0 + 1e-9
    assert looks[-1] == pytest.approx(60.0)


def test_an_assignment_written_late_in_the_idle_time_is_found_before_the_pod_ends(
    tmp_path: Path, clock: Clock, monkeypatch: pytest.MonkeyPatch
):
    loop, looks = _counting_loop(tmp_path, 60.0, monkeypatch)
    task = Assignment(
        job_id="kp-job",
        task_run_id="run",
        job_dir="gs://b/kinetic/kp-job",
        payload="",
        payload_sha256="",
        context="",
        context_sha256="",
    )
    name = assignment_name(1)
    clock.due.append((59.5, lambda: (tmp_path / name).write_bytes(batch_to_json([task]))))

    assert loop._wait_for(name) == batch_to_json([task])
    assert looks[-1] <= 60.0
