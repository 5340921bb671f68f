"""A flow run's lease: proof, renewed while the flow runs, that someone still owns its pods.

The runner that runs a flow run writes `leases/{flow_run_id}.json` in the jobs
store every `orphan_timeout_seconds / 4`, signed with the flow run's key
(`kinetic_prefect.common.lease`). The key names the flow run only, so a flow
process restarted for the same flow run (or a Prefect retry of it) renews the
very lease its predecessor's pods read, and those pods live on to be
reattached. Pods read it (`kinetic_prefect.pod.watchdog`): a lease older than
the timeout means the flow process is gone (killed, laptop asleep, CI runner
lost), and the pod ends itself instead of writing checkpoints nobody will collect.

The lease also tells pods that their flow run is over, so they never ask the
Prefect API themselves: the runner looks at its flow run's state (one request
per flow process every `min(timeout / 4, flow_run_look_seconds)` seconds, however many
pods it has)
and, once the flow run is cancelling or final, marks the lease `ending`; it marks
it `ending` too when it closes. Every pod that reads the marked lease ends.

Before it writes the mark, the lease calls `on_ending`: the runner cancels the flow
run's unfinished task runs then, so that none of them learns of the end from a pod
that ended itself (a dependent would see its upstream fail, and end NotReady), and a
task run waiting for a retry's delay launches no pod for a flow run that is over.
"""

from __future__ import annotations

import contextvars
import secrets
import threading
import time
from collections.abc import Callable

from prefect.logging import get_logger

from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.common.lease import LeaseRecord
from kinetic_prefect.common.storage import JobsStore

logger = get_logger("kinetic_prefect.runner.lease")

ENDING_CANCELLED = "cancelled"
ENDING_ENDED = "ended"


def flow_run_ending(flow_run_id: str) -> str | None:
    """`cancelled` or `ended` once the flow run is cancelling or final, else None."""
    from prefect import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run_id).state  # type: ignore[arg-type]
    if state is None:
        return None
    if state.is_cancelling() or state.is_cancelled():
        return ENDING_CANCELLED
    return ENDING_ENDED if state.is_final() else None


class Lease:
    """Renews one flow run's signed lease in the background until `release()`.

    `flow_run_id` None: a runner used outside a flow run, whose lease is shared with
    every other such runner; it is never marked ending and the flow run is not looked at.
    """

    def __init__(
        self,
        store: JobsStore,
        key: str,
        flow_run_id: str | None,
        signing_key: str,
        timeout_seconds: float,
        look_seconds: float = Intervals.flow_run_look_seconds,
        on_ending: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self._on_ending = on_ending
        self.key = key
        self.uri = store.uri(key)
        self._flow_run_id = flow_run_id
        self._signing_key = signing_key
        self._renew_every = max(timeout_seconds / 4, 0.5)
        # The most time between a cancel in the UI and the runner marking the lease.
        self._look_every = min(self._renew_every, look_seconds)
        self._writer = secrets.token_hex(8)
        self._sequence = 0
        self._ending: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.renewed_at = self._write()
        # The flow's context (settings, API client) for the flow run look-ups.
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="kinetic-lease", daemon=True
        )
        self._thread.start()

    @property
    def ending(self) -> str | None:
        return self._ending

    def _write(self) -> float:
        with self._lock:
            self._sequence += 1
            record = LeaseRecord(
                flow_run_id=self._flow_run_id or "no-flow-run",
                renewed_at=time.time(),
                sequence=self._sequence,
                writer=self._writer,
                ending=self._ending,
            )
            record.sign(self._signing_key)
            self.store.put_bytes(self.key, record.encode())
            return record.renewed_at

    def mark_ending(self, ending: str) -> None:
        """Tell every pod of the flow run that it is over (they end at their next look)."""
        with self._lock:
            if self._ending is not None or self._flow_run_id is None:
                return
            self._ending = ending
        logger.info("Flow run %s is %s: marking its lease %s", self._flow_run_id, ending, self.uri)
        if self._on_ending is not None:
            try:
                self._on_ending()
            except Exception:  # the mark still reaches the pods
                logger.exception("Could not end the task runs of flow run %s", self._flow_run_id)
        self.renewed_at = self._write()

    def _run(self) -> None:
        next_renewal = time.monotonic() + self._renew_every
        while not self._stop.wait(self._look_every if self._flow_run_id else self._renew_every):
            if self._flow_run_id and self._ending is None:
                self._look_at_flow_run(self._flow_run_id)
            if time.monotonic() < next_renewal:
                continue
            try:
                self.renewed_at = self._write()
                next_renewal = time.monotonic() + self._renew_every
            except Exception:
                logger.warning("Could not renew the lease %s", self.uri, exc_info=True)

    def _look_at_flow_run(self, flow_run_id: str) -> None:
        try:
            ending = flow_run_ending(flow_run_id)
        except Exception:
            # The API being unreachable ends no pod: the lease is renewed regardless.
            logger.debug("Could not read the state of flow run %s", flow_run_id, exc_info=True)
            return
        if ending is not None:
            try:
                self.mark_ending(ending)
            except Exception:
                logger.warning("Could not mark the lease %s ending", self.uri, exc_info=True)

    def release(self) -> None:
        """Stop renewing; a flow run's lease is left marked ending, a flowless one deleted."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            if self._flow_run_id:
                self.mark_ending(ENDING_ENDED)
            else:
                self.store.delete_prefix(self.key)
        except Exception:
            logger.warning("Could not mark the lease %s ending", self.uri, exc_info=True)
