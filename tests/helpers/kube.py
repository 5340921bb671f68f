"""A Kubernetes API for tests: kmock's emulator completed where the backend needs it, and a kubelet.

- `ClusterEmulator` is `kmock.KubernetesEmulator` plus, through kmock's own handler
  API: resourceVersions, label and field selectors, watches that resume from a
  resourceVersion (410 Gone once compacted) or end on a server-side timeout or a
  cut, Foreground deletion (a finalizer the kubelet releases), and pod logs.
- `Kubelet` plays kubelet, scheduler and Job controller: for every created Job it
  makes a pod, runs its container through `LocalBackend` (secretKeyRefs resolved
  from the Secrets stored in the emulator) and writes pod and Job status back over
  HTTP. It can instead leave the pod pending (image pull error, unschedulable,
  quota) or end it as Kubernetes would (OOMKilled, evicted, preempted, deadline).
- `running_cluster()` runs both on an event loop in a background thread and
  writes a kubeconfig that points at them.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import json
import re
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import attrs
import kmock
from kmock._internal import aiobus

from kinetic_prefect.backends.base import PodExit
from kinetic_prefect.backends.local import LocalBackend

KUBELET_AGENT = "test-kubelet"
JOBS = "jobs"
PODS = "pods"
_LOG_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Kubernetes equality-based label selectors: `a=b`, `a==b`, `a!=b`, `a`, `!a`."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _fields_match(selector: str, obj: dict[str, Any]) -> bool:
    """Field selectors as `a.b=c` on the object's dotted paths."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        path, _, expected = term.replace("==", "=").partition("=")
        value: Any = obj
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if str(value if value is not None else "") != expected:
            return False
    return True


class _Buses(dict):  # type: ignore[type-arg]
    """kmock's per-resource event buses, each stamping and recording what it carries."""

    def __init__(self, emulator: ClusterEmulator) -> None:
        super().__init__()
        self.emulator = emulator

    def __missing__(self, resource: Any) -> aiobus.Bus[Any]:
        bus = _RecordingBus(emulator=self.emulator, resource=resource)
        self[resource] = bus
        return bus


