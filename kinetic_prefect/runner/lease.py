"""A flow run's lease: proof, renewed while the flow runs, that someone still owns its pods.

The runner that runs a flow run writes `leases/{flow_run_id}.json` in the jobs
store every `orphan_timeout_seconds / 4` and deletes it when it closes. The
key names the flow run only, so a flow process restarted for the same flow run
(or a Prefect retry of it) renews the very lease its predecessor's pods read,
and those pods live on to be reattached. Pods read it
(`kinetic_prefect.pod.watchdog`): a lease older than the timeout means the flow
process is gone (killed, laptop asleep, CI runner lost), and the pod ends itself
instead of writing checkpoints nobody will collect.
"""

from __future__ import annotations

import json
import threading
import time

from prefect.logging import get_logger

from kinetic_prefect.common.storage import JobsStore

logger = get_logger("kinetic_prefect.runner.lease")


class Lease:
    """Renews one lease object in the background until `release()`."""

    def __init__(self, store: JobsStore, key: str, timeout_seconds: float) -> None:
        self.store = store
        self.key = key
        self.uri = store.uri(key)
        self._every = max(timeout_seconds / 4, 0.5)
        self._stop = threading.Event()
        self._renew()
        self._thread = threading.Thread(target=self._run, name="kinetic-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        body = json.dumps({"renewed_at": time.time()}).encode()
        self.store.put_bytes(self.key, body)

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._renew()
            except Exception:
                logger.warning("Could not renew the lease %s", self.uri, exc_info=True)

    def release(self) -> None:
        """Stop renewing and delete the lease: any pod still running sees it gone."""
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self.store.delete_prefix(self.key)
        except Exception:
            logger.warning("Could not delete the lease %s", self.uri, exc_info=True)
