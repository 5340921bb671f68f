"""The gke backend: each pod is a Kubernetes Job, created and watched with kubernetes-asyncio.

Threads: every API call runs on one event loop in one background thread. The
runner's callbacks are synchronous and may block (GCS reads, Prefect API calls),
so they run on a small thread pool, in order per job, and never hold up the watch.

Watching: one watcher per backend instance, made of a Job stream and a pod
stream per namespace, selecting only this instance's objects by label
(`kinetic-prefect.io/runner`). A stream that ends or breaks resumes from the
last resourceVersion it saw; on 410 Gone it relists and reconciles every job it
tracks against the listing, so a pod that finished (or vanished) in the gap is
still noticed. Handling is level-based: every event carries the object's whole
state, and each job is re-evaluated from what was last seen of its Job and pod.

Outcomes: a pod in a terminal phase ends its job with the container's exit code
and the most telling reason (preempted, Evicted, OOMKilled, DeadlineExceeded).
A pod that waits to start reports why (image pull, unschedulable, quota) through
`on_pending`, and past `pending_timeout_seconds` its Job is deleted and the job
ends with `start_failure`.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import contextlib
import copy
import datetime
import hashlib
import json
import secrets as token_source
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prefect.logging import get_logger

from kinetic_prefect.backends.base import OnExit, OnPending, PodExit, Secrets
from kinetic_prefect.manifest import (
    ANNOTATION_ACCELERATOR,
    CONTAINER_NAME,
    LABEL_JOB_ID,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    container_of,
)
from kinetic_prefect.storage import open_store

logger = get_logger("kinetic_prefect.backends.kubernetes")

T = TypeVar("T")

# Which backend instance (runner) owns a Job: its watch selects on this label only.
LABEL_RUNNER = "kinetic-prefect.io/runner"
HANDLE_FILE = "handle.json"
LOG_TAIL_LINES = 20
# The API server ends a watch after at most this long; the watcher then resumes.
WATCH_TIMEOUT_SECONDS = 300
# A Job that has no pod after this long is checked for FailedCreate events (quota).
EVENTS_PROBE_SECONDS = 10.0
EVENTS_PROBE_INTERVAL = 15.0
# How long to wait for a pod's own final status after its Job ended or was deleted.
SETTLE_MARGIN_SECONDS = 30.0
# How long to wait for the Job's reason after its pod vanished without a final status.
POD_GONE_SETTLE_SECONDS = 5.0

_IMAGE_WAITING_REASONS = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
}
_CONFIG_WAITING_REASONS = {"CreateContainerConfigError", "CreateContainerError"}
_DISRUPTIONS = {
    "PreemptionByScheduler": "preempted by the scheduler for a higher-priority pod",
    "TerminationByKubelet": "preempted: the node is shutting down (spot or maintenance)",
    "DeletionByTaintManager": "preempted: the node was tainted (spot reclaim or node problem)",
    "EvictionByEvictionAPI": "evicted through the Eviction API (node drain or upgrade)",
    "DeletionByPodGC": "preempted: the node disappeared",
}


# -- reading pod and Job status --------------------------------------------------------


def _conditions(obj: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return list(((obj or {}).get("status") or {}).get("conditions") or [])


def _condition(obj: Mapping[str, Any] | None, kind: str) -> dict[str, Any] | None:
    for condition in _conditions(obj):
        if condition.get("type") == kind and condition.get("status") == "True":
            return condition
    return None


def _task_container_status(pod: Mapping[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        if status.get("name") == CONTAINER_NAME:
            return dict(status)
    return dict(statuses[0]) if statuses else {}


def _terminated(pod: Mapping[str, Any]) -> dict[str, Any]:
    status = _task_container_status(pod)
    state = status.get("state") or {}
    return dict(state.get("terminated") or (status.get("lastState") or {}).get("terminated") or {})


def pod_phase(pod: Mapping[str, Any] | None) -> str:
    return str(((pod or {}).get("status") or {}).get("phase") or "")


def pod_started(pod: Mapping[str, Any] | None) -> bool:
    """Whether the container ever ran (a pod past Pending)."""
    if pod is None:
        return False
    if pod_phase(pod) in {"Running", "Succeeded", "Failed"}:
        return True
    state = _task_container_status(pod).get("state") or {}
    return "running" in state or "terminated" in state


def job_failure(job: Mapping[str, Any] | None) -> str:
    """The Job controller's reason for failing a Job, when it says more than the pod does."""
    condition = _condition(job, "FailureTarget") or _condition(job, "Failed")
    if condition is None or condition.get("reason") in {None, "", "BackoffLimitExceeded"}:
        return ""
    return f"{condition.get('reason')}: {condition.get('message') or ''}".strip().rstrip(":")


