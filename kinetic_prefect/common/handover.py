"""Handing task runs to warm pods through the jobs store: the records and their names.

The runner cannot reach a pod over the network on GKE, so work is handed over
through the jobs store. A warm pod's warm dir (`common.layout.warm_dir`) receives
`assign-{n}.json`, its n-th batch of next tasks, run in order: for each, the task's
payload inline when it is small (else its URI) and the env that differs from the
pod's own. The runner writes a batch (up to `MAX_BATCH` tasks) while the pod still
runs its task when every pod of the spec is busy; to an idle pod it hands its next
task, with its share of the tasks waiting after it.

Every task a warm pod runs, its first one (which came in the Job's arguments) too,
is claimed before anything of it runs: the pod writes the task's
`warm-pod.json` (`Claim`, `common.layout.WARM_POD_JSON`) only if there is none, and
runs the task only if the claim names it. So the runner can take back a task no pod
has started, by writing the claim first: to give a busy pod's queued task, or the
task of a pod still waiting for a node, to an idle pod of its spec (which then claims
it over the runner's claim), or to cancel it without ending the pod. A pod that exits
has run exactly the handed tasks whose claim names it, and `kinetic-prefect jobs logs`
finds a task's warm pod the same way. A pod that has its next task as it reports a
task also names it in that task's final record (`FinalRecord.next_job`), which tells
the runner that the task started.
"""

from __future__ import annotations

import base64
import json
from typing import Literal

from pydantic import ConfigDict, Field

from kinetic_prefect.common.contract import Record, parse_json
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.errors import RecordError

# The lines around each task's part of a warm pod's log (`jobs logs JOB_ID` cuts there).
BEGIN_MARK = "kinetic-prefect pod: ===== begin job"
END_MARK = "kinetic-prefect pod: ===== end job"


def assignment_name(sequence: int) -> str:
    return f"assign-{sequence}.json"


def poll_seconds(uri: str) -> float:
    """How often to look at the store: a local path is cheap, a bucket costs a request."""
    return 0.5 if "://" in uri else 0.02


def reuse_margin(uri: str) -> float:
    """Idle time a pod must have left to be handed a task (it could idle out meanwhile)."""
    return max(1.0, 4 * poll_seconds(uri))


# A payload up to this size travels inside its assignment: no object of its own.
INLINE_PAYLOAD_BYTES = 64 * 1024
# The most tasks one assignment queues on a pod. Each assignment costs a write and the
# pod's reads; a pod idle at the end of a map takes from the longest queue instead of
# waiting for it (`runner.warm_policy`, rule 4).
MAX_BATCH = 32


class Assignment(Record):
    """The next task run for a warm pod: the pod's arguments and the task's own env.

    `payload_inline` is the payload itself (base64) when small, and `payload` then only
    names where a cold pod would have read it; `env` is what differs from the env the
    pod started with.
    """

    model_config = ConfigDict(frozen=True)

    kind: Literal["assignment"] = "assignment"
    version: int = 1
    job_id: str
    task_run_id: str
    job_dir: str
    payload: str
    payload_sha256: str
    context: str
    context_sha256: str
    env: dict[str, str] = Field(default_factory=dict)
    payload_inline: str = ""

    def payload_bytes(self) -> bytes | None:
        """The inline payload, or None when the pod reads it from `payload`."""
        return base64.b64decode(self.payload_inline) if self.payload_inline else None


def batch_to_json(batch: list[Assignment]) -> bytes:
    """An `assign-{n}.json`: the tasks the pod runs next, in order (a JSON list of records)."""
    return json.dumps([a.fields() for a in batch], sort_keys=True).encode()


def batch_from_json(data: bytes, source: str) -> list[Assignment]:
    """The tasks of an `assign-{n}.json` read from `source`; `RecordError` if it is not one."""
    items = parse_json(data, source, "an assignment batch")
    if not isinstance(items, list) or not items:
        raise RecordError(
            f"{source} is not an assignment batch: not a non-empty JSON list", source=source
        )
    return [Assignment.from_fields(item, f"{source}[{i}]") for i, item in enumerate(items)]


class Claim(Record):
    """A task's `warm-pod.json`: which warm pod runs the task, written once
    (`JobsStore.put_if_absent`) before anything of the task runs.

    A pod writes it as it takes the task. The runner writes it first to take back a
    task no pod has taken: for an idle pod (`pod` names it; that pod writes its own
    claim over it as it takes the task) or for none (`pod` empty: cancelled).
    """

    kind: Literal["warm-claim"] = "warm-claim"
    version: int = 1
    pod: str
    sequence: int  # the assignment it came in
    by_runner: bool = False


def claim(store: JobsStore, key: str, pod_id: str, sequence: int) -> bool:
    """Claim the task whose `warm-pod.json` is `key` for the pod `pod_id`, as that pod: True
    if it is the pod's now, False if the runner took it back for another pod or for none.
    Raises if the store cannot say."""
    mine = Claim(pod=pod_id, sequence=sequence)
    found = store.put_if_absent(key, mine.encode())
    if found is None:
        return True
    there = Claim.decode(found, store.uri(key))
    if there.pod != pod_id:
        return False
    if there.by_runner:  # kept for this pod by the runner: now it takes it
        store.put_bytes(key, mine.encode())
    return True


def take_back(
    store: JobsStore, key: str, for_pod: str, sequence: int, deadline: float | None = None
) -> Claim | None:
    """As the runner, keep the task whose `warm-pod.json` is `key` for the pod `for_pod`
    (for none: ""): None if it is kept so now, else the claim that is there (a pod's, or
    an earlier one of the runner's). Raises if the store cannot say within `deadline`."""
    kept = Claim(pod=for_pod, sequence=sequence, by_runner=True)
    found = store.put_if_absent(key, kept.encode(), deadline)
    if found is None:
        return None
    there = Claim.decode(found, store.uri(key))
    return None if there == kept else there


def claimant(store: JobsStore, key: str) -> str | None:
    """The pod that took the task whose `warm-pod.json` is `key`; None if no pod did (yet).
    Raises if the store cannot say."""
    try:
        there = Claim.decode(store.get_bytes(key), store.uri(key))
    except FileNotFoundError:
        return None
    return None if there.by_runner else there.pod


def task_section(log: str, job_id: str) -> str:
    """The part of a warm pod's log written while it ran job `job_id` ("" if none)."""
    lines = log.splitlines(keepends=True)
    begin = f"{BEGIN_MARK} {job_id} "
    end = f"{END_MARK} {job_id} "
    start = next((i for i, line in enumerate(lines) if line.startswith(begin)), None)
    if start is None:
        return ""
    stop = next((i for i in range(start, len(lines)) if lines[i].startswith(end)), len(lines) - 1)
    return "".join(lines[start : stop + 1])