@attrs.mutable(weakref_slot=True)
class _RecordingBus(aiobus.Bus[Any]):
    emulator: Any = None
    resource: Any = None

    async def put(self, *items: Any) -> None:
        for item in items:
            await self.emulator._record(self.resource, item)
        await super().put(*items)


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with what a watching client relies on."""

    version: int = attrs.field(default=0, init=False)
    compacted_version: int = attrs.field(default=0, init=False)
    events: list[tuple[int, Any, dict[str, Any]]] = attrs.field(factory=list, init=False)
    log_files: dict[tuple[str, str], Path] = attrs.field(factory=dict, init=False)
    finished_logs: set[tuple[str, str]] = attrs.field(factory=set, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    _cuts: int = attrs.field(default=0, init=False)
    _released: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = _Buses(self)
        self._released.set()
        self["get", _LOG_PATH] << self._serve_log

    # -- state changes --------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.action == kmock.action.CREATE:
            meta = request.data.setdefault("metadata", {})
            if request.namespace:
                meta.setdefault("namespace", request.namespace)
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", _now())
        if request.resource is not None and request.action == kmock.action.DELETE:
            policy = request.params.get("propagationPolicy") or (
                (request.data or {}).get("propagationPolicy") if request.data else None
            )
            key = (request.resource, request.namespace, request.name)
            if policy == "Foreground" and key in self.objects and not self.objects[key].deleted:
                # The garbage collector holds a Foreground-deleted owner until its pods are gone.
                async with self._lock:
                    self.objects[key].patch({"metadata": {"finalizers": ["foregroundDeletion"]}})
        return await super()._handle(request)

    async def _record(self, resource: Any, event: dict[str, Any]) -> None:
        """Give every change a resourceVersion, on the stored object too, and log it."""
        self.version += 1
        obj = event.get("object") or {}
        if event.get("type") == "DELETED":
            obj = copy.deepcopy(obj)
            event = {**event, "object": obj}
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        async with self._changed:
            self.events.append((self.version, resource, copy.deepcopy(event)))
            self._changed.notify_all()

    # -- listing and watching --------------------------------------------------------

    def _matches(
        self, request: kmock.Request, resource: Any, namespace: str | None, obj: Any
    ) -> bool:
        if resource != request.resource:
            return False
        if request.namespace is not None and namespace != request.namespace:
            return False
        meta = obj.get("metadata") or {}
        labels = request.params.get("labelSelector")
        fields = request.params.get("fieldSelector")
        if labels and not _selector_matches(labels, meta.get("labels") or {}):
            return False
        return not (fields and not _fields_match(fields, obj))

    def _current(self, request: kmock.Request) -> list[dict[str, Any]]:
        found = []
        for (resource, namespace, _), obj in self.objects.items():
            if obj.deleted:
                continue
            raw = copy.deepcopy(obj.raw)
            if self._matches(request, resource, namespace, raw):
                found.append(raw)
        return found

    async def _serve_list(self, request: kmock.Request) -> Any:
        if request.params.get("watch", "").lower() in {"true", "1"}:
            return self._serve_watch(request)
        async with self._lock:
            items = self._current(request)
            version = self.version
        return {"kind": "List", "metadata": {"resourceVersion": str(version)}, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:  # type: ignore[override]
        yield b""
        cuts = self._cuts
        await self._released.wait()
        since = request.params.get("resourceVersion")
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = asyncio.get_running_loop().time() + timeout
        async with self._lock:
            if since not in {None, "", "0"} and int(since) < self.compacted_version:
                yield {
                    "type": "ERROR",
                    "object": {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": f"too old resource version: {since} ({self.compacted_version})",
                        "reason": "Expired",
                        "code": 410,
                    },
                }
                return
            if since in {None, "", "0"}:
                initial = [{"type": "ADDED", "object": o} for o in self._current(request)]
                position = len(self.events)
            else:
                initial = []
                position = next(
                    (i for i, (v, _, _) in enumerate(self.events) if v > int(since)),
                    len(self.events),
                )
        for event in initial:
            yield event
        while True:
            async with self._changed:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(
                            lambda seen=position: len(self.events) > seen or self._cuts != cuts
                        ),
                        max(remaining, 0),
                    )
                except TimeoutError:
                    return
                if self._cuts != cuts:
                    return
                batch = self.events[position:]
                position = len(self.events)
            for _, resource, event in batch:
                obj = event.get("object") or {}
                namespace = (obj.get("metadata") or {}).get("namespace")
                if self._matches(request, resource, namespace, obj):
                    yield event

    async def cut_watches(self, hold: bool = False) -> None:
        """End every open watch stream; with `hold`, new watches wait for `release_watches()`."""
        if hold:
            self._released.clear()
        async with self._changed:
            self._cuts += 1
            self._changed.notify_all()

    def release_watches(self) -> None:
        self._released.set()

    def compact(self) -> None:
        """Forget history: a watch resuming from an older resourceVersion gets 410 Gone."""
        self.compacted_version = self.version

    # -- pod logs ---------------------------------------------------------------------

    async def _serve_log(self, request: kmock.Request) -> Any:
        match = _LOG_PATH.fullmatch(request.url.path)
        assert match is not None
        key = (match.group(1), match.group(2))
        path = self.log_files.get(key)
        if path is None:
            raise kmock.KubernetesObjectNotFoundError()
        if request.params.get("follow", "").lower() in {"true", "1"}:
            return self._follow_log(key, path)
        lines = path.read_bytes().splitlines(keepends=True) if path.exists() else []
        tail = request.params.get("tailLines")
        return b"".join(lines[-int(tail) :] if tail else lines)

    async def _follow_log(self, key: tuple[str, str], path: Path) -> AsyncIterator[bytes]:
        yield b""
        offset = 0
        while True:
            finished = key in self.finished_logs
            data = path.read_bytes()[offset:] if path.exists() else b""
            if data:
                offset += len(data)
                yield data
            elif finished:
                return
            else:
                await asyncio.sleep(0.05)

    # -- reading objects (on the emulator's loop) ----------------------------------------

    def live(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj.raw)
            for (resource, ns, _), obj in self.objects.items()
            if resource.plural == plural and not obj.deleted and namespace in {None, ns}
        ]

    def find(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        for (resource, ns, object_name), obj in self.objects.items():
            if (resource.plural, ns, object_name) == (plural, namespace, name) and not obj.deleted:
                return copy.deepcopy(obj.raw)
        return None


@dataclass
class Node:
    """A node the kubelet's scheduler can place pods on."""

    name: str = "node-1"
    labels: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, int] = field(default_factory=dict)


