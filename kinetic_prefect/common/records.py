"""The final-state records a pod leaves in its job directory.

`final-state.json` is written last and is the pod's word on how it ended;
`final-state.pkl`, written before it, carries the Prefect state (and so the
result or the exception) when the task ran.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kinetic_prefect.common import signing
from kinetic_prefect.common.layout import FINAL_STATE_JSON, FINAL_STATE_PICKLE  # noqa: F401

PHASES = ("download", "verify", "extract", "unpickle", "data", "environment", "run", "report")


STATUS_FINISHED = "finished"
STATUS_PHASE_FAILED = "phase-failed"
# The task run was already final when the pod was about to run it: the pod left it as it was.
STATUS_ALREADY_FINAL = "already-final"


@dataclass
class FinalRecord(signing.SignedRecord):
    """What a pod reports about itself, readable without unpickling anything.

    Signed with the flow run's key; through its digests the signature covers the
    pickle and the result record in result storage too.
    """

    status: str
    phase: str | None = None
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    state_type: str | None = None
    state_name: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # sha256 of final-state.pkl, so the signature covers the pickle too.
    pickle_sha256: str | None = None
    # The Prefect result record the pod's engine persisted to result storage (its storage
    # key and the sha256 of its bytes there), so the signature covers the result too.
    result_storage_key: str | None = None
    result_sha256: str | None = None
    signature: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> FinalRecord:
        raw: dict[str, Any] = json.loads(data)
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class ResultSeal(signing.SignedRecord):
    """A pod's signed word on a result record it persisted: where it is and its sha256.

    Kept in the jobs store (`layout.result_seal_key`) so that a later flow run whose
    cache policy hits the record can check it too; signed with the key of the flow
    run that wrote it, which the orchestrator derives from its master key.
    """

    flow_run_id: str
    task_run_id: str
    storage_block_id: str
    storage_key: str
    sha256: str
    signature: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> ResultSeal:
        raw: dict[str, Any] = json.loads(data)
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})
