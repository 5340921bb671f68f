"""When a pod's watchdog decides that nobody owns the pod: `orphan_reason`, on a fake clock.

The lease is the runner's signed record (`kinetic_prefect.common.lease`); the pod
launched at `SINCE` with the lease its runner had written then. Each row gives the
leases the watchdog read, in order, with the clock at each look, and what the last
look decides. The end-to-end cases (tests/emulated/test_reattach.py,
tests/pod/test_watchdog.py) show the wiring: a killed flow process's pod ends with
this reason in its log.
"""

from __future__ import annotations

import pytest

from kinetic_prefect.common.lease import LeaseRecord, LeaseWatch
from kinetic_prefect.pod.watchdog import orphan_reason

KEY = "k" * 64
FLOW_RUN = "flow-run-1"
SINCE = 1_000.0
TIMEOUT = 4.0


def lease(
    renewed_at: float,
    *,
    ending: str | None = None,
    key: str = KEY,
    flow_run_id: str = FLOW_RUN,
    sequence: int = 1,
) -> bytes:
    record = LeaseRecord(
        flow_run_id=flow_run_id,
        renewed_at=renewed_at,
        sequence=sequence,
        writer="runner",
        ending=ending,
    )
    record.sign(key)
    return record.encode()


GONE = None

# (what the watchdog read at each look, as (lease bytes, clock)), the last look's verdict:
# None, or a fragment of the reason.
ROWS = [
    pytest.param([(lease(SINCE), SINCE + 3.9)], None, id="launch-lease-within-limit"),
    pytest.param([(lease(SINCE), SINCE + 4.1)], "last renewed 4s ago (limit 4s", id="not-renewed"),
    pytest.param([(GONE, SINCE + 4.1)], "the flow is gone", id="lease-deleted"),
    pytest.param([(b"{not json", SINCE + 4.1)], "1 unverified lease(s) ignored", id="garbage"),
    pytest.param(
        [(lease(SINCE + 3), SINCE + 3.5), (GONE, SINCE + 6.9)],
        None,
        id="renewed-then-unreadable-within-limit",
    ),
    pytest.param(
        [(lease(SINCE + 3), SINCE + 3.5), (GONE, SINCE + 7.1)],
        "last renewed 4s ago",
        id="renewed-then-unreadable-past-limit",
    ),
    pytest.param(
        [(lease(SINCE + 3, key="x" * 64), SINCE + 4.1)],
        "1 unverified lease(s) ignored): the flow is gone",
        id="forged-renewal-keeps-nothing-alive",
    ),
    pytest.param(
        [(lease(SINCE + 3, flow_run_id="other"), SINCE + 4.1)],
        "the flow is gone",
        id="another-flow-runs-lease",
    ),
    pytest.param(
        [(lease(SINCE + 1, ending="cancelled"), SINCE + 1.5)],
        "the flow run is cancelled",
        id="ending-at-once",
    ),
    pytest.param(
        [(lease(SINCE - 10, ending="ended"), SINCE + 1)],
        None,
        id="ending-older-than-launch-is-no-news",
    ),
    pytest.param(
        [(lease(SINCE + 2, ending="ended", key="x" * 64), SINCE + 2.5)],
        None,
        id="forged-ending-ends-nothing",
    ),
    pytest.param(
        [(lease(SINCE + 3, sequence=2), SINCE + 3.5), (lease(SINCE + 1), SINCE + 6)],
        None,
        id="replayed-older-lease-is-no-news",
    ),
]


@pytest.mark.parametrize(("looks", "verdict"), ROWS)
def test_orphan_reason(looks: list[tuple[bytes | None, float]], verdict: str | None) -> None:
    watch = LeaseWatch(KEY, FLOW_RUN, SINCE)
    reasons = [orphan_reason(watch, data, TIMEOUT, now) for data, now in looks]

    assert reasons[:-1] == [None] * (len(reasons) - 1)
    if verdict is None:
        assert reasons[-1] is None
    else:
        assert reasons[-1] is not None and verdict in reasons[-1], reasons[-1]
