"""What the gke backend knows of each job it launched, kept current by watching the cluster.

Owns `TrackedJob` (one record per launched Job: its callbacks, the last seen state
of its Job and pod, and where it stands) and `JobWatch`: one Job stream and one
pod stream per namespace, selecting only one backend instance's objects by label
(`kinetic-prefect.io/runner`). A stream that ends or breaks resumes from the last
resourceVersion it saw; on 410 Gone it relists and reconciles every job it tracks
against the listing, so a pod that finished (or vanished) in the gap is still
noticed. Every event carries the object's whole state; after each one the job's
owner re-evaluates it from what was last seen of its Job and pod.

A stream answered 401 or 403 re-reads the credentials from where they came from
(a rotated token, a refreshed kubeconfig; `ClusterAccess.reload_credentials`)
and resumes from its last resourceVersion, backing off. Only a job whose stream
stays refused for `credentials_denied_timeout_seconds` (a launch setting, counted
from the first refusal or the job's creation, whichever is later) fails, saying
since when the credentials are refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import json
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException
from prefect.logging import get_logger

from kinetic_prefect.backends.base import OnExit, OnPending
from kinetic_prefect.backends.gke.client import api_error_message, read_json
from kinetic_prefect.backends.gke.slice import slice_pod
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.launch.manifest import LABEL_JOB_ID
from kinetic_prefect.launch.settings import LaunchSettings

logger = get_logger("kinetic_prefect.backends.gke.watch")

_DENIED_STATUSES = frozenset({401, 403})


@dataclass(frozen=True)
class _Refusal:
    """When a stream was first refused, by the two clocks (one to measure, one to tell)."""

    monotonic: float
    wall: datetime.datetime

    @classmethod
    def now(cls) -> _Refusal:
        return cls(time.monotonic(), datetime.datetime.now(datetime.UTC))


@dataclass
class TrackedJob:
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
    # When its Job was admitted (time.monotonic()): at creation, or when Kueue unsuspended
    # it; None while it waits in a Kueue LocalQueue. The pending timeout counts from here.
    admitted_at: float | None = None
    # When its pending clock last started (monotonic): at admission, and again whenever a
    # wait for capacity ends (the pod then needs the scheduler to place it).
    pending_since: float = 0.0
    pod: dict[str, Any] | None = None
    pod_gone: bool = False
    job: dict[str, Any] | None = None
    job_gone: bool = False
    cancelled: bool = False
    # The watch has seen its Job unsuspended (admitted, for a Job of a Kueue queue).
    seen_unsuspended: bool = False
    # Kueue evicted its admitted Job while the pod ran (it suspended the Job): the Job is
    # deleted, and the job ends as preempted once it is gone (`OutcomeTracker`).
    evicted: bool = False
    failing_to_start: bool = False
    done: bool = False
    pending_reason: str | None = None
    # Waiting for capacity (status.Pending.waits_for_capacity): since when (monotonic), and
    # how long earlier waits lasted (toward the queue timeout, never the pending one).
    capacity_since: float | None = None
    capacity_since_wall: float = 0.0
    capacity_waited: float = 0.0
    # The scheduler found no node for the pod, and the pod's events as last read.
    unschedulable: bool = False
    pod_events: list[dict[str, Any]] = field(default_factory=list, repr=False)
    # The nodes of its kind as last read (None: not read yet), and whether it waits for
    # those of them that are not ready (status.Pending.waits_for_nodes).
    pod_nodes: list[dict[str, Any]] | None = field(default=None, repr=False)
    waits_for_nodes: bool = False
    # Listing them was forbidden (its pending reason says what to grant).
    nodes_refused: bool = False
    settle_by: float | None = None
    next_probe: float = 0.0
    last_callback: concurrent.futures.Future[None] | None = field(default=None, repr=False)
    # A multi-host slice: every host's pod by name (`pod` is the one that speaks for
    # them, see kube_slice), and the objects created with its Job (its Service).
    hosts: int = 1
    pods: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)
    gone_pods: set[str] = field(default_factory=set, repr=False)
    extra_objects: tuple[dict[str, Any], ...] = ()
    # The Secrets its secretKeyRefs name; the Job is made their owner once created.
    secret_names: tuple[str, ...] = ()
    # When it was concluded (time.monotonic()); a finished Job lives on for its TTL.
    ended_at: float | None = None

    @property
    def pod_name(self) -> str | None:
        return (self.pod or {}).get("metadata", {}).get("name")


class JobWatch:
    """Keeps the Job and pod of every tracked job current; see the module docstring.

    `on_change(job)` is called after each change to a job's Job or pod;
    `reload_credentials()` when a stream is refused; `on_denied(job, reason)` for
    each live job of a namespace the credentials have not been allowed to watch for
    `denied_timeout_seconds` (without a watch no exit would ever be seen).
    """

    def __init__(
        self,
        selector: str,
        jobs: Mapping[str, TrackedJob],
        on_change: Callable[[TrackedJob], None],
        on_denied: Callable[[TrackedJob, str], None],
        reload_credentials: Callable[[], Awaitable[None]],
        denied_timeout_seconds: float = LaunchSettings.credentials_denied_timeout_seconds,
        watch_timeout_seconds: float = Intervals.watch_timeout_seconds,
    ) -> None:
        self.selector = selector
        self._jobs = jobs
        self._on_change = on_change
        self._on_denied = on_denied
        self._reload_credentials = reload_credentials
        # How long a stream may stay refused (401/403) before its jobs fail: longer than
        # a rotated token takes to reach a kubeconfig or a mounted token file.
        self.denied_timeout_seconds = denied_timeout_seconds
        # The API server ends a watch after at most this long; the watcher then resumes.
        self.watch_timeout_seconds = watch_timeout_seconds
        self._namespaces: set[str] = set()
        self._create_seq = 0

    def note_created(self, job: TrackedJob) -> None:
        """Record that the job's Job exists, in order with the listings the watch makes."""
        self._create_seq += 1
        job.created = True
        job.created_seq = self._create_seq

    def observe(self, kind: str, obj: dict[str, Any]) -> None:
        """Apply a Job or pod read outside the streams (an adopted job's) as its latest state."""
        self._on_event(kind, "MODIFIED", obj)

    def streams(self, namespace: str, batch: Any, core: Any) -> list[Coroutine[Any, Any, None]]:
        """The Job and pod streams of `namespace` the first time it is asked for, then none."""
        if namespace in self._namespaces:
            return []
        self._namespaces.add(namespace)
        return [
            self._stream(namespace, "job", batch.list_namespaced_job),
            self._stream(namespace, "pod", core.list_namespaced_pod),
        ]

    async def _stream(self, namespace: str, kind: str, list_fn: Any) -> None:
        """List, then watch from the listing's version; resume (or relist) whenever it breaks."""
        version: str | None = None
        backoff = 0.1
        refused: _Refusal | None = None
        while True:
            try:
                if version is None:
                    version = await self._relist(namespace, kind, list_fn)
                    refused = None
                response = await self._open_watch(namespace, list_fn, version)
                try:
                    if response.status == 410:
                        version = None
                        continue
                    if response.status != 200:
                        raise ApiException(status=response.status, reason=await response.text())
                    backoff, refused = 0.1, None
                    version = await self._follow(kind, response, version)
                finally:
                    response.release()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, ApiException) and exc.status == 410:
                    version = None
                    continue
                if isinstance(exc, ApiException) and exc.status in _DENIED_STATUSES:
                    refused = refused or _Refusal.now()
                    await self._on_refused(namespace, kind, exc, refused)
                else:
                    logger.warning(
                        "The %s watch in namespace %s broke (%s); resuming", kind, namespace, exc
                    )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _relist(self, namespace: str, kind: str, list_fn: Any) -> str | None:
        """A full listing applied to the tracked jobs; the version to watch from."""
        seen_seq = self._create_seq
        listing = await read_json(
            await list_fn(namespace, label_selector=self.selector, _preload_content=False)
        )
        self._reconcile(namespace, kind, listing.get("items") or [], seen_seq)
        version: str | None = (listing.get("metadata") or {}).get("resourceVersion")
        return version

    async def _open_watch(self, namespace: str, list_fn: Any, version: str | None) -> Any:
        return await list_fn(
            namespace,
            label_selector=self.selector,
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=int(self.watch_timeout_seconds),
            _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=30, sock_read=self.watch_timeout_seconds + 60
            ),
        )

    async def _follow(self, kind: str, response: Any, version: str | None) -> str | None:
        """Apply the watch's events until it ends; the version to resume from (None: relist)."""
        while True:
            line = await response.content.readline()
            if not line:
                return version  # the server ended the watch: resume from `version`
            event = json.loads(line)
            obj = event.get("object") or {}
            if event.get("type") == "ERROR":
                if obj.get("code") == 410:
                    return None  # too old: relist
                raise ApiException(status=obj.get("code"), reason=obj.get("message"))
            version = (obj.get("metadata") or {}).get("resourceVersion") or version
            if event.get("type") != "BOOKMARK":
                self._on_event(kind, str(event.get("type")), obj)

    async def _on_refused(
        self, namespace: str, kind: str, exc: ApiException, refused: _Refusal
    ) -> None:
        """Fail the jobs refused for longer than the bound; read the credentials again."""
        now = time.monotonic()
        since = refused.wall.isoformat(timespec="seconds")
        for job in list(self._jobs.values()):
            live = not job.done and not job.failing_to_start and job.created
            if job.namespace != namespace or not live:
                continue
            waited = now - max(refused.monotonic, job.created_at)
            if waited >= self.denied_timeout_seconds:
                self._on_denied(
                    job,
                    f"the cluster refused the credentials to watch {kind}s in namespace "
                    f"{namespace} since {since} ({waited:.0f}s, longer than "
                    f"credentials_denied_timeout_seconds={self.denied_timeout_seconds:g}; "
                    f"the Job was deleted): {api_error_message(exc)}",
                )
        logger.warning(
            "The %s watch in namespace %s is refused since %s (%s); reading the credentials "
            "again and retrying",
            kind,
            namespace,
            since,
            api_error_message(exc),
        )
        try:
            await self._reload_credentials()
        except Exception as reload_error:
            logger.warning("Could not read the credentials again: %s", reload_error)

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
                self._on_change(job)
            elif kind == "job" and job.created and job.created_seq <= seen_seq:
                job.job_gone = True
                self._on_change(job)

    def _on_event(self, kind: str, event_type: str, obj: dict[str, Any]) -> None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        job = self._jobs.get(labels.get(LABEL_JOB_ID, ""))
        if job is None or job.done:
            return
        if kind == "pod" and job.hosts > 1:
            name = obj["metadata"]["name"]
            job.pods[name] = obj
            if event_type == "DELETED":
                job.gone_pods.add(name)
            job.pod, job.pod_gone = slice_pod(job.pods, job.gone_pods, job.hosts)
        elif kind == "pod":
            job.pod = obj
            job.pod_gone = event_type == "DELETED"
        else:
            job.job = obj
            job.job_gone = event_type == "DELETED"
        self._on_change(job)
