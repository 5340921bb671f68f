"""A Kubernetes cluster for tests: the emulated API and the test kubelet, run in the background.

`running_cluster()` serves `ClusterEmulator` (tests/support/kube_emulator.py) on a
local port with a `Kubelet` (tests/support/kubelet.py) and a `GarbageCollector`
(tests/support/garbage_collector.py) working on it, all on an event loop in a
background thread, and writes a kubeconfig that points at them.
`KubeCluster` is the tests' synchronous handle on both.

The cluster is as strict as GKE's (tests/support/kube_auth.py): the kubeconfig's
user "tester" may do only what RBAC grants it. At start an admin applies
deployments/k8s/rbac.yaml to each of the tests' namespaces, as `kubectl apply`
would, and binds its Role to "tester" with deployments/k8s/user-binding.yaml, as
a laptop user is told to (`unbind_user()` takes that binding away again).
"""

from __future__ import annotations

import asyncio
import json
import shlex
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import kmock

from kinetic_prefect.common.gcs import EMULATOR_PROJECT
from tests.support.garbage_collector import GARBAGE_COLLECTOR_AGENT, GarbageCollector
from tests.support.gcs_iam import documented_kubectl_commands
from tests.support.kube_auth import AUTHENTICATED, MASTERS, User
from tests.support.kube_emulator import JOBS, PODS, ClusterEmulator
from tests.support.kubelet import KUBELET_AGENT, Kubelet
from tests.support.kueue import KUEUE_AGENT, Kueue
from tests.support.standins import Target, apply, kubeconfig, kubectl, manifests

# The cluster's own controllers: their requests are not a client's.
_CONTROLLER_AGENTS = {KUBELET_AGENT, GARBAGE_COLLECTOR_AGENT, KUEUE_AGENT}

TESTER = "tester"
TESTER_TOKEN = "test-token"
# A cluster administrator (kubectl as the cluster's creator), who applies the manifests.
ADMIN_TOKEN = "admin-token"
NAMESPACE = "default"
_K8S = Path(__file__).resolve().parents[2] / "deployments" / "k8s"
RBAC_MANIFEST = _K8S / "rbac.yaml"
USER_BINDING_MANIFEST = _K8S / "user-binding.yaml"

# Longer than aiohttp needs to close finished handlers, on a loaded machine.
SERVER_STOP_SECONDS = 15.0