@dataclass
class _Pod:
    job: dict[str, Any]
    name: str
    namespace: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: bool = False
    terminating: bool = False


class Kubelet:
    """Kubelet, scheduler and Job controller for the emulator (see the module docstring).

    Faults (`fault`, or `faults_by_job` for one Job), applied to a pod once it runs,
    without starting its container: `"oom"`, `"evict"`, `"preempt"`, `"deadline"`, and
    `"hang"` (it runs until its Job is deleted). `run_containers=False` ends every
    pod with exit code 0 without running it (for request counting at scale).
    """

    def __init__(self, emulator: ClusterEmulator, workspace: Path) -> None:
        self.emulator = emulator
        self.local = LocalBackend(workspace, max_parallel=4, cancel_grace_seconds=5)
        self.workspace = workspace
        workspace.mkdir(parents=True, exist_ok=True)
        # Exceptions of the kubelet's own tasks: a broken kubelet must fail the test.
        self.errors: list[BaseException] = []
        self.nodes = [Node()]
        self.missing_images: set[str] = set()
        self.quota_exceeded = False
        self.fault: str | None = None
        self.faults_by_job: dict[str, str] = {}
        self.run_containers = True
        # Wall-clock time at which each pod's terminal status was written, by job name.
        self.finished_at: dict[str, float] = {}
        self._pods: dict[str, _Pod] = {}
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, base_url: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._session = aiohttp.ClientSession(
            base_url=base_url, headers={"User-Agent": KUBELET_AGENT}
        )
        position = 0
        try:
            while True:
                async with self.emulator._changed:
                    await self.emulator._changed.wait_for(
                        lambda seen=position: len(self.emulator.events) > seen
                    )
                    batch = self.emulator.events[position:]
                    position = len(self.emulator.events)
                for _, resource, event in batch:
                    if resource.plural == JOBS:
                        self._on_job(event["type"], event["object"])
        finally:
            await self._session.close()

    def stop(self) -> None:
        self.local.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]

    def _on_job(self, event_type: str, job: dict[str, Any]) -> None:
        name = job["metadata"]["name"]
        ending = event_type == "DELETED" or job["metadata"].get("deletionTimestamp")
        if ending:
            pod = self._pods.get(name)
            if pod is not None and not pod.terminating:
                pod.terminating = True
                self._spawn(self._terminate(pod))
            elif pod is None:
                self._spawn(self._release_job(job))
        elif event_type == "ADDED" and name not in self._pods:
            pod = _Pod(
                job=job,
                name=f"{name}-{secrets.token_hex(3)[:5]}",
                namespace=job["metadata"]["namespace"],
            )
            self._pods[name] = pod
            self._spawn(self._start(pod))

    # -- HTTP -----------------------------------------------------------------------------

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        assert self._session is not None
        async with self._session.request(method, path, json=body) as response:
            if response.status >= 400 and response.status != 404:
                raise RuntimeError(f"{method} {path}: {response.status} {await response.text()}")
            return await response.json() if response.status < 300 else None

    def _pod_path(self, pod: _Pod, suffix: str = "") -> str:
        return f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}{suffix}"

    def _job_path(self, pod: _Pod) -> str:
        return f"/apis/batch/v1/namespaces/{pod.namespace}/jobs/{pod.job['metadata']['name']}"

    async def _pod_status(self, pod: _Pod, status: dict[str, Any]) -> None:
        await self._request("PATCH", self._pod_path(pod, "/status"), {"status": status})

    async def _job_status(self, pod: _Pod, status: dict[str, Any]) -> None:
        await self._request("PATCH", self._job_path(pod) + "/status", {"status": status})

    # -- scheduling and starting ------------------------------------------------------------

    async def _start(self, pod: _Pod) -> None:
        async with pod.lock:
            job = pod.job
            job_name = job["metadata"]["name"]
            if self.quota_exceeded:
                await self._failed_create(pod)
                return
            template = job["spec"]["template"]
            labels = {
                **(template["metadata"].get("labels") or {}),
                "batch.kubernetes.io/job-name": job_name,
                "job-name": job_name,
                "controller-uid": job["metadata"]["uid"],
            }
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod.name,
                    "namespace": pod.namespace,
                    "labels": labels,
                    "annotations": template["metadata"].get("annotations") or {},
                    "ownerReferences": [
                        {
                            "apiVersion": "batch/v1",
                            "kind": "Job",
                            "name": job_name,
                            "uid": job["metadata"]["uid"],
                            "controller": True,
                        }
                    ],
                },
                "spec": template["spec"],
                "status": {"phase": "Pending"},
            }
            await self._request("POST", f"/api/v1/namespaces/{pod.namespace}/pods", body)
            unschedulable = self._schedule(template["spec"])
            if unschedulable:
                await self._pod_status(
                    pod,
                    {
                        "phase": "Pending",
                        "conditions": [
                            {
                                "type": "PodScheduled",
                                "status": "False",
                                "reason": "Unschedulable",
                                "message": unschedulable,
                            }
                        ],
                    },
                )
                return
            image = template["spec"]["containers"][0]["image"]
            if image in self.missing_images:
                for reason, message in (
                    ("ErrImagePull", f'failed to pull and unpack image "{image}": not found'),
                    ("ImagePullBackOff", f'Back-off pulling image "{image}"'),
                ):
                    await self._pod_status(pod, self._waiting(image, reason, message))
                return
            try:
                values = self._secret_values(pod, template["spec"])
            except KeyError as exc:
                await self._pod_status(
                    pod, self._waiting(image, "CreateContainerConfigError", str(exc))
                )
                return
            log = self.workspace / f"{job_name}.log"
            self.emulator.log_files[(pod.namespace, pod.name)] = log
            if self._fault(job_name) or not self.run_containers:
                log.write_text(f"container of {job_name} started\n")
                await self._pod_status(pod, self._running(image))
                self._spawn(self._simulate_end(pod))
                return
            manifest = copy.deepcopy(job)
            self.local.launch(
                manifest, on_exit=lambda outcome: self._exited(pod, outcome), secrets=values
            )
            pod.running = True
            await self._pod_status(pod, self._running(image))

    def _schedule(self, pod_spec: dict[str, Any]) -> str | None:
        """The scheduler's message when no node fits, else None."""
        selector = pod_spec.get("nodeSelector") or {}
        limits = (pod_spec["containers"][0].get("resources") or {}).get("limits") or {}
        total = len(self.nodes)
        matching = [n for n in self.nodes if all(n.labels.get(k) == v for k, v in selector.items())]
        if not matching:
            return (
                f"0/{total} nodes are available: {total} node(s) didn't match Pod's node "
                f"affinity/selector. preemption: 0/{total} nodes are available: {total} "
                "Preemption is not helpful for scheduling."
            )
        for resource, amount in limits.items():
            if "/" in resource and not any(
                n.allocatable.get(resource, 0) >= int(amount) for n in matching
            ):
                return f"0/{total} nodes are available: {len(matching)} Insufficient {resource}."
        return None

    def _secret_values(self, pod: _Pod, pod_spec: dict[str, Any]) -> dict[str, dict[str, str]]:
        values: dict[str, dict[str, str]] = {}
        for item in pod_spec["containers"][0].get("env") or []:
            ref = (item.get("valueFrom") or {}).get("secretKeyRef")
            if ref is None:
                continue
            secret = self.emulator.find("secrets", pod.namespace, ref["name"])
            if secret is None or ref["key"] not in (secret.get("data") or {}):
                raise KeyError(
                    f"couldn't find key {ref['key']} in Secret {pod.namespace}/{ref['name']}"
                )
            values.setdefault(ref["name"], {})[ref["key"]] = base64.b64decode(
                secret["data"][ref["key"]]
            ).decode()
        return values

    async def _failed_create(self, pod: _Pod) -> None:
        job_name = pod.job["metadata"]["name"]
        await self._request(
            "POST",
            f"/api/v1/namespaces/{pod.namespace}/events",
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {
                    "name": f"{job_name}.{secrets.token_hex(4)}",
                    "namespace": pod.namespace,
                },
                "involvedObject": {
                    "kind": "Job",
                    "name": job_name,
                    "namespace": pod.namespace,
                    "apiVersion": "batch/v1",
                    "uid": pod.job["metadata"]["uid"],
                },
                "reason": "FailedCreate",
                "type": "Warning",
                "message": (
                    f'Error creating: pods "{pod.name}" is forbidden: exceeded quota: gpu-quota, '
                    "requested: nvidia.com/gpu=1, used: nvidia.com/gpu=8, limited: nvidia.com/gpu=8"
                ),
                "lastTimestamp": _now(),
            },
        )

    @staticmethod
    def _waiting(image: str, reason: str, message: str) -> dict[str, Any]:
        return {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": "task",
                    "image": image,
                    "ready": False,
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
            ],
        }

    @staticmethod
    def _running(image: str) -> dict[str, Any]:
        return {
            "phase": "Running",
            "startTime": _now(),
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": "task",
                    "image": image,
                    "ready": True,
                    "state": {"running": {"startedAt": _now()}},
                }
            ],
        }

    # -- ending -----------------------------------------------------------------------------

    def _exited(self, pod: _Pod, outcome: PodExit) -> None:
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(self._container_ended(pod, outcome), self._loop)

    async def _container_ended(self, pod: _Pod, outcome: PodExit) -> None:
        async with pod.lock:
            pod.running = False
            self.emulator.finished_logs.add((pod.namespace, pod.name))
            if pod.terminating:
                await self._remove(pod)
                return
            code = outcome.exit_code if outcome.exit_code is not None else 137
            await self._finish(pod, code if code >= 0 else 128 - code)

    async def _finish(
        self,
        pod: _Pod,
        exit_code: int,
        reason: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        image = pod.job["spec"]["template"]["spec"]["containers"][0]["image"]
        terminated = {
            "exitCode": exit_code,
            "reason": reason or ("Completed" if exit_code == 0 else "Error"),
            "finishedAt": _now(),
        }
        status = {
            "phase": "Succeeded" if exit_code == 0 else "Failed",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": "task",
                    "image": image,
                    "ready": False,
                    "state": {"terminated": terminated},
                }
            ],
            **(extra or {}),
        }
        self.finished_at[pod.job["metadata"]["name"]] = time.time()
        await self._pod_status(pod, status)
        condition = (
            {"type": "Complete", "status": "True", "lastTransitionTime": _now()}
            if exit_code == 0
            else {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
            }
        )
        await self._job_status(
            pod,
            {
                "conditions": [condition],
                "succeeded" if exit_code == 0 else "failed": 1,
            },
        )

    async def _simulate_end(self, pod: _Pod) -> None:
        async with pod.lock:
            fault = self._fault(pod.job["metadata"]["name"])
            if pod.terminating or fault == "hang":
                return
            self.emulator.finished_logs.add((pod.namespace, pod.name))
            if fault is None:
                await self._finish(pod, 0)
            elif fault == "oom":
                await self._finish(pod, 137, reason="OOMKilled")
            elif fault == "evict":
                await self._finish(
                    pod,
                    137,
                    extra={
                        "reason": "Evicted",
                        "message": "The node was low on resource: memory.",
                    },
                )
            elif fault == "preempt":
                await self._finish(
                    pod,
                    143,
                    extra={
                        "conditions": [
                            {"type": "PodScheduled", "status": "True"},
                            {
                                "type": "DisruptionTarget",
                                "status": "True",
                                "reason": "TerminationByKubelet",
                                "message": "Pod was terminated: imminent node shutdown.",
                            },
                        ]
                    },
                )
                await self._request("DELETE", self._pod_path(pod))
            elif fault == "deadline":
                condition = {
                    "status": "True",
                    "reason": "DeadlineExceeded",
                    "message": "Job was active longer than specified deadline",
                }
                await self._job_status(
                    pod, {"conditions": [{"type": "FailureTarget", **condition}]}
                )
                await self._request("DELETE", self._pod_path(pod))
                await self._job_status(
                    pod,
                    {
                        "conditions": [
                            {"type": "FailureTarget", **condition},
                            {"type": "Failed", **condition},
                        ]
                    },
                )

    def _fault(self, job_name: str) -> str | None:
        return self.faults_by_job.get(job_name, self.fault)

    async def publish_nodes(self) -> None:
        """Show the scheduler's nodes through the API, as `kubectl get nodes` would."""
        for node in self.nodes:
            await self._request(
                "POST",
                "/api/v1/nodes",
                {
                    "apiVersion": "v1",
                    "kind": "Node",
                    "metadata": {"name": node.name, "labels": node.labels},
                    "status": {"allocatable": {k: str(v) for k, v in node.allocatable.items()}},
                },
            )

    async def _terminate(self, pod: _Pod) -> None:
        """The Job is being deleted: stop the container, then remove the pod and the Job."""
        async with pod.lock:
            if pod.running:
                self.local.cancel(pod.job["metadata"]["name"])  # `_container_ended` removes it
                return
            await self._remove(pod)

    async def _remove(self, pod: _Pod) -> None:
        self.emulator.finished_logs.add((pod.namespace, pod.name))
        await self._request("DELETE", self._pod_path(pod))
        await self._release_job(pod.job)

    async def _release_job(self, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        current = self.emulator.find(JOBS, meta["namespace"], meta["name"])
        if current is not None and current["metadata"].get("finalizers"):
            path = f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{meta['name']}"
            await self._request("PATCH", path, {"metadata": {"finalizers": []}})


class KubeCluster:
    """Synchronous handle on the emulator and kubelet running in a background loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, workspace: Path) -> None:
        self.loop = loop
        self.workspace = workspace
        self.emulator = ClusterEmulator()
        self.kubelet = Kubelet(self.emulator, workspace / "kubelet")
        self.url = ""
        self.kubeconfig = workspace / "kubeconfig.json"
        self._server: kmock.Server | None = None
        self._kubelet_task: asyncio.Task[Any] | None = None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the emulator's loop (a consistent view of its objects)."""

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def _start(self) -> None:
        await self.emulator.__aenter__()
        self._server = kmock.Server(self.emulator)
        await self._server.__aenter__()
        self.url = str(self._server.url).rstrip("/")
        self._kubelet_task = asyncio.get_running_loop().create_task(self.kubelet.run(self.url))

    async def _stop(self) -> None:
        if self._kubelet_task is not None:
            self._kubelet_task.cancel()
            await asyncio.gather(self._kubelet_task, return_exceptions=True)
        assert self._server is not None
        await self._server.__aexit__(None, None, None)
        await self.emulator.__aexit__(None, None, None)

    def kubeconfig_dict(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "test-token"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}],
            "current-context": "kmock",
        }

    # -- what tests look at ---------------------------------------------------------------

    def jobs(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: self.emulator.live(JOBS, namespace))

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: self.emulator.live(PODS, namespace))

    def secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.call(lambda: self.emulator.find("secrets", namespace, name))

    def created_jobs(self) -> list[dict[str, Any]]:
        """Every Job body the API accepted a POST for, exactly as sent."""
        return [
            json.loads(r.body)
            for r in self.call(lambda: list(self.emulator))
            if r.method == "POST" and r.resource is not None and r.resource.plural == JOBS
        ]

    def client_requests(self) -> list[kmock.Request]:
        """Requests from anything but the test kubelet (the runner, the CLI)."""
        return [
            r
            for r in self.call(lambda: list(self.emulator))
            if r.headers.get("User-Agent") != KUBELET_AGENT
        ]

    def create(self, path: str, body: dict[str, Any]) -> Any:
        """Create an object as another client would (not counted as the runner's)."""
        return self.run(self.kubelet._request("POST", path, body))

    def publish_nodes(self) -> None:
        self.run(self.kubelet.publish_nodes())

    def cut_watches(self, hold: bool = False) -> None:
        self.run(self.emulator.cut_watches(hold))

    def release_watches(self) -> None:
        self.call(self.emulator.release_watches)

    def compact(self) -> None:
        self.call(self.emulator.compact)


@contextmanager
def running_cluster(workspace: Path) -> Iterator[KubeCluster]:
    """An emulated cluster with a kubelet, served on a local port until the block ends."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kmock", daemon=True)
    thread.start()
    workspace.mkdir(parents=True, exist_ok=True)
    cluster = KubeCluster(loop, workspace)
    try:
        cluster.run(cluster._start())
        cluster.kubeconfig.write_text(json.dumps(cluster.kubeconfig_dict()))
        yield cluster
    finally:
        cluster.kubelet.stop()
        cluster.run(cluster._stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    if cluster.kubelet.errors:
        raise cluster.kubelet.errors[0]
