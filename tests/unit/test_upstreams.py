"""Which futures a submission waits on, and starting it once they are all done."""

from __future__ import annotations

import concurrent.futures
import uuid

import pytest
from prefect.futures import PrefectConcurrentFuture
from prefect.utilities.annotations import allow_failure, quote

from kinetic_prefect.runner.task_runner import WhenDone, upstream_futures


def _future(
    wrapped: concurrent.futures.Future[object] | None = None,
) -> PrefectConcurrentFuture[object]:
    return PrefectConcurrentFuture(uuid.uuid4(), wrapped or concurrent.futures.Future())


A, B, C = _future(), _future(), _future()


@pytest.mark.parametrize(
    ("parameters", "wait_for", "found"),
    [
        ({"x": 1}, None, []),
        ({"x": A}, None, [A]),
        ({"xs": [A, {"deep": (B,)}]}, None, [A, B]),
        ({"x": allow_failure(A)}, None, [A]),
        ({"x": quote(A)}, None, []),
        ({"x": 1}, [B, C], [B, C]),
        ({"x": A}, allow_failure(B), [A, B]),
        ({"x": A, "y": [A]}, [A], [A]),
    ],
    ids=["none", "one", "nested", "allow_failure", "quote", "wait_for", "both", "repeated"],
)
def test_a_submission_waits_on_the_futures_prefects_engine_would_resolve(
    parameters, wait_for, found
):
    assert upstream_futures(parameters, wait_for) == found


def test_a_parked_submission_starts_once_when_its_last_upstream_is_done():
    first: concurrent.futures.Future[object] = concurrent.futures.Future()
    second: concurrent.futures.Future[object] = concurrent.futures.Future()
    started: list[str] = []

    WhenDone([_future(first), _future(second)], lambda: started.append("started"))
    assert started == []
    first.set_result(None)
    assert started == []
    second.set_result(None)

    assert started == ["started"]


def test_a_submission_with_nothing_pending_starts_at_once():
    done: concurrent.futures.Future[object] = concurrent.futures.Future()
    done.set_result(None)
    started: list[str] = []

    WhenDone([_future(done)], lambda: started.append("started"))
    WhenDone([], lambda: started.append("started"))

    assert started == ["started", "started"]
