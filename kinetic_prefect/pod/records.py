"""The final-state records a pod leaves in its job directory.

`final-state.json` is written last and is the pod's word on how it ended;
`final-state.pkl`, written before it, carries the Prefect state (and so the
result or the exception) when the task ran.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

FINAL_STATE_JSON = "final-state.json"
FINAL_STATE_PICKLE = "final-state.pkl"
PHASES = ("download", "verify", "extract", "unpickle", "data", "environment", "run", "report")

STATUS_FINISHED = "finished"
STATUS_PHASE_FAILED = "phase-failed"


@dataclass
class FinalRecord:
    """What a pod reports about itself, readable without unpickling anything."""

    status: str
    phase: str | None = None
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None
    state_type: str | None = None
    state_name: str | None = None
    versions: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> FinalRecord:
        raw: dict[str, Any] = json.loads(data)
        known = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        return cls(**known)