class KubeCluster:
    """Synchronous handle on the emulator and kubelet running in a background loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, workspace: Path) -> None:
        self.loop = loop
        self.workspace = workspace
        self.emulator = ClusterEmulator()
        self.emulator.controller_agents.update(_CONTROLLER_AGENTS)
        self.emulator.tokens.update(
            {
                TESTER_TOKEN: User(TESTER),
                ADMIN_TOKEN: User("admin", (MASTERS, AUTHENTICATED)),
            }
        )
        self.kubelet = Kubelet(self.emulator, workspace / "kubelet")
        self.garbage_collector = GarbageCollector(self.emulator)
        # Admits Jobs of a Kueue LocalQueue once a test applies its queues (tests/support/kueue.py).
        self.kueue = Kueue(self.emulator)
        self.emulator.pending_workloads = self.kueue.pending_workloads
        self.url = ""
        self.kubeconfig = workspace / "kubeconfig.json"
        self._server: kmock.Server | None = None
        # Set by a test that provokes 401s or 403s; otherwise each one fails the test.
        self.refusals_expected = False
        self._kubelet_task: asyncio.Task[Any] | None = None
        self._collector_task: asyncio.Task[Any] | None = None
        self._kueue_task: asyncio.Task[Any] | None = None

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
        loop = asyncio.get_running_loop()
        self._kubelet_task = loop.create_task(self.kubelet.run(self.url))
        self._collector_task = loop.create_task(self.garbage_collector.run(self.url))
        self._kueue_task = loop.create_task(self.kueue.run(self.url))

    async def _stop(self) -> None:
        controllers = [
            t for t in (self._kubelet_task, self._collector_task, self._kueue_task) if t is not None
        ]
        for task in controllers:
            task.cancel()
        await asyncio.gather(*controllers, return_exceptions=True)
        assert self._server is not None
        # Open watch streams (of a runner killed mid-test, say) would hold the server's
        # graceful shutdown for its full minute: end them first.
        await self.emulator.cut_watches()
        try:
            await asyncio.wait_for(self._server.__aexit__(None, None, None), SERVER_STOP_SECONDS)
        except TimeoutError:
            # A watch handler cancelled while it waits on kmock's stream condition can
            # wait forever to re-acquire it; the clients are gone, so end what is left.
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()
        await self.emulator.__aexit__(None, None, None)

    def kubeconfig_dict(self) -> dict[str, Any]:
        return kubeconfig(self.url, TESTER, TESTER_TOKEN)

    # -- requests as someone ------------------------------------------------------------

    @property
    def admin(self) -> Target:
        """The cluster administrator's access (kubectl as the cluster's creator)."""
        return Target(self.url, ADMIN_TOKEN)

    async def _send(self, token: str, method: str, path: str, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            aiohttp.ClientSession(base_url=self.url, headers=headers) as session,
            session.request(method, path, json=body) as response,
        ):
            text = await response.text()
        try:
            return response.status, json.loads(text)
        except ValueError:  # a watch's stream of events, or nothing
            return response.status, text

    def request_as(self, token: str, method: str, path: str, body: Any = None) -> Any:
        """(HTTP status, JSON answer) of one request made with the bearer token `token`."""
        return self.run(self._send(token, method, path, body))

    def apply(self, manifest: Path, namespace: str = NAMESPACE, **replace: str) -> None:
        """`kubectl apply -n namespace -f manifest` as the admin, placeholders replaced."""
        text = manifest.read_text()
        for placeholder, value in replace.items():
            text = text.replace(placeholder, value)
        apply(self.admin, namespace, manifests(text))

    def kubectl_as_admin(self, command: str) -> None:
        """One `kubectl ...` command line, run by the admin with the kubectl stand-in."""
        argv = shlex.split(command)
        assert argv[0] == "kubectl", command
        if kubectl(argv[1:], self.admin) != 0:
            raise RuntimeError(f"{command!r} failed")

    def delete_as_admin(self, path: str) -> None:
        status, answer = self.request_as(ADMIN_TOKEN, "DELETE", path)
        if status >= 300:
            raise RuntimeError(f"DELETE {path}: {status} {answer}")

    def refusals(self) -> list[tuple[int, str, str, str]]:
        """Every 401 and RBAC 403 the API answered: (code, method, path, message)."""
        return self.call(lambda: list(self.emulator.refusals))

    def unbind_user(self, namespace: str = NAMESPACE) -> None:
        """Take the Role away from the kubeconfig's user: its requests get 403."""
        self.delete_as_admin(
            f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
            "/rolebindings/kinetic-prefect-users"
        )

    # -- what tests look at ---------------------------------------------------------------

    def jobs(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: self.emulator.live(JOBS, namespace))

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: self.emulator.live(PODS, namespace))

    def print_state(self) -> None:
        """Print the live Jobs and pods and the test Kueue's Workloads (for a failed case)."""

        def lines() -> list[str]:
            found = []
            for job in self.emulator.live(JOBS, None):
                status = job.get("status") or {}
                true = [
                    c.get("type")
                    for c in status.get("conditions") or []
                    if c.get("status") == "True"
                ]
                suspend = (job.get("spec") or {}).get("suspend")
                found.append(f"Job {job['metadata']['name']}: suspend={suspend} conditions={true}")
            for pod in self.emulator.live(PODS, None):
                node = (pod.get("spec") or {}).get("nodeName")
                phase = (pod.get("status") or {}).get("phase")
                found.append(f"pod {pod['metadata']['name']}: phase={phase} node={node}")
            for w in self.kueue.workloads.values():
                found.append(
                    f"Workload {w.name} of Job {w.job_name}: admitted to {w.admitted_to}, "
                    f"done={w.done}, evicted={w.evicted is not None}, message={w.message!r}"
                )
            found.extend(f"test Kueue error: {error!r}" for error in self.kueue.errors)
            return found

        print("--- the cluster's Jobs, pods and Workloads ---", *self.call(lines), sep="\n")

    def most_at_once(
        self,
        plural: str,
        holds: Callable[[str, dict[str, Any]], bool],
        group: Callable[[dict[str, Any]], str | None] = lambda obj: "",
    ) -> int:
        """From the cluster's event history: the most objects of `plural` that `holds` (given
        the event type and the object) at once, counted apart per `group` (None: skipped)."""
        held: dict[str, set[str]] = {}
        most = 0
        for _, resource, event in self.call(lambda: list(self.emulator.events)):
            obj = event["object"]
            key = group(obj) if resource.plural == plural else None
            if key is None:
                continue
            names = held.setdefault(key, set())
            if holds(event["type"], obj):
                names.add(obj["metadata"]["name"])
            else:
                names.discard(obj["metadata"]["name"])
            most = max(most, len(names))
        return most

    def workloads(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Kueue's Workloads (tests/support/kueue.py)."""
        return self.call(lambda: self.emulator.live("workloads", namespace))

    def services(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: self.emulator.live("services", namespace))

    def created(self, plural: str) -> list[dict[str, Any]]:
        """Every body of `plural` the API accepted a POST for, exactly as sent (not dry runs)."""
        return [
            json.loads(r.body)
            for r in self.call(lambda: list(self.emulator.requests))
            if r.method == "POST"
            and r.resource is not None
            and r.resource.plural == plural
            and r.params.get("dryRun") != "All"
        ]

    def secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.call(lambda: self.emulator.find("secrets", namespace, name))

    def secrets(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.call(lambda: self.emulator.live("secrets", namespace))

    def fail_next(
        self, method: str, plural: str, code: int, reason: str, message: str, **kw: Any
    ) -> None:
        """Answer the next such request with an error (`ClusterEmulator.fail_next`)."""
        self.call(lambda: self.emulator.fail_next(method, plural, code, reason, message, **kw))

    def refuse(self, code: int, reason: str, message: str, **kw: Any) -> None:
        """Answer such requests with an error until `stop_refusing` (`ClusterEmulator.refuse`)."""
        self.call(lambda: self.emulator.refuse(code, reason, message, **kw))

    def stop_refusing(self) -> None:
        self.call(self.emulator.stop_refusing)

    def created_jobs(self) -> list[dict[str, Any]]:
        """Every Job body the API accepted a POST for, exactly as sent."""
        return [body for _, body in self.job_creations()]

    def job_creations(self) -> list[tuple[str, dict[str, Any]]]:
        """(bearer token, Job body) of every Job the API accepted a POST for."""
        return [
            (r.headers.get("Authorization", "").removeprefix("Bearer "), json.loads(r.body))
            for r in self.call(lambda: list(self.emulator.requests))
            if r.method == "POST" and r.resource is not None and r.resource.plural == JOBS
        ]

    def client_requests(self) -> list[kmock.Request]:
        """Requests from anything but the cluster's controllers (the runner, the CLI)."""
        return [
            r
            for r in self.call(lambda: list(self.emulator.requests))
            if r.headers.get("User-Agent") not in _CONTROLLER_AGENTS
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
def running_cluster(
    workspace: Path, namespaces: tuple[str, ...] = (NAMESPACE,), set_up: bool = True
) -> Iterator[KubeCluster]:
    """An emulated cluster with a kubelet, served on a local port until the block ends.

    deployments/k8s/rbac.yaml, the kubeconfig user's binding and the docs' Workload
    Identity annotations are applied to each of `namespaces`; with `set_up=False`
    none is (a new cluster: Kubernetes' bootstrap policy only).
    """
    from tests.support.kube_auth import BOOTSTRAP_POLICY

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kmock", daemon=True)
    thread.start()
    workspace.mkdir(parents=True, exist_ok=True)
    cluster = KubeCluster(loop, workspace)
    try:
        cluster.run(cluster._start())
        apply(cluster.admin, NAMESPACE, BOOTSTRAP_POLICY)
        for namespace in namespaces if set_up else ():
            cluster.apply(RBAC_MANIFEST, namespace)
            cluster.apply(USER_BINDING_MANIFEST, namespace, USER=TESTER)
            # The Workload Identity annotations docs/kubernetes.md "Permissions" makes.
            for command in documented_kubectl_commands(
                {"NAMESPACE": namespace, "PROJECT": EMULATOR_PROJECT}
            ):
                cluster.kubectl_as_admin(command)
        cluster.kubeconfig.write_text(json.dumps(cluster.kubeconfig_dict()))
        yield cluster
    finally:
        cluster.run(cluster.kubelet.shutdown())
        cluster.run(cluster._stop())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    errors = cluster.kubelet.errors + cluster.garbage_collector.errors + cluster.kueue.errors
    if errors:
        raise errors[0]