def pod_outcome(
    pod: Mapping[str, Any] | None, job: Mapping[str, Any] | None = None
) -> tuple[int | None, int | None, str]:
    """(exit code, signal, reason) of a pod that ended, from its status and its Job's.

    The reason names what Kubernetes did to the pod (preempted, Evicted,
    OOMKilled, DeadlineExceeded); without one, an exit code above 128 is
    reported as the signal that killed the container.
    """
    pod = pod or {}
    status = pod.get("status") or {}
    terminated = _terminated(pod)
    exit_code = terminated.get("exitCode")
    signal = terminated.get("signal")
    disruption = _condition(pod, "DisruptionTarget")
    if disruption is not None:
        what = _DISRUPTIONS.get(str(disruption.get("reason")), "preempted")
        reason = f"{what} ({disruption.get('reason')}: {disruption.get('message') or ''})"
    elif status.get("reason") == "Evicted":
        reason = f"Evicted: {status.get('message') or 'the node ran out of resources'}"
    elif terminated.get("reason") == "OOMKilled":
        reason = "OOMKilled: the container exceeded its memory limit"
    elif job_failure(job):
        reason = job_failure(job)
    elif status.get("reason"):
        reason = f"{status.get('reason')}: {status.get('message') or ''}".strip().rstrip(":")
    else:
        reason = ""
    if reason:
        signal = None
    elif signal is None and isinstance(exit_code, int) and exit_code > 128:
        signal = exit_code - 128
    return exit_code, signal, reason


def accelerator_hint(manifest: Mapping[str, Any]) -> str:
    """What the pod asks of a node, to name in an unschedulable message."""
    pod_spec = manifest["spec"]["template"]["spec"]
    accelerator = (manifest["metadata"].get("annotations") or {}).get(ANNOTATION_ACCELERATOR)
    selectors = ", ".join(f"{k}={v}" for k, v in (pod_spec.get("nodeSelector") or {}).items())
    limits = ", ".join(
        f"{k}: {v}"
        for k, v in ((container_of(manifest).get("resources") or {}).get("limits") or {}).items()
    )
    parts = [f"a node with {selectors}" if selectors else "", f"{limits} free" if limits else ""]
    wants = " and ".join(part for part in parts if part)
    if not wants:
        return ""
    return (
        f"accelerator {accelerator or 'requested'} needs {wants}; check that a node pool "
        f"offers it (kinetic-prefect doctor --accelerator {accelerator or 'NAME'})"
    )


def pending_reason(pod: Mapping[str, Any], manifest: Mapping[str, Any]) -> str | None:
    """Why a pending pod is not running, when Kubernetes says so; None while it just starts."""
    container = _task_container_status(pod)
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason")
    message = waiting.get("message") or ""
    if reason in _IMAGE_WAITING_REASONS:
        image = container_of(manifest).get("image") or container.get("image")
        return f"cannot pull image {image} ({reason}: {message})".replace(": )", ")")
    if reason in _CONFIG_WAITING_REASONS:
        return f"cannot create the container ({reason}: {message})".replace(": )", ")")
    for condition in _conditions(pod):
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            if condition.get("reason") != "Unschedulable":
                continue
            hint = accelerator_hint(manifest)
            text = f"unschedulable: {condition.get('message') or 'no node fits the pod'}"
            return f"{text} — {hint}" if hint else text
    return None


# -- the backend --------------------------------------------------------------------------


