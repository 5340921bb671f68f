"""The one place a task run's state changes: a serial loop over posted events.

Each runner has one `RunLoop`. Backends, the warm pool, reattach, retry delays,
cancels and the flow's exit only `post` events to it; for each, in the order
posted, the loop asks `run_state.step` for the task run's next state, stores
it, and carries out the effects:

- recording a state in Prefect and showing why a pod waits are done on the loop
  (a state is recorded as an event Prefect's events client sends on, so neither
  waits on the network);
- launching, adopting and stopping pods are I/O: they run on the loop's pool of
  `IO_THREADS` threads, and what they learn comes back as events;
- resolving a future runs on that pool too, after the state is stored and
  recorded: the future's done callbacks run there, as on a thread pool's worker,
  so a callback that waits for another task run of this runner holds up no event;
- a retry's delay is a deadline the loop keeps: waiting holds no thread.

No other module assigns a `TaskLaunch` field (`tests/unit/test_run_loop.py`
reads the source to hold this).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from prefect.logging import get_logger
from prefect.states import Pending

from kinetic_prefect.backends.base import pending_message
from kinetic_prefect.runner import prefect_engine as prefect_bridge
from kinetic_prefect.runner.run_state import (
    Adopt,
    Cancel,
    Effect,
    Event,
    Launch,
    PodEnded,
    Prepared,
    Record,
    RecordAwaitingRetry,
    Resolve,
    RetryDue,
    ShowPending,
    Started,
    StopEarlier,
    StopPod,
    WakeAfter,
    launch_failed,
    step,
)
from kinetic_prefect.runner.task_launch import TaskLaunch

logger = get_logger("kinetic_prefect.runner.run_loop")

# Launches, adoptions and pod stops in flight at once; what waits (upstreams, retry
# delays, pods) holds none of them.
IO_THREADS = 8


class PodActions(Protocol):
    """The I/O the loop's effects need (the launcher's)."""

    def launch_attempt(self, launch: TaskLaunch) -> None: ...

    def adopt(self, launch: TaskLaunch, job_id: str) -> None: ...

    def stop_pod(self, launch: TaskLaunch, job_id: str) -> None: ...

    def stop_earlier(self, launch: TaskLaunch, job_id: str) -> None: ...


_CLOSING = object()
CLOSED_WHILE_WAITING = "The runner closed while the task run waited to be retried."


class RunLoop:
    """Applies task-run events one at a time; see the module docstring.

    The loop's thread lives while there is work: a post starts it, and it ends once
    nothing is queued and no retry deadline is pending. A runner that is closed, or
    entered again, or a pod that ends after its runner closed, needs nothing more.
    """

    def __init__(self, actions: PodActions) -> None:
        self._actions = actions
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ended: threading.Thread | None = None  # the last thread that went idle
        self._io: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        # Marks the loop's own thread and its I/O threads (not another runner's).
        self._mine = threading.local()
        # Retry delays: (due, order, launch, event), the earliest first.
        self._timers: list[tuple[float, int, TaskLaunch, Event]] = []
        self._order = itertools.count()
        self._in_flight: set[concurrent.futures.Future[None]] = set()

    # -- posting ------------------------------------------------------------------

    def post(self, launch: TaskLaunch, event: Event) -> None:
        self.post_many([(launch, event)])

    def post_many(self, items: Iterable[tuple[TaskLaunch, Event]]) -> None:
        """Post events to be applied together: every one's state is stored before any
        effect of them is carried out (a cancel of many task runs is seen by all of them
        before any future's callbacks run)."""
        batch = list(items)
        if batch:
            self._put(batch)

    def settle(self) -> None:
        """Return once every event posted before has been applied (at once on the loop's
        own threads, which would otherwise wait for themselves)."""
        if self.runs_on_current_thread():
            return
        applied = threading.Event()
        self._put(applied)
        applied.wait()

    def open(self) -> None:
        """Use the loop again after `close` (a runner entered again)."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Apply what was posted, cancel the task runs waiting to be retried, and return
        once the loop is idle (at once on the loop's own threads). A later post starts it again."""
        with self._lock:
            self._closed = True
        self._put(_CLOSING)
        with self._lock:
            # The thread serving now, and one that went idle just before and may still be
            # on its way out.
            threads = [t for t in (self._thread, self._ended) if t is not None]
        if not self.runs_on_current_thread():
            for thread in threads:
                thread.join()

    def runs_on_current_thread(self) -> bool:
        """Whether this thread is the loop's or one of its I/O threads (a future's callback
        may run on either): waiting there for the loop would wait forever."""
        return getattr(self._mine, "here", False)

    def wait_for_io(self) -> None:
        """Return once the launches, adoptions and stops asked for so far are done."""
        with self._lock:
            in_flight = list(self._in_flight)
        concurrent.futures.wait(in_flight)

    def _put(self, item: Any) -> None:
        with self._lock:
            self._queue.put(item)
            if self._io is None:
                self._io = concurrent.futures.ThreadPoolExecutor(
                    max_workers=IO_THREADS,
                    thread_name_prefix="kinetic-io",
                    initializer=self._mark_mine,
                )
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kinetic-run-loop", daemon=True
                )
                self._thread.start()

    def _mark_mine(self) -> None:
        self._mine.here = True

    def _idle(self) -> bool:
        """Whether the thread may end (under the lock, so a post then starts another);
        once the loop was closed, its I/O pool goes with it."""
        with self._lock:
            if not self._queue.empty() or self._timers:
                return False
            self._ended = self._thread
            self._thread = None
            self._shut_io_if_done()
            return True

    def _shut_io_if_done(self) -> None:
        """Once the loop was closed and is idle, its I/O pool goes too (under the lock)."""
        if self._closed and self._thread is None and not self._in_flight and self._io:
            self._io.shutdown(wait=False)
            self._io = None

    # -- the loop -----------------------------------------------------------------

    def _run(self) -> None:
        self._mark_mine()
        try:
            self._serve()
        finally:
            # However the thread ends, the next post starts another (none is lost).
            with self._lock:
                if self._thread is threading.current_thread():
                    self._thread = None
                    self._shut_io_if_done()
                again = self._thread is None and not self._queue.empty()
            if again:
                self._put([])

    def _serve(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._until_next_timer())
            except queue.Empty:
                item = None
            if item is _CLOSING:
                # No retry is waiting once the runner closes: each such run ends Cancelled.
                waiting: list[tuple[TaskLaunch, Event]] = [
                    (launch, Cancel(CLOSED_WHILE_WAITING)) for *_, launch, _ in self._timers
                ]
                self._timers.clear()
                self._apply(waiting)
            elif isinstance(item, threading.Event):  # `settle`: everything before is applied
                item.set()
            elif item:
                self._apply(item)
            # Checked after every event too: a steady stream of them starves no deadline.
            due = self._due_timers()
            if due:
                self._apply(due)
            if item is None and self._idle():
                return

    def _until_next_timer(self) -> float:
        if not self._timers:
            return 0.0
        return max(0.0, self._timers[0][0] - time.monotonic())

    def _due_timers(self) -> list[tuple[TaskLaunch, Event]]:
        now = time.monotonic()
        due = []
        while self._timers and self._timers[0][0] <= now:
            _, _, launch, event = heapq.heappop(self._timers)
            due.append((launch, event))
        return due

    def _apply(self, batch: list[tuple[TaskLaunch, Event]]) -> None:
        decided: list[tuple[TaskLaunch, tuple[Effect, ...]]] = []
        for launch, event in batch:
            try:
                new_state, effects = step(launch.state, event)
            except Exception as exc:
                # Never a future left unresolved: the run ends Failed, saying why.
                logger.exception("Task run %s: no step for %r", launch.task_run.name, event)
                new_state, effects = step(launch.state, launch_failed("The runner failed", exc))
            self._take_in(launch, event)
            launch.state = new_state
            decided.append((launch, effects))
        for launch, effects in decided:
            for effect in effects:
                try:
                    launch.in_context(self._carry_out, launch, effect)
                except BaseException:  # a future's callback may raise anything
                    logger.warning(
                        "Task run %s: %r failed", launch.task_run.name, effect, exc_info=True
                    )

    @staticmethod
    def _take_in(launch: TaskLaunch, event: Event) -> None:
        """What an event brings besides the state: the pods' inputs, the started pod's
        backend and manifest, the pod's own view of the task run."""
        if isinstance(event, Prepared) and launch.inputs is None:
            launch.inputs = event.inputs
            if event.earlier is not None and event.earlier.backend is not None:
                launch.backend = event.earlier.backend
        elif isinstance(event, Started) and event.job_id == launch.state.job_id:
            launch.backend = event.backend
            launch.manifest = event.manifest
        elif (
            isinstance(event, PodEnded)
            and event.task_run is not None
            and event.job_id == launch.state.job_id
            and not launch.state.done
        ):
            launch.task_run = event.task_run

    # -- effects ------------------------------------------------------------------

    def _carry_out(self, launch: TaskLaunch, effect: Effect) -> None:
        match effect:
            case Record(state=state):
                self._count_runs(launch)
                prefect_bridge.report_state(launch.task_run, state)
            case RecordAwaitingRetry(delay=delay, note=note):
                self._count_runs(launch)
                waiting = prefect_bridge.awaiting_retry(delay, note)
                prefect_bridge.report_state(launch.task_run, waiting)
            case Resolve(state=state):
                self._io_task(launch, None, self._resolve, launch, state)
            case ShowPending(reason=reason):
                message = pending_message(launch.state.job_id, reason)
                prefect_bridge.report_state(launch.task_run, Pending(message=message))
            case WakeAfter(delay=delay, job_id=job_id, note=note):
                logger.info(
                    "Task run %s: %s; relaunching as %s in %.1fs",
                    launch.task_run.name,
                    note,
                    job_id,
                    delay,
                )
                due = time.monotonic() + delay
                heapq.heappush(self._timers, (due, next(self._order), launch, RetryDue(job_id)))
            case Launch():
                # The runs so far: the pod's engine starts from it, and the states this
                # runner records carry it to the API (their events name the run count).
                launch.task_run.run_count = launch.state.runs_used
                first = launch.state.pods_launched == 0 and len(launch.state.job_ids) == 1
                what = "Could not launch the pod" if first else "Could not relaunch the pod"
                self._io_task(launch, what, self._actions.launch_attempt, launch)
            case Adopt(job_id=job_id):
                what = f"Could not reattach to pod {job_id}"
                self._io_task(launch, what, self._actions.adopt, launch, job_id)
            case StopPod(job_id=job_id):
                self._io_task(launch, None, self._actions.stop_pod, launch, job_id)
            case StopEarlier(job_id=job_id):
                self._io_task(launch, None, self._actions.stop_earlier, launch, job_id)

    @staticmethod
    def _count_runs(launch: TaskLaunch) -> None:
        """The runs the task run has made, on its object: a state this runner records
        carries the run count to the API in its event (a pod killed silently reported
        none, and the API would otherwise count the runs as this object last had them)."""
        launch.task_run.run_count = max(launch.task_run.run_count, launch.state.runs_used)

    def _io_task(self, launch: TaskLaunch, what: str | None, fn: Any, *args: Any) -> None:
        """Run `fn` on the I/O pool in the flow's context. A failure ends the task run,
        saying `what` failed (when `what` is None it is only logged)."""

        def run() -> None:
            try:
                launch.in_context(fn, *args)
            except BaseException as exc:
                if what is None:
                    logger.warning("%s failed for %s", fn.__name__, args[-1], exc_info=True)
                    return
                logger.debug("%s for %s", what, launch.state.job_id, exc_info=True)
                self.post(launch, launch_failed(what, exc))

        with self._lock:
            # The pool exists while the loop's thread runs, which is where effects are
            # carried out; an interpreter shutting down may still refuse the work.
            assert self._io is not None
            try:
                done = self._io.submit(run)
            except RuntimeError as exc:
                refused: RuntimeError | None = exc
            else:
                refused = None
                self._in_flight.add(done)
        if refused is not None:
            if what is not None:
                self.post(launch, launch_failed(what, refused))
            return
        done.add_done_callback(self._landed)

    @staticmethod
    def _resolve(launch: TaskLaunch, state: Any) -> None:
        if not launch.future.done():
            launch.future.set_result(state)

    def _landed(self, done: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._in_flight.discard(done)
            self._shut_io_if_done()
