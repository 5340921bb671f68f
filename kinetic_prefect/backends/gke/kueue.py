"""Jobs that wait in a Kueue LocalQueue: whether a Job is queued, and where it stands.

With `queue_name`, a Job is created suspended and labelled `kueue.x-k8s.io/queue-name`;
Kueue makes a Workload for it (owned by the Job, labelled with its uid), reserves
quota in the LocalQueue's ClusterQueue for all of its pods at once and admits it by
unsuspending the Job (https://kueue.sigs.k8s.io/docs/tasks/run/jobs/). Until then the
Job has no pod, and its wait is not pending time: the pending timeout counts from
admission (see `kube_outcomes`).

`QueueReader` says where each queued Job stands, as its pending reason: the queue,
its position (from Kueue's visibility API, `pendingworkloads` of the LocalQueue,
https://kueue.sigs.k8s.io/docs/tasks/manage/monitor_pending_workloads/pending_workloads_on_demand/)
and why it is not admitted (the Workload's `QuotaReserved` condition). It costs no
request per Job: while any Job of a namespace is queued, one listing of the
namespace's Workloads and one visibility request per LocalQueue every
`poll_seconds`; nothing when no Job is queued. Without the visibility API (not
installed, or not granted) the position is the Job's place among the LocalQueue's
pending Workloads of the listing, in Kueue's order (priority, then creation).
A Job whose LocalQueue (or that queue's ClusterQueue) does not exist is not left to wait
for a queue nobody may create: once every read for `missing_queue_grace_seconds` said so,
the reader fails it, naming the queue and the fix.

Which version of Kueue's APIs to speak is read from the API server's discovery
(`GET /apis/kueue.x-k8s.io`, and the same for the visibility API), once per reader:
Kueue serves `v1beta2` from 0.15 and stores it from 0.16, deprecates `v1beta1`, and
stops serving it in a later release; a cluster with Kueue 0.14 or older serves only
`v1beta1`. The fields read here (conditions, priority, the visibility summary) are the
same in both.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from prefect.logging import get_logger

from kinetic_prefect.backends.gke.client import api_error_message, get_json, read_json
from kinetic_prefect.backends.gke.status import false_condition, queue_name_of, true_condition
from kinetic_prefect.backends.gke.watch import TrackedJob
from kinetic_prefect.common.intervals import Intervals

logger = get_logger("kinetic_prefect.backends.gke.kueue")

KUEUE_GROUP = "kueue.x-k8s.io"
WORKLOADS = "workloads"
VISIBILITY_GROUP = "visibility.kueue.x-k8s.io"
# The versions of Kueue's APIs this reader speaks, newest first.
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
# Kueue labels each Workload it makes for a Job with the Job's uid.
LABEL_JOB_UID = "kueue.x-k8s.io/job-uid"
PENDING_WORKLOADS_PATH = (
    f"/apis/{VISIBILITY_GROUP}/{{version}}/namespaces/{{namespace}}/localqueues/{{name}}"
    "/pendingworkloads"
)


def served_version(group: Mapping[str, Any] | None) -> str | None:
    """The version to speak of an API group, from its discovery document (an `APIGroup`).

    The server's preferred version when this reader speaks it, else the newest served
    one it speaks; None when it serves none of them (or the group is not there).
    """
    if not group:
        return None
    preferred = (group.get("preferredVersion") or {}).get("version")
    if preferred in KUEUE_VERSIONS:
        return str(preferred)
    served = {str(v.get("version")) for v in group.get("versions") or []}
    return next((v for v in KUEUE_VERSIONS if v in served), None)


def workload_of(workloads: list[dict[str, Any]], job_uid: str) -> dict[str, Any] | None:
    """The Workload Kueue made for the Job of uid `job_uid` (owner, else its label)."""
    for workload in workloads:
        meta = workload.get("metadata") or {}
        owners = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
        if job_uid in owners or (meta.get("labels") or {}).get(LABEL_JOB_UID) == job_uid:
            return workload
    return None


def _order(workload: Mapping[str, Any]) -> tuple[int, str, str]:
    meta = workload.get("metadata") or {}
    priority = int((workload.get("spec") or {}).get("priority") or 0)
    return (-priority, str(meta.get("creationTimestamp") or ""), str(meta.get("name") or ""))


def listing_positions(workloads: list[dict[str, Any]]) -> dict[str, int]:
    """Each pending Workload's place in its LocalQueue (0 first), by name, from a listing."""
    by_queue: dict[str, list[dict[str, Any]]] = {}
    for workload in workloads:
        if true_condition(workload, "QuotaReserved") or true_condition(workload, "Finished"):
            continue
        by_queue.setdefault(str((workload.get("spec") or {}).get("queueName")), []).append(workload)
    positions: dict[str, int] = {}
    for pending in by_queue.values():
        for index, workload in enumerate(sorted(pending, key=_order)):
            positions[str(workload["metadata"]["name"])] = index
    return positions


