"""A task whose pod outlived its flow process is reattached to, never launched twice.

Every task pod carries the label `kinetic-prefect.io/task-identity`, a digest of
its flow run id and task key (`identity.task_identity`), which is the same for
every process that runs the flow run. When a flow run submits a task, its
runner first asks the backend, once per flow run and namespace, for the flow
run's pods that other processes launched (`Backend.find_pods`: one list request
on Kubernetes, the `.kinetic/pods` records locally), and looks for the task's
identity among them:

- a live pod (pending, running, or ending in its SIGTERM grace) is adopted: the
  runner renews the flow run's lease, waits for the pod's end and resolves the
  new task run from its record. A Completed record gives the new task run that
  state, with a message naming the pod; any other end launches a new pod, as the
  retry, only now that the old one is gone;
- a pod that ended with a Completed record gives its state the same way, unless
  the task opts out of reused results (`cache_policy=NO_CACHE`, `refresh_cache`);
- anything else (no pod, or one that failed, crashed or left no record) launches
  normally, and the new pod resumes from the checkpoint in `KINETIC_OUTPUT_DIR`.

Warm pods are not reattached to: after its first task a warm pod may be running
any task run of its flow run, handed over by the process that is gone. A live
warm pod found this way is stopped as a cancel would (SIGTERM, its grace, then
SIGKILL; on Kubernetes its Job deleted), and no task of the flow run launches
before it has ended; the tasks it ran resume from their checkpoints.

So at no moment do two pods run for one task identity, whatever restarted.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect.logging import get_logger
from prefect.states import State

from kinetic_prefect.backends.base import Backend, FoundPod, PodExit
from kinetic_prefect.common import prefect_cache
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.launch.identity import task_identity
from kinetic_prefect.launch.manifest import LABEL_TASK_IDENTITY
from kinetic_prefect.runner.attempt_end import read_attempt_end
from kinetic_prefect.runner.resources import RunnerResources
from kinetic_prefect.runner.run_state import EarlierPod

if TYPE_CHECKING:
    from kinetic_prefect.runner.task_launch import TaskLaunch

logger = get_logger("kinetic_prefect.runner.reattach")


def identity_labels(launch: TaskLaunch) -> dict[str, str]:
    """The task-identity label of the launch's pods (none outside a flow run)."""
    flow_run_id = launch.task_run.flow_run_id
    if flow_run_id is None:
        return {}
    return {LABEL_TASK_IDENTITY: task_identity(str(flow_run_id), launch.task_key)}


def reattached_state(state: State[Any], job_id: str, *, adopted: bool = True) -> State[Any]:
    """The Completed state of an earlier pod, as the new task run's own (a new state id)."""
    fresh = state.fresh_copy()
    if adopted:
        fresh.message = (
            f"Completed by pod {job_id}, launched for this flow run by an earlier flow "
            "process and reattached to"
        )
    else:
        fresh.message = (
            f"Completed by pod {job_id}, launched for an earlier run of this task in this "
            "flow run (another flow process, or an earlier attempt of the flow run); its "
            "result is reused. cache_policy=NO_CACHE or refresh_cache=True runs it again"
        )
    return fresh


def reuses_completed_pods(task: Any) -> bool:
    """Whether an earlier completed pod's result may stand for a new run of `task`: not
    when the task opts out of reused results, as it would of Prefect's cache
    (`cache_policy=NO_CACHE`, which `persist_result=False` implies, or `refresh_cache`,
    the task's or else `PREFECT_TASKS_REFRESH_CACHE`)."""
    # As Prefect caches: by a policy that gives keys, or by a `result_storage_key`.
    caches = prefect_cache.caches(task) or task.result_storage_key is not None
    return caches and not prefect_cache.refreshes(task)


