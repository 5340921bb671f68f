"""A warm pod: after its task, wait for the next task run of the same pod spec.

The hand-over goes through the jobs store (`kinetic_prefect.common.handover`):
the pod's warm dir (`KINETIC_WARM_DIR`) receives the next assignment, a batch of
tasks, often while the pod still runs its task. The pod claims each task it is handed
before it touches it, and skips a task the runner took back. As it
reports a task, it claims its next one (the rest of its batch, or the first of a batch
it finds then) and names it in that final record; otherwise it waits for an
assignment.

Between tasks the pod goes back to its base environment: `os.environ` as the pod
started, its working directory and a fresh scratch directory per task. What stays
is the interpreter and every module imported so far, as in the worker processes
of Prefect's `ProcessPoolTaskRunner`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kinetic_prefect.common import storage
from kinetic_prefect.common.env import (
    JOB_ID_ENV,
    SCRATCH_DIR_ENV,
    TASK_RUN_ID_ENV,
    WARM_DIR_ENV,
    WARM_IDLE_ENV,
)
from kinetic_prefect.common.handover import (
    Assignment,
    assignment_name,
    batch_from_json,
    claim,
    poll_seconds,
)
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.common.layout import WARM_POD_JSON
from kinetic_prefect.pod.runner import (
    EXIT_COMPLETED,
    EXIT_PHASE_FAILED,
    EXIT_TASK_NOT_COMPLETED,
    PodRun,
    log,
    run_task,
)

# An idle pod's looks for its next task: every `poll_seconds` at first, then less often,
# one more `poll_seconds` apart for each `warm_idle_slowdown_seconds` idle, to MAX_SLOWDOWN
# times.
MAX_SLOWDOWN = 10


class WarmLoop:
    """The pod's side of the hand-over; None from `from_environ` when the pod is cold."""

    def __init__(
        self, warm_dir: str, idle_seconds: float, slowdown_seconds: float | None = None
    ) -> None:
        self.warm_dir = warm_dir.rstrip("/")
        self.idle_seconds = idle_seconds
        self.slowdown_seconds = slowdown_seconds or Intervals().warm_idle_slowdown_seconds
        self.sequence = 0
        self.base_env = dict(os.environ)
        self.base_cwd = os.getcwd()
        self.base_scratch = os.environ.get(SCRATCH_DIR_ENV) or tempfile.gettempdir()
        self.task_scratch: Path | None = None
        # The pod's name: the job id it started with (its warm dir is named after it too).
        self.pod_id = os.environ.get(JOB_ID_ENV, "")
        # The next task, taken before the last task's report named it.
        self.taken: Assignment | None = None
        # The rest of the last batch read, not taken yet.
        self.batch: list[Assignment] = []

    @classmethod
    def from_environ(cls, hosts: int) -> WarmLoop | None:
        warm_dir = os.environ.get(WARM_DIR_ENV)
        if not warm_dir or hosts > 1:
            return None
        return cls(
            warm_dir,
            float(os.environ.get(WARM_IDLE_ENV) or "60"),
            Intervals.from_environ(os.environ).warm_idle_slowdown_seconds,
        )

    def _read(self, name: str) -> bytes | None:
        """The warm dir's `name`, or None while it is not there (one request either way)."""
        try:
            return storage.read_uri(f"{self.warm_dir}/{name}")
        except FileNotFoundError:
            return None

    def _look(self) -> bool:
        """Read the next assignment into the batch; False while it is not there."""
        name = assignment_name(self.sequence + 1)
        data = self._read(name)
        if data is None:
            return False
        self.batch = batch_from_json(data, f"{self.warm_dir}/{name}")
        self.sequence += 1
        return True

    def claims(self, job_dir: str, job_id: str, sequence: int) -> bool:
        """Claim a task for this pod; False if the runner took it back (for another pod,
        or cancelled). Raises if the store cannot say."""
        store, key = storage.split_uri(f"{job_dir.rstrip('/')}/{WARM_POD_JSON}")
        if claim(store, key, self.pod_id, sequence):
            return True
        log(f"job {job_id} was taken back by the runner: not running it here")
        return False

    def _claim_next(self) -> Assignment | None:
        """The next task of the batch this pod claims, reading assignments as long as they
        are there; None when there is none now. A claim the store fails leaves its task
        first in the batch, to claim again."""
        while True:
            while self.batch:
                task = self.batch[0]
                mine = self.claims(task.job_dir, task.job_id, self.sequence)
                self.batch.pop(0)
                if mine:
                    return task
            if not self._look():
                return None

    def take_next(self) -> str | None:
        """Before the task's report: claim the next task if the pod has it or the runner has
        written it already (the report then names its job). Not at its first report: the
        runner writes a pod assignments only once it has read a report of it."""
        first_report = self.sequence == 0 and not self.batch
        self.taken = None if first_report else self._look_again()
        return self.taken.job_id if self.taken is not None else None

    def _look_again(self) -> Assignment | None:
        """`_claim_next`, with a store that fails counted as nothing there yet (the claim
        in hand is claimed again at the next look)."""
        try:
            return self._claim_next()
        except Exception as exc:
            log(f"could not look for the next task: {type(exc).__name__}: {exc}")
            return None

    def wait_for_assignment(self) -> Assignment | None:
        """The next task this pod claims, or None once it has been idle for its idle time.
        The pod looks less often the longer it idles (a map's next task comes at once, a
        later one may wait a little), and once more at the end of its idle time."""
        if self.taken is not None:
            taken, self.taken = self.taken, None
            return taken
        started = time.monotonic()
        deadline = started + self.idle_seconds
        base = poll_seconds(self.warm_dir)
        # No look at once: the pod looked just before its report (or, at its first, knew
        # there was nothing), and the runner hands the next task only after it has read
        # that report.
        time.sleep(base)
        while (task := self._look_again()) is None:
            now = time.monotonic()
            if now >= deadline:
                return None
            interval = base * min(1 + (now - started) / self.slowdown_seconds, MAX_SLOWDOWN)
            time.sleep(min(interval, deadline - now))
        return task

    def begin_task(self, env: dict[str, str] | None = None) -> None:
        """The base environment plus the task's own env, and a fresh scratch dir."""
        os.environ.clear()
        os.environ.update(self.base_env)
        if env:
            os.environ.update(env)
        job_id = os.environ.get(JOB_ID_ENV, "task")
        self.task_scratch = Path(tempfile.mkdtemp(prefix=f"{job_id}-", dir=self.base_scratch))
        os.environ[SCRATCH_DIR_ENV] = str(self.task_scratch)

    def end_task(self, workdir: Path | None) -> None:
        """Back to the pod's base environment, in the code's directory."""
        os.environ.clear()
        os.environ.update(self.base_env)
        os.chdir(workdir or self.base_cwd)
        if self.task_scratch is not None:
            shutil.rmtree(self.task_scratch, ignore_errors=True)
            self.task_scratch = None

    def serve(self, run: PodRun) -> int:
        """Task after task in this pod until it idles out; a crash or phase failure ends it.

        The pod claims its first task (its Job's own) too: while the pod waited for a node,
        the runner may have given that task to an idle pod of its spec. The pod then ends
        at once, having run nothing (the runner has ended its Job too)."""
        run.code_root = self.base_scratch
        run.send_telemetry_before_report = True
        run.take_next = self.take_next
        try:
            if not self.claims(run.job_dir, self.pod_id, 0):
                return EXIT_COMPLETED
        except Exception as exc:
            # The store's own retries are spent: the task could not report either. The
            # pod ends without running it, and the runner takes that as a crash.
            log(f"could not claim its task, ending: {type(exc).__name__}: {exc}")
            return EXIT_TASK_NOT_COMPLETED
        assignment: Assignment | None = None
        while True:
            code, state = self._run_one(run, assignment)
            if code == EXIT_PHASE_FAILED or (state is not None and state.is_crashed()):
                log("ending this warm pod: its last task did not end cleanly")
                return code
            assignment = self.wait_for_assignment()
            if assignment is None:
                log(f"idle for {self.idle_seconds:g}s: ending this warm pod")
                return EXIT_COMPLETED
            run = self._next_run(run, assignment)

    def _run_one(self, run: PodRun, assignment: Assignment | None) -> tuple[int, Any]:
        """One task run between the log's begin and end marks, in its own environment."""
        self.begin_task(assignment.env if assignment else None)
        job_id = os.environ.get(JOB_ID_ENV, "")
        task_run_id = os.environ.get(TASK_RUN_ID_ENV, "")
        log(f"===== begin job {job_id} (task run {task_run_id}) =====")
        code, state = run_task(run, 0, 1)
        outcome = state.type.value if state is not None else f"exit code {code}"
        log(f"===== end job {job_id} (task run {task_run_id}): {outcome} =====")
        self.end_task(run.workdir)
        return code, state

    @staticmethod
    def _next_run(previous: PodRun, assignment: Assignment) -> PodRun:
        """The assignment's task run, reusing the code the pod already extracted."""
        return PodRun(
            job_dir=assignment.job_dir.rstrip("/"),
            payload_uri=assignment.payload,
            payload_sha256=assignment.payload_sha256,
            payload_bytes=assignment.payload_bytes(),
            context_uri=assignment.context,
            context_sha256=assignment.context_sha256,
            workdir=previous.workdir,
            extracted_sha256=previous.extracted_sha256,
            code_root=previous.code_root,
            send_telemetry_before_report=True,
            take_next=previous.take_next,
        )
