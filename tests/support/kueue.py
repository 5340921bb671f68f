"""A test Kueue: admission of suspended batch/v1 Jobs by ClusterQueue quota, as Kueue does it.

No real Kueue runs here (docs/testing.md). This one follows Kueue's API shapes
(https://kueue.sigs.k8s.io/docs/concepts/), as another client of the emulated API:

- It reads `ResourceFlavor`, `ClusterQueue` and `LocalQueue` objects
  (`kueue.x-k8s.io`, either version) that a test applies, e.g. the ones docs/kueue.md shows.
- For each Job labelled `kueue.x-k8s.io/queue-name`, it creates a `Workload` owned by
  the Job (`job-{name}-{5 hex}`, label `kueue.x-k8s.io/job-uid`, `spec.queueName`, one
  pod set `main` whose `count` is the Job's parallelism and whose template is the
  Job's), as Kueue's batch/Job integration does.
- Admission: each ClusterQueue's pending Workloads in order of creation (priority is
  always 0 here); one is admitted when every resource its pod set requests (requests
  times count) fits the nominal quota of a flavor whose `nodeLabels` agree with the pod's
  nodeSelector, minus what admitted Workloads use. `StrictFIFO` stops at the first
  that does not fit, `BestEffortFIFO` (Kueue's default) goes on to the next. No
  cohorts, borrowing, admission checks, or preemption of its own accord.
- An admitted Workload gets `QuotaReserved` and `Admitted` conditions and
  `status.admission` (its ClusterQueue, flavors and usage per pod set); then the Job's
  pod template gets the flavor's nodeLabels as nodeSelector and `spec.suspend: false`.
  One that does not fit gets `QuotaReserved: False` (reason `Pending`) with Kueue's
  message: "couldn't assign flavors to pod set main: insufficient unused quota for
  google.com/tpu in flavor F, 4 more needed".
- `preempt(namespace, job)` evicts an admitted Workload as Kueue's preemption does
  (https://kueue.sigs.k8s.io/docs/concepts/preemption/, and the job reconciler's
  eviction step, `pkg/controller/jobframework/reconciler.go`): `Evicted` (reason
  `Preempted`) and `Preempted` (reason `InClusterQueue`) with Kueue's message; the Job
  suspended, so the Job controller deletes its pods; once the Job has none left,
  `Requeued` (reason `Preempted`), `QuotaReserved: False` (reason `Pending`, the eviction's
  message), `Admitted: False` (reason `NoReservation`), no `admission`, and the quota back.
  The Workload waits in its queue again and is admitted again (the Job unsuspended) when
  it fits; `Evicted` and `Preempted` then turn False with the message "Previously: ...".
- A Job that finishes gives its quota back (its Workload gets `Finished`); a Job that
  is deleted gives it back too, and its Workload goes with it (the garbage collector
  deletes it, as it would by its owner reference).
- The visibility API (`visibility.kueue.x-k8s.io`, `pendingworkloads` of a
  LocalQueue) answers with the pending Workloads in admission order and their
  positions, shaped as Kueue's `PendingWorkloadsSummary`.
- It serves both versions of both APIs and writes `v1beta2`, as Kueue 0.16 to 0.19 do
  (`v1beta2` stored, `v1beta1` deprecated but served), unless a test calls
  `serve("v1beta2")` (a Kueue that no longer serves `v1beta1`, as kubernetes-sigs/
  kueue#13957 plans for 0.20) or `serve("v1beta1")` (Kueue 0.14 and older): the emulated
  API server then answers any other version of them 404 and lists only the served ones
  in discovery. The fields used here are the same in both (`apis/kueue/v1beta1` and
  `v1beta2` of kueue v0.19.0). Objects are kept per version here; a real API server
  converts between them, so a client reading at the version it did not write sees them too.

`peak_admitted` is the most Workloads each ClusterQueue held admitted at once.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.support.gke_machines import quantity as parse_quantity
from tests.support.kube_emulator import JOBS, ClusterEmulator
from tests.support.kube_objects import now

KUEUE_AGENT = "test-kueue"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
GROUP = "kueue.x-k8s.io"
VISIBILITY_GROUP = "visibility.kueue.x-k8s.io"
POD_SET = "main"


def _condition(kind: str, status: bool, reason: str, message: str) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if status else "False",
        "reason": reason,
        "message": message,
        "lastTransitionTime": now(),
    }


def _quantity(value: float) -> str:
    return f"{value:g}"


@dataclass
class _Workload:
    name: str
    namespace: str
    job_name: str
    job_uid: str
    queue: str
    created: int
    count: int
    # What one pod requests, by resource name.
    requests: dict[str, float]
    node_selector: dict[str, str]
    owner: dict[str, Any]
    admitted_to: str | None = None
    usage: dict[tuple[str, str], float] = field(default_factory=dict)  # (flavor, resource)
    done: bool = False
    message: str = ""
    # Its object was created in the API (admission waits for that).
    posted: bool = False
    body: dict[str, Any] = field(default_factory=dict)
    conditions: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Evicted and not requeued yet: the eviction's message.
    evicted: str | None = None


def _pod_requests(template: dict[str, Any]) -> dict[str, float]:
    total: dict[str, float] = {}
    for container in (template.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in wanted.items():
            total[name] = total.get(name, 0.0) + parse_quantity(str(value))
    return total


def _suspended_without_pods(job: dict[str, Any]) -> bool:
    """The Job controller says the suspended Job's pods are gone (condition `Suspended`)."""
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Suspended" and c.get("status") == "True" for c in conditions)