@dataclass
class _Job:
    job_id: str
    namespace: str
    manifest: dict[str, Any]
    on_exit: OnExit
    on_pending: OnPending | None
    created: bool = False
    # Holds one of `max_parallel` slots (from its create request until it ends).
    counted: bool = False
    created_seq: int = 0
    created_at: float = 0.0
    pod: dict[str, Any] | None = None
    pod_gone: bool = False
    job: dict[str, Any] | None = None
    job_gone: bool = False
    cancelled: bool = False
    failing_to_start: bool = False
    done: bool = False
    pending_reason: str | None = None
    settle_by: float | None = None
    next_probe: float = 0.0
    last_callback: concurrent.futures.Future[None] | None = field(default=None, repr=False)

    @property
    def pod_name(self) -> str | None:
        return (self.pod or {}).get("metadata", {}).get("name")


class KubernetesBackend:
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
        cancel_grace_seconds: float = 10.0,
        kube_context: str | None = None,
    ) -> None:
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
        self._store = open_store(jobs_root)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._callbacks = concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="kinetic-gke-callback"
        )
        # Loop-side state: touched only on the backend's event loop.
        self._access: Any = None
        self._batch: Any = None
        self._core: Any = None
        self._jobs: dict[str, _Job] = {}
        self._queued: collections.deque[_Job] = collections.deque()
        self._active = 0
        self._create_seq = 0
        self._secret_digests: dict[tuple[str, str], str] = {}
        self._secret_lock: asyncio.Lock | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._watched: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._wake: asyncio.Event | None = None

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
    ) -> None:
        manifest = copy.deepcopy(manifest)
        for meta in (manifest["metadata"], manifest["spec"]["template"]["metadata"]):
            meta.setdefault("labels", {})[LABEL_RUNNER] = self.runner_id
        job_id = manifest["metadata"]["name"]
        namespace = manifest["metadata"].get("namespace") or "default"
        with self._lock:
            if self._closed:
                raise RuntimeError("The gke backend is closed; submit inside the flow run.")
            self.launch_count += 1
        self._start_loop()
        access = self._call(self._connect())
        self._write_handle(job_id, namespace, access, created=None)
        job = _Job(job_id, namespace, manifest, on_exit, on_pending)
        try:
            self._call(self._launch(job, secrets))
        except BaseException as exc:
            self._write_handle(job_id, namespace, access, created=False, error=str(exc))
            raise

    def cancel(self, job_id: str) -> None:
        if self._loop is None:
            return
        self._call(self._cancel(job_id))

    def logs(self, job_id: str, tail: int | None = None) -> str:
        """The pod's log (its last `tail` lines), or "" when the pod is gone."""
        self._start_loop()
        self._call(self._connect())
        return str(self._call(self._logs(job_id, tail)))

    def close(self) -> None:
        """Cancel every job still running, wait for their exits, and stop the watcher."""
        with self._lock:
            self._closed = True
            loop = self._loop
        if loop is not None and self._thread is not None:
            deadline = self.cancel_grace_seconds + SETTLE_MARGIN_SECONDS
            try:
                self._call(self._drain(deadline))
            finally:
                loop.call_soon_threadsafe(loop.stop)
                self._thread.join(timeout=30)
        self._callbacks.shutdown(wait=True)

    # -- the loop thread --------------------------------------------------------------

    def _start_loop(self) -> None:
        with self._lock:
            if self._loop is not None:
                return
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._run_loop, args=(loop,), name="kinetic-gke-watcher", daemon=True
            )
            self._loop = loop
            self._thread.start()

    def _run_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shutdown())
            loop.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self._loop is not None
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("Backend calls must not be made from its own event loop.")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connect(self) -> Any:
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:  # launches from several threads arrive together
            if self._access is None:
                from kubernetes_asyncio import client

                from kinetic_prefect.kube import connect

                access = await connect(self.cluster, self.kube_context)
                self._batch = client.BatchV1Api(access.client)
                self._core = client.CoreV1Api(access.client)
                self._secret_lock = asyncio.Lock()
                self._wake = asyncio.Event()
                self._access = access
                self._spawn(access.keep_token_fresh())
                self._spawn(self._timers())
        return self._access

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._access is not None:
            await self._access.close()

    # -- callbacks --------------------------------------------------------------------

    def _dispatch(self, job: _Job, fn: Callable[[Any], None], arg: Any) -> None:
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

    def _write_handle(
        self,
        job_id: str,
        namespace: str,
        access: Any,
        created: bool | None,
        error: str | None = None,
    ) -> None:
        cluster = self.cluster
        handle: dict[str, Any] = {
            "backend": "gke",
            "job_name": job_id,
            "namespace": namespace,
            "runner": self.runner_id,
            "cluster": {
                "name": getattr(cluster, "cluster_name", None),
                "project": getattr(cluster, "project", None),
                "location": getattr(cluster, "zone", None) or getattr(cluster, "region", None),
                "api_server": access.server,
                "context": access.context,
            },
            "written_at": datetime.datetime.now(datetime.UTC).isoformat(),
        }
        if created is False:
            handle["created"] = False
            handle["error"] = error
        self._store.put_bytes(
            f"kinetic/{job_id}/{HANDLE_FILE}", json.dumps(handle, indent=2).encode()
        )

    async def _launch(self, job: _Job, secrets: Secrets) -> None:
        await self._ensure_secrets(job.namespace, secrets)
        self._ensure_watch(job.namespace)
        self._jobs[job.job_id] = job
        if self.max_parallel and self._active >= self.max_parallel:
            self._queued.append(job)
            return
        try:
            await self._create(job)
        except BaseException:
            self._jobs.pop(job.job_id, None)
            raise

    async def _create(self, job: _Job) -> None:
        from kinetic_prefect.kube import read_json

        self._active += 1
        job.counted = True
        try:
            await read_json(
                await self._batch.create_namespaced_job(
                    job.namespace, body=job.manifest, _preload_content=False
                )
            )
        except Exception as exc:
            # A lost response or a retried request may still have created the Job.
            if not await self._job_exists(job):
                self._active -= 1
                job.counted = False
                raise RuntimeError(
                    f"Could not create Job {job.namespace}/{job.job_id}: {_api_error(exc)}"
                ) from exc
        self._create_seq += 1
        job.created = True
        job.created_seq = self._create_seq
        job.created_at = time.monotonic()
        first_probe = min(EVENTS_PROBE_SECONDS, self.pending_timeout_seconds / 2)
        job.next_probe = job.created_at + first_probe
        self._poke()

    async def _job_exists(self, job: _Job) -> bool:
        from kinetic_prefect.kube import read_json

        try:
            found = await read_json(
                await self._batch.read_namespaced_job(
                    job.job_id, job.namespace, _preload_content=False
                )
            )
        except Exception:
            return False
        labels = (found.get("metadata") or {}).get("labels") or {}
        return bool(labels.get(LABEL_JOB_ID) == job.job_id)

    async def _create_queued(self) -> None:
        while self._queued and not (self.max_parallel and self._active >= self.max_parallel):
            job = self._queued.popleft()
            if job.done:
                continue
            try:
                await self._create(job)
            except Exception as exc:
                self._conclude(job, None, None, "", start_failure=str(exc))

    async def _ensure_secrets(self, namespace: str, secrets: Secrets) -> None:
        """Create or update the Secrets the manifest's secretKeyRefs name (once per content)."""
        from kubernetes_asyncio.client.exceptions import ApiException

        from kinetic_prefect.kube import read_json

        assert self._secret_lock is not None
        async with self._secret_lock:
            for name, values in secrets.items():
                digest = hashlib.sha256(json.dumps(dict(values), sort_keys=True).encode())
                key = (namespace, name)
                if self._secret_digests.get(key) == digest.hexdigest():
                    continue
                data = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
                body = {
                    "apiVersion": "v1",
                    "kind": "Secret",
                    "type": "Opaque",
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "labels": {LABEL_MANAGED_BY: MANAGED_BY},
                    },
                    "data": data,
                }
                try:
                    await read_json(
                        await self._core.create_namespaced_secret(
                            namespace, body=body, _preload_content=False
                        )
                    )
                except ApiException as exc:
                    if exc.status != 409:
                        raise RuntimeError(
                            f"Could not create Secret {namespace}/{name}: {_api_error(exc)}"
                        ) from exc
                    await read_json(
                        await self._core.patch_namespaced_secret(
                            name, namespace, body={"data": data}, _preload_content=False
                        )
                    )
                self._secret_digests[key] = digest.hexdigest()

    # -- cancelling, logs, closing ------------------------------------------------------

    async def _cancel(self, job_id: str) -> None:
        job = self._jobs.get(job_id)
        if job is None or job.done or job.cancelled:
            return
        job.cancelled = True
        if not job.created:
            self._conclude(job, None, None, "")
            return
        await self._delete_job(job)
        job.settle_by = time.monotonic() + self.cancel_grace_seconds + SETTLE_MARGIN_SECONDS
        self._evaluate(job)
        self._poke()

    async def _delete_job(self, job: _Job) -> None:
        from kubernetes_asyncio.client.exceptions import ApiException

        from kinetic_prefect.kube import read_json

        try:
            await read_json(
                await self._batch.delete_namespaced_job(
                    job.job_id,
                    job.namespace,
                    propagation_policy="Foreground",
                    _preload_content=False,
                )
            )
        except ApiException as exc:
            if exc.status != 404:
                logger.warning("Could not delete Job %s: %s", job.job_id, _api_error(exc))
                return
            job.job_gone = True

    async def _logs(self, job_id: str, tail: int | None) -> str:
        from kinetic_prefect.kube import pod_log, pods_of_job

        job = self._jobs.get(job_id)
        namespace = job.namespace if job else "default"
        pod: str | None = job.pod_name if job else None
        try:
            if pod is None:
                pods = await pods_of_job(self._core, namespace, job_id)
                if not pods:
                    return ""
                pod = pods[0]["metadata"]["name"]
            return await pod_log(self._core, namespace, pod, tail)
        except Exception as exc:
            logger.debug("No log for %s: %s", job_id, exc)
            return ""

    async def _drain(self, timeout: float) -> None:
        for job in list(self._jobs.values()):
            if not job.done:
                await self._cancel(job.job_id)
        deadline = time.monotonic() + timeout
        # Exits arrive through the watch; a short poll keeps this independent of it.
        while any(not j.done for j in self._jobs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for job in list(self._jobs.values()):
            if not job.done:
                self._conclude(job, None, None, "the pod did not end within the cancel grace")
        finishing = [t for t in self._tasks if t.get_name().startswith("kinetic-finish")]
        await asyncio.gather(*finishing, return_exceptions=True)

    # -- watching -----------------------------------------------------------------------

    def _ensure_watch(self, namespace: str) -> None:
        if namespace in self._watched:
            return
        self._watched.add(namespace)
        self._spawn(self._watch(namespace, "job"))
        self._spawn(self._watch(namespace, "pod"))

    async def _watch(self, namespace: str, kind: str) -> None:
        import aiohttp
        from kubernetes_asyncio.client.exceptions import ApiException

        from kinetic_prefect.kube import read_json

        list_fn = (
            self._batch.list_namespaced_job if kind == "job" else self._core.list_namespaced_pod
        )
        version: str | None = None
        backoff = 0.1
        while True:
            try:
                if version is None:
                    seen_seq = self._create_seq
                    listing = await read_json(
                        await list_fn(
                            namespace, label_selector=self.selector, _preload_content=False
                        )
                    )
                    version = (listing.get("metadata") or {}).get("resourceVersion")
                    self._reconcile(namespace, kind, listing.get("items") or [], seen_seq)
                response = await list_fn(
                    namespace,
                    label_selector=self.selector,
                    watch=True,
                    resource_version=version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=WATCH_TIMEOUT_SECONDS,
                    _preload_content=False,
                    _request_timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=30, sock_read=WATCH_TIMEOUT_SECONDS + 60
                    ),
                )
                try:
                    if response.status == 410:
                        version = None
                        continue
                    if response.status != 200:
                        raise ApiException(status=response.status, reason=await response.text())
                    backoff = 0.1
                    while True:
                        line = await response.content.readline()
                        if not line:
                            break  # the server ended the watch: resume from `version`
                        event = json.loads(line)
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            if obj.get("code") == 410:
                                version = None  # too old: relist
                                break
                            raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                        version = (obj.get("metadata") or {}).get("resourceVersion") or version
                        if event.get("type") != "BOOKMARK":
                            self._on_event(kind, str(event.get("type")), obj)
                finally:
                    response.release()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, ApiException) and exc.status == 410:
                    version = None
                    continue
                if isinstance(exc, ApiException) and exc.status in {401, 403}:
                    # Without a watch no exit would ever be seen: fail fast, saying why.
                    reason = f"cannot watch {kind}s in namespace {namespace}: {_api_error(exc)}"
                    logger.error("%s", reason)
                    for job in list(self._jobs.values()):
                        live = not job.done and not job.failing_to_start and job.created
                        if job.namespace == namespace and live:
                            job.failing_to_start = True
                            self._spawn(self._fail_to_start(job, reason))
                logger.warning(
                    "The %s watch in namespace %s broke (%s); resuming", kind, namespace, exc
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _reconcile(
        self, namespace: str, kind: str, items: list[dict[str, Any]], seen_seq: int
    ) -> None:
        """Apply a full listing: objects present are updates, tracked ones missing are gone."""
        present: set[str] = set()
        for obj in items:
            self._on_event(kind, "MODIFIED", obj)
            labels = (obj.get("metadata") or {}).get("labels") or {}
            present.add(labels.get(LABEL_JOB_ID, ""))
        for job in list(self._jobs.values()):
            if job.done or job.namespace != namespace or job.job_id in present:
                continue
            if kind == "pod" and job.pod is not None:
                job.pod_gone = True
                self._evaluate(job)
            elif kind == "job" and job.created and job.created_seq <= seen_seq:
                job.job_gone = True
                self._evaluate(job)

    def _on_event(self, kind: str, event_type: str, obj: dict[str, Any]) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        job = self._jobs.get(labels.get(LABEL_JOB_ID, ""))
        if job is None or job.done:
            return
        if kind == "pod":
            job.pod = obj
            job.pod_gone = event_type == "DELETED"
        else:
            job.job = obj
            job.job_gone = event_type == "DELETED"
        self._evaluate(job)

    # -- deciding a job's outcome --------------------------------------------------------

    def _evaluate(self, job: _Job) -> None:
        if job.done or job.failing_to_start:
            return
        pod = job.pod
        if pod_phase(pod) in {"Succeeded", "Failed"}:
            self._conclude(job, *pod_outcome(pod, job.job))
            return
        ended = bool(
            job.job_gone
            or _condition(job.job, "Complete")
            or _condition(job.job, "Failed")
            or _condition(job.job, "FailureTarget")
        )
        if pod is None and _condition(job.job, "Complete"):
            self._conclude(job, 0, None, "")
            return
        if (job.pod_gone and (ended or job.cancelled)) or (pod is None and job.job_gone):
            self._conclude_as_known(job)
            return
        if job.pod_gone or ended:
            # The rest of the story is on its way on the other stream: the Job's reason
            # after its pod vanished (DeadlineExceeded), or the pod's final status after
            # its Job ended. Wait for it, but not forever.
            if job.settle_by is None:
                alive = pod is not None and not job.pod_gone
                wait = (
                    self.cancel_grace_seconds + SETTLE_MARGIN_SECONDS
                    if alive
                    else POD_GONE_SETTLE_SECONDS
                )
                job.settle_by = time.monotonic() + wait
                self._poke()
            return
        if pod is not None and not pod_started(pod):
            waiting = pending_reason(pod, job.manifest)
            if waiting and waiting != job.pending_reason:
                job.pending_reason = waiting
                if job.on_pending is not None and not job.cancelled:
                    self._dispatch(job, job.on_pending, waiting)

    def _conclude_as_known(self, job: _Job) -> None:
        """End a job from whatever was last seen of its pod and Job."""
        code, sig, reason = pod_outcome(job.pod, job.job)
        if not reason and not job.cancelled:
            if job.pod_gone:
                reason = "the pod was deleted before it finished"
            elif job.pod is None and job.job_gone:
                reason = "the Job was deleted before its pod started"
            elif job.pod is None:
                reason = "the Job ended before its pod was seen"
            else:
                reason = "the pod did not report how it ended"
        self._conclude(job, code, sig, reason)

    def _conclude(
        self,
        job: _Job,
        exit_code: int | None,
        signal: int | None,
        reason: str,
        start_failure: str | None = None,
    ) -> None:
        """Mark the job done now; fetch its log tail and report it without blocking the loop."""
        if job.done:
            return
        job.done = True
        if job.counted:
            job.counted = False
            self._active -= 1
            if self._queued:
                self._spawn(self._create_queued())
        wants_log = (
            start_failure is None
            and not job.cancelled
            and exit_code != 0
            and job.pod_name is not None
            and not job.pod_gone
        )

        async def report() -> None:
            log_tail = ""
            if wants_log:
                log_tail = await self._logs(job.job_id, LOG_TAIL_LINES)
            outcome = PodExit(
                job_id=job.job_id,
                exit_code=exit_code,
                signal=signal,
                reason=reason,
                cancelled=job.cancelled and start_failure is None,
                log_tail=log_tail,
                start_failure=start_failure,
            )
            self._dispatch(job, job.on_exit, outcome)

        task = asyncio.get_running_loop().create_task(report(), name=f"kinetic-finish-{job.job_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fail_to_start(self, job: _Job, reason: str | None = None) -> None:
        if reason is None:
            if job.pod is None:
                await self._probe_events(job)
            waited = time.monotonic() - job.created_at
            reason = (job.pending_reason or "the pod did not start") + (
                f" (pending for {waited:.0f}s, longer than "
                f"pending_timeout_seconds={self.pending_timeout_seconds:g}; the Job was deleted)"
            )
        await self._delete_job(job)
        self._conclude(job, None, None, "", start_failure=reason)

    async def _probe_events(self, job: _Job) -> None:
        """Look for FailedCreate events on a Job that has no pod (quota, admission, RBAC)."""
        from kinetic_prefect.kube import read_json

        try:
            listing = await read_json(
                await self._core.list_namespaced_event(
                    job.namespace,
                    field_selector=f"involvedObject.kind=Job,involvedObject.name={job.job_id}",
                    _preload_content=False,
                )
            )
        except Exception as exc:
            logger.debug("Could not read the events of %s: %s", job.job_id, exc)
            return
        failures = [e for e in listing.get("items") or [] if e.get("reason") == "FailedCreate"]
        if not failures or job.done:
            return
        latest = max(failures, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
        reason = f"cannot create the pod: {latest.get('message') or 'FailedCreate'}"
        if reason != job.pending_reason:
            job.pending_reason = reason
            if job.on_pending is not None and not job.cancelled:
                self._dispatch(job, job.on_pending, reason)

    # -- timers -------------------------------------------------------------------------

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _timers(self) -> None:
        """Pending timeouts, event probes for pod-less Jobs, and settle deadlines."""
        assert self._wake is not None
        while True:
            now = time.monotonic()
            upcoming: list[float] = []
            for job in list(self._jobs.values()):
                moment = self._tick(job, now)
                if moment is not None:
                    upcoming.append(moment)
            self._wake.clear()
            timeout = max(0.0, min(upcoming) - time.monotonic()) if upcoming else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _tick(self, job: _Job, now: float) -> float | None:
        if job.done or not job.created:
            return None
        moments: list[float] = []
        if job.settle_by is not None:
            if now >= job.settle_by:
                self._conclude_as_known(job)
                return None
            moments.append(job.settle_by)
        if job.failing_to_start:
            return None
        if not job.cancelled and not pod_started(job.pod) and not job.job_gone:
            deadline = job.created_at + self.pending_timeout_seconds
            if now >= deadline:
                job.failing_to_start = True
                self._spawn(self._fail_to_start(job))
                return None
            moments.append(deadline)
            if job.pod is None:
                if now >= job.next_probe:
                    job.next_probe = now + EVENTS_PROBE_INTERVAL
                    self._spawn(self._probe_events(job))
                moments.append(job.next_probe)
        return min(moments) if moments else None


def _api_error(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or getattr(exc, "body", None) or str(exc)
    if status in {401, 403}:
        return (
            f"{status} {reason} — the credentials may not create Jobs, Secrets or watch pods in "
            "this namespace; apply deployments/k8s/rbac.yaml"
        )
    return f"{status} {reason}" if status else f"{type(exc).__name__}: {exc}"
