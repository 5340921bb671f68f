"""The lease record: the runner's signed word that a flow run's pods still have an owner.

The runner writes `leases/{flow_run_id}.json` (`common.layout.lease_key`) and
renews it (`kinetic_prefect.runner.lease`); every pod's watchdog reads it
(`kinetic_prefect.pod.watchdog`). The record is signed with the flow run's key
(the one that signs final-state records), over every field: the flow run it
speaks for, when it was renewed, a sequence number and a random id of the
writing process, and `ending` once the runner knows the flow run is over
("cancelled", "ended"). A pod trusts a lease only if the signature verifies,
the flow run is its own, and it is newer than every lease the pod trusted
before and than the lease its runner had written when it launched the pod; anything
else counts as no renewal. So a forged lease neither keeps an orphaned pod alive
nor ends a live one, and an old lease replayed is no news.
"""

from __future__ import annotations

from typing import Literal

from kinetic_prefect.common.contract import SignedRecord
from kinetic_prefect.errors import RecordError


class LeaseRecord(SignedRecord):
    """One renewal of a flow run's lease."""

    kind: Literal["lease"] = "lease"
    version: int = 1
    flow_run_id: str
    renewed_at: float
    sequence: int
    writer: str
    ending: str | None = None


class LeaseWatch:
    """A pod's view of its lease: the newest renewal it could verify.

    `since` is the renewal time of the lease when the runner launched the pod: no
    older lease counts, so an "ending" lease left by an earlier process of the same
    flow run cannot end the pod.
    """

    def __init__(self, key: str, flow_run_id: str, since: float, source: str = "lease") -> None:
        self._key = key
        self._source = source
        self._flow_run_id = flow_run_id
        self.renewed_at = since
        self.ending: str | None = None
        self.ignored = 0

    def look(self, data: bytes | None) -> None:
        """Take in the lease as read now (None: unreadable or gone, i.e. no renewal)."""
        if data is None:
            return
        try:
            record = LeaseRecord.decode(data, self._source)
        except RecordError:
            self.ignored += 1
            return
        if (
            not record.signed_by(self._key)
            or record.flow_run_id != self._flow_run_id
            or record.renewed_at <= self.renewed_at
        ):
            if record.renewed_at != self.renewed_at:
                self.ignored += 1
            return
        self.renewed_at = record.renewed_at
        self.ending = record.ending
