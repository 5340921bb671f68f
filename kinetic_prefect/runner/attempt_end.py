"""How an attempt ended: the pod's own report, or what the backend saw of a silent pod.

The pod leaves `final-state.json` (always, when it could), with the Prefect
state in it when the task ran. A pod that left none was
killed, evicted, preempted or never started: its state is built here from the
backend's `PodExit`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import cloudpickle
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Crashed, Failed, State, get_state_exception

from kinetic_prefect.backends.base import PodExit
from kinetic_prefect.common import layout, prefect_results
from kinetic_prefect.common.records import (
    FINAL_STATE_JSON,
    STATUS_ALREADY_FINAL,
    STATUS_PHASE_FAILED,
    FinalRecord,
)
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.errors import (
    PodCrashedError,
    PodPhaseError,
    PodStartError,
    RecordError,
    RemoteTraceback,
    TamperedRecordError,
    TamperedResultError,
)
from kinetic_prefect.runner.result_check import verified_result


@dataclass(frozen=True)
class AttemptEnd:
    """The final state of one pod, and whether the pod's engine reported it to Prefect itself."""

    state: State[Any]
    reported_by_pod: bool
    task_run: Any = None  # the pod's view of the task run (run count), when it reported

    @property
    def retrying(self) -> bool:
        """The pod's engine ended its one attempt by recording a retry (a slice): relaunch it."""
        return self.reported_by_pod and not self.state.is_final()

    def retry_delay(self) -> float:
        """Seconds until the retry the pod recorded is due (0 for an immediate `Retrying`)."""
        scheduled = self.state.state_details.scheduled_time
        if not self.retrying or not self.state.is_scheduled() or scheduled is None:
            return 0.0
        return max(0.0, (scheduled - datetime.now(UTC)).total_seconds())


# What follows a pod that ended without reporting its task's end itself.
CONCLUDE = "conclude"  # the state stands: the task run ends with it
RELAUNCH_PREEMPTED = "relaunch-preempted"  # a new pod, on the preemption budget
RETRY = "retry"  # a new pod after the task's retry delay, on the task's retries


def after_silent_end(
    *,
    state_type: StateType,
    cancelled: bool,
    preempted: bool,
    preemptions_left: int,
    retries_left: int,
    pod_never_ran_the_task: bool,
) -> str:
    """The runner's next step for a pod that left no report of its own (`state_type` is
    what the backend saw made of it: Crashed, or Cancelled, Completed, ...).

    Only a crash is relaunched, never a cancel. The infrastructure taking a pod away
    (preemption, eviction, node loss: `preempted`) spends the preemption budget, not the
    task's retries; a crash spends a retry, unless the pod never ran the task (a phase
    or start failure: the same pod spec would fail the same way).
    """
    if cancelled or state_type != StateType.CRASHED:
        return CONCLUDE
    if preempted and preemptions_left > 0:
        return RELAUNCH_PREEMPTED
    if retries_left > 0 and not pod_never_ran_the_task:
        return RETRY
    return CONCLUDE


def ask_recorded_runs(*, retries: int, crashed: bool, preempted: bool, hosts: int) -> bool:
    """Whether a silent end's engine runs are to be read from the API's run count.

    A one-host pod's engine retries in-process, so it may have run the task several
    times; the API counts them, and a relaunch depends on it (retries set, a crash that
    was not a preemption). A slice's host 0 runs one attempt: its `Retrying` (a Running
    state, so counted) may be recorded just before the attempt is ended for a lost host,
    and was never run; one pod is one run there.
    """
    return bool(retries) and crashed and not preempted and hosts == 1


def concluded_state(state: State[Any], cancelled: bool) -> State[Any]:
    """The state a silent end concludes with (`after_silent_end` said CONCLUDE).

    A pod that crashed while its task run was being cancelled, or once the lease said
    its flow run was over, was stopped, not broken: the run ends Cancelled, as its
    siblings cancelled a moment later do, with the pod's end in the message.
    """
    if cancelled and state.is_crashed():
        return Cancelled(
            message=f"The task run was cancelled or its flow run ended while its pod ran; "
            f"the pod ended: {state.message or 'without a report'}"
        )
    return state


