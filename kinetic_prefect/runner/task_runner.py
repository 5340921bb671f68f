"""`KineticTaskRunner`: every submitted task run goes to its own Kinetic pod.

The flow stays where it is; each `task.submit()` / `task.map()` becomes a task
run whose pods are launched by `kinetic_prefect.runner.launcher.Launcher`, and its
`KineticFuture` resolves from the state the pod reports (or, for a pod that
could not report, from what the backend saw).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Self

from prefect.client.schemas.objects import TaskRun
from prefect.futures import PrefectConcurrentFuture, PrefectFuture, PrefectWrappedFuture
from prefect.logging import get_logger
from prefect.states import Failed, State
from prefect.task_runners import TaskRunner
from prefect.utilities.annotations import quote
from prefect.utilities.collections import StopVisiting, visit_collection

from kinetic_prefect.backends.base import Backend
from kinetic_prefect.errors import PayloadError
from kinetic_prefect.launch import identity, prefect_context, preflight
from kinetic_prefect.launch.accelerators import parse_accelerator
from kinetic_prefect.launch.manifest import new_job_id as make_job_id
from kinetic_prefect.launch.packaging import check_picklable
from kinetic_prefect.launch.pod_secrets import env_value
from kinetic_prefect.launch.settings import (
    CLUSTER_ENV,
    RESULT_STORAGE_ENV,
    LaunchSettings,
    current_overrides,
    join_uri,
    resolve_settings,
    spot_request,
)
from kinetic_prefect.runner import prefect_engine as prefect_bridge
from kinetic_prefect.runner.launcher import CANCELLED_ON_EXIT, Launcher
from kinetic_prefect.runner.resources import RunnerResources
from kinetic_prefect.runner.run_state import RunState
from kinetic_prefect.runner.task_launch import TaskLaunch

if TYPE_CHECKING:
    from prefect.tasks import Task

logger = get_logger("kinetic_prefect.runner.task_runner")


class KineticFuture(PrefectConcurrentFuture[Any]):
    """The future of a task run in Kinetic pods.

    Besides Prefect's future API it tells where the run is: `job_id` (the
    current attempt's Job, which is also the pod name prefix), `job_ids` (every
    attempt) and `output_dir` (the task run's `KINETIC_OUTPUT_DIR`).
    """

    def __init__(self, launch: TaskLaunch) -> None:
        super().__init__(launch.task_run.id, launch.future)
        self._launch = launch

    @property
    def job_id(self) -> str:
        return self._launch.job_ids[-1]

    @property
    def job_ids(self) -> list[str]:
        return list(self._launch.job_ids)

    @property
    def output_dir(self) -> str:
        return self._launch.output_dir

    @property
    def task_key(self) -> str:
        """The task run's stable identity in its flow run (the last part of `output_dir`)."""
        return self._launch.task_key

    @property
    def manifest(self) -> dict[str, Any]:
        """The Job manifest of the current attempt (empty until launched)."""
        return dict(self._launch.manifest)

    @property
    def data_bytes_uploaded(self) -> int:
        """Bytes of local `Data` this submission uploaded (0 when the cache had them)."""
        return self._launch.data_bytes_uploaded


def _contains_future(value: Any) -> bool:
    found = False

    def visit(item: Any) -> Any:
        nonlocal found
        if isinstance(item, (PrefectFuture, State)):
            found = True
        return item

    visit_collection(value, visit_fn=visit, return_data=False)
    return found


def _quoted_future(value: Any) -> bool:
    """Whether `value` holds a future inside `quote()`, which Prefect leaves unresolved
    (a quoted `State` is a value like any other)."""
    found = False

    def visit(item: Any, context: dict[str, Any]) -> Any:
        nonlocal found
        if isinstance(item, PrefectFuture) and isinstance(context.get("annotation"), quote):
            found = True
        return item

    visit_collection(value, visit_fn=visit, context={}, return_data=False)
    return found


def upstream_futures(parameters: dict[str, Any], wait_for: Any) -> list[PrefectFuture[Any]]:
    """The futures a task run waits on before it starts: those in `wait_for` and in its
    parameters, nested at any depth, as Prefect's engine resolves them (not inside `quote`)."""
    found: list[PrefectFuture[Any]] = []

    def visit(item: Any, context: dict[str, Any]) -> Any:
        if isinstance(context.get("annotation"), quote):
            raise StopVisiting()
        # Wrapped futures only (this runner's, a thread pool's): their callbacks fire in this
        # process. Any other kind (a `.delay()` future, whose API waiter keeps one callback
        # per task run) is waited on by Prefect's own resolution on a pool thread.
        if isinstance(item, PrefectWrappedFuture) and all(item is not f for f in found):
            found.append(item)
        return item

    for value in (*parameters.values(), wait_for):
        visit_collection(value, visit_fn=visit, return_data=False, max_depth=-1, context={})
    return found


class WhenDone:
    """Calls `start` once every one of `futures` is done, on the thread that finishes the
    last (at once when none is pending): a task run waiting for its upstreams holds no
    thread meanwhile."""

    def __init__(self, futures: list[PrefectFuture[Any]], start: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._left = len(futures) + 1  # one more, let go of once every callback is added
        self._start = start
        for future in futures:
            future.add_done_callback(self._one_done)
        self._one_done(None)

    def _one_done(self, _future: object) -> None:
        with self._lock:
            self._left -= 1
            ready = self._left == 0
        if ready:
            self._start()


def _cancelled_runner_error() -> RuntimeError:
    return RuntimeError(
        "This task runner was cancelled (cancel_all) and takes no new task runs; "
        "submit to a new KineticTaskRunner, or run the flow again."
    )


class KineticTaskRunner(TaskRunner[KineticFuture]):
    """Run each submitted task in its own Kinetic pod.

    Args:
        accelerator: accelerator name, e.g. `"cpu"`, `"l4x2"`, `"tpu-v5e-4"` (default `cpu`);
            add `:spot` for spot capacity. `kinetic-prefect accelerators` lists them.
        cluster: a `KineticCluster` block, its saved name, or None (then the block
            `KINETIC_CLUSTER` names, then `KINETIC_*` variables, then the embedded local
            backend).
        backend: `"local"` or `"gke"`; normally taken from the cluster.
        max_parallel: pods running at once (local default: the CPU count).
        container_image: image for the pod container (GKE).
        output_dir: explicit `KINETIC_OUTPUT_DIR` root for this runner's tasks.
        env: extra environment variables for every pod.
        timeout_seconds: the pod's deadline (`activeDeadlineSeconds`); on a warm pod, each
            task run's own deadline.
        warm_pods: keep a pod after its task for the next task run of the same pod spec
            (accelerator, image, env, volumes, code...) instead of starting a new one. Task
            runs in one pod share its interpreter and imported modules, as in the worker
            processes of `ProcessPoolTaskRunner`; each gets its own output dir, env and
            scratch dir. Multi-host slices are never warm. See docs/warm-pods.md.
        warm_pod_idle_seconds: how long an idle warm pod waits for its next task run
            (default 60). On GKE an idle pod keeps its node and accelerator, which cost money.
        cpu, memory: the pod's requests as Kubernetes quantities (`"8"`, `"64Gi"`); by
            default what the accelerator's machine leaves to pods (docs/kubernetes.md).
        pod_overrides: PodSpec fields merged into the pod spec (tolerations,
            `priorityClassName`, `imagePullSecrets`, volumes...); docs/kubernetes.md has the rule.
        queue_name: a Kueue LocalQueue (gke): every Job is created suspended in it and starts
            when Kueue admits it; time spent queued is not pending time (docs/kueue.md).
        queued_provisioning: the queue provisions its nodes through DWS flex-start with
            queued provisioning (gke): pods tolerate the taint GKE gives those nodes.
        job_labels, job_annotations: added to every Job's metadata (gke), for what Kueue
            and GKE read there: `kueue.x-k8s.io/priority-class`,
            `provreq.kueue.x-k8s.io/maxRunDurationSeconds`, ...
        **settings: any other setting of `kinetic_prefect.launch.settings.LaunchSettings`.

    Retries: an exception in the task is retried by Prefect's engine inside the
    pod, exactly as with Prefect's own runners (`retries`, `retry_delay_seconds`,
    `retry_condition_fn`). A pod that dies without reporting (killed, evicted,
    preempted, out of memory) is recorded as `AwaitingRetry` with the reason and
    relaunched for the same task run while the task has retries left; every pod
    of a task run sees the same `KINETIC_OUTPUT_DIR`, so it resumes from its
    checkpoint. `cancel_all()` (and leaving the flow) stops unfinished task runs,
    records them `Cancelled` and resolves their futures so; as with Prefect's own
    runners, `submit` then raises `RuntimeError` until the runner is entered again.

    Example:
        ```python
        @flow(task_runner=KineticTaskRunner(accelerator="tpu-v5e-1", warm_pods=True))
        def sweep(lrs: list[float]):
            return [f.result() for f in train.map(lrs)]
        ```
    """

    def __init__(
        self,
        accelerator: str | None = None,
        cluster: Any = None,
        backend: str | None = None,
        max_parallel: int | None = None,
        container_image: str | None = None,
        output_dir: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_seconds: int | None = None,
        package_root: str | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        self._options: dict[str, Any] = {
            "accelerator": accelerator,
            "backend": backend,
            "max_parallel": max_parallel,
            "container_image": container_image,
            "output_dir": output_dir,
            "env": {k: env_value(k, v) for k, v in env.items()} if env else None,
            "timeout_seconds": timeout_seconds,
            **settings,
        }
        # Fail on a misspelt setting now, without any I/O.
        resolve_settings(runner=self._options, environ={})
        self._cluster = cluster
        self._package_root = package_root
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._lock = threading.Lock()
        self._cancelled_all = False
        self._launches: dict[uuid.UUID, TaskLaunch] = {}
        self._submitter: concurrent.futures.ThreadPoolExecutor | None = None
        self._task_counts: dict[tuple[str, str], int] = {}
        self._cluster_block: Any = None
        self._checked_roots: set[str] = set()
        self._launcher = Launcher(
            RunnerResources(self._cluster_obj, self._package_root, self._flow_run_over)
        )

    # -- Prefect's task runner protocol ---------------------------------------

    def duplicate(self) -> Self:
        return type(self)(cluster=self._cluster, package_root=self._package_root, **self._options)

    def __getstate__(self) -> dict[str, Any]:
        # Threads, locks, backends and executors stay behind; the copy re-creates them.
        return {
            "_options": self._options,
            "_cluster": self._cluster,
            "_package_root": self._package_root,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__init__()
        self.__dict__.update(state)
        self._reset_runtime()

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, KineticTaskRunner)
            and self._options == other._options
            and self._cluster == other._cluster
        )

    def __hash__(self) -> int:
        return id(self)

    def __enter__(self) -> Self:
        super().__enter__()
        with self._lock:
            self._cancelled_all = False
        self._launcher.open()
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        try:
            self.cancel_all()
        finally:
            self._launcher.close()
            super().__exit__(exc_type, exc_value, traceback)

    def cancel_all(self) -> None:
        """Cancel every unfinished task run: pods stopped, runs and futures `Cancelled`.

        This is what leaving the flow does to task runs that are still going, and the
        runner takes no new work afterwards: `submit` raises `RuntimeError`, as with
        Prefect's own runners (a new runner, or this one entered again, works normally).
        Unlike Prefect's thread and process pools, which let a task that has started
        finish before the flow returns, a running pod is stopped too: a flow that
        returns without waiting on its futures does not keep accelerators busy for
        work nobody collects. Wait on the futures you want (`wait(futures)`).
        """
        with self._lock:
            self._cancelled_all = True
            pending = [launch for launch in self._launches.values() if not launch.future.done()]
            submitter, self._submitter = self._submitter, None
        self._launcher.cancel_many(pending, CANCELLED_ON_EXIT)
        if submitter is not None:
            # Every future is resolved, so submitter threads waiting on upstreams return now.
            submitter.shutdown(wait=True, cancel_futures=True)

    def _flow_run_over(self, flow_run_id: str) -> None:
        """The lease found the flow run cancelling or final while the flow is still in the
        runner: its unfinished task runs learn it before its pods can (`FlowRunOver`). The
        runner still takes work: Prefect's engine decides when the flow leaves it."""
        with self._lock:
            pending = [
                launch
                for launch in self._launches.values()
                if not launch.future.done() and str(launch.task_run.flow_run_id) == flow_run_id
            ]
        if pending:
            self._launcher.flow_run_over(pending)

    def submit(
        self,
        task: Task[Any, Any],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
        dependencies: dict[str, set[Any]] | None = None,
    ) -> KineticFuture:
        """Launch `task` with `parameters` in a pod; returns at once with a `KineticFuture`."""
        if not self._started:
            raise RuntimeError("The task runner must be started (use it as a flow's task_runner).")
        if self._cancelled_all:
            raise _cancelled_runner_error()
        settings = self._settings()
        accelerator = parse_accelerator(settings.accelerator, spot=spot_request(settings.spot))
        task = self._with_result_storage(task, settings)
        quoted = [name for name, value in parameters.items() if _quoted_future(value)]
        if quoted:
            raise PayloadError(
                f"Parameter {quoted[0]!r} of task {task.name!r} holds a PrefectFuture inside "
                "quote(): Prefect hands a quoted future to the task unresolved, and a future "
                "cannot travel to a pod. Pass the future without quote() to get its result in "
                "the pod, or pass future.result()."
            )
        check_picklable({k: v for k, v in parameters.items() if not _contains_future(v)}, task.name)
        task_run = prefect_bridge.new_task_run(
            task, uuid.uuid4(), parameters, wait_for, dependencies
        )
        task_key = self._task_key(task, task_run, parameters)
        launch = TaskLaunch(
            task=task,
            task_run=task_run,
            future=concurrent.futures.Future(),
            settings=settings,
            accelerator=accelerator,
            task_key=task_key,
            output_dir=self._output_dir(settings, task_run, task_key),
            context=contextvars.copy_context(),
            serialized_context=prefect_context.pod_context(task, task_run),
            state=RunState(
                job_ids=(make_job_id(task.name),),
                retries=task.retries or 0,
                preemption_retries=settings.preemption_retries,
            ),
        )
        with self._lock:
            submitter = None
            if not self._cancelled_all:
                self._launches[task_run.id] = launch
                if self._submitter is None:
                    self._submitter = concurrent.futures.ThreadPoolExecutor(
                        max_workers=8, thread_name_prefix="kinetic-submit"
                    )
                submitter = self._submitter
        if submitter is None:  # cancel_all() came while this run was being created
            self._launcher.cancel(launch, CANCELLED_ON_EXIT)
            raise _cancelled_runner_error()

        def start() -> None:
            if launch.cancelled:  # cancel_all() resolved it while it waited
                return
            try:
                submitter.submit(
                    launch.in_context,
                    self._launcher.prepare_and_launch,
                    launch,
                    parameters,
                    wait_for,
                    dependencies,
                )
            except RuntimeError:  # the pool was shut down by cancel_all() meanwhile
                self._launcher.cancel(launch, CANCELLED_ON_EXIT)
            except Exception as exc:  # on an upstream's callback: nobody else would see it
                message = f"Could not start the task run: {exc}"
                self._launcher.conclude(launch, Failed(message=message, data=exc))

        # Parked until its upstreams are done; then a pool thread resolves them at once.
        try:
            WhenDone(upstream_futures(parameters, wait_for), start)
        except Exception as exc:
            # The run exists in the API: it ends Failed rather than stay Pending.
            message = f"Could not wait for the task's upstream futures: {exc}"
            self._launcher.conclude(launch, Failed(message=message, data=exc))
        return KineticFuture(launch)

    def map(
        self,
        task: Task[Any, Any],
        parameters: dict[str, Any],
        wait_for: Iterable[PrefectFuture[Any]] | None = None,
    ) -> Any:
        return super().map(task, parameters, wait_for)

    # -- settings and checks before any pod ------------------------------------

    def _cluster_obj(self) -> Any:
        cluster = self._cluster if self._cluster is not None else os.environ.get(CLUSTER_ENV)
        if not cluster:
            return None
        if self._cluster_block is None:
            from kinetic_prefect.blocks import load_cluster

            self._cluster_block = load_cluster(cluster)
        return self._cluster_block

    def _settings(self) -> LaunchSettings:
        cluster = self._cluster_obj()
        block_settings: Mapping[str, Any] | None = None
        if cluster is not None:
            from kinetic_prefect.blocks import cluster_settings

            block_settings = cluster_settings(cluster)
        settings = resolve_settings(
            runner=self._options, overrides=current_overrides(), block=block_settings
        )
        self._check_storage(settings)
        return settings

    def _check_storage(self, settings: LaunchSettings) -> None:
        if settings.backend == "gke":
            # Pods elsewhere cannot reach a loopback API: refuse before anything is uploaded.
            preflight.check_api_reachable_by_pods(settings)
        jobs_root = settings.resolved_jobs_root()
        if jobs_root in self._checked_roots or "://" not in jobs_root:
            return
        preflight.check_jobs_root(jobs_root, self._cluster_obj())
        self._checked_roots.add(jobs_root)

    def _with_result_storage(self, task: Any, settings: LaunchSettings) -> Any:
        """Point the task's results at the cluster's result storage; refuse unusable storage."""
        cluster = self._cluster_obj()
        storage = task.result_storage
        from_cluster = storage is None and cluster is not None and cluster.result_storage
        if from_cluster:
            storage = cluster.result_storage
        elif storage is None and cluster is None and os.environ.get(RESULT_STORAGE_ENV):
            # A flow pod's runner: its worker handed the cluster's result storage down.
            from prefect.blocks.core import Block

            storage = Block.load_from_ref(os.environ[RESULT_STORAGE_ENV])
            from_cluster = True
        if "://" in settings.resolved_jobs_root():
            preflight.check_result_storage(storage)
        preflight.check_relative_result_storage(storage)
        if from_cluster:
            task = task.with_options(result_storage=storage, persist_result=True)
        return task

    def _task_key(self, task: Any, task_run: TaskRun, parameters: dict[str, Any]) -> str:
        """The task run's identity in its flow run (see `kinetic_prefect.launch.identity`)."""
        key = identity.base_key(task.name, parameters)
        flow_run_id = str(task_run.flow_run_id or "no-flow-run")
        with self._lock:
            index = self._task_counts.get((flow_run_id, key), 0)
            self._task_counts[(flow_run_id, key)] = index + 1
        return identity.with_occurrence(key, index)

    def _output_dir(self, settings: LaunchSettings, task_run: TaskRun, task_key: str) -> str:
        root = settings.output_dir or settings.resolved_output_root()
        return join_uri(root, str(task_run.flow_run_id or "no-flow-run"), task_key)

    # -- introspection --------------------------------------------------------

    def backend_of(self, future: KineticFuture) -> Backend | None:
        """The backend running `future`'s pods (for tooling and tests)."""
        launch = self._launches.get(future.task_run_id)
        return launch.backend if launch else None

    @property
    def launch_count(self) -> int:
        """Pods launched by this runner so far, over every backend."""
        return self._launcher.resources.launch_count
