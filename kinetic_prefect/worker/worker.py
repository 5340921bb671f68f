"""`KineticWorker` (work pool type `kinetic`): each deployed flow run in a Kinetic pod of its own.

For a flow run the worker plans its pod (`kinetic_prefect.worker.flow_pod`: settings
resolved as for task pods, the same Job manifest builder, Prefect's `prefect
flow-run execute` as the container command), launches it through a backend
and follows it to the end.

Inside the flow pod the flow's own `KineticTaskRunner` launches a pod per task:
the worker hands its cluster settings (backend, jobs root, output root, ...)
down as `KINETIC_*` variables, so those pods land where the flow pod did
unless the flow's runner names another cluster.

Stopping the worker leaves running flow pods alone, as Kubernetes-style
workers do: each flow run still reports its own final state.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets as token_source
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.events.filters import EventAnyResourceFilter
from prefect.exceptions import InfrastructureNotFound
from prefect.settings import get_current_settings
from prefect.workers.base import (
    BaseJobConfiguration,
    BaseVariables,
    BaseWorker,
    BaseWorkerResult,
)
from pydantic import BaseModel, Field, PrivateAttr

from kinetic_prefect.backends import create_backend
from kinetic_prefect.backends.base import Backend, PodExit
from kinetic_prefect.backends.environments import ready_environment

# The flow pod's identity: deployments/k8s/rbac.yaml binds it to the Role that may launch
# and watch the flow's task pods. Task pods keep the cluster's `service_account`.
from kinetic_prefect.backends.gke.permissions import RUNNER_SERVICE_ACCOUNT
from kinetic_prefect.common.storage import open_store
from kinetic_prefect.launch import prefect_context
from kinetic_prefect.launch.packaging import find_package_root
from kinetic_prefect.launch.settings import LaunchSettings
from kinetic_prefect.worker.flow_pod import (
    FLOW_RUN_COMMAND,
    RECORD_KEY_SECRET_KEY,
    FlowPodPlan,
    crash_message,
    exit_status,
    flow_pod_settings,
    plan_flow_pod,
    record_key_secret,
)
from kinetic_prefect.worker.prefect_observer import cancelling_observer

__all__ = [
    "FlowPodPlan",
    "KineticJobConfiguration",
    "KineticVariables",
    "KineticWorker",
    "KineticWorkerResult",
    "plan_flow_pod",
]

if TYPE_CHECKING:
    from uuid import UUID

    from prefect.client.schemas.objects import Flow as APIFlow
    from prefect.client.schemas.objects import FlowRun, WorkPool
    from prefect.client.schemas.responses import DeploymentResponse
    from prefect.logging.loggers import PrefectLogAdapter

_ACCELERATOR_HELP = (
    "Accelerator for the flow-run pod, e.g. cpu, l4x2, tpu-v5e-4 (`kinetic-prefect "
    "accelerators` lists them; add :spot for spot capacity). Default: the cluster's, else cpu."
)
_SPOT_HELP = "Run the flow-run pod on spot capacity."
_IMAGE_HELP = (
    "Container image for the flow-run pod (and, by default, its task pods). "
    "Default: the cluster's container_image, else python:3.11-slim."
)
_CLUSTER_HELP = (
    "Name of a saved KineticCluster block: where pods run (gke or local), jobs bucket, "
    "output root, result storage. Default: KINETIC_* variables of the worker, else local."
)
_TIMEOUT_HELP = "Deadline of the flow-run pod in seconds (activeDeadlineSeconds)."
_NAMESPACE_HELP = "Kubernetes namespace of the flow-run Job. Default: the cluster's, else default."
_CPU_HELP = (
    "CPU request of the flow-run pod, a Kubernetes quantity (8, 500m). Default: the cluster's, "
    "else what the accelerator's machine leaves to pods (1 for cpu)."
)
_MEMORY_HELP = (
    "Memory request of the flow-run pod, a Kubernetes quantity (64Gi, 512Mi). Default: the "
    "cluster's, else what the accelerator's machine leaves to pods (2Gi for cpu)."
)
_POD_OVERRIDES_HELP = (
    "PodSpec fields merged into the flow-run pod's spec (tolerations, priorityClassName, "
    "imagePullSecrets, volumes, ...); see docs/kubernetes.md for the merge rule."
)
_QUEUE_NAME_HELP = (
    "Kueue LocalQueue (in the Job's namespace) that admits the flow-run pod's Job and, unless "
    "the flow's runner names another, its task pods' Jobs: they are created suspended and "
    "start when Kueue admits them (docs/kueue.md). Default: the cluster's, else none."
)
_QUEUED_PROVISIONING_HELP = (
    "The queue provisions nodes through DWS flex-start with queued provisioning: the pods "
    "tolerate the cloud.google.com/gke-queued taint of those nodes (docs/kueue.md)."
)
_JOB_LABELS_HELP = "Labels added to the flow-run pod's Job and its task pods' Jobs."
_JOB_ANNOTATIONS_HELP = (
    "Annotations added to the flow-run pod's Job and its task pods' Jobs (e.g. "
    "provreq.kueue.x-k8s.io/maxRunDurationSeconds)."
)
_FLOW_SERVICE_ACCOUNT_HELP = (
    "Kubernetes service account of the flow-run pod, with its token mounted: it launches the "
    "flow's task pods, so it needs the kinetic-prefect-runner Role of deployments/k8s/rbac.yaml. "
    "The task pods run as the cluster's service_account."
)


class _KineticPodFields(BaseModel):
    """The pod settings a work pool exposes: shared by the job variables and configuration."""

    accelerator: str | None = Field(default=None, description=_ACCELERATOR_HELP)
    spot: bool | None = Field(default=None, description=_SPOT_HELP)
    image: str | None = Field(default=None, description=_IMAGE_HELP)
    cluster: str | None = Field(default=None, description=_CLUSTER_HELP)
    timeout_seconds: int | None = Field(default=None, gt=0, description=_TIMEOUT_HELP)
    namespace: str | None = Field(default=None, description=_NAMESPACE_HELP)
    cpu: str | None = Field(default=None, description=_CPU_HELP)
    memory: str | None = Field(default=None, description=_MEMORY_HELP)
    pod_overrides: dict[str, Any] | None = Field(default=None, description=_POD_OVERRIDES_HELP)
    queue_name: str | None = Field(default=None, description=_QUEUE_NAME_HELP)
    queued_provisioning: bool | None = Field(default=None, description=_QUEUED_PROVISIONING_HELP)
    job_labels: dict[str, str] | None = Field(default=None, description=_JOB_LABELS_HELP)
    job_annotations: dict[str, str] | None = Field(default=None, description=_JOB_ANNOTATIONS_HELP)
    flow_service_account: str = Field(
        default=RUNNER_SERVICE_ACCOUNT, min_length=1, description=_FLOW_SERVICE_ACCOUNT_HELP
    )


class KineticJobConfiguration(_KineticPodFields, BaseJobConfiguration):
    """A flow run's pod, as the work pool's base job template and job variables describe it."""

    _user_labels: dict[str, str] = PrivateAttr(default_factory=dict)
    _flow_name: str | None = PrivateAttr(default=None)
    _pool_name: str | None = PrivateAttr(default=None)

    def prepare_for_flow_run(
        self,
        flow_run: FlowRun,
        deployment: DeploymentResponse | None = None,
        flow: APIFlow | None = None,
        work_pool: WorkPool | None = None,
        worker_name: str | None = None,
        worker_id: UUID | None = None,
    ) -> None:
        # Prefect adds `prefect.io/*` labels (flow-run id among them) here; the pod keeps
        # the kinetic labels and the user's own only, so Prefect's Kubernetes observer
        # never mistakes it for one of its pods.
        self._user_labels = dict(self.labels)
        self._flow_name = flow.name if flow is not None else None
        self._pool_name = work_pool.name if work_pool is not None else None
        super().prepare_for_flow_run(
            flow_run, deployment, flow, work_pool, worker_name, worker_id=worker_id
        )

    @classmethod
    def _base_environment(cls) -> dict[str, str]:
        # This process's Prefect settings without secrets (they travel as Secret
        # refs) and without what only makes sense here (database URL, PREFECT_HOME).
        return prefect_context.pod_settings_env()

    @staticmethod
    def _base_flow_run_command() -> str:
        return FLOW_RUN_COMMAND

    @property
    def user_labels(self) -> dict[str, str]:
        """Labels from the `labels` job variable, without the ones Prefect adds."""
        return dict(self._user_labels)

    @property
    def flow_name(self) -> str | None:
        return self._flow_name

    @property
    def pool_name(self) -> str | None:
        """The work pool the flow run came from."""
        return self._pool_name


class KineticVariables(_KineticPodFields, BaseVariables):
    """Job variables of a `kinetic` work pool; a deployment's `job_variables` override them."""


