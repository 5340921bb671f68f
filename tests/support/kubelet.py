"""A test kubelet: kubelet, scheduler, Job controller and TTL controller for `ClusterEmulator`.

For every created Job it makes its pods, runs their containers through the test
container runtime (tests/support/containers.py: a process each, with the env,
volumes, hostname and /etc/hosts a kubelet gives a container) and writes pod and
Job status back over HTTP, as another client of the API. A pod is Running once its
container has started (after its init containers); a Job's pods all end when one
fails, as the Job controller deletes the rest of a failed Job's pods; a Job past its
`activeDeadlineSeconds`, counted from the Job's start (its pods' creation, or its
resumption from suspension) so that pending time counts, fails with DeadlineExceeded and
its pods are deleted, running or not. It can instead
leave the pod pending (image pull error, unschedulable) or end it as
Kubernetes would (OOMKilled, evicted, preempted, deadline). As Kubernetes'
TTL-after-finished controller does, it deletes a finished Job (and so its pods)
`ttlSecondsAfterFinished` after the Job finished. A pod the API server refuses
(over quota, a service account that does not exist) is not created: as the Job
controller does, it records a FailedCreate event on the Job and tries again with
backoff. A suspended Job (one waiting in a Kueue queue, tests/support/kueue.py) gets
its pods only once it is unsuspended. Suspending a Job that has pods deletes them, as
Kubernetes' Job controller does ("Suspending a Job will delete its active Pods until
the Job is resumed again", https://kubernetes.io/docs/concepts/workloads/controllers/job/
"Suspending a Job"), and gives the Job the condition `Suspended` (reason
`JobSuspended`); resumed, it gets new pods.

A container runs the interpreter of its image: a stock `python` image has a bare
one, with its standard library and pip only (`bare_interpreter`), so a pod of the
gke backend can import nothing but what its shipped environment brings. An
image listed in `images` (a test's own image for `environment="image"`) runs
that interpreter instead. The kubelet's node keeps its hostPath directories in
one place for the session (`node_root`), so the node's environment cache serves
every cluster of the run, as a long-lived node's would.

A container's environment is what its image sets plus its manifest's env, never
the environment of whoever created the Job. So a pod run here starts from
`image_env()`, what a python image sets: `PATH` (the image interpreter's directory
first, standing in for the image's `/usr/local/bin`, then the system
directories), `HOME` (an empty directory of each pod's own, as a fresh container
filesystem has) and `LANG=C.UTF-8`; then its manifest's env; then `KUBECONFIG`,
the test-only stand-in for a mounted service-account token, and the pod's Workload
Identity port of the GCS IAM proxy in place of its address (tests/support/pod_env.py).
Anything else a pod needs, such as the GCS emulator's address, must travel in
the manifest as a user's settings would.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.containers import (
    ContainerRuntime,
    MountFailed,
    PodAddresses,
    Sandbox,
    bare_interpreter,
)
from tests.support.kube_emulator import JOBS, ClusterEmulator
from tests.support.kube_objects import (
    MAX_SIZE_REACHED,
    Node,
    NodePool,
    event,
    failed_create_event,
    finished_job_status,
    now,
    place,
    pod_of_job,
    pod_requests,
    pool_verdict,
    quota_refusal,
    running_status,
    scale_up_refused,
    scale_up_triggered,
    terminated_status,
    unschedulable_message,
    unschedulable_status,
    waiting_status,
)
from tests.support.pod_env import (
    GCS_ADDRESS_VARIABLES,
    image_env,
    pod_kubeconfig,
    secret_values,
    workload_identity_env,
)

KUBELET_AGENT = "test-kubelet"
# An image with kinetic-prefect and the tests' libraries: this interpreter (environment="image").
TEST_IMAGE = "kinetic-prefect-tests:image"


def _finished(job: dict[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c["type"] in {"Complete", "Failed"} and c["status"] == "True" for c in conditions)


@dataclass
class _Pod:
    job: dict[str, Any]
    name: str
    namespace: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    running: bool = False
    terminating: bool = False
    # Its Job was suspended: its pods go, the Job stays and gets new ones once resumed.
    suspending: bool = False
    # One pod per host for an Indexed Job (a multi-host slice); `name` is host 0's.
    names: list[str] = field(default_factory=list)
    # The nodes its pods are bound to, one per pod, until it ends.
    nodes: list[Node] = field(default_factory=list)
    # Where the scheduler put its pods when they were created, or why it could not.
    placement: list[Node] | str | None = None
    # Its pods' containers, host 0 first, once the runtime set them up.
    boxes: list[Sandbox] = field(default_factory=list)
    # Past its Job's activeDeadlineSeconds: the Job fails with DeadlineExceeded.
    deadline_exceeded: bool = False
    # Its Job's activeDeadlineSeconds, counted from the Job's start (or its resumption).
    deadline_timer: asyncio.TimerHandle | None = None


class Kubelet:
    """Kubelet, scheduler and Job controller for the emulator (see the module docstring).

    Faults (`fault`, or `faults_by_job` for one Job), applied to a pod once it runs,
    without starting its container: `"oom"`, `"evict"`, `"preempt"`, `"reclaim"` (preempted
    as its nodes lose contact, until `bring_back` their pool), `"deadline"`, and
    `"hang"` (it runs until its Job is deleted); `fault_pods_left` limits `fault` to that
    many pods. `run_containers=False` ends every
    pod with exit code 0 without running it (for request counting at scale).
    """

    def __init__(
        self, emulator: ClusterEmulator, workspace: Path, node_root: Path | None = None
    ) -> None:
        self.emulator = emulator
        workspace.mkdir(parents=True, exist_ok=True)
        (workspace / "home").mkdir(exist_ok=True)
        # Image name -> the interpreter it runs; any other image has a bare Python.
        self.images: dict[str, str] = {TEST_IMAGE: sys.executable}
        self.runtime = ContainerRuntime(
            workspace,
            node_root=node_root or cache_dir() / "test-node",
            images=self.images,
            bare_python=lambda: bare_interpreter(cache_dir() / "test-images"),
            image_env=image_env,
            find_services=lambda namespace: self.emulator.live("services", namespace),
            addresses=_addresses(),
        )
        self.workspace = workspace
        # Exceptions of the kubelet's own tasks: a broken kubelet must fail the test.
        self.errors: list[BaseException] = []
        # The default cluster: one node every pod shares. A test that sets finite nodes
        # (`gke_nodes`) gets a scheduler that uses them up, and `node_pools` the
        # autoscaler may grow.
        self.nodes = [Node(unlimited=True)]
        self.node_pools: dict[str, NodePool] = {}
        # The most pods bound to a node pool's nodes at once, by pool.
        self.most_bound: dict[str, int] = {}
        self.missing_images: set[str] = set()
        self.quota_exceeded = False
        # The IAM proxy that stands for GCS on this cluster's network (tests/support/pod_env.py),
        # and the metadata server every pod reaches (tests/support/metadata_server.py).
        self.gcs: Any = None
        self.metadata: Any = None
        # What stands between a pod and GCS (a test's fault-injecting proxy): the pod's GCS
        # address -> the address it gets instead.
        self.gcs_front: Callable[[str], str] | None = None
        # The Job controller's backoff between attempts to create a refused pod (its
        # DefaultJobApiBackOff and MaxJobApiBackOff).
        self.create_backoff_seconds = 1.0
        self.create_backoff_max_seconds = 60.0
        self.fault: str | None = None
        self.faults_by_job: dict[str, str] = {}
        # With `fault`: how many pods it applies to before pods run normally again.
        self.fault_pods_left: int | None = None
        self.run_containers = True
        # Wall-clock time at which each pod's terminal status was written, by job name.
        self.finished_at: dict[str, float] = {}
        self._pods: dict[str, _Pod] = {}
        self._session: aiohttp.ClientSession | None = None
        self._base_url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ttl_timers: dict[str, asyncio.Task[Any]] = {}
        # Unschedulable Jobs, in creation order, until capacity frees for them.
        self._waiting: list[_Pod] = []
        # Pods whose container waits for a Secret its env names (CreateContainerConfigError).
        self._config_waiting: list[_Pod] = []
        # Nodes the autoscaler is adding, by pool; they join once allowed (`hold_scale_ups`).
        self._scaling: dict[str, int] = {}
        self._scale_ups_allowed: asyncio.Event | None = None

    def print_log_tails(self, lines: int = 40) -> None:
        """Print the end of each pod's log (for a failed case: the logs go with the cluster)."""
        for log in sorted(self.workspace.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- the last {len(tail)} lines of pod log {log.name} ---", *tail, sep="\n")

    def hold_scale_ups(self) -> None:
        """New nodes wait for `release_scale_ups` (call both on the cluster's loop)."""
        self._allowed().clear()

    def release_scale_ups(self) -> None:
        self._allowed().set()

    def _allowed(self) -> asyncio.Event:
        if self._scale_ups_allowed is None:
            self._scale_ups_allowed = asyncio.Event()
            self._scale_ups_allowed.set()
        return self._scale_ups_allowed

    def add_node_pool(self, pool: str, accelerator: str, nodes: int, max_nodes: int) -> None:
        """A node pool of `nodes` nodes that the autoscaler grows up to `max_nodes`."""
        node_pool = NodePool(pool, accelerator, max_nodes)
        self.node_pools[pool] = node_pool
        self.nodes.extend(node_pool.new_node(index) for index in range(nodes))

    def bound_nodes(self, job_name: str) -> list[Node]:
        """The nodes the scheduler bound a Job's pods to (empty once it ended)."""
        pod = self._pods.get(job_name)
        return list(pod.nodes) if pod is not None else []

    @property
    def node_root(self) -> Path:
        """Where the node keeps its hostPath directories."""
        return self.runtime.node_root

    @node_root.setter
    def node_root(self, path: Path) -> None:
        self.runtime.node_root = path

    # -- lifecycle ----------------------------------------------------------------------

    async def run(self, base_url: str) -> None:
        self._loop = asyncio.get_running_loop()
        self._base_url = base_url
        self._session = aiohttp.ClientSession(
            base_url=base_url, headers={"User-Agent": KUBELET_AGENT}
        )
        try:
            async for batch in self.emulator.event_batches():
                for _, resource, event in batch:
                    if resource.plural == JOBS:
                        self._on_job(event["type"], event["object"])
                    elif resource.plural == "services":
                        self.runtime.dns_changed()  # the cluster's DNS follows Services
                    elif resource.plural == "secrets" and event["type"] != "DELETED":
                        self._retry_config_waiting()
        finally:
            # The cluster is going away: work still in flight (a pod being ended, a TTL
            # timer) stops here, before the session it talks through is closed.
            pending = [*self._ttl_timers.values(), *self._tasks]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await self._session.close()

    async def shutdown(self) -> None:
        """The node goes away: every container still running is killed, and reaped."""
        processes = list(self.runtime.kill_all())
        await asyncio.gather(*(p.wait() for p in processes))

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
        elif _finished(job) and job["spec"].get("ttlSecondsAfterFinished") is not None:
            if name not in self._ttl_timers:
                timer = asyncio.get_running_loop().create_task(self._expire(job))
                timer.add_done_callback(self._task_done)
                self._ttl_timers[name] = timer
        elif job["spec"].get("suspend") and name in self._pods:
            pod = self._pods[name]
            if not pod.terminating:
                pod.terminating = pod.suspending = True
                self._spawn(self._terminate(pod))
        elif name not in self._pods and not job["spec"].get("suspend") and pods_at_once(job):
            # A suspended Job (waiting in a Kueue queue) gets its pods once unsuspended.
            indexed = job["spec"].get("completionMode") == "Indexed"
            names = [
                f"{name}-{index}-{secrets.token_hex(3)[:5]}"
                if indexed
                else f"{name}-{secrets.token_hex(3)[:5]}"
                for index in range(pods_at_once(job))
            ]
            pod = _Pod(job=job, name=names[0], namespace=job["metadata"]["namespace"], names=names)
            self._pods[name] = pod
            self._spawn(self._start(pod))
            deadline = job["spec"].get("activeDeadlineSeconds")
            if deadline is not None:
                # Counted from the Job's startTime: set as the Job controller first syncs
                # it, and set again when a suspended Job resumes; time its pods spend
                # pending counts.
                pod.deadline_timer = asyncio.get_running_loop().call_later(
                    float(deadline), lambda: self._spawn(self._past_deadline(pod))
                )

    async def _expire(self, job: dict[str, Any]) -> None:
        """TTL-after-finished: delete the Job (and with it its pods) once its TTL is up."""
        await asyncio.sleep(float(job["spec"]["ttlSecondsAfterFinished"]))
        meta = job["metadata"]
        path = f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{meta['name']}"
        await self._request("DELETE", path, {"propagationPolicy": "Background"})

    # -- HTTP -----------------------------------------------------------------------------

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        assert self._session is not None
        async with self._session.request(method, path, json=body) as response:
            if response.status >= 400 and response.status != 404:
                raise RuntimeError(f"{method} {path}: {response.status} {await response.text()}")
            return await response.json() if response.status < 300 else None

    def _pod_path(self, pod: _Pod, suffix: str = "", name: str | None = None) -> str:
        return f"/api/v1/namespaces/{pod.namespace}/pods/{name or pod.name}{suffix}"

    def _job_path(self, pod: _Pod) -> str:
        return f"/apis/batch/v1/namespaces/{pod.namespace}/jobs/{pod.job['metadata']['name']}"

    async def _pod_status(
        self, pod: _Pod, status: dict[str, Any], names: list[str] | None = None
    ) -> None:
        for name in pod.names if names is None else names:
            await self._request("PATCH", self._pod_path(pod, "/status", name), {"status": status})

    async def _job_status(self, pod: _Pod, status: dict[str, Any]) -> None:
        await self._request("PATCH", self._job_path(pod) + "/status", {"status": status})

    # -- scheduling and starting ------------------------------------------------------------

    async def _start(self, pod: _Pod) -> None:
        """Create the Job's pods, retrying with backoff while the API refuses them, then run."""
        delay = self.create_backoff_seconds
        while True:
            async with pod.lock:
                if pod.terminating or pod.deadline_exceeded:
                    return
                refusal = await self._create_pods(pod)
                if refusal is None:
                    await self._run(pod)
                    return
                await self._failed_create(pod, refusal)
            # As the Job controller requeues a Job whose pod it could not create.
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.create_backoff_max_seconds)

    async def _create_pods(self, pod: _Pod) -> str | None:
        """Create the Job's pods; the API server's refusal (quota, admission) if it refused."""
        if self.quota_exceeded:
            return quota_refusal(pod.name)
        indexed = pod.job["spec"].get("completionMode") == "Indexed"
        spec = pod.job["spec"]["template"]["spec"]
        pod.placement = place(self.nodes, spec, len(pod.names))
        if isinstance(pod.placement, list):
            self._bind(pod, pod.placement)
        for index, name in enumerate(pod.names):
            node = pod.placement[index].name if isinstance(pod.placement, list) else None
            body = pod_of_job(pod.job, name, pod.namespace, index if indexed else None, node)
            path = f"/api/v1/namespaces/{pod.namespace}/pods"
            assert self._session is not None
            async with self._session.post(path, json=body) as response:
                if response.status == 403:
                    self._unbind(pod)
                    return str((await response.json()).get("message"))
                if response.status >= 300:
                    raise RuntimeError(f"POST {path}: {response.status} {await response.text()}")
        return None

    async def _run(self, pod: _Pod) -> None:
        """Schedule and start the Job's created pods (the caller holds the pod's lock)."""
        job = pod.job
        job_name = job["metadata"]["name"]
        template = job["spec"]["template"]
        placed = pod.placement
        if isinstance(placed, str):
            # One pod per node: the pods past the nodes that fit stay unschedulable.
            fit = sum(unschedulable_message([n], template["spec"]) is None for n in self.nodes)
            pending = pod.names[min(fit, len(pod.names) - 1) :]
            await self._pod_status(pod, unschedulable_status(placed), pending)
            await self._wait_for_capacity(pod, placed, pending[0])
            return
        image = template["spec"]["containers"][0]["image"]
        if image in self.missing_images:
            for reason, message in (
                ("ErrImagePull", f'failed to pull and unpack image "{image}": not found'),
                ("ImagePullBackOff", f'Back-off pulling image "{image}"'),
            ):
                await self._pod_status(pod, waiting_status(image, reason, message))
            return
        try:
            values = self._secret_values(pod, template["spec"])
        except KeyError as exc:
            # The kubelet tries again to run a pod whose Secret it could not fetch: here as
            # soon as a Secret is written (`_retry_config_waiting`; listed before the status
            # is written, so a Secret written meanwhile is not missed).
            self._config_waiting.append(pod)
            await self._pod_status(
                pod, waiting_status(image, "CreateContainerConfigError", str(exc))
            )
            return
        log = self.workspace / f"{job_name}.log"
        for index, name in enumerate(pod.names):
            host_log = log if index == 0 else self.workspace / f"{job_name}.host{index}.log"
            self.emulator.log_files[(pod.namespace, name)] = host_log
        self._pin_counted_fault(job_name)
        if self._fault(job_name) or not self.run_containers:
            log.write_text(f"container of {job_name} started\n")
            await self._pod_status(pod, running_status(image))
            self._spawn(self._simulate_end(pod))
            return
        pod.running = True
        hosts = [self._host_pod(pod, name) for name in pod.names]
        self._spawn(self._run_containers(pod, hosts, values))

    def _host_pod(self, pod: _Pod, name: str) -> dict[str, Any]:
        """The pod `name` as the API holds it, its container's env as this node gives it.

        The env gets the test-only stand-ins of tests/support/pod_env.py: the pod's
        Workload Identity port of the GCS IAM proxy, `KUBECONFIG` for its service
        account's token, its own empty `HOME`, and its metadata server.
        """
        stored = self.emulator.find("pods", pod.namespace, name)
        assert stored is not None, f"pod {name} is not in the API"
        spec = stored["spec"]
        # Each container starts with a filesystem of its own: nothing one pod leaves in
        # its home (a Prefect home, a key file) is there for the next.
        home = self.workspace / "homes" / name
        home.mkdir(parents=True, exist_ok=True)
        stand_ins = [
            {"name": "KUBECONFIG", "value": self._pod_kubeconfig(pod, spec)},
            {"name": "HOME", "value": str(home)},
        ]
        if self.metadata is not None:  # Workload Identity's ADC (tests/support/metadata_server.py)
            stand_ins += [{"name": k, "value": v} for k, v in self.metadata.pod_env(name).items()]
        # Every container of the pod, init containers too, reaches GCS and the metadata
        # server as the pod's identity.
        for container in [*(spec.get("initContainers") or []), *spec["containers"]]:
            container["env"] = workload_identity_env(
                lambda account: self.emulator.find("serviceaccounts", pod.namespace, account),
                pod.namespace,
                {**spec, "containers": [container]},
                self.gcs,
            )
            if self.gcs_front is not None:
                for item in container["env"]:
                    if item["name"] in GCS_ADDRESS_VARIABLES and item.get("value"):
                        item["value"] = self.gcs_front(item["value"])
            container["env"] += [dict(item) for item in stand_ins]
        return stored

    async def _run_containers(
        self, pod: _Pod, hosts: list[dict[str, Any]], values: dict[str, dict[str, str]]
    ) -> None:
        """Set up the pods' volumes, run their init containers, start them and see them end."""
        image = pod.job["spec"]["template"]["spec"]["containers"][0]["image"]
        logs = [self.emulator.log_files[(pod.namespace, name)] for name in pod.names]
        pod.boxes = [self.runtime.sandbox(host, log) for host, log in zip(hosts, logs, strict=True)]
        homes = [Path(_env_value(box.pod, "HOME") or self.workspace) for box in pod.boxes]
        try:
            for box in pod.boxes:
                await self.runtime.mount_volumes(box, _env_value(box.pod, "STORAGE_EMULATOR_HOST"))
        except MountFailed as exc:
            await self._mount_failed(pod, image, str(exc))
            return
        try:
            codes = await self._run_hosts(pod, values, homes, image)
        except BaseException:
            # A broken kubelet fails the test (`errors`); nothing it started runs on.
            self._stop_containers(pod)
            raise
        for box in pod.boxes:
            self.runtime.forget(box)
        await self._container_ended(pod, codes)

    async def _run_hosts(
        self, pod: _Pod, values: dict[str, dict[str, str]], homes: list[Path], image: str
    ) -> list[int]:
        """Run the hosts' init containers, then their containers; each host's exit code."""
        if pod.terminating or pod.deadline_exceeded:
            return [137] * len(pod.boxes)
        init_codes = await asyncio.gather(
            *(
                self.runtime.run_init_containers(b, values, h)
                for b, h in zip(pod.boxes, homes, strict=True)
            )
        )
        failed_init = next((code for code in init_codes if code), 0)
        if not failed_init and not pod.terminating and not pod.deadline_exceeded:
            for box, home in zip(pod.boxes, homes, strict=True):
                await self.runtime.start(box, values, home)
            async with pod.lock:
                if pod.terminating or pod.deadline_exceeded:
                    self._stop_containers(pod)
                else:
                    await self._pod_status(pod, running_status(image))
            return await self._wait_for_hosts(pod)
        return [failed_init or 137] * len(pod.boxes)

    async def _wait_for_hosts(self, pod: _Pod) -> list[int]:
        """Each host's exit code, once all ended. When one fails, the Job has failed: the
        Job controller deletes its other pods, whose containers are stopped."""
        waits = {asyncio.ensure_future(box.process.wait()): box for box in pod.boxes if box.process}
        pending = set(waits)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                self.runtime.ended(waits[finished])
            if any(box.exit_code for box in pod.boxes):
                self._stop_containers(pod)
        return [box.exit_code or 0 for box in pod.boxes]

    def _stop_containers(self, pod: _Pod) -> None:
        grace = pod.job["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        for box in pod.boxes:
            self.runtime.stop(box, float(grace))

    async def _past_deadline(self, pod: _Pod) -> None:
        """The Job controller's activeDeadlineSeconds: the Job is failing, its pods are stopped,
        or deleted if they never ran (pending for a node, an image, a volume)."""
        async with pod.lock:
            meta = pod.job["metadata"]
            job = self.emulator.find(JOBS, meta["namespace"], meta["name"])
            if pod.terminating or pod.deadline_exceeded or job is None or _finished(job):
                return
            pod.deadline_exceeded = True
            await self._job_status(pod, {"conditions": [_deadline_condition("FailureTarget")]})
            if pod.running:
                self._stop_containers(pod)  # `_container_ended` fails the Job
                return
            for waiting in (self._waiting, self._config_waiting):
                if pod in waiting:
                    waiting.remove(pod)
            await self._fail_past_deadline(pod)

    async def _mount_failed(self, pod: _Pod, image: str, message: str) -> None:
        """A volume could not be mounted: the pod stays ContainerCreating, with an event."""
        async with pod.lock:
            pod.running = False
            for box in pod.boxes:
                self.runtime.forget(box)
            if pod.terminating:
                await self._remove(pod)
                return
            if pod.deadline_exceeded:  # past it while mounting: no container runs
                await self._fail_past_deadline(pod)
                return
            await self._pod_status(pod, waiting_status(image, "ContainerCreating", ""))
            found = self.emulator.find("pods", pod.namespace, pod.name)
            if found is not None:
                await self._event(found, "FailedMount", message, "kubelet", "Warning")

    def _pod_kubeconfig(self, pod: _Pod, pod_spec: dict[str, Any]) -> str:
        return pod_kubeconfig(self.workspace, self._base_url, pod.namespace, pod_spec)

    def _secret_values(self, pod: _Pod, pod_spec: dict[str, Any]) -> dict[str, dict[str, str]]:
        return secret_values(
            lambda name: self.emulator.find("secrets", pod.namespace, name), pod.namespace, pod_spec
        )

    # -- capacity: binding, waiting, scaling up ------------------------------------------

    def _bind(self, pod: _Pod, nodes: list[Node]) -> None:
        requests = pod_requests(pod.job["spec"]["template"]["spec"])
        for node in nodes:
            node.bind(requests)
        pod.nodes = list(nodes)
        for pool in {node.pool or "" for node in nodes}:
            bound = sum((n.pool or "") == pool for p in self._pods.values() for n in p.nodes[:1])
            self.most_bound[pool] = max(self.most_bound.get(pool, 0), bound)

    def _unbind(self, pod: _Pod) -> None:
        """The Job's pods ended or went away: their nodes take the next waiting pods."""
        if not pod.nodes:
            return
        requests = pod_requests(pod.job["spec"]["template"]["spec"])
        for node in pod.nodes:
            node.release(requests)
        pod.nodes = []
        self._schedule_waiting()

    def _retry_config_waiting(self) -> None:
        """A Secret was written: start again the pods that waited for one."""
        waiting, self._config_waiting = self._config_waiting, []
        for pod in waiting:
            self._spawn(self._retry_start(pod))

    async def _retry_start(self, pod: _Pod) -> None:
        async with pod.lock:
            if pod.terminating or pod.deadline_exceeded or pod.running:
                return
            await self._run(pod)

    def _schedule_waiting(self) -> None:
        """Bind the waiting Jobs that fit now, in creation order (no await: no one jumps in)."""
        for pod in list(self._waiting):
            placed = place(self.nodes, pod.job["spec"]["template"]["spec"], len(pod.names))
            if isinstance(placed, list):
                self._waiting.remove(pod)
                pod.placement = placed
                self._bind(pod, placed)
                self._spawn(self._start_bound(pod))

    async def _start_bound(self, pod: _Pod) -> None:
        async with pod.lock:
            if pod.terminating or pod.deadline_exceeded:
                return
            assert isinstance(pod.placement, list)
            for name, node in zip(pod.names, pod.placement, strict=True):
                path = self._pod_path(pod, name=name)
                await self._request("PATCH", path, {"spec": {"nodeName": node.name}})
            await self._run(pod)

    async def _wait_for_capacity(self, pod: _Pod, message: str, pod_name: str) -> None:
        """Record what the scheduler and autoscaler say, queue the Job, and maybe grow a pool."""
        self._waiting.append(pod)
        found = self.emulator.find("pods", pod.namespace, pod_name)
        if found is None:
            return
        spec = pod.job["spec"]["template"]["spec"]
        await self._event(found, "FailedScheduling", message, "default-scheduler", "Warning")
        verdicts: list[str] = []
        for name, members in self._pools().items():
            node_pool = self.node_pools.get(name)
            size = len(members) + self._scaling.get(name, 0)
            template = node_pool.new_node(size) if node_pool else members[0]
            most = node_pool.max_nodes if node_pool else len(members)
            verdict = pool_verdict(template, spec, size, most if len(pod.names) == 1 else 0)
            if verdict is None and node_pool is not None:
                self._scaling[name] = self._scaling.get(name, 0) + 1
                grows = scale_up_triggered(node_pool, size)
                await self._event(found, "TriggeredScaleUp", grows, "cluster-autoscaler")
                self._spawn(self._scale_up(node_pool))
                return
            verdicts.append(verdict or MAX_SIZE_REACHED)
        if verdicts:
            refused = scale_up_refused(verdicts)
            await self._event(found, "NotTriggerScaleUp", refused, "cluster-autoscaler")

    def _pools(self) -> dict[str, list[Node]]:
        """The node pools (the autoscaler's node groups) and their nodes."""
        pools: dict[str, list[Node]] = {name: [] for name in self.node_pools}
        for node in self.nodes:
            if node.pool:
                pools.setdefault(node.pool, []).append(node)
        return pools

    async def _scale_up(self, node_pool: NodePool) -> None:
        """The autoscaler's new node joins, once its TriggeredScaleUp event is recorded."""
        await self._allowed().wait()
        node = node_pool.new_node(len(self._pools()[node_pool.name]))
        self.nodes.append(node)
        self._scaling[node_pool.name] -= 1
        await self._publish(node)
        self._schedule_waiting()

    async def _event(
        self, about: dict[str, Any], reason: str, message: str, component: str, kind: str = "Normal"
    ) -> None:
        name = f"{about['metadata']['name']}.{secrets.token_hex(4)}"
        body = event(about, name, reason, message, component, kind)
        path = f"/api/v1/namespaces/{about['metadata']['namespace']}/events"
        await self._request("POST", path, body)

    async def _failed_create(self, pod: _Pod, refusal: str) -> None:
        event_name = f"{pod.job['metadata']['name']}.{secrets.token_hex(4)}"
        event = failed_create_event(pod.job, event_name, refusal)
        await self._request("POST", f"/api/v1/namespaces/{pod.namespace}/events", event)

    # -- ending -----------------------------------------------------------------------------

    async def _container_ended(self, pod: _Pod, codes: list[int]) -> None:
        async with pod.lock:
            if pod.deadline_timer is not None:
                pod.deadline_timer.cancel()
            pod.running = False
            self.emulator.finished_logs.update((pod.namespace, n) for n in pod.names)
            if pod.terminating:
                await self._remove(pod)
                return
            if pod.deadline_exceeded:
                await self._fail_past_deadline(pod)
                return
            await self._finish(pod, next((code for code in codes if code), 0), host_codes=codes)

    async def _finish(
        self,
        pod: _Pod,
        exit_code: int,
        reason: str | None = None,
        extra: dict[str, Any] | None = None,
        host_codes: list[int] | None = None,
    ) -> None:
        image = pod.job["spec"]["template"]["spec"]["containers"][0]["image"]
        job_name = pod.job["metadata"]["name"]
        self.finished_at[job_name] = time.time()
        self._unbind(pod)
        if host_codes is not None and len(pod.names) > 1:
            for name, code in zip(pod.names, host_codes, strict=True):
                await self._pod_status(pod, terminated_status(image, code, reason, extra), [name])
        else:
            await self._pod_status(pod, terminated_status(image, exit_code, reason, extra))
        await self._job_status(pod, finished_job_status(exit_code))

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
            elif fault in ("preempt", "reclaim"):
                if fault == "reclaim":
                    # The VMs under it go away (a reclaimed spot slice): its nodes lose
                    # contact before its pods end, so its next pods find them down.
                    await self.take_down(pod.nodes)
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
                await self._job_status(pod, {"conditions": [_deadline_condition("FailureTarget")]})
                await self._fail_past_deadline(pod)

    async def _fail_past_deadline(self, pod: _Pod) -> None:
        """The Job past its activeDeadlineSeconds: its pods deleted, then the Job Failed."""
        self.finished_at[pod.job["metadata"]["name"]] = time.time()
        self._unbind(pod)
        for name in pod.names:
            await self._request("DELETE", self._pod_path(pod, name=name))
        conditions = [_deadline_condition("FailureTarget"), _deadline_condition("Failed")]
        await self._job_status(pod, {"conditions": conditions})

    def _fault(self, job_name: str) -> str | None:
        return self.faults_by_job.get(job_name, self.fault)

    def _pin_counted_fault(self, job_name: str) -> None:
        if self.fault is None or self.fault_pods_left is None or job_name in self.faults_by_job:
            return
        self.faults_by_job[job_name] = self.fault
        self.fault_pods_left -= 1
        if self.fault_pods_left <= 0:
            self.fault, self.fault_pods_left = None, None

    async def _update_node(self, node: Node) -> None:
        body = node.as_object()
        patch = {"spec": {"taints": node.taints}, "status": body["status"]}
        await self._request("PATCH", f"/api/v1/nodes/{node.name}", patch)

    async def take_down(self, nodes: list[Node]) -> None:
        """`nodes` lose contact (their VMs went away): Ready Unknown, and unreachable."""
        for node in nodes:
            node.lose_contact()
            await self._update_node(node)

    async def bring_back(self, pool: str) -> None:
        """A node pool's nodes are Ready again (GKE recreated them): waiting pods may land."""
        for node in self.nodes:
            if node.pool == pool:
                node.come_back()
                await self._update_node(node)
        self._schedule_waiting()

    async def publish_nodes(self) -> None:
        """Show the scheduler's nodes through the API, as `kubectl get nodes` would."""
        for node in self.nodes:
            await self._publish(node)

    async def _publish(self, node: Node) -> None:
        """The node and its system DaemonSets' pods, as a joining node shows them."""
        await self._request("POST", "/api/v1/nodes", node.as_object())
        for pod in node.system_pod_objects():
            await self._request("POST", "/api/v1/namespaces/kube-system/pods", pod)

    async def _terminate(self, pod: _Pod) -> None:
        """The Job is being deleted: stop the container, then remove the pod and the Job."""
        async with pod.lock:
            if pod.running:
                self._stop_containers(pod)  # `_container_ended` removes it
                return
            await self._remove(pod)

    async def _remove(self, pod: _Pod) -> None:
        if pod in self._waiting:
            self._waiting.remove(pod)
        if pod in self._config_waiting:
            self._config_waiting.remove(pod)
        self._unbind(pod)
        for name in pod.names:
            self.emulator.finished_logs.add((pod.namespace, name))
            await self._request("DELETE", self._pod_path(pod, name=name))
        meta = pod.job["metadata"]
        current = self.emulator.find(JOBS, meta["namespace"], meta["name"])
        if (
            pod.suspending
            and current is not None
            and not current["metadata"].get("deletionTimestamp")
        ):
            # Suspended, not deleted: the Job stays, and gets new pods once resumed.
            self._pods.pop(meta["name"], None)
            suspended = {
                "type": "Suspended",
                "status": "True",
                "reason": "JobSuspended",
                "message": "Job suspended",
                "lastTransitionTime": now(),
            }
            await self._job_status(pod, {"conditions": [suspended], "active": 0})
            if not current["spec"].get("suspend"):  # resumed meanwhile
                self._on_job("MODIFIED", current)
            return
        await self._release_job(pod.job)

    async def _release_job(self, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        current = self.emulator.find(JOBS, meta["namespace"], meta["name"])
        if current is not None and current["metadata"].get("finalizers"):
            path = f"/apis/batch/v1/namespaces/{meta['namespace']}/jobs/{meta['name']}"
            await self._request("PATCH", path, {"metadata": {"finalizers": []}})


def cache_dir() -> Path:
    """Where the test node and image live on this machine: the suite's cache, which
    `KINETIC_CACHE_DIR` names as it does the product's (shared across the run's processes)."""
    configured = os.environ.get("KINETIC_CACHE_DIR")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(configured) if configured else Path(base) / "kinetic-prefect"


def _deadline_condition(kind: str) -> dict[str, str]:
    return {
        "type": kind,
        "status": "True",
        "reason": "DeadlineExceeded",
        "message": "Job was active longer than specified deadline",
    }


def _env_value(pod: dict[str, Any], name: str) -> str | None:
    """The value the pod's container env gives `name` (the last one wins)."""
    values = [
        i.get("value") for i in pod["spec"]["containers"][0].get("env") or [] if i["name"] == name
    ]
    return values[-1] if values else None


_ADDRESSES: PodAddresses | None = None


def _addresses() -> PodAddresses:
    """This test process's pod addresses (one block for every cluster it starts)."""
    global _ADDRESSES
    if _ADDRESSES is None:
        _ADDRESSES = PodAddresses(cache_dir() / "test-pod-addresses")
    return _ADDRESSES


def pods_at_once(job: dict[str, Any]) -> int:
    """How many pods the Job controller runs at once for `job`: its `parallelism`
    (default 1), at most its `completions` when set (Kubernetes' Job controller)."""
    spec = job["spec"]
    parallelism = int(spec.get("parallelism", 1))
    completions = spec.get("completions")
    return parallelism if completions is None else min(parallelism, int(completions))