# Kueue's word for a Workload whose LocalQueue, or that queue's ClusterQueue, is not there
# (its workload controller's `getQueueBlocker`, under reason `Inadmissible`, or
# `Misconfigured` with the UnadmittedWorkloadsObservability gate): it keeps the Workload
# and admits it only if that queue is created, which a typo never is.
_MISSING_QUEUE = re.compile(
    r"^(LocalQueue|ClusterQueue) (\S+) (doesn't exist|is terminating or missing)$"
)


def missing_queue(workload: Mapping[str, Any] | None, namespace: str) -> str | None:
    """Why the Workload cannot be admitted when its queue does not exist, else None."""
    condition = false_condition(workload, "QuotaReserved")
    found = _MISSING_QUEUE.match(str((condition or {}).get("message") or ""))
    if found is None:
        return None
    kind, name = found.group(1), found.group(2)
    if kind == "LocalQueue":
        fix = (
            f"set queue_name to a LocalQueue of namespace {namespace} "
            f"(kubectl get localqueues -n {namespace}), or create {name} there (docs/kueue.md)"
        )
    else:
        fix = (
            f"create ClusterQueue {name}, or point the LocalQueue at one that exists "
            "(docs/kueue.md)"
        )
    return f"Kueue cannot admit the Job: {found.group(0)}; {fix}. The Job was deleted"


def queued_message(
    queue: str,
    workload: Mapping[str, Any] | None,
    position: Mapping[str, Any] | None,
) -> str:
    """The pending reason of a queued Job: its queue, position, and why it waits."""
    text = f"queued in Kueue LocalQueue {queue}"
    if workload is None:
        return f"{text} (Kueue has not made its Workload yet)"
    if position is not None:
        text += f", position {int(position['positionInLocalQueue']) + 1} in the LocalQueue"
        cluster = position.get("positionInClusterQueue")
        if cluster is not None:
            text += f" ({int(cluster) + 1} in its ClusterQueue)"
    for kind in ("QuotaReserved", "Admitted"):
        condition = false_condition(workload, kind)
        if condition is not None and condition.get("message"):
            text += f": {condition['message']}"
            break
    requeue = (workload.get("status") or {}).get("requeueState") or {}
    if requeue.get("requeueAt"):
        text += f" (requeued after eviction; back in the queue at {requeue['requeueAt']})"
    return text


