"""The final-state records a pod leaves in its job directory.

`final-state.json` is written last and is the pod's word on how it ended; when
the task ran, it carries the pickled Prefect state too (and so the result's
reference or the exception), under the same signature: one object to write and
to read per attempt. A state over `INLINE_STATE_BYTES` (an unsaved result of a few MB
and up) is written beside it as `final-state.pkl` instead, and the record carries its
sha256 under the signature: inside the JSON, base64 would hold several copies of it in
memory at once.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Literal

from pydantic import Field

from kinetic_prefect.common.contract import SignedRecord
from kinetic_prefect.common.layout import FINAL_STATE_JSON  # noqa: F401

PHASES = ("download", "verify", "extract", "unpickle", "data", "environment", "run", "report")


# A result record up to this size travels in the final-state record too, so the
# orchestrator need not read it back from result storage.
INLINE_RESULT_BYTES = 64 * 1024
# A pickled state up to this size travels in the final-state record itself.
INLINE_STATE_BYTES = 1024 * 1024

STATUS_FINISHED = "finished"
STATUS_PHASE_FAILED = "phase-failed"
# The task run was already final when the pod was about to run it: the pod left it as it was.
STATUS_ALREADY_FINAL = "already-final"


class FinalRecord(SignedRecord):
    """What a pod reports about itself, readable without unpickling anything.

    Signed with the flow run's key; the signature covers the pickled state it
    carries and, through its digest, the result record in result storage.
    `pod/bootstrap.py` writes one too, for its environment phase.
    """

    kind: Literal["final-state"] = "final-state"
    # 2: `state_sha256` (a large state beside the record).
    version: int = 2
    status: str
    phase: str | None = None
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    state_type: str | None = None
    state_name: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)
    # The cloudpickled Prefect state (base64), when the task ran: never unpickled unsigned.
    state_pickle: str | None = None
    # Or, for a larger one, the sha256 of `layout.FINAL_STATE_PICKLE` beside the record.
    state_sha256: str | None = None
    # The Prefect result record the pod's engine persisted to result storage (its storage
    # key and the sha256 of its bytes there), so the signature covers the result too.
    result_storage_key: str | None = None
    result_sha256: str | None = None
    # That record's bytes (base64) when at most INLINE_RESULT_BYTES.
    result_record: str | None = None
    # A warm pod: the job of the next assignment, when it took it before this report
    # (it has claimed that task; see common.handover).
    next_job: str | None = None

    def carry_state(self, pickled: bytes) -> bool:
        """Carry the pickled state when small; else sign its digest. False: the caller
        writes it as `layout.FINAL_STATE_PICKLE` beside the record."""
        if len(pickled) <= INLINE_STATE_BYTES:
            self.state_pickle = base64.b64encode(pickled).decode()
            return True
        self.state_sha256 = hashlib.sha256(pickled).hexdigest()
        return False

    def carried_state(self) -> bytes | None:
        """The pickled state's bytes (check the signature before unpickling them)."""
        return base64.b64decode(self.state_pickle) if self.state_pickle is not None else None

    def carry_result(self, storage_key: str, sha256: str, data: bytes | None) -> None:
        """Sign the result record the pod persisted, and carry its bytes when small."""
        self.result_storage_key, self.result_sha256 = storage_key, sha256
        if data is not None and len(data) <= INLINE_RESULT_BYTES:
            self.result_record = base64.b64encode(data).decode()

    def carried_result(self) -> bytes | None:
        return base64.b64decode(self.result_record) if self.result_record is not None else None


# The custom metadata key of a GCS result record that carries its seal.
SEAL_METADATA_KEY = "kinetic-result-seal"


class ResultSeal(SignedRecord):
    """A pod's signed word on a result record it persisted: where it is and its sha256.

    Kept so that a later flow run whose cache policy hits the record can check it
    too: in the record's own custom metadata (`SEAL_METADATA_KEY`) when the pod wrote
    the record to GCS itself, else in the jobs store (`layout.result_seal_key`).
    Signed with the key of the flow run that wrote it, which the orchestrator derives
    from its master key.
    """

    kind: Literal["result-seal"] = "result-seal"
    version: int = 1
    flow_run_id: str
    task_run_id: str
    storage_block_id: str
    storage_key: str
    sha256: str
