"""The gke backend: each pod is a Kubernetes Job, created and watched with kubernetes-asyncio.

Owns `KubernetesBackend`: its synchronous API (launch, cancel, logs, close), the
event loop thread every API call runs on, creating Jobs within `max_parallel`
(with their Secret, `secrets`), deleting them, and reporting how
each job ended. What is known of
each job comes from `kube_watch.JobWatch`; when and how it ended is decided by
`kube_outcomes.OutcomeTracker`; both read Job and pod objects through
`kube_status`. Where Jobs waiting in a Kueue queue stand is read by
`kube_kueue.QueueReader`, only while any waits.

Threads: every API call runs on one event loop in one background thread. The
runner's callbacks are synchronous and may block (GCS reads, Prefect API calls),
so they run on a small thread pool, in order per job, and never hold up the watch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import datetime
import secrets as token_source
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from prefect.logging import get_logger

from kinetic_prefect.backends.base import FoundPod, OnExit, OnPending, Secrets
from kinetic_prefect.backends.gke.admission import NodeCacheAdmission
from kinetic_prefect.backends.gke.client import (
    MANAGED_SELECTOR,
    api_error_message,
    connect,
    create_idempotently,
    pods_of_job,
    put_secret,
    read_json,
)
from kinetic_prefect.backends.gke.ending import JobEnding
from kinetic_prefect.backends.gke.kueue import QueueReader
from kinetic_prefect.backends.gke.loop_thread import LoopThread
from kinetic_prefect.backends.gke.outcomes import OutcomeTracker
from kinetic_prefect.backends.gke.secrets import JobSecrets
from kinetic_prefect.backends.gke.slice import create_services
from kinetic_prefect.backends.gke.status import suspended, true_condition
from kinetic_prefect.backends.gke.watch import JobWatch, TrackedJob
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.launch.manifest import (
    LABEL_FLOW_RUN_ID,
    LABEL_JOB_ID,
    LABEL_MANAGED_BY,
    LABEL_TASK_IDENTITY,
    LABEL_WARM,
    MANAGED_BY,
)
from kinetic_prefect.launch.slices import hosts_of

logger = get_logger("kinetic_prefect.backends.gke.backend")

# Which backend instance (runner) owns a Job: its watch selects on this label only.
LABEL_RUNNER = "kinetic-prefect.io/runner"
# A Secret no Job owns and no cleanup removes (a work pool's record key).
LABEL_KEPT_SECRET = "kinetic-prefect.io/kept"


# A finished Job is trusted to exist (and to keep its Secret) for this share of its TTL.
TTL_TRUST = 0.5


def _labels(obj: Any) -> dict[str, str]:
    return dict(((obj or {}).get("metadata") or {}).get("labels") or {})


class KubernetesBackend(JobEnding):
    """Runs pods as Kubernetes Jobs on the cluster a `KineticCluster` (or kubeconfig) names.

    Example:
        ```python
        backend = KubernetesBackend("gs://my-jobs", cluster=KineticCluster.load("gke"))
        backend.launch(manifest, on_exit=print, secrets={})
        ```
    """

    def __init__(
        self,
        jobs_root: str,
        cluster: Any = None,
        max_parallel: int | None = None,
        pending_timeout_seconds: float = 600.0,
        queue_timeout_seconds: float | None = None,
        cancel_grace_seconds: float = 10.0,
        kube_context: str | None = None,
        credentials_denied_timeout_seconds: float = 120.0,
        intervals: Intervals | None = None,
    ) -> None:
        self.intervals = intervals = intervals or Intervals()
        self.jobs_root = jobs_root
        self.cluster = cluster
        self.max_parallel = max_parallel
        self.pending_timeout_seconds = pending_timeout_seconds
        self.cancel_grace_seconds = cancel_grace_seconds
        self.kube_context = kube_context
        self.runner_id = token_source.token_hex(6)
        self.launch_count = 0
        self._lock = threading.Lock()
        self._closed = False
        self._runtime = LoopThread("kinetic-gke-watcher", on_shutdown=self._close_access)
        self._callbacks = concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="kinetic-gke-callback"
        )
        # Loop-side state: touched only on the backend's event loop.
        self._access: Any = None
        self._batch: Any = None
        self._core: Any = None
        self._jobs: dict[str, TrackedJob] = {}
        self._queued: collections.deque[TrackedJob] = collections.deque()
        self._active = 0
        self._secrets = JobSecrets(self._job_may_exist, intervals.owner_batch_seconds)
        self._connect_lock: asyncio.Lock | None = None
        # Whether each namespace admits the node's environment cache (backends/gke/admission.py).
        self._admission = NodeCacheAdmission()
        # Where Jobs waiting in a Kueue LocalQueue stand, read only while any waits.
        self._queue_reader = QueueReader(
            self._jobs,
            lambda: self._access.client,
            self._report_pending,
            self._start_failing,
            intervals.queue_poll_seconds,
            intervals.missing_queue_grace_seconds,
        )
        self._outcomes = OutcomeTracker(
            self._jobs,
            cancel_grace_seconds=cancel_grace_seconds,
            pending_timeout_seconds=pending_timeout_seconds,
            queue_timeout_seconds=queue_timeout_seconds,
            conclude=self._conclude,
            report_pending=self._report_pending,
            fail_to_start=self._start_failing,
            probe_events=lambda job: self._runtime.spawn(self._probe_events(job)),
            on_queued=lambda job: self._queue_reader.poke(),
            evict=self._evict,
            intervals=intervals,
        )
        self._watch = JobWatch(
            self.selector,
            self._jobs,
            self._outcomes.evaluate,
            self._start_failing,
            self._reload_credentials,
            credentials_denied_timeout_seconds,
            intervals.watch_timeout_seconds,
        )

    # -- public API (any thread but the loop's) ---------------------------------------

    @property
    def selector(self) -> str:
        """The label selector of this backend's Jobs and pods."""
        return f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_RUNNER}={self.runner_id}"

    def launch(
        self,
        manifest: dict[str, Any],
        on_exit: OnExit,
        secrets: Secrets,
        on_pending: OnPending | None = None,
        extra_objects: Sequence[dict[str, Any]] = (),
    ) -> None:
        manifest = copy.deepcopy(manifest)
        companions = tuple(copy.deepcopy(obj) for obj in extra_objects)
        for meta in (
            manifest["metadata"],
            manifest["spec"]["template"]["metadata"],
            *(obj["metadata"] for obj in companions),
        ):
            meta.setdefault("labels", {})[LABEL_RUNNER] = self.runner_id
        job_id = manifest["metadata"]["name"]
        namespace = manifest["metadata"].get("namespace") or "default"
        with self._lock:
            if self._closed:
                raise RuntimeError("The gke backend is closed; submit inside the flow run.")
            self.launch_count += 1
        self._runtime.start()
        self._runtime.call(self._connect())
        job = TrackedJob(job_id, namespace, manifest, on_exit, on_pending)
        job.hosts, job.extra_objects = hosts_of(manifest), companions
        job.secret_names = tuple(secrets)
        self._runtime.call(self._launch(job, secrets))

    def find_pods(self, flow_run_id: str, namespace: str) -> list[FoundPod]:
        """The flow run's Jobs in `namespace` that other runners launched: one list request."""
        self._runtime.start()
        self._runtime.call(self._connect())
        return list(self._runtime.call(self._find_pods(flow_run_id, namespace)))

    def adopt(
        self,
        job_id: str,
        namespace: str,
        on_exit: OnExit,
        on_pending: OnPending | None = None,
    ) -> None:
        """Watch a live Job another runner launched: relabel it and its pods as this runner's."""
        with self._lock:
            if self._closed:
                raise RuntimeError("The gke backend is closed; submit inside the flow run.")
        self._runtime.start()
        self._runtime.call(self._connect())
        job = TrackedJob(job_id, namespace, {}, on_exit, on_pending)
        self._runtime.call(self._adopt(job))

    def cancel(self, job_id: str) -> None:
        if not self._runtime.started:
            return
        self._runtime.call(self._cancel(job_id))

    def logs(self, job_id: str, tail: int | None = None) -> str:
        """The pod's log (its last `tail` lines), or "" when the pod is gone."""
        self._runtime.start()
        self._runtime.call(self._connect())
        return str(self._runtime.call(self._logs(job_id, tail)))

    def keep_secret(self, namespace: str, name: str, values: dict[str, str]) -> None:
        """Create a Secret that outlives every Job (no owners, no managed-by label).

        One that exists already is kept as it is, unread: its values win over `values`.
        """
        self._runtime.start()
        self._runtime.call(self._connect())
        labels = {LABEL_KEPT_SECRET: "true"}
        self._runtime.call(put_secret(self._core, namespace, name, values, labels=labels))

    def forget(self, job_id: str) -> None:
        if self._runtime.started:
            self._runtime.call(self._forget(job_id))

    def kept_jobs(self) -> list[str]:
        if not self._runtime.started:
            return []
        return list(self._runtime.call(self._kept_jobs()))

    def close(self) -> None:
        """Cancel every job still running, wait for their exits, and stop the watcher."""
        with self._lock:
            self._closed = True
            started = self._runtime.started
        if started:
            deadline = self._outcomes.settle_seconds()
            try:
                self._runtime.call(self._drain(deadline))
            finally:
                self._runtime.stop()
        self._callbacks.shutdown(wait=True)

    # -- on the loop ------------------------------------------------------------------

    async def _connect(self) -> Any:
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:  # launches from several threads arrive together
            if self._access is None:
                access = await connect(self.cluster, self.kube_context)
                self._batch = client.BatchV1Api(access.client)
                self._core = client.CoreV1Api(access.client)
                self._access = access
                self._runtime.spawn(access.keep_token_fresh(self.intervals.token_refresh_seconds))
                self._runtime.spawn(self._outcomes.run())
                self._runtime.spawn(self._queue_reader.run())
        return self._access

    async def _forget(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is not None and job.done:
            del self._jobs[job_id]
            self._secrets.forget_gone_owners()

    async def _kept_jobs(self) -> list[str]:
        return list(self._jobs)

    async def _reload_credentials(self) -> None:
        if self._access is not None:
            await self._access.reload_credentials()

    async def _close_access(self) -> None:
        if self._access is not None:
            await self._access.close()

    # -- callbacks --------------------------------------------------------------------

    def _dispatch(self, job: TrackedJob, fn: Callable[[Any], None], arg: Any) -> None:
        """Run a runner callback off the loop, after the job's earlier callbacks."""
        previous = job.last_callback

        def call() -> None:
            if previous is not None:
                concurrent.futures.wait([previous])
            try:
                fn(arg)
            except Exception:
                logger.exception("A callback for pod %s failed", job.job_id)

        job.last_callback = self._callbacks.submit(call)

    # -- launching --------------------------------------------------------------------

    async def _launch(self, job: TrackedJob, secrets: Secrets) -> None:
        await self._secrets.ensure(self._core, job.namespace, secrets)
        for stream in self._watch.streams(job.namespace, self._batch, self._core):
            self._runtime.spawn(stream)
        self._jobs[job.job_id] = job
        if self.max_parallel and self._active >= self.max_parallel:
            self._queued.append(job)
            return
        try:
            await self._create(job)
        except BaseException:
            self._jobs.pop(job.job_id, None)
            raise

    async def _create(self, job: TrackedJob) -> None:
        self._active += 1
        job.counted = True
        created: dict[str, Any] | None
        try:
            job.manifest = await self._admission.admit(self._core, job.namespace, job.manifest)
            created = await create_idempotently(
                lambda: self._batch.create_namespaced_job(
                    job.namespace, body=job.manifest, _preload_content=False
                ),
                lambda: self._batch.read_namespaced_job(
                    job.job_id, job.namespace, _preload_content=False
                ),
                lambda found: _labels(found).get(LABEL_JOB_ID) == job.job_id,
                f"Job {job.namespace}/{job.job_id}",
            )
        except Exception as exc:
            # The last attempt's answer may have been lost after the Job was stored.
            created = await self._existing_job(job)
            if created is None:
                self._active -= 1
                job.counted = False
                raise RuntimeError(
                    f"Could not create Job {job.namespace}/{job.job_id}: {api_error_message(exc)}"
                ) from exc
        self._watch.note_created(job)
        self._outcomes.start_clock(job)
        self._secrets.add_owner(self._core, job.namespace, job.secret_names, created)
        if job.extra_objects:
            await self._create_services(job, created)

    async def _create_services(self, job: TrackedJob, created: dict[str, Any]) -> None:
        """A slice's headless Service, owned by its Job; without it the hosts cannot meet."""
        try:
            await create_services(self._core, job.namespace, job.extra_objects, created)
        except Exception as exc:
            self._start_failing(
                job,
                f"could not create the slice's headless Service: {api_error_message(exc)} "
                "(the runner's service account needs create/delete on services)",
            )

    def _job_may_exist(self, namespace: str, job_id: str) -> bool:
        """Whether the Job may still exist: not deleted, not past its TTL (with a margin)."""
        job = self._jobs.get(job_id)
        if job is None or job.namespace != namespace:
            return False
        if job.job_gone or job.cancelled or job.failing_to_start:
            return False
        if job.ended_at is None:
            return True
        ttl = (job.manifest.get("spec") or {}).get("ttlSecondsAfterFinished")
        return ttl is None or time.monotonic() - job.ended_at < ttl * TTL_TRUST

    async def _existing_job(self, job: TrackedJob) -> dict[str, Any] | None:
        """The Job under this job's name if it is this job's; None if there is none."""
        try:
            found = await read_json(
                await self._batch.read_namespaced_job(
                    job.job_id, job.namespace, _preload_content=False
                )
            )
        except Exception:
            return None
        return dict(found) if _labels(found).get(LABEL_JOB_ID) == job.job_id else None

    # -- jobs of other runners ----------------------------------------------------------

    async def _find_pods(self, flow_run_id: str, namespace: str) -> list[FoundPod]:
        try:
            listing = await read_json(
                await self._batch.list_namespaced_job(
                    namespace,
                    label_selector=f"{MANAGED_SELECTOR},{LABEL_FLOW_RUN_ID}={flow_run_id}",
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            raise RuntimeError(
                f"Could not list the Jobs of flow run {flow_run_id} in namespace {namespace}: "
                f"{api_error_message(exc)}"
            ) from exc
        found = []
        for item in listing.get("items") or []:
            meta = item.get("metadata") or {}
            labels = meta.get("labels") or {}
            job_id = labels.get(LABEL_JOB_ID, meta.get("name", ""))
            if labels.get(LABEL_RUNNER) == self.runner_id or job_id in self._jobs:
                continue
            ended = true_condition(item, "Complete") or true_condition(item, "Failed")
            created = meta.get("creationTimestamp") or "1970-01-01T00:00:00Z"
            launched_at = datetime.datetime.fromisoformat(created.replace("Z", "+00:00"))
            identity = labels.get(LABEL_TASK_IDENTITY, "")
            warm = labels.get(LABEL_WARM) == "true"
            found.append(FoundPod(job_id, identity, not ended, launched_at.timestamp(), warm))
        return sorted(found, key=lambda pod: pod.launched_at, reverse=True)

    async def _adopt(self, job: TrackedJob) -> None:
        """Relabel the Job and its pods so this backend's watch selects them, then track it.

        The objects the patches return are applied once the job is tracked; what
        changes later arrives on the watch.
        """
        relabel = {"metadata": {"labels": {LABEL_RUNNER: self.runner_id}}}
        try:
            found = await read_json(
                await self._batch.patch_namespaced_job(
                    job.job_id, job.namespace, relabel, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            found = None
        if suspended(found):
            # Queued in Kueue: its pods are still to be made from the template, which a
            # suspended Job may change (its labels among them); they must carry this label.
            found = await self._relabel_template(job, found, relabel) or found
        pods = []
        for pod in await pods_of_job(self._core, job.namespace, job.job_id) if found else []:
            with contextlib.suppress(ApiException):  # a pod already gone is no loss
                name = pod["metadata"]["name"]
                pods.append(
                    await read_json(
                        await self._core.patch_namespaced_pod(
                            name, job.namespace, relabel, _preload_content=False
                        )
                    )
                )
        job.manifest = found or {}
        job.hosts = hosts_of(job.manifest)
        self._jobs[job.job_id] = job
        for stream in self._watch.streams(job.namespace, self._batch, self._core):
            self._runtime.spawn(stream)
        self._active += 1
        job.counted = True
        self._watch.note_created(job)
        self._outcomes.start_clock(job)
        if found is None:
            self._conclude(job, None, None, "its Job was deleted before it could be adopted")
            return
        self._watch.observe("job", found)
        for pod in pods:
            self._watch.observe("pod", pod)

    async def _relabel_template(
        self, job: TrackedJob, found: dict[str, Any], relabel: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Label the pod template of a suspended Job as this runner's; None if it was admitted."""
        try:
            return dict(
                await read_json(
                    await self._batch.patch_namespaced_job(
                        job.job_id,
                        job.namespace,
                        {"spec": {"template": relabel}},
                        _preload_content=False,
                    )
                )
            )
        except ApiException as exc:
            # Admitted in between (the template is immutable again): its pods are listed
            # and relabelled below, as a running Job's are.
            logger.info("Could not relabel the pod template of %s: %s", job.job_id, exc.status)
            return None

    async def _create_queued(self) -> None:
        while self._queued and not (self.max_parallel and self._active >= self.max_parallel):
            job = self._queued.popleft()
            if job.done:
                continue
            try:
                await self._create(job)
            except Exception as exc:
                self._conclude(job, None, None, "", start_failure=str(exc))
