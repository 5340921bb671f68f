"""The embedded local backend: each pod is a process group on this machine.

The manifest's container command and env are run as they are, with `python`
replaced by the current interpreter. One watcher thread waits on every pod's
pidfd, so a pod's exit is noticed as it happens rather than by polling.
A pod's init containers (the shipped environment's unpack) run in order, as the
kubelet runs them, on a thread of that pod's own: the watcher never waits for
one. A failed init container ends the pod with its exit code, and the task
container never starts.

A multi-host slice (an Indexed Job) runs as one process group per host, wired to
each other on 127.0.0.1 (`slices.local_host_env`). The first host that ends badly
ends the attempt: the other hosts are killed and the job reports that host's exit.

A restarted flow process adopts its predecessor's pods, found in `.kinetic/pods`
(`AdoptedPods`): not being their parent, it watches each through a pidfd, which
becomes readable when the process ends, and cannot learn its exit code (the pod's
own final record says how the task ended).
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.logging import get_logger

from kinetic_prefect.backends.base import FoundPod, OnExit, OnPending, PodExit, Secrets
from kinetic_prefect.backends.local.container import (
    HostProcess,
    PodProcess,
    container_command,
    container_env,
    env_cache_directory,
    has_init_containers,
    materialise_fuse_volumes,
    run_init_containers,
    start_process,
)
from kinetic_prefect.backends.local.interpreter import default_interpreter
from kinetic_prefect.backends.local.pods import (
    pods_labelled,
    process_start_ticks,
    read_pod,
    record_launch,
    record_update,
    watched_here,
)
from kinetic_prefect.common.env import ENV_CACHE_ENV, MOUNT_ROOT_ENV, SCRATCH_DIR_ENV
from kinetic_prefect.launch.environment import cache_dir
from kinetic_prefect.launch.manifest import (
    LABEL_FLOW_RUN_ID,
    LABEL_TASK_IDENTITY,
    LABEL_WARM,
)
from kinetic_prefect.launch.slices import (
    COMPLETION_INDEX_ANNOTATION,
    free_port,
    local_host_count,
    local_host_env,
)

UNKNOWN_EXIT = "it was launched by an earlier flow process, so its exit code is unknown"


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal a pod's process group, if it is still there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass
class AdoptedPod:
    """A pod another process launched, watched here until it ends (not this process's child)."""

    job_id: str
    pid: int
    pidfd: int
    on_exit: OnExit
    cancelled: bool = False
    kill_at: float | None = None


class AdoptedPods:
    """The adopted pods of one local backend: found, watched, cancelled, finished."""

    def __init__(
        self, workspace: Path, cancel_grace_seconds: float, logs: Callable[[str], str]
    ) -> None:
        self.workspace = workspace
        self.cancel_grace_seconds = cancel_grace_seconds
        self._logs = logs
        self._lock = threading.Lock()
        self._pods: dict[str, AdoptedPod] = {}

    def find(self, flow_run_id: str, launched_here: Callable[[str], bool]) -> list[FoundPod]:
        """The recorded pods of the flow run that were not launched or adopted here."""
        return [
            FoundPod(
                p.job_id,
                p.labels.get(LABEL_TASK_IDENTITY, ""),
                p.alive(),
                p.launched_at,
                warm=p.labels.get(LABEL_WARM) == "true",
            )
            for p in pods_labelled(self.workspace, LABEL_FLOW_RUN_ID, flow_run_id)
            if not launched_here(p.job_id) and p.job_id not in self
        ]

    def adopt(self, job_id: str, on_exit: OnExit) -> bool:
        """Watch the pod from now on; False (its end already reported) if it is gone."""
        record = read_pod(self.workspace, job_id)
        pidfd = None
        if record is not None and record.alive() and record.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                pidfd = os.pidfd_open(record.pid)
        if record is None or record.pid is None or pidfd is None:
            self.finish(AdoptedPod(job_id, 0, -1, on_exit))
            return False
        with self._lock:
            self._pods[job_id] = AdoptedPod(job_id, record.pid, pidfd, on_exit)
        record_update(self.workspace, job_id, **watched_here())
        return True

    def cancel(self, job_id: str) -> bool:
        """SIGTERM the pod now and SIGKILL it after the grace; False if it is not adopted."""
        with self._lock:
            pod = self._pods.get(job_id)
            if pod is None:
                return False
            if not pod.cancelled:
                pod.cancelled = True
                signal_group(pod.pid, signal.SIGTERM)
                pod.kill_at = time.monotonic() + self.cancel_grace_seconds
        return True

    def by_fd(self) -> dict[int, AdoptedPod]:
        with self._lock:
            return {pod.pidfd: pod for pod in self._pods.values()}

    def kill_moments(self) -> list[float]:
        with self._lock:
            return [pod.kill_at for pod in self._pods.values() if pod.kill_at is not None]

    def kill_overdue(self, now: float) -> None:
        """SIGKILL the cancelled pods whose grace is over."""
        with self._lock:
            for pod in self._pods.values():
                if pod.kill_at is not None and now >= pod.kill_at:
                    signal_group(pod.pid, signal.SIGKILL)
                    pod.kill_at = None

    def finish(self, pod: AdoptedPod) -> None:
        """The pod ended: record it and report its end as far as it is known."""
        with self._lock:
            self._pods.pop(pod.job_id, None)
        if pod.pidfd >= 0:
            os.close(pod.pidfd)
            # What the task left behind in the pod's process group goes with it.
            signal_group(pod.pid, signal.SIGKILL)
        record_update(self.workspace, pod.job_id, ended=True, ended_at=time.time())
        outcome = PodExit(
            job_id=pod.job_id,
            exit_code=None,
            reason=UNKNOWN_EXIT,
            cancelled=pod.cancelled,
            log_tail=self._logs(pod.job_id),
        )
        try:
            pod.on_exit(outcome)
        except Exception:
            logger.exception("Handling the exit of pod %s failed", pod.job_id)

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._pods)

    def __contains__(self, job_id: object) -> bool:
        with self._lock:
            return job_id in self._pods

    def __len__(self) -> int:
        with self._lock:
            return len(self._pods)


