"""The test kubelet's container runtime: each container a process of this machine.

What a container gets is what the Kubernetes documentation says a kubelet and a
container runtime give it (docs/testing.md, "The test kubelet's containers", cites
each rule), and nothing the product's own code decides:

- Its command and args as written. `python` is found on the image's `PATH`: the
  image's interpreter directory first (`image_bin`), then the system's.
- Its environment: what the image sets (`tests/support/pod_env.image_env`), then the
  container's `env` in order. A `value` is used as written, `valueFrom.fieldRef` is read
  from the pod (`metadata.name`, `metadata.namespace`, `metadata.labels['k']`,
  `metadata.annotations['k']`, `spec.nodeName`, `spec.serviceAccountName`,
  `status.podIP`), and `secretKeyRef` from the Secret. For an Indexed Job's pod, the Job
  controller adds `JOB_COMPLETION_INDEX`.
- Its volumes at their `mountPath`s, in a mount namespace of its own
  (`unshare --mount`): a `hostPath` is the node's directory (under `node_root`), an
  `emptyDir` the pod's own, and a `gcsfuse.csi.storage.gke.io` volume the bucket's
  objects under its `only-dir`, read through GCS as the pod's identity, as the CSI
  driver's sidecar reads them. `readOnly` mounts are read-only.
- A hostname (its `spec.hostname`, else its name; `unshare --uts`), an address of its
  own, and an `/etc/hosts` written as the cluster's DNS answers: its own name, and the
  names `hostname.subdomain[.namespace.svc.cluster.local]` of every pod whose container
  runs (a Ready pod) and that a headless Service named by its subdomain selects, only
  once that Service exists (`dns_changed`).
- Init containers run in order, each with its own env, before the main container
  starts; the first that fails ends the pod with its code.

Stand-ins where this machine differs from a node (each named in docs/testing.md):
every pod here shares one network stack, so each has an address of its own on
127.0.0.0/8 (`PodAddresses`), and JAX's coordinator, which binds every address of the
pod's own network namespace on GKE, is told to bind only the pod's
(`JAX_COORDINATOR_BIND_ADDRESS`, JAX's own variable). A container's private `/tmp` is
`TMPDIR`, a directory of the pod's own. Mount points that do not exist on this machine
are created as empty directories, as a runtime creates them in a container's root
filesystem. Init containers write to the pod's log ahead of the main container.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.parse
import venv
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

GCSFUSE_CSI_DRIVER = "gcsfuse.csi.storage.gke.io"
# The variable Kubernetes' Job controller gives every container of an Indexed Job's pod.
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
# JAX's own variables: where its coordinator is, and which address it binds.
JAX_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
JAX_COORDINATOR_BIND_ADDRESS = "JAX_COORDINATOR_BIND_ADDRESS"
_FIELD = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")
_CLUSTER_DOMAIN = "svc.cluster.local"


class MountFailed(Exception):
    """A volume could not be set up (the kubelet's FailedMount): the pod does not start."""


def image_bin(interpreter: str) -> str:
    """The directory an image's `python` is in (first on its PATH)."""
    return str(Path(interpreter).parent)


def bare_interpreter(cache: Path) -> str:
    """A Python with its standard library and pip only, as a stock `python` image has.

    A virtualenv of this machine's base Python without its site-packages, made once
    per Python under `cache` (by the first test process that takes its lock; a marker
    says it is whole).
    """
    root = cache / "python-image" / f"{sys.version_info.major}.{sys.version_info.minor}"
    whole = root / ".whole"
    if not whole.exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{root}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not whole.exists():
                venv.EnvBuilder(clear=True, with_pip=True).create(root)
                whole.touch()
    return str(root / "bin" / "python")


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """The value of a `fieldRef` on `pod` (a Pod object with `status.podIP` set)."""
    meta, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.podIP": (pod.get("status") or {}).get("podIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    match = _FIELD.match(path)
    if match is None:
        raise KeyError(f"fieldRef {path} is not a field a container can read")
    return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))