class Kueue:
    """Admits queued Jobs by ClusterQueue quota (see the module docstring)."""

    def __init__(self, emulator: ClusterEmulator) -> None:
        self.emulator = emulator
        self.version = ""
        self.serve("v1beta2", "v1beta1")
        self.errors: list[BaseException] = []
        self.flavors: dict[str, dict[str, str]] = {}  # name -> nodeLabels
        self.cluster_queues: dict[str, dict[str, Any]] = {}  # name -> spec
        self.local_queues: dict[tuple[str, str], str] = {}  # (namespace, name) -> ClusterQueue
        self.workloads: dict[str, _Workload] = {}  # by Job uid
        self.peak_admitted: dict[str, int] = {}
        self._created = 0
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()

    def serve(self, *versions: str) -> None:
        """Serve Kueue's APIs at `versions` only, writing the first (before a test applies
        its queues)."""
        self.version = versions[0]
        self.emulator.served_versions.update({GROUP: versions, VISIBILITY_GROUP: versions})

    async def run(self, base_url: str) -> None:
        self._session = aiohttp.ClientSession(
            base_url=base_url, headers={"User-Agent": KUEUE_AGENT}
        )
        admitting = asyncio.get_running_loop().create_task(self._admit_forever())
        # A failure that ends admission must fail the test, not leave Jobs queued for good.
        admitting.add_done_callback(self._done)
        try:
            async for batch in self.emulator.event_batches():
                for _, resource, event in batch:
                    self._observe(resource.plural, event["type"], event["object"])
        finally:
            admitting.cancel()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(admitting, *self._tasks, return_exceptions=True)
            await self._session.close()

    # -- what the API shows -------------------------------------------------------------

    def _observe(self, plural: str, event_type: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        gone = event_type == "DELETED"
        if plural == "resourceflavors":
            self.flavors[meta["name"]] = dict((obj.get("spec") or {}).get("nodeLabels") or {})
        elif plural == "clusterqueues":
            if gone:
                self.cluster_queues.pop(meta["name"], None)
            else:
                self.cluster_queues[meta["name"]] = dict(obj.get("spec") or {})
        elif plural == "localqueues":
            key = (meta.get("namespace") or "", meta["name"])
            if gone:
                self.local_queues.pop(key, None)
            else:
                self.local_queues[key] = str((obj.get("spec") or {}).get("clusterQueue"))
        elif plural == JOBS:
            self._observe_job(event_type, obj)
        else:
            return
        self._changed.set()

    def _observe_job(self, event_type: str, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        queue = (meta.get("labels") or {}).get(QUEUE_LABEL)
        uid = meta.get("uid") or ""
        if not queue:
            return
        workload = self.workloads.get(uid)
        ended = event_type == "DELETED" or bool(meta.get("deletionTimestamp"))
        conditions = (job.get("status") or {}).get("conditions") or []
        finished = next(
            (
                c
                for c in conditions
                if c.get("type") in {"Complete", "Failed"} and c.get("status") == "True"
            ),
            None,
        )
        if workload is None:
            if not ended and finished is None and event_type == "ADDED":
                self._add(job, queue)
            return
        if workload.done:
            return
        if workload.evicted is not None and not ended and _suspended_without_pods(job):
            self._spawn(self._requeue(workload))
            return
        if ended or finished is not None:
            workload.done = True
            workload.usage = {}
            if finished is not None and not ended:
                self._spawn(self._finish(workload, finished))

    def _add(self, job: dict[str, Any], queue: str) -> None:
        meta = job["metadata"]
        spec = job.get("spec") or {}
        template = spec.get("template") or {}
        self._created += 1
        workload = _Workload(
            name=f"job-{meta['name']}-{secrets.token_hex(3)[:5]}",
            namespace=meta["namespace"],
            job_name=meta["name"],
            job_uid=meta["uid"],
            queue=queue,
            created=self._created,
            count=int(spec.get("parallelism") or 1),
            requests=_pod_requests(template),
            node_selector=dict((template.get("spec") or {}).get("nodeSelector") or {}),
            owner={
                "apiVersion": "batch/v1",
                "kind": "Job",
                "name": meta["name"],
                "uid": meta["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            },
        )
        self.workloads[workload.job_uid] = workload
        workload.body = {
            "apiVersion": f"{GROUP}/{self.version}",
            "kind": "Workload",
            "metadata": {
                "name": workload.name,
                "namespace": workload.namespace,
                "labels": {JOB_UID_LABEL: workload.job_uid},
                "ownerReferences": [workload.owner],
            },
            "spec": {
                "queueName": queue,
                "priority": 0,
                "podSets": [{"name": POD_SET, "count": workload.count, "template": template}],
            },
        }

    # -- admission ------------------------------------------------------------------------

    async def _admit_forever(self) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            for workload in list(self.workloads.values()):
                if not workload.posted and not workload.done:
                    workload.posted = True
                    await self._request("POST", self._collection(workload), workload.body)
            await self._admit()

    def pending(self, cluster_queue: str) -> list[_Workload]:
        """The ClusterQueue's Workloads waiting for quota, in admission order."""
        return sorted(
            (
                w
                for w in self.workloads.values()
                if not w.done
                and w.posted
                and w.admitted_to is None
                and self.local_queues.get((w.namespace, w.queue)) == cluster_queue
            ),
            key=lambda w: w.created,
        )

    def _used(self, cluster_queue: str) -> dict[tuple[str, str], float]:
        used: dict[tuple[str, str], float] = {}
        for workload in self.workloads.values():
            # A finished or deleted Workload holds no quota, whatever it was admitted to.
            if workload.admitted_to == cluster_queue and not workload.done:
                for key, value in workload.usage.items():
                    used[key] = used.get(key, 0.0) + value
        return used

    def _queue_blocker(self, workload: _Workload) -> str | None:
        """Kueue's message for a Workload whose LocalQueue, or its ClusterQueue, is missing
        (`getQueueBlocker` in `pkg/controller/core/workload_controller.go`)."""
        cluster_queue = self.local_queues.get((workload.namespace, workload.queue))
        if cluster_queue is None:
            return f"LocalQueue {workload.queue} doesn't exist"
        if cluster_queue not in self.cluster_queues:
            return f"ClusterQueue {cluster_queue} doesn't exist"
        return None

    async def _admit(self) -> None:
        for workload in list(self.workloads.values()):
            blocker = None
            if workload.posted and not workload.done and workload.admitted_to is None:
                blocker = self._queue_blocker(workload)
            if blocker is not None and blocker != workload.message:
                # Without the UnadmittedWorkloadsObservability gate (off by default up to
                # v0.19, on by default after it: then the reason is Misconfigured, the
                # message the same) the reason is Inadmissible; Kueue keeps the Workload
                # and admits it once the queue exists.
                workload.message = blocker
                await self._status(
                    workload, {}, _condition("QuotaReserved", False, "Inadmissible", blocker)
                )
        for name, spec in list(self.cluster_queues.items()):
            strict = spec.get("queueingStrategy") == "StrictFIFO"
            for workload in self.pending(name):
                if workload.done or workload.admitted_to is not None:
                    continue  # it ended, or was admitted, while this pass awaited the API
                usage, message = self._assign(spec, workload, self._used(name))
                if usage is None:
                    if message != workload.message:
                        workload.message = message
                        await self._status(
                            workload, {}, _condition("QuotaReserved", False, "Pending", message)
                        )
                    if strict:
                        break
                    continue
                workload.admitted_to, workload.usage = name, usage
                held = sum(
                    1 for w in self.workloads.values() if w.admitted_to == name and not w.done
                )
                self.peak_admitted[name] = max(self.peak_admitted.get(name, 0), held)
                await self._admitted(workload, name, usage)

    def _assign(
        self, spec: dict[str, Any], workload: _Workload, used: dict[tuple[str, str], float]
    ) -> tuple[dict[tuple[str, str], float] | None, str]:
        """The quota the Workload takes, by (flavor, resource); else None and Kueue's reason."""
        usage: dict[tuple[str, str], float] = {}
        wanted = {k: v * workload.count for k, v in workload.requests.items() if v}
        covered = {
            resource
            for group in spec.get("resourceGroups") or []
            for resource in group.get("coveredResources") or []
        }
        for resource in sorted(set(wanted) - covered):
            return None, (
                f"couldn't assign flavors to pod set {POD_SET}: resource {resource} "
                "unavailable in ClusterQueue"
            )
        for group in spec.get("resourceGroups") or []:
            asked = {r: wanted[r] for r in group.get("coveredResources") or [] if r in wanted}
            if not asked:
                continue
            reason = ""
            for flavor in group.get("flavors") or []:
                labels = self.flavors.get(flavor["name"], {})
                if any(
                    workload.node_selector.get(key, value) != value for key, value in labels.items()
                ):
                    reason = reason or (f"flavor {flavor['name']} doesn't match node affinity")
                    continue
                quota = {
                    r["name"]: parse_quantity(str(r["nominalQuota"]))
                    for r in flavor.get("resources") or []
                }
                short = [
                    (
                        resource,
                        amount
                        + used.get((flavor["name"], resource), 0.0)
                        - quota.get(resource, 0.0),
                    )
                    for resource, amount in asked.items()
                ]
                short = [(r, more) for r, more in short if more > 0]
                if not short:
                    usage.update({(flavor["name"], r): a for r, a in asked.items()})
                    break
                resource, more = short[0]
                reason = reason or (
                    f"insufficient unused quota for {resource} in flavor {flavor['name']}, "
                    f"{_quantity(more)} more needed"
                )
            else:
                return None, f"couldn't assign flavors to pod set {POD_SET}: {reason}"
        return usage, ""

    async def _admitted(
        self, workload: _Workload, cluster_queue: str, usage: dict[tuple[str, str], float]
    ) -> None:
        flavors = {resource: flavor for flavor, resource in usage}
        await self._status(
            workload,
            {
                "admission": {
                    "clusterQueue": cluster_queue,
                    "podSetAssignments": [
                        {
                            "name": POD_SET,
                            "flavors": flavors,
                            "resourceUsage": {r: _quantity(v) for (_, r), v in usage.items()},
                            "count": workload.count,
                        }
                    ],
                },
            },
            _condition(
                "QuotaReserved",
                True,
                "QuotaReserved",
                f"Quota reserved in ClusterQueue {cluster_queue}",
            ),
            _condition("Admitted", True, "Admitted", "The workload is admitted"),
            *(
                _condition(kind, False, "QuotaReserved", f"Previously: {old['message']}")
                for kind in ("Evicted", "Preempted")
                if (old := workload.conditions.get(kind)) and old["status"] == "True"
            ),
        )
        labels: dict[str, str] = {}
        for flavor in set(flavors.values()):
            labels.update(self.flavors.get(flavor, {}))
        path = self._job_path(workload)
        patch: dict[str, Any] = {"spec": {"suspend": False}}
        if labels:
            patch["spec"]["template"] = {"spec": {"nodeSelector": labels}}
        try:
            await self._request("PATCH", path, patch)
        except RuntimeError:
            # Deleted while it was being admitted (kmock answers a PATCH of an object being
            # deleted with a 500): its quota goes back, as for any deleted Job.
            found = self.emulator.find(JOBS, workload.namespace, workload.job_name)
            if found is not None and not found["metadata"].get("deletionTimestamp"):
                raise
            workload.done, workload.usage = True, {}
            self._changed.set()

    async def _finish(self, workload: _Workload, finished: dict[str, Any]) -> None:
        succeeded = finished.get("type") == "Complete"
        message = "Job finished successfully" if succeeded else str(finished.get("message") or "")
        reason = "Succeeded" if succeeded else "Failed"
        await self._status(workload, {}, _condition("Finished", True, reason, message))
        self._changed.set()

    # -- preemption -------------------------------------------------------------------------

    async def preempt(self, namespace: str, job_name: str) -> None:
        """Evict the admitted Workload of Job `job_name`, as Kueue's preemption does."""
        workload = next(
            w
            for w in self.workloads.values()
            if (w.namespace, w.job_name) == (namespace, job_name) and not w.done
        )
        assert workload.admitted_to is not None, f"{job_name} is not admitted"
        message = (
            f"Preempted to accommodate a workload (UID: {secrets.token_hex(8)}, JobUID: "
            f"{secrets.token_hex(8)}) due to prioritization in the ClusterQueue"
        )
        workload.evicted = message
        await self._status(
            workload,
            {},
            _condition("Evicted", True, "Preempted", message),
            _condition("Preempted", True, "InClusterQueue", message),
        )
        # Kueue stops the Job; the Job controller then deletes its pods.
        await self._request("PATCH", self._job_path(workload), {"spec": {"suspend": True}})

    async def _requeue(self, workload: _Workload) -> None:
        """The evicted Job has no pod left: its quota goes back and it waits in its queue."""
        message, workload.evicted = workload.evicted or "", None
        workload.admitted_to, workload.usage = None, {}
        await self._status(
            workload,
            {"admission": None},
            _condition("Requeued", True, "Preempted", message),
            _condition("QuotaReserved", False, "Pending", message),
            _condition("Admitted", False, "NoReservation", "The workload has no reservation"),
        )
        self._changed.set()

    # -- the visibility API ---------------------------------------------------------------

    def pending_workloads(self, namespace: str, local_queue: str) -> dict[str, Any]:
        """`pendingworkloads` of a LocalQueue, as Kueue's visibility API answers."""
        cluster_queue = self.local_queues.get((namespace, local_queue))
        waiting = self.pending(cluster_queue) if cluster_queue else []
        items = []
        in_local = 0
        for index, workload in enumerate(waiting):
            if (workload.namespace, workload.queue) != (namespace, local_queue):
                continue
            items.append(
                {
                    "metadata": {
                        "name": workload.name,
                        "namespace": workload.namespace,
                        "ownerReferences": [
                            {k: workload.owner[k] for k in ("apiVersion", "kind", "name", "uid")}
                        ],
                    },
                    "priority": 0,
                    "localQueueName": local_queue,
                    "positionInClusterQueue": index,
                    "positionInLocalQueue": in_local,
                }
            )
            in_local += 1
        return {
            "kind": "PendingWorkloadsSummary",
            "apiVersion": f"{VISIBILITY_GROUP}/{self.version}",
            "metadata": {"creationTimestamp": None},
            "items": items,
        }

    # -- HTTP -----------------------------------------------------------------------------

    def _job_path(self, workload: _Workload) -> str:
        return f"/apis/batch/v1/namespaces/{workload.namespace}/jobs/{workload.job_name}"

    def _collection(self, workload: _Workload) -> str:
        return f"/apis/{GROUP}/{self.version}/namespaces/{workload.namespace}/workloads"

    async def _status(
        self, workload: _Workload, status: dict[str, Any], *conditions: dict[str, Any]
    ) -> None:
        """Patch the Workload's status; `conditions` replace those of their type."""
        workload.conditions.update((c["type"], c) for c in conditions)
        path = f"{self._collection(workload)}/{workload.name}/status"
        body = {**status, "conditions": list(workload.conditions.values())}
        await self._request("PATCH", path, {"status": body})

    async def _request(self, method: str, path: str, body: Any) -> None:
        assert self._session is not None
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self._session.request(method, path, json=body, headers=headers) as response:
            if response.status >= 400 and response.status != 404:
                raise RuntimeError(f"{method} {path}: {response.status} {await response.text()}")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]
