"""A pod that nobody owns any more ends itself.

Two signs of that: the runner's lease (`kinetic_prefect.runner.lease`) is older than
`KINETIC_ORPHAN_TIMEOUT_SECONDS` or gone, or the flow run is final or being
cancelled (a cancel in the UI reaches pods even when the flow process is gone).
The pod then gets a SIGTERM, so a task that opted into
`checkpoint_manager(save_on_preemption=True)` saves its state, and a SIGKILL
after `KINETIC_TERMINATION_GRACE_SECONDS`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from kinetic_prefect.common.env import (
    FLOW_RUN_ID_ENV,
    LEASE_URI_ENV,
    ORPHAN_TIMEOUT_ENV,
    emergency_window_seconds,
)


def _lease_age(uri: str, started: float) -> float:
    from kinetic_prefect.common import storage

    try:
        renewed = float(json.loads(storage.read_uri(uri))["renewed_at"])
    except Exception:
        renewed = started  # never seen: count from the pod's start
    return time.time() - renewed


def _flow_run_over(flow_run_id: str) -> str | None:
    try:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            state: Any = client.read_flow_run(flow_run_id).state  # type: ignore[arg-type]
    except Exception:
        return None
    if state is not None and (state.is_final() or state.name == "Cancelling"):
        return f"the flow run is {state.name}"
    return None


def orphan_reason(lease_uri: str, timeout: float, flow_run_id: str, started: float) -> str | None:
    """Why this pod has no owner any more, or None while it has one."""
    age = _lease_age(lease_uri, started)
    if age > timeout:
        return f"the runner's lease is {age:.0f}s old (limit {timeout:.0f}s): the flow is gone"
    return _flow_run_over(flow_run_id) if flow_run_id else None


def _end_pod(reason: str) -> None:
    sys.stderr.write(f"kinetic-prefect pod: ending, nobody owns this pod: {reason}\n")
    sys.stderr.flush()
    grace = emergency_window_seconds(os.environ)
    killer = threading.Timer(grace, os.kill, args=(os.getpid(), signal.SIGKILL))
    killer.daemon = True
    killer.start()
    os.kill(os.getpid(), signal.SIGTERM)


def start_watchdog() -> None:
    """Watch for orphaning in the background (no-op when the runner gave no lease)."""
    lease_uri = os.environ.get(LEASE_URI_ENV)
    if not lease_uri:
        return
    timeout = float(os.environ.get(ORPHAN_TIMEOUT_ENV, "300"))
    flow_run_id = os.environ.get(FLOW_RUN_ID_ENV, "")
    started = time.time()
    every = min(max(timeout / 4, 0.5), 15.0)

    def watch() -> None:
        while True:
            time.sleep(every)
            reason = orphan_reason(lease_uri, timeout, flow_run_id, started)
            if reason:
                _end_pod(reason)
                return

    threading.Thread(target=watch, name="kinetic-watchdog", daemon=True).start()
