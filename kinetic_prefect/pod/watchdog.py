"""A pod that nobody owns any more ends itself.

The runner's lease (`kinetic_prefect.runner.lease`, format in
`kinetic_prefect.common.lease`) says so: a lease marked `ending` (the flow run
was cancelled or is over), or no verified renewal for longer than
`KINETIC_ORPHAN_TIMEOUT_SECONDS` (the flow process is gone). A lease whose
signature does not verify with the pod's key counts as no renewal. The pod
never asks the Prefect API: the lease is the only thing it reads, so a flow run
with 500 pods costs the API nothing here. The pod then gets a SIGTERM, so a task
that opted into `checkpoint_manager(save_on_preemption=True)` saves its state,
and a SIGKILL after `KINETIC_TERMINATION_GRACE_SECONDS`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from kinetic_prefect.common.env import (
    FLOW_RUN_ID_ENV,
    LEASE_SINCE_ENV,
    LEASE_URI_ENV,
    ORPHAN_TIMEOUT_ENV,
    SIGNING_KEY_ENV,
)
from kinetic_prefect.common.intervals import Intervals

if TYPE_CHECKING:
    from kinetic_prefect.common.lease import LeaseWatch


def _read_lease(uri: str) -> bytes | None:
    from kinetic_prefect.common import storage

    try:
        return storage.read_uri(uri)
    except Exception:
        return None  # gone or unreadable: no renewal


def orphan_reason(watch: LeaseWatch, lease: bytes | None, timeout: float, now: float) -> str | None:
    """Why this pod has no owner any more, after one more look at the lease as read at `now`.

    `lease` is the lease's bytes (None: gone or unreadable). A pure decision: the
    watchdog's thread reads the lease and the clock, tests give both.
    """
    watch.look(lease)
    if watch.ending:
        return f"the runner marked its lease: the flow run is {watch.ending}"
    age = now - watch.renewed_at
    if age > timeout:
        return (
            f"the runner's lease was last renewed {age:.0f}s ago (limit {timeout:.0f}s"
            f"{f'; {watch.ignored} unverified lease(s) ignored' if watch.ignored else ''}): "
            "the flow is gone"
        )
    return None


def _end_pod(reason: str) -> None:
    sys.stderr.write(f"kinetic-prefect pod: ending, nobody owns this pod: {reason}\n")
    sys.stderr.flush()
    grace = Intervals.from_environ(os.environ).emergency_window_seconds
    killer = threading.Timer(grace, _signal_self, args=(signal.SIGKILL,))
    killer.daemon = True
    killer.start()
    _signal_self(signal.SIGTERM)


def _signal_self(sig: signal.Signals) -> None:
    """Send `sig` to this process, as the kubelet would send it.

    On GKE the task is its container's PID 1, and the kernel drops a signal that PID 1
    sends itself when it has no handler for it (SIGKILL included). There the process
    exits with the status the signal would have given (128 + its number) instead.
    """
    if os.getpid() == 1 and (sig == signal.SIGKILL or signal.getsignal(sig) == signal.SIG_DFL):
        sys.stderr.flush()
        os._exit(128 + sig)
    os.kill(os.getpid(), sig)


def start_watchdog(look_seconds: float) -> None:
    """Watch for orphaning in the background (no-op when the runner gave no lease).

    `look_seconds` is the most time between two looks at the lease.
    """
    lease_uri = os.environ.get(LEASE_URI_ENV)
    if not lease_uri:
        return
    timeout = float(os.environ.get(ORPHAN_TIMEOUT_ENV, "300"))
    since = float(os.environ.get(LEASE_SINCE_ENV) or time.time())
    key = os.environ.get(SIGNING_KEY_ENV, "")
    flow_run_id = os.environ.get(FLOW_RUN_ID_ENV) or "no-flow-run"
    every = min(max(timeout / 4, 0.5), look_seconds)

    def run() -> None:
        watch: LeaseWatch | None = None
        while True:
            time.sleep(every)
            lease, now = _read_lease(lease_uri), time.time()
            if watch is None:
                # Imported once the first lease is in hand: its model costs pydantic's
                # import, which a bare pod (one that has not imported Prefect yet) would
                # otherwise pay before its first look.
                from kinetic_prefect.common.lease import LeaseWatch

                watch = LeaseWatch(key, flow_run_id, since, lease_uri)
            reason = orphan_reason(watch, lease, timeout, now)
            if reason:
                _end_pod(reason)
                return

    threading.Thread(target=run, name="kinetic-watchdog", daemon=True).start()