logger = get_logger("kinetic_prefect.backends.local.backend")

_COMPLETION_INDEX_FIELD = f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"


class LocalBackend:
    """Runs pods as local process groups, at most `max_parallel` at once.

    Each pod's environment is its manifest's env on top of `base_env`; without
    one, on top of this machine's environment (see `container_env`).

    Example:
        ```python
        backend = LocalBackend(workspace=".kinetic/pods", max_parallel=2)
        backend.launch(manifest, on_exit=print, secrets={})
        ```
    """

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        max_parallel: int | None = None,
        cancel_grace_seconds: float = 10.0,
        base_env: Mapping[str, str] | None = None,
        interpreter: Callable[[Mapping[str, Any]], str] = default_interpreter,
        node_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self.workspace = Path(workspace)
        # Which Python runs a pod's `python` (a bare one for a shipped environment).
        self.interpreter = interpreter
        # This machine as the pods' node: where its hostPath caches live.
        self.node_root = Path(node_root) if node_root else cache_dir() / "node"
        # None: pods start from this machine's environment (see `container_env`).
        self.base_env = None if base_env is None else dict(base_env)
        self.max_parallel = max_parallel or os.cpu_count() or 1
        self.cancel_grace_seconds = cancel_grace_seconds
        self.launch_count = 0
        self._lock = threading.Lock()
        self._queued: collections.deque[PodProcess] = collections.deque()
        self._running: dict[str, PodProcess] = {}
        self._known: dict[str, PodProcess] = {}
        self._adopted = AdoptedPods(
            self.workspace, cancel_grace_seconds, lambda job_id: self.logs(job_id, tail=20)
        )
        self._wake_r, self._wake_w = os.pipe()
        self._watcher: threading.Thread | None = None
        self._closed = False

    # -- public API -------------------------------------------------------

    def launch(
        self,
        manifest: dict[str, Any],
        on_exit: OnExit,
        secrets: Secrets,
        on_pending: OnPending | None = None,
        extra_objects: Sequence[dict[str, Any]] = (),
    ) -> None:
        job_id = manifest["metadata"]["name"]
        self.workspace.mkdir(parents=True, exist_ok=True)
        pod = PodProcess(
            job_id=job_id,
            manifest=manifest,
            on_exit=on_exit,
            secrets=secrets,
            log_path=self.workspace / f"{job_id}.log",
        )
        record_launch(self.workspace, manifest)
        with self._lock:
            if self._closed:
                raise RuntimeError("The local backend is closed; submit inside the flow run.")
            self.launch_count += 1
            self._known[job_id] = pod
            self._queued.append(pod)
            self._ensure_watcher()
        self._wake()

    def find_pods(self, flow_run_id: str, namespace: str = "") -> list[FoundPod]:
        """The recorded pods of the flow run that this backend did not launch, newest first."""
        return self._adopted.find(flow_run_id, lambda job_id: job_id in self._known)

    def adopt(
        self,
        job_id: str,
        namespace: str,
        on_exit: OnExit,
        on_pending: OnPending | None = None,
    ) -> None:
        """Watch the pod another process launched through its pidfd, until it ends."""
        with self._lock:
            if self._closed:
                raise RuntimeError("The local backend is closed; submit inside the flow run.")
        if self._adopted.adopt(job_id, on_exit):
            with self._lock:
                self._ensure_watcher()
            self._wake()

    def cancel(self, job_id: str) -> None:
        if self._adopted.cancel(job_id):
            self._wake()
            return
        with self._lock:
            pod = self._known.get(job_id)
            if pod is None or pod.cancelled:
                return
            pod.cancelled = True
            if pod in self._queued:
                self._queued.remove(pod)
                queued = True
            else:
                queued = False
                self._terminate(pod)
        if queued:
            self._finish(pod, exit_code=None, sig=None)
        self._wake()

    def logs(self, job_id: str, tail: int | None = None, host: int = 0) -> str:
        """The log of the pod's host `host` (0 unless it is a multi-host slice)."""
        path = self._log_path(job_id, host)
        if not path.exists():
            return ""
        lines = path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:] if tail else lines)

    def pid(self, job_id: str) -> int | None:
        """The pod's process id (also its process group id), once started (host 0's)."""
        pids = self.pids(job_id)
        return pids[0] if pids else None

    def pids(self, job_id: str) -> list[int]:
        """The process ids of every host of the pod, host 0 first, once started."""
        pod = self._known.get(job_id)
        return [host.process.pid for host in pod.hosts] if pod else []

    def host_exit_codes(self, job_id: str) -> list[int | None]:
        """Each host's exit code (negative: the signal), host 0 first; None while it runs."""
        pod = self._known.get(job_id)
        return [host.process.returncode for host in pod.hosts] if pod else []

    def _log_path(self, job_id: str, host: int) -> Path:
        return self.workspace / (f"{job_id}.log" if host == 0 else f"{job_id}.host{host}.log")

    def forget(self, job_id: str) -> None:
        with self._lock:
            pod = self._known.get(job_id)
            if pod is not None and job_id not in self._running and pod not in self._queued:
                del self._known[job_id]

    def kept_jobs(self) -> list[str]:
        with self._lock:
            return [*self._known, *(i for i in self._adopted.ids() if i not in self._known)]

    def running(self) -> list[str]:
        with self._lock:
            return [*self._running, *(p.job_id for p in self._queued), *self._adopted.ids()]

    def close(self) -> None:
        """Cancel every pod still queued or running and wait until all have exited."""
        for job_id in self.running():
            self.cancel(job_id)
        deadline = time.monotonic() + self.cancel_grace_seconds + 30
        while self.running() and time.monotonic() < deadline:
            with self._lock:
                watcher = self._watcher
            if watcher is None:
                break
            watcher.join(timeout=0.05)
        with self._lock:
            self._closed = True
        self._wake()

    # -- watcher ----------------------------------------------------------

    def _ensure_watcher(self) -> None:
        if self._watcher is None or not self._watcher.is_alive():
            self._watcher = threading.Thread(
                target=self._watch, name="kinetic-local-watcher", daemon=True
            )
            self._watcher.start()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _start_queued(self) -> None:
        while True:
            with self._lock:
                busy = len(self._running) + len(self._adopted)
                if not self._queued or busy >= self.max_parallel:
                    return
                pod = self._queued.popleft()
                self._running[pod.job_id] = pod
            if has_init_containers(pod.manifest):
                # Init containers can download and unpack for minutes: on a thread of the
                # pod's own, so this one keeps noticing every other pod's exit meanwhile.
                threading.Thread(
                    target=self._start, args=(pod,), name=f"kinetic-start-{pod.job_id}", daemon=True
                ).start()
            else:
                self._start(pod)

    def _start(self, pod: PodProcess) -> None:
        """Start the pod's processes (after its init containers), then let the watcher see them."""
        try:
            self._spawn(pod)
            with self._lock:
                if pod.cancelled:  # cancelled while its processes were starting
                    self._terminate(pod)
        except Exception as exc:
            logger.error("Could not start pod %s: %s", pod.job_id, exc)
            with self._lock:
                self._running.pop(pod.job_id, None)
            pod.log_path.write_text(f"could not start the pod: {exc}\n")
            self._finish(pod, exit_code=127, sig=None, reason=f"could not start: {exc}")
        self._wake()

    def _spawn(self, pod: PodProcess) -> None:
        scratch = self.workspace / pod.job_id
        scratch.mkdir(parents=True, exist_ok=True)
        mounts = materialise_fuse_volumes(pod.manifest, scratch / "mnt")
        count = local_host_count(pod.manifest)
        port = free_port() if count > 1 else 0
        hosts: list[HostProcess] = []
        try:
            for index in range(count):
                hosts.append(self._spawn_host(pod, index, count, port, scratch, mounts))
        except BaseException:
            for host in hosts:  # a slice starts whole or not at all
                signal_group(host.process.pid, signal.SIGKILL)
                if host.pidfd is not None:
                    os.close(host.pidfd)
                    host.pidfd = None
            raise
        pod.started_at = time.monotonic()
        pid = hosts[0].process.pid
        record_update(
            self.workspace,
            pod.job_id,
            pid=pid,
            pid_start=process_start_ticks(pid),
            started_at=time.time(),
        )
        deadline = pod.manifest["spec"].get("activeDeadlineSeconds")
        with self._lock:
            if deadline:
                pod.deadline = time.monotonic() + float(deadline)
            # Only now does the watcher see the hosts: it must never take a slice that is
            # still starting for one that ended, nor record the end before the start.
            pod.hosts = hosts

    def _spawn_host(
        self, pod: PodProcess, index: int, count: int, port: int, scratch: Path, mounts: Path | None
    ) -> HostProcess:
        env = container_env(
            pod.manifest, pod.secrets, {_COMPLETION_INDEX_FIELD: str(index)}, self.base_env
        )
        if count > 1:
            env.update(local_host_env(index, count, port))
        env[SCRATCH_DIR_ENV] = str(scratch)
        if mounts:
            env[MOUNT_ROOT_ENV] = str(mounts)
        if ENV_CACHE_ENV in env:
            # The environment cache volume: the node's (a hostPath on GKE) or the pod's own.
            env[ENV_CACHE_ENV] = str(env_cache_directory(pod.manifest, self.node_root, scratch))
            for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"):
                env.pop(name, None)  # a stock image has none of this machine's Python
        log_path = self._log_path(pod.job_id, index)
        interpreter = self.interpreter(pod.manifest)
        command = container_command(pod.manifest, interpreter)
        failed = run_init_containers(pod.manifest, interpreter, env, scratch, log_path)
        if failed:
            # The pod ends as its failed init container did; the task container never starts.
            command = [interpreter, "-c", f"raise SystemExit({failed})"]
        process, pidfd = start_process(command, env, scratch, log_path)
        return HostProcess(index, process, pidfd, log_path)

    def _terminate(self, pod: PodProcess) -> None:
        live = [h for h in pod.hosts if h.process.returncode is None]
        if not live:
            return
        for host in live:
            signal_group(host.process.pid, signal.SIGTERM)
        pod.kill_at = time.monotonic() + self.cancel_grace_seconds

    def _next_timeout(self) -> float | None:
        with self._lock:
            moments = [
                m for p in self._running.values() for m in (p.deadline, p.kill_at) if m is not None
            ]
        moments += self._adopted.kill_moments()
        if not moments:
            return None
        return max(0.0, min(moments) - time.monotonic())

    def _watch(self) -> None:
        while True:
            self._start_queued()
            with self._lock:
                if self._closed and not self._running and not self._queued and not self._adopted:
                    return
                by_fd = {
                    h.pidfd: (p, h)
                    for p in self._running.values()
                    for h in p.hosts
                    if h.pidfd is not None
                }
            adopted = self._adopted.by_fd()
            readable, _, _ = select.select(
                [self._wake_r, *by_fd, *adopted], [], [], self._next_timeout()
            )
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
            for fd in readable:
                if fd in by_fd:
                    self._reap(*by_fd[fd])
                elif fd in adopted:
                    self._adopted.finish(adopted[fd])
            self._enforce_deadlines()

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            pods = list(self._running.values())
        self._adopted.kill_overdue(now)
        for pod in pods:
            if pod.deadline is not None and now >= pod.deadline and pod.kill_at is None:
                pod.deadline_exceeded = True
                with self._lock:
                    self._terminate(pod)
            if pod.kill_at is not None and now >= pod.kill_at:
                for host in pod.hosts:
                    signal_group(host.process.pid, signal.SIGKILL)
                pod.kill_at = None

    def _reap(self, pod: PodProcess, host: HostProcess) -> None:
        code = host.process.wait()
        # Children the task left behind share the process group: end them too.
        signal_group(host.process.pid, signal.SIGKILL)
        if host.pidfd is not None:
            os.close(host.pidfd)
            host.pidfd = None
        if code != 0 and pod.failed_host is None:
            # One host lost is the whole attempt lost: end the others now.
            pod.failed_host = host
            for other in pod.hosts:
                if other is not host:
                    signal_group(other.process.pid, signal.SIGKILL)
        if any(h.pidfd is not None for h in pod.hosts):
            return
        with self._lock:
            self._running.pop(pod.job_id, None)
        ended = pod.failed_host or pod.hosts[0]
        code = ended.process.wait()
        sig = -code if code < 0 else None
        reason = "DeadlineExceeded" if pod.deadline_exceeded else ""
        # A SIGTERM the runner did not send is the local stand-in for a preemption.
        preempted = sig == signal.SIGTERM and not pod.cancelled and not pod.deadline_exceeded
        if preempted:
            reason = "SIGTERM from outside the runner"
        with open(pod.log_path, "a") as log:
            where = f" (host {ended.index} of {len(pod.hosts)})" if len(pod.hosts) > 1 else ""
            log.write(
                f"kinetic-prefect local backend: pod exited with code {code}{where} "
                f"after {time.monotonic() - pod.started_at:.3f}s"
                f"{' (stopped by the runner)' if pod.cancelled else ''}\n"
            )
        self._finish(pod, exit_code=code, sig=sig, reason=reason, preempted=preempted)

    def _finish(
        self,
        pod: PodProcess,
        exit_code: int | None,
        sig: int | None,
        reason: str = "",
        preempted: bool = False,
    ) -> None:
        outcome = PodExit(
            job_id=pod.job_id,
            exit_code=exit_code,
            signal=sig,
            reason=reason,
            cancelled=pod.cancelled,
            log_tail=self.logs(
                pod.job_id, tail=20, host=pod.failed_host.index if pod.failed_host else 0
            ),
            preempted=preempted,
        )
        record_update(
            self.workspace, pod.job_id, ended=True, exit_code=exit_code, ended_at=time.time()
        )
        try:
            pod.on_exit(outcome)
        except Exception:
            logger.exception("Handling the exit of pod %s failed", pod.job_id)