def read_attempt_end(
    store: JobsStore, job_id: str, outcome: PodExit, signing_key: str
) -> AttemptEnd:
    """The attempt's end from the job directory, or from `outcome` when the pod left no record.

    The record must carry the signature made with this runner's `signing_key`, which
    covers the pickled state in it, before anything is unpickled:
    whoever can write the jobs bucket must not be able to run code here.
    """
    prefix = layout.job_dir(job_id)
    record_key = f"{prefix}/{FINAL_STATE_JSON}"
    try:
        data = outcome.final_record
        data = data if data is not None else store.get_bytes(record_key)
    except FileNotFoundError:
        return AttemptEnd(state_without_record(job_id, outcome), reported_by_pod=False)
    source = store.uri(record_key)
    try:
        record = FinalRecord.decode(data, source)
    except RecordError as exc:
        message = f"The final-state record of pod {job_id} cannot be read: {exc}"
        return AttemptEnd(Failed(message=message, data=exc), False)
    try:
        record.verify(signing_key, source)
    except RecordError as exc:
        return _tampered(job_id, str(exc))
    if record.status == STATUS_PHASE_FAILED:
        error = PodPhaseError(
            record.message or f"Failed during {record.phase}",
            phase=record.phase or "unknown",
            job_id=job_id,
            remote_traceback=record.traceback or "",
        )
        if record.traceback:
            error.__cause__ = RemoteTraceback(record.traceback)
        return AttemptEnd(Failed(message=str(error), data=error), reported_by_pod=False)
    if record.status == STATUS_ALREADY_FINAL:
        # The pod changed nothing: the task run stays as recorded, and the future says so.
        state: State[Any] = State(
            type=StateType(record.state_type or StateType.CANCELLED.value),
            name=record.state_name,
            message=f"Pod {job_id} found the task run already {record.state_name} and "
            f"left it so: {record.message or ''}".rstrip(": "),
        )
        return AttemptEnd(state, reported_by_pod=True)
    pickled = record.carried_state()
    if pickled is None and record.state_sha256 is not None:
        beside = f"{prefix}/{layout.FINAL_STATE_PICKLE}"
        try:
            pickled = store.get_bytes(beside)
        except FileNotFoundError:
            message = (
                f"The final state of pod {job_id} is gone: {store.uri(beside)}, which its "
                "record names, is not there (removed by `kinetic-prefect jobs cleanup` or a "
                "bucket lifecycle rule?). Rerun the task."
            )
            return AttemptEnd(Failed(message=message, data=FileNotFoundError(message)), False)
        if hashlib.sha256(pickled).hexdigest() != record.state_sha256:
            return _tampered(job_id, f"{layout.FINAL_STATE_PICKLE} is not the one it signed")
    if pickled is None:
        return _tampered(job_id, f"the signed {FINAL_STATE_JSON} of a finished task has no state")
    final = cloudpickle.loads(pickled)
    del pickled
    state = final["state"]
    reference = prefect_results.result_reference(state)
    if reference is not None:
        try:
            state.data = verified_result(
                record, reference, job_id, final.get("task_run"), store.gcp_credentials
            )
        except TamperedResultError as refused:
            return AttemptEnd(Failed(message=str(refused), data=refused), reported_by_pod=False)
    if final.get("traceback"):
        attach_remote_traceback(state, final["traceback"])
    return AttemptEnd(state, reported_by_pod=True, task_run=final.get("task_run"))


def _tampered(job_id: str, what: str) -> AttemptEnd:
    message = (
        f"The final-state record of pod {job_id} was altered after the pod wrote it ({what}); "
        "it was not unpickled. Check who else can write to the jobs bucket, then rerun the task."
    )
    return AttemptEnd(Failed(message=message, data=TamperedRecordError(message)), False)


def state_without_record(job_id: str, outcome: PodExit) -> State[Any]:
    """The state of a pod that ended without a word: start failure, cancel or crash."""
    if outcome.start_failure:
        message = f"Pod {job_id} could not start: {outcome.start_failure}"
        return Failed(message=message, data=PodStartError(message))
    if outcome.cancelled:
        return Cancelled(message=f"Pod {job_id} was cancelled.")
    message = f"Pod {job_id} ended without reporting a final state: {outcome.describe()}."
    if outcome.log_tail:
        message += f" Last log lines:\n{outcome.log_tail}"
    return Crashed(message=message, data=PodCrashedError(message))


def exception_or_none(state: State[Any]) -> BaseException | None:
    """The exception a failed or crashed state carries (read synchronously), else None."""
    if not (state.is_failed() or state.is_crashed()):
        return None
    try:
        # Callbacks run in the flow's context, which may be async: ask for the sync form.
        return get_state_exception(state, _sync=True)  # type: ignore[call-arg,return-value]
    except Exception:
        return None


def attach_remote_traceback(state: State[Any], text: str) -> None:
    exc = exception_or_none(state)
    if exc is not None and not isinstance(exc.__cause__, RemoteTraceback):
        exc.__cause__ = RemoteTraceback(text)