class KineticWorkerResult(BaseWorkerResult):
    """How a flow-run pod ended: `identifier` is its job id."""


@dataclass
class _FlowPod:
    """A launched flow-run pod the worker follows until it ends."""

    job_id: str
    backend: Backend
    loop: asyncio.AbstractEventLoop
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    deadline_seconds: int | None = None
    # Time for the backend to report a cancelled pod's exit beyond Prefect's grace period.
    exit_report_margin_seconds: float = 15.0
    outcome: PodExit | None = None
    cancelled_by_worker: bool = False

    def on_exit(self, outcome: PodExit) -> None:
        # Called on the backend's watcher thread.
        self.outcome = outcome
        with contextlib.suppress(RuntimeError):  # the worker's loop is already closed
            self.loop.call_soon_threadsafe(self.ended.set)


class KineticWorker(BaseWorker[KineticJobConfiguration, KineticVariables, KineticWorkerResult]):
    """Runs each flow run of a `kinetic` work pool in its own Kinetic pod.

    Example:
        ```bash
        prefect work-pool create -t kinetic gpu-pool
        prefect worker start --pool gpu-pool          # the pool's type picks this worker
        prefect deploy --prefect-file deployments/prefect.yaml --all
        ```
    """

    type = "kinetic"
    job_configuration = KineticJobConfiguration
    job_configuration_variables = KineticVariables
    _description = (
        "Run each flow run in a Kinetic pod on a TPU/GPU/CPU node of GKE (or as a local "
        "process); the flow's KineticTaskRunner tasks get pods of their own."
    )
    _display_name = "Kinetic"
    _documentation_url = "https://pypi.org/project/kinetic-prefect/"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._backends: dict[tuple[str, str, str], Backend] = {}
        self._pods: dict[str, _FlowPod] = {}
        self._checked_roots: set[str] = set()
        self._pod_observer: Any = None

    async def setup(self) -> None:
        await super().setup()
        settings = get_current_settings().worker
        if not settings.enable_cancellation:
            return
        # Prefect's own observer forgets a run once its infrastructure id is reported;
        # a pod can then still wait minutes for a node before the flow starts, and only
        # this worker can stop it. Once the flow has started, its pod handles cancelling.
        pool_filter = (
            EventAnyResourceFilter(id=[f"prefect.work-pool.{self._work_pool.id}"])
            if self._work_pool is not None
            else None
        )
        self._pod_observer = await self._exit_stack.enter_async_context(
            cancelling_observer(
                self._on_cancelling, settings.cancellation_poll_seconds, pool_filter
            )
        )

    def _on_cancelling(self, flow_run_id: UUID) -> None:
        if self._runs_task_group is not None:
            self._runs_task_group.start_soon(self._cancel_run, flow_run_id)

    async def run(
        self,
        flow_run: FlowRun,
        configuration: KineticJobConfiguration,
        task_status: anyio.abc.TaskStatus[Any] | None = None,
    ) -> KineticWorkerResult:
        """Launch the flow run's pod, report its job id, and follow it until it ends."""
        logger = self.get_flow_run_logger(flow_run)
        pod = await anyio.to_thread.run_sync(
            self._launch, flow_run, configuration, logger, asyncio.get_running_loop()
        )
        if task_status is not None:
            task_status.started(pod.job_id)
        if self._pod_observer is not None:
            self._pod_observer.add_in_flight_flow_run_id(flow_run.id)
        try:
            await pod.ended.wait()
        finally:
            if self._pod_observer is not None:
                self._pod_observer.remove_in_flight_flow_run_id(flow_run.id)
            with self._lock:
                self._pods.pop(pod.job_id, None)
        if pod.outcome is not None:
            await anyio.to_thread.run_sync(pod.backend.forget, pod.job_id)
        outcome = pod.outcome
        assert outcome is not None
        # A pod the worker stopped is not a crash: its flow run is being cancelled.
        status = 0 if pod.cancelled_by_worker else exit_status(outcome)
        crash = crash_message(pod.job_id, outcome, pod.deadline_seconds)
        if crash is not None and not pod.cancelled_by_worker:
            # Said before Prefect's generic "exited with non-zero status" can be.
            logger.error(crash)
            await self._propose_crashed_state(flow_run, crash)
        elif status != 0:
            tail = f" Last log lines:\n{outcome.log_tail}" if outcome.log_tail else ""
            logger.error("Flow-run pod %s: %s.%s", pod.job_id, outcome.describe(), tail)
        else:
            logger.info("Flow-run pod %s: %s.", pod.job_id, outcome.describe())
        return KineticWorkerResult(identifier=pod.job_id, status_code=status)

    async def sync_with_backend(self) -> None:
        """Prefect's periodic sync, and a pass that forgets flow-run pods no run follows."""
        await super().sync_with_backend()
        await anyio.to_thread.run_sync(self._forget_unfollowed)

    def _forget_unfollowed(self) -> None:
        """Forget every ended job no run follows (a run ended before its pod was seen out)."""
        with self._lock:
            backends = list(self._backends.values())
            followed = set(self._pods)
        for backend in backends:
            for job_id in set(backend.kept_jobs()) - followed:
                backend.forget(job_id)

    def kept_jobs(self) -> list[str]:
        """The flow-run pods the worker (or its backends) keeps anything about.

        Empty once every flow run it launched has ended: nothing grows with the runs.
        """
        with self._lock:
            backends = list(self._backends.values())
            followed = list(self._pods)
        kept = {job_id for backend in backends for job_id in backend.kept_jobs()}
        return sorted(kept.union(followed))

    async def kill_infrastructure(
        self,
        infrastructure_pid: str,
        configuration: KineticJobConfiguration,
        grace_seconds: int = 30,
    ) -> None:
        """Cancel the flow run's pod (its Job, on GKE) and wait until it has ended."""
        with self._lock:
            pod = self._pods.get(infrastructure_pid)
        if pod is None:
            raise InfrastructureNotFound(
                f"Flow-run pod {infrastructure_pid} is not one this worker follows: it has "
                "ended, or another worker launched it (on GKE, `kubectl delete job "
                f"{infrastructure_pid}` stops it)."
            )
        pod.cancelled_by_worker = True
        await anyio.to_thread.run_sync(pod.backend.cancel, pod.job_id)
        with anyio.move_on_after(grace_seconds + pod.exit_report_margin_seconds):
            await pod.ended.wait()

    # -- launching (on a worker thread: settings, blocks and backends do blocking I/O) ----

    def _launch(
        self,
        flow_run: FlowRun,
        configuration: KineticJobConfiguration,
        logger: PrefectLogAdapter,
        loop: asyncio.AbstractEventLoop,
    ) -> _FlowPod:
        cluster = self._cluster(configuration.cluster)
        settings = flow_pod_settings(configuration, cluster)
        # Local flow pods share this machine's key file (`record_key.key_file`).
        key_secret = None
        if settings.backend == "gke" and configuration.pool_name:
            key_secret = record_key_secret(configuration.pool_name)
        plan = plan_flow_pod(flow_run, configuration, cluster, key_secret)
        jobs_root = settings.resolved_jobs_root()
        self._check_storage(jobs_root, cluster)
        backend = self._backend_for(settings, jobs_root, configuration.cluster, cluster)
        if key_secret is not None:
            self._ensure_record_key(backend, settings.namespace, key_secret)
        if settings.ships_environment():
            # The flow pod starts from the stock image too; its environment is planned
            # from the project the worker runs in (its working directory).
            environment = ready_environment(
                settings,
                plan.spec.accelerator,
                find_package_root(None),
                open_store(settings.resolved_environment_store(), settings.gcp_credentials),
                backend,
            )
            plan = plan.with_environment(environment)
        pod = _FlowPod(
            job_id=plan.spec.job_id,
            backend=backend,
            loop=loop,
            deadline_seconds=plan.spec.timeout_seconds,
            exit_report_margin_seconds=settings.intervals.exit_report_margin_seconds,
        )
        with self._lock:
            self._pods[pod.job_id] = pod
        try:
            backend.launch(
                plan.manifest,
                on_exit=pod.on_exit,
                secrets=plan.backend_secrets(),
                on_pending=lambda reason: logger.info(
                    "Flow-run pod %s is pending: %s", pod.job_id, reason
                ),
            )
        except BaseException:
            with self._lock:
                self._pods.pop(pod.job_id, None)
            raise
        accelerator = plan.spec.accelerator
        logger.info(
            "Launched flow-run pod %s (%s%s, %s backend); KINETIC_OUTPUT_DIR=%s",
            pod.job_id,
            accelerator.name,
            " spot" if accelerator.spot else "",
            settings.backend,
            plan.spec.output_dir,
        )
        return pod

    def _ensure_record_key(self, backend: Backend, namespace: str, name: str) -> None:
        """Create the pool's record-key Secret once; one that exists keeps its key."""
        from kinetic_prefect.backends.gke.backend import KubernetesBackend

        if isinstance(backend, KubernetesBackend):
            backend.keep_secret(
                namespace, name, {RECORD_KEY_SECRET_KEY: token_source.token_hex(32)}
            )

    def _cluster(self, name: str | None) -> Any:
        if not name:
            return None
        from kinetic_prefect.blocks import load_cluster

        return load_cluster(name)

    def _check_storage(self, jobs_root: str, cluster: Any) -> None:
        if "://" not in jobs_root or jobs_root in self._checked_roots:
            return
        from kinetic_prefect.launch import preflight

        preflight.check_jobs_root(jobs_root, cluster)
        self._checked_roots.add(jobs_root)

    def _backend_for(
        self, settings: LaunchSettings, jobs_root: str, cluster_name: str | None, cluster: Any
    ) -> Backend:
        key = (settings.backend, jobs_root, cluster_name or "")
        with self._lock:
            backend = self._backends.get(key)
            if backend is None:
                backend = create_backend(settings, jobs_root, cluster)
                self._backends[key] = backend
            return backend