class QueueReader:
    """Reports where each queued Job stands while any is queued (see the module docstring).

    `report(job, reason)` is the backend's pending report; `fail(job, reason)` gives up on
    a Job whose queue does not exist (`missing_queue`); `api_client` is called for the
    Kubernetes API client when reading.
    """

    def __init__(
        self,
        jobs: Mapping[str, TrackedJob],
        api_client: Callable[[], Any],
        report: Callable[[TrackedJob, str], None],
        fail: Callable[[TrackedJob, str], None],
        poll_seconds: float = Intervals.queue_poll_seconds,
        missing_queue_grace_seconds: float = Intervals.missing_queue_grace_seconds,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._jobs = jobs
        self._api_client = api_client
        self._report = report
        self._fail = fail
        self.missing_queue_grace_seconds = missing_queue_grace_seconds
        self._clock = clock
        # Job id -> when a read first said its queue does not exist (every read since has).
        self._missing_since: dict[str, float] = {}
        self.poll_seconds = poll_seconds
        self._wake = asyncio.Event()
        # (namespace, LocalQueue) whose visibility API did not answer: read the listing only.
        self._no_visibility: set[tuple[str, str]] = set()
        # API group -> the version discovery chose (None: not served), once read.
        self._versions: dict[str, str | None] = {}

    def poke(self) -> None:
        """A Job may have become queued: read soon."""
        self._wake.set()

    def _queued_jobs(self) -> list[TrackedJob]:
        return [
            job
            for job in self._jobs.values()
            if job.created
            and not job.done
            and not job.cancelled
            and not job.failing_to_start
            and job.admitted_at is None
        ]

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            started = time.monotonic()
            waiting = self._queued_jobs()
            for gone in self._missing_since.keys() - {job.job_id for job in waiting}:
                del self._missing_since[gone]
            if not waiting:
                continue
            by_namespace: dict[str, list[TrackedJob]] = {}
            for job in waiting:
                by_namespace.setdefault(job.namespace, []).append(job)
            for namespace, jobs in by_namespace.items():
                try:
                    await self._read(namespace, jobs)
                except Exception as exc:
                    logger.warning(
                        "Could not read the Kueue Workloads of namespace %s: %s",
                        namespace,
                        api_error_message(exc),
                    )
            # Read again after the interval while anything is still queued.
            await asyncio.sleep(max(0.0, self.poll_seconds - (time.monotonic() - started)))
            if self._queued_jobs():
                self._wake.set()

    async def _version(self, api: Any, group: str) -> str | None:
        """The version of `group` to speak (discovery, read once); None when not served."""
        if group not in self._versions:
            try:
                document = await get_json(api, f"/apis/{group}")
            except ApiException as exc:
                if exc.status != 404:
                    raise
                document = None
            self._versions[group] = served_version(document)
        return self._versions[group]

    async def _read(self, namespace: str, jobs: list[TrackedJob]) -> None:
        from kubernetes_asyncio import client

        api = self._api_client()
        version = await self._version(api, KUEUE_GROUP)
        if version is None:
            self._versions.pop(KUEUE_GROUP)  # installed later, perhaps: ask again next time
            raise RuntimeError(
                f"the cluster serves no version of {KUEUE_GROUP} this runner speaks "
                f"({', '.join(KUEUE_VERSIONS)}): is Kueue installed?"
            )
        try:
            response = await client.CustomObjectsApi(api).list_namespaced_custom_object(
                KUEUE_GROUP, version, namespace, WORKLOADS, _preload_content=False
            )
        except ApiException as exc:
            if exc.status == 404:  # that version no longer served (Kueue upgraded meanwhile)
                self._versions.clear()
            raise
        listing = await read_json(response)
        workloads = list(listing.get("items") or [])
        fallback = listing_positions(workloads)
        positions: dict[str, Mapping[str, Any]] = {}
        for queue in sorted({queue_name_of(job.manifest) or "" for job in jobs} - {""}):
            positions.update(await self._positions(api, namespace, queue))
        for job in jobs:
            if job.done or job.cancelled or job.failing_to_start or job.admitted_at is not None:
                self._missing_since.pop(job.job_id, None)
                continue
            uid = str(((job.job or {}).get("metadata") or {}).get("uid") or "")
            workload = workload_of(workloads, uid) if uid else None
            missing = missing_queue(workload, namespace)
            if missing is None:
                self._missing_since.pop(job.job_id, None)
            elif self._missing_for_good(job.job_id):
                self._missing_since.pop(job.job_id, None)
                self._fail(job, missing)
                continue
            name = str(((workload or {}).get("metadata") or {}).get("name") or "")
            position = positions.get(name)
            if position is None and name in fallback:
                position = {"positionInLocalQueue": fallback[name]}
            queue = queue_name_of(job.manifest) or queue_name_of(job.job) or "?"
            self._report(job, queued_message(queue, workload, position))

    def _missing_for_good(self, job_id: str) -> bool:
        """Whether every read for `missing_queue_grace_seconds` said the Job's queue is
        missing: Kueue says so for a moment after it restarts (its queue manager fills as
        it sees the queues) or before it has seen a queue just created."""
        now = self._clock()
        since = self._missing_since.setdefault(job_id, now)
        return now - since >= self.missing_queue_grace_seconds

    async def _positions(self, api: Any, namespace: str, queue: str) -> dict[str, Any]:
        """Pending Workloads of a LocalQueue by name, from the visibility API ({} without it)."""
        if (namespace, queue) in self._no_visibility:
            return {}
        try:
            version = await self._version(api, VISIBILITY_GROUP)
            if version is None:
                raise ApiException(status=404, reason=f"{VISIBILITY_GROUP} is not served")
            summary = await get_json(
                api,
                PENDING_WORKLOADS_PATH,
                {"namespace": namespace, "name": queue, "version": version},
            )
        except ApiException as exc:
            logger.info(
                "Kueue's visibility API did not answer for LocalQueue %s/%s (%s); queue "
                "positions come from the Workloads' order instead",
                namespace,
                queue,
                api_error_message(exc),
            )
            self._no_visibility.add((namespace, queue))
            return {}
        return {
            str((item.get("metadata") or {}).get("name")): item
            for item in summary.get("items") or []
        }