class Reattacher:
    """Finds a submitted task's earlier pod and takes it over; see the module docstring."""

    def __init__(self, resources: RunnerResources) -> None:
        self._resources = resources
        self._lock = threading.Lock()
        self._found: dict[tuple[int, str, str], dict[str, list[FoundPod]]] = {}

    def earlier_pods(
        self, backend: Backend, flow_run_id: str, namespace: str, stop_within: float
    ) -> dict[str, list[FoundPod]]:
        """The flow run's pods launched by other processes, by task identity (asked for once).

        Live warm pods among them are stopped, and waited for (`stop_within` seconds), first.
        """
        key = (id(backend), flow_run_id, namespace)
        with self._lock:  # concurrent submissions wait for the one request
            found = self._found.get(key)
            if found is None:
                pods = backend.find_pods(flow_run_id, namespace)
                warm = [pod for pod in pods if pod.warm and pod.live]
                if warm:
                    _stop_and_wait(backend, namespace, warm, stop_within)
                found = {}
                for pod in pods:
                    if pod.identity:
                        ended = dataclasses.replace(pod, live=False) if pod in warm else pod
                        found.setdefault(pod.identity, []).append(ended)
                self._found[key] = found
        return found

    def find(self, launch: TaskLaunch, store: JobsStore) -> EarlierPod | None:
        """The task's earlier pod worth taking over: a live one to adopt, or one whose
        Completed state is the task run's. None: launch a new pod."""
        labels = identity_labels(launch)
        if not labels:
            return None
        settings = launch.settings
        backend = self._resources.backend_for(settings, settings.resolved_jobs_root())
        earlier = self.earlier_pods(
            backend,
            str(launch.task_run.flow_run_id),
            settings.namespace,
            # The pods' grace, and how long deleting a Job and seeing its pod end may take.
            settings.cancel_grace_seconds + settings.intervals.reattach_stop_slack_seconds,
        )
        pods = earlier.get(labels[LABEL_TASK_IDENTITY], [])
        if not pods:
            return None
        live = [pod for pod in pods if pod.live]
        if live:
            return EarlierPod(live[0].job_id, backend=backend)
        newest = pods[0]
        if not reuses_completed_pods(launch.task):
            logger.info(
                "Task run %s: not reusing the earlier pod %s (the task opts out of reused "
                "results); launching a new one",
                launch.task_run.name,
                newest.job_id,
            )
            return None
        key = self._resources.signing_key(launch)
        end = read_attempt_end(store, newest.job_id, PodExit(newest.job_id, exit_code=None), key)
        if not (end.reported_by_pod and end.state.is_completed()):
            logger.info(
                "Task run %s: the earlier pod %s did not complete (%s); launching a new one",
                launch.task_run.name,
                newest.job_id,
                end.state.message,
            )
            return None
        completed = reattached_state(end.state, newest.job_id, adopted=False)
        return EarlierPod(newest.job_id, completed=completed)


def stop_earlier_pod(
    backend: Backend,
    namespace: str,
    job_id: str,
    on_exit: Callable[[PodExit], None] = lambda outcome: None,
) -> None:
    """Stop a pod an earlier flow process launched, as a cancel would (SIGTERM, its grace,
    then SIGKILL; on Kubernetes its Job deleted): watched first, so that the backend
    knows it."""
    backend.adopt(job_id, namespace, on_exit=on_exit)
    backend.cancel(job_id)


def _setter(event: threading.Event) -> Callable[[PodExit], None]:
    def on_exit(outcome: PodExit) -> None:
        event.set()

    return on_exit


def _stop_and_wait(backend: Backend, namespace: str, pods: list[FoundPod], within: float) -> None:
    """End warm pods of an earlier process and return once every one has ended."""
    ended = {pod.job_id: threading.Event() for pod in pods}
    for pod in pods:
        logger.info(
            "Stopping warm pod %s of an earlier flow process before launching (its tasks "
            "resume from their checkpoints)",
            pod.job_id,
        )
        stop_earlier_pod(backend, namespace, pod.job_id, on_exit=_setter(ended[pod.job_id]))
    deadline = time.monotonic() + within
    for job_id, event in ended.items():
        if not event.wait(max(0.0, deadline - time.monotonic())):
            raise RuntimeError(
                f"The warm pod {job_id} of an earlier flow process did not end within "
                f"{within:.0f}s of being stopped; delete it "
                f"(`kinetic-prefect jobs cancel {job_id}`) and retry the flow run."
            )