def container_env(
    container: Mapping[str, Any],
    pod: Mapping[str, Any],
    secrets: Mapping[str, Mapping[str, str]],
    image_env: Mapping[str, str],
) -> dict[str, str]:
    """The container's environment: the image's, then its `env` in order (see the docstring)."""
    env = dict(image_env)
    index = (pod["metadata"].get("annotations") or {}).get(
        "batch.kubernetes.io/job-completion-index"
    )
    if index is not None:
        env[COMPLETION_INDEX_ENV] = index
    for item in container.get("env") or []:
        source = item.get("valueFrom")
        if source is None:
            env[item["name"]] = item.get("value", "")
        elif "fieldRef" in source:
            env[item["name"]] = field_value(pod, source["fieldRef"]["fieldPath"])
        else:
            ref = source["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def dns_names(pod: Mapping[str, Any]) -> list[str]:
    """The names a pod with a hostname and subdomain answers to, short to fully qualified."""
    spec, namespace = pod["spec"], pod["metadata"]["namespace"]
    hostname = spec.get("hostname") or pod["metadata"]["name"]
    subdomain = spec.get("subdomain")
    if not subdomain:
        return [hostname]
    base = f"{hostname}.{subdomain}"
    return [
        f"{base}.{namespace}.{_CLUSTER_DOMAIN}",
        f"{base}.{namespace}.svc",
        f"{base}.{namespace}",
        base,
    ]


def selects(service: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    """Whether a headless Service publishes DNS records for `pod` (same namespace, selected)."""
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = pod["metadata"].get("labels") or {}
    return (
        bool(pod["spec"].get("hostname"))
        and spec.get("clusterIP") == "None"
        and service["metadata"]["namespace"] == pod["metadata"]["namespace"]
        and service["metadata"]["name"] == pod["spec"].get("subdomain")
        and bool(selector)
        and all(labels.get(k) == v for k, v in selector.items())
    )


def hosts_file(
    pod: Mapping[str, Any], address: str, peers: Sequence[tuple[str, Mapping[str, Any]]]
) -> str:
    """A pod's /etc/hosts: localhost, its own names, and the records DNS holds for its peers."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    # As the kubelet writes it: the pod's FQDN, then its bare hostname (the shorter
    # forms come from DNS, so only once a Service publishes the pod, below).
    hostname = pod["spec"].get("hostname") or pod["metadata"]["name"]
    own = dict.fromkeys([dns_names(pod)[0], hostname])
    lines.append(f"{address}\t{' '.join(own)}")
    namespace = pod["metadata"]["namespace"]
    for peer_address, peer in peers:
        names = dns_names(peer)
        if peer["metadata"]["namespace"] != namespace:
            names = names[:3]  # the search path completes only the pod's own namespace
        lines.append(f"{peer_address}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"


class PodAddresses:
    """Addresses of their own on 127.0.0.0/8 for the pods of this test process.

    The second octet is this process's: claimed with a lock file every test process
    of the machine sees, held until the process ends, so no two processes hand out
    one address.
    """

    def __init__(self, claims: Path) -> None:
        claims.mkdir(parents=True, exist_ok=True)
        for octet in range(1, 255):
            handle = open(claims / f"{octet}.lock", "w")  # noqa: SIM115 - held while we live
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            self._claim, self._octet = handle, octet
            break
        else:
            raise RuntimeError(f"every address block under {claims} is claimed")
        self._next = 0

    def next(self) -> str:
        self._next += 1
        high, low = divmod(self._next % (254 * 254), 254)
        return f"127.{self._octet}.{high + 1}.{low + 1}"


@dataclass
class Sandbox:
    """One pod's container as a process, and what it was given."""

    pod: dict[str, Any]
    address: str
    directory: Path
    log: Path
    hosts: Path
    process: asyncio.subprocess.Process | None = None
    # Its main container started (a Ready pod: it has no readiness probe).
    started: bool = False
    kill: asyncio.TimerHandle | None = None
    volumes: dict[str, Path] = field(default_factory=dict)

    @property
    def exit_code(self) -> int | None:
        """Its exit code as a container reports it (128 + n for signal n); None while it runs."""
        if self.process is None or self.process.returncode is None:
            return None
        code = self.process.returncode
        return code if code >= 0 else 128 - code


class ContainerRuntime:
    """Runs pods' containers as processes (see the module docstring).

    `images`: image name -> the interpreter its `python` is; any other image is a stock
    python image (`bare_interpreter`). `image_env`: what an image sets, given the
    container's home. `find_services`: the Services of a namespace, as the API holds them.
    """

    def __init__(
        self,
        workspace: Path,
        node_root: Path,
        images: dict[str, str],
        bare_python: Callable[[], str],
        image_env: Callable[[str, Path], dict[str, str]],
        find_services: Callable[[str], list[dict[str, Any]]],
        addresses: PodAddresses,
    ) -> None:
        self.workspace = workspace
        self.node_root = node_root
        self.images = images
        self.bare_python = bare_python
        self.image_env = image_env
        self.find_services = find_services
        self.addresses = addresses
        self.sandboxes: dict[tuple[str, str], Sandbox] = {}

    def interpreter(self, image: str) -> str:
        return self.images.get(image) or self.bare_python()

    def sandbox(self, pod: dict[str, Any], log: Path) -> Sandbox:
        """The pod's address, directory and /etc/hosts, before any of its containers runs."""
        meta = pod["metadata"]
        directory = self.workspace / "pods" / meta["namespace"] / meta["name"]
        (directory / "tmp").mkdir(parents=True, exist_ok=True)
        address = self.addresses.next()
        pod.setdefault("status", {})["podIP"] = address
        box = Sandbox(pod, address, directory, log, directory / "hosts")
        self.sandboxes[(meta["namespace"], meta["name"])] = box
        self.dns_changed()
        return box

    def forget(self, box: Sandbox) -> None:
        meta = box.pod["metadata"]
        self.sandboxes.pop((meta["namespace"], meta["name"]), None)
        self.dns_changed()

    def dns_changed(self) -> None:
        """Rewrite every pod's /etc/hosts from the Services and pods there are now."""
        services: dict[str, list[dict[str, Any]]] = {}
        for box in self.sandboxes.values():
            namespace = box.pod["metadata"]["namespace"]
            if namespace not in services:
                services[namespace] = self.find_services(namespace)
        for box in list(self.sandboxes.values()):
            peers = [
                (other.address, other.pod)
                for other in self.sandboxes.values()
                if any(
                    selects(s, other.pod)
                    and (other.started or s["spec"].get("publishNotReadyAddresses"))
                    for s in services[other.pod["metadata"]["namespace"]]
                )
            ]
            content = hosts_file(box.pod, box.address, peers)
            _rewrite_in_place(box.hosts, content)

    async def mount_volumes(self, box: Sandbox, gcs_address: str | None) -> None:
        """Set up the pod's volumes on this machine (`MountFailed` if one cannot be)."""
        for volume in box.pod["spec"].get("volumes") or []:
            name = volume["name"]
            if "hostPath" in volume:
                path = self.node_root / volume["hostPath"]["path"].lstrip("/")
                path.mkdir(parents=True, exist_ok=True)
            elif "emptyDir" in volume:
                path = box.directory / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
            elif (volume.get("csi") or {}).get("driver") == GCSFUSE_CSI_DRIVER:
                path = box.directory / "volumes" / name
                await _copy_bucket(volume["csi"], gcs_address, path)
            else:
                raise MountFailed(f"volume {name}: the test kubelet mounts no such volume")
            box.volumes[name] = path

    def command(self, box: Sandbox, container: Mapping[str, Any]) -> list[str]:
        """The container's command inside its own mount and UTS namespaces."""
        steps = ["set -e", f"mount --bind {shlex.quote(str(box.hosts))} /etc/hosts"]
        for mount in container.get("volumeMounts") or []:
            source, target = box.volumes[mount["name"]], mount["mountPath"]
            Path(target).mkdir(parents=True, exist_ok=True)
            steps.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
            if mount.get("readOnly"):
                steps.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        hostname = box.pod["spec"].get("hostname") or box.pod["metadata"]["name"]
        steps += [f"hostname {shlex.quote(hostname[:63])}", 'exec "$@"']
        argv = [*container.get("command", []), *container.get("args", [])]
        script = "; ".join(steps)
        return [
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "--",
            "/bin/sh",
            "-c",
            script,
            "sh",
            *argv,
        ]

    def env(
        self,
        box: Sandbox,
        container: Mapping[str, Any],
        secrets: Mapping[str, Mapping[str, str]],
        home: Path,
    ) -> dict[str, str]:
        image = self.image_env(self.interpreter(container["image"]), home)
        env = container_env(container, box.pod, secrets, image)
        env["TMPDIR"] = str(box.directory / "tmp")
        coordinator = env.get(JAX_COORDINATOR_ADDRESS)
        if coordinator and ":" in coordinator:
            env[JAX_COORDINATOR_BIND_ADDRESS] = f"{box.address}:{coordinator.rsplit(':', 1)[1]}"
        return env

    async def run_init_containers(
        self, box: Sandbox, secrets: Mapping[str, Mapping[str, str]], home: Path
    ) -> int:
        """Run the pod's init containers in order; the first failing one's code, else 0."""
        for init in box.pod["spec"].get("initContainers") or []:
            if box.kill is not None:  # stopped meanwhile
                return 137
            # Tracked as the pod's process while it runs, so a stop reaches it.
            box.process = process = await self._start(box, init, secrets, home)
            code = await process.wait()
            self.ended(box)
            if code != 0:
                return code if code > 0 else 128 - code
        return 0

    async def start(
        self, box: Sandbox, secrets: Mapping[str, Mapping[str, str]], home: Path
    ) -> None:
        """Start the pod's (first) container."""
        if box.kill is not None:  # stopped while its init containers ran
            return
        box.process = await self._start(box, box.pod["spec"]["containers"][0], secrets, home)
        box.started = True
        self.dns_changed()

    async def _start(
        self,
        box: Sandbox,
        container: Mapping[str, Any],
        secrets: Mapping[str, Mapping[str, str]],
        home: Path,
    ) -> asyncio.subprocess.Process:
        env = self.env(box, container, secrets, home)
        with open(box.log, "ab") as log:
            return await asyncio.create_subprocess_exec(
                *self.command(box, container),
                env=env,
                cwd=container.get("workingDir") or "/",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self, box: Sandbox, grace_seconds: float) -> None:
        """SIGTERM the container, then SIGKILL once its grace period is over (as a kubelet)."""
        process = box.process
        if process is None or process.returncode is not None or box.kill is not None:
            return  # not running, or already told
        _signal_group(process.pid, signal.SIGTERM)
        box.kill = asyncio.get_running_loop().call_later(grace_seconds, _kill_if_running, process)

    @staticmethod
    def ended(box: Sandbox) -> None:
        """Its container was reaped: no SIGKILL may reach its (reusable) pid afterwards."""
        if box.kill is not None:
            box.kill.cancel()

    def kill_all(self) -> Iterator[asyncio.subprocess.Process]:
        """SIGKILL every container still running (the node goes away); those processes."""
        for box in list(self.sandboxes.values()):
            if box.process is not None and box.process.returncode is None:
                _signal_group(box.process.pid, signal.SIGKILL)
                yield box.process


def _rewrite_in_place(path: Path, content: str) -> None:
    """Write `content` over `path` with one write at offset 0, never shrinking the file.

    The file is bind-mounted into a pod, so it must keep its inode, and a reader must
    never find it empty: the rest is padded with blank lines instead of truncated.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        data = content.encode()
        if os.pread(fd, size, 0).rstrip(b"\n") != data.rstrip(b"\n"):
            os.pwrite(fd, data + b"\n" * max(0, size - len(data)), 0)
    finally:
        os.close(fd)


def _kill_if_running(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:  # not reaped yet: its pid is still its own
        _signal_group(process.pid, signal.SIGKILL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def _copy_bucket(csi: Mapping[str, Any], gcs_address: str | None, target: Path) -> None:
    """What a gcsfuse volume shows: the bucket's objects under `only-dir`, as files."""
    attributes = csi.get("volumeAttributes") or {}
    bucket = attributes.get("bucketName", "")
    options = dict(
        option.partition("=")[::2] for option in (attributes.get("mountOptions") or "").split(",")
    )
    prefix = options.get("only-dir", "").strip("/")
    if gcs_address is None:
        raise MountFailed(f"gcsfuse volume of bucket {bucket}: the pod reaches no GCS")
    base = gcs_address.rstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    async with aiohttp.ClientSession() as session:
        token = ""
        while True:
            query = {"prefix": f"{prefix}/" if prefix else "", "pageToken": token}
            async with session.get(f"{base}/storage/v1/b/{bucket}/o", params=query) as listing:
                if listing.status != 200:
                    raise MountFailed(
                        f"gcsfuse volume of bucket {bucket}: listing answered "
                        f"{listing.status} {await listing.text()}"
                    )
                page = await listing.json()
            for item in page.get("items") or []:
                relative = item["name"][len(prefix) :].lstrip("/") if prefix else item["name"]
                if not relative or relative.endswith("/"):
                    continue
                quoted = urllib.parse.quote(item["name"], safe="")
                url = f"{base}/storage/v1/b/{bucket}/o/{quoted}"
                async with session.get(url, params={"alt": "media"}) as media:
                    if media.status != 200:
                        raise MountFailed(f"gcsfuse volume: reading {item['name']}: {media.status}")
                    path = target / relative
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(await media.read())
            token = page.get("nextPageToken") or ""
            if not token:
                return
