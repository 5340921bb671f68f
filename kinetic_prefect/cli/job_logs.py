"""Following Kinetic pods: `kinetic-prefect jobs logs -f` and `jobs attach`.

A `JobSource` finds a job's pod and follows its log until the pod ends, on the
gke backend through the Kubernetes API (`ClusterJobs`) and on the local backend
through the pod records and logs under the jobs root (`LocalJobs`).
`attach` follows a task run through its attempts: each attempt is a Job of its
own carrying the `kinetic-prefect.io/task-run-id` label, and the task run's
state in the Prefect API says when it is over.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

from kinetic_prefect.backends.local.pods import pods_labelled, read_pod
from kinetic_prefect.common import layout
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.manifest import LABEL_TASK_RUN_ID


def _poll_seconds() -> float:
    """How often a follower looks again at a log, a pod or a task run that has not changed."""
    return Intervals.from_environ(os.environ).logs_poll_seconds


class JobSource(Protocol):
    """Where a backend's jobs, pods and logs are found."""

    async def current_job(self, task_run_id: str) -> str | None:
        """The task run's newest job (its current attempt), if any."""
        ...

    async def started(self, job_id: str) -> bool | None:
        """Whether the job's pod has started (has a log); None when there is no such job."""
        ...

    def follow(self, job_id: str, host: int = 0) -> AsyncIterator[str]:
        """The pod's log, line by line, until the pod has ended."""
        ...

    async def log(self, job_id: str, tail: int | None, host: int = 0) -> str:
        """The pod's log so far (its last `tail` lines); `host` K of a multi-host slice."""
        ...


class LocalJobs:
    """The local backend's pods: records and logs in `pods` (`local_pods.local_pods_dir`)."""

    def __init__(self, pods: Path) -> None:
        self.pods = pods

    async def current_job(self, task_run_id: str) -> str | None:
        found = pods_labelled(self.pods, LABEL_TASK_RUN_ID, task_run_id)
        return found[0].job_id if found else None

    async def started(self, job_id: str) -> bool | None:
        pod = read_pod(self.pods, job_id)
        if pod is None:
            return True if (self.pods / f"{job_id}.log").exists() else None
        return pod.started

    def _log_path(self, job_id: str, host: int) -> Path:
        return self.pods / (f"{job_id}.log" if host == 0 else f"{job_id}.host{host}.log")

    async def log(self, job_id: str, tail: int | None, host: int = 0) -> str:
        path = self._log_path(job_id, host)
        if not path.exists():
            raise ConfigurationError(
                f"No log of pod {job_id} under {self.pods}: check the job id and the jobs "
                "root (KINETIC_JOBS_ROOT, or --cluster)."
            )
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        return "".join(lines[-tail:] if tail else lines)

    async def follow(self, job_id: str, host: int = 0) -> AsyncIterator[str]:
        path = self._log_path(job_id, host)
        pending = b""
        with open(path, "rb") as log:
            while True:
                pod = read_pod(self.pods, job_id)
                # Decided before reading: once the pod is gone, one more read gets all it wrote.
                gone = pod is None or pod.gone()
                pending += log.read()
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace") + "\n"
                if gone:
                    if pending:
                        yield pending.decode(errors="replace")
                    return
                if not lines:
                    await asyncio.sleep(_poll_seconds())


class ClusterJobs:
    """The Jobs of one namespace, through the Kubernetes API."""

    def __init__(self, access: Any, namespace: str) -> None:
        from kubernetes_asyncio import client

        self.namespace = namespace
        self.batch = client.BatchV1Api(access.client)
        self.core = client.CoreV1Api(access.client)

    async def current_job(self, task_run_id: str) -> str | None:
        from kinetic_prefect.backends.gke.client import read_json

        listing = await read_json(
            await self.batch.list_namespaced_job(
                self.namespace,
                label_selector=f"{LABEL_TASK_RUN_ID}={task_run_id}",
                _preload_content=False,
            )
        )
        jobs = [j["metadata"] for j in listing.get("items") or []]
        if not jobs:
            return None
        newest = max(jobs, key=lambda m: (m.get("creationTimestamp") or "", m["name"]))
        return str(newest["name"])

    async def _pod(self, job_id: str, host: int = 0) -> dict[str, Any] | None:
        from kinetic_prefect.backends.gke.client import pods_of_job
        from kinetic_prefect.launch.slices import host_index

        pods = await pods_of_job(self.core, self.namespace, job_id)
        pods = [p for p in pods if host_index(p) == host]
        return pods[0] if pods else None

    async def started(self, job_id: str) -> bool | None:
        from kubernetes_asyncio.client.exceptions import ApiException

        from kinetic_prefect.backends.gke.client import read_json

        pod = await self._pod(job_id)
        if pod is not None:
            return (pod.get("status") or {}).get("phase") not in {None, "Pending"}
        try:
            await read_json(
                await self.batch.read_namespaced_job(job_id, self.namespace, _preload_content=False)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return False

    async def log(self, job_id: str, tail: int | None, host: int = 0) -> str:
        from kinetic_prefect.backends.gke.client import pod_log

        name = await self._pod_name(job_id, host)
        return await pod_log(self.core, self.namespace, name, tail)

    async def follow(self, job_id: str, host: int = 0) -> AsyncIterator[str]:
        from kinetic_prefect.backends.gke.client import follow_pod_log

        name = await self._pod_name(job_id, host)
        async for line in follow_pod_log(self.core, self.namespace, name):
            yield line

    async def _pod_name(self, job_id: str, host: int = 0) -> str:
        pod = await self._pod(job_id, host)
        if pod is None:
            which = f" for host {host}" if host else ""
            raise ConfigurationError(
                f"Job {job_id} has no pod{which} in namespace {self.namespace} (yet, or any more)."
            )
        return str(pod["metadata"]["name"])


def warm_pod_for(store: JobsStore | None, job_id: str) -> str | None:
    """The warm pod that claimed job `job_id` after its first task (its `warm-pod.json`),
    if one did; None for a job its own pod ran (a warm pod claims its first task too)."""
    from kinetic_prefect.common.handover import claimant
    from kinetic_prefect.common.layout import WARM_POD_JSON
    from kinetic_prefect.errors import RecordError

    if store is None:
        return None
    key = layout.job_file(job_id, WARM_POD_JSON)
    try:
        pod = claimant(store, key)
        return None if pod == job_id else pod
    except RecordError:
        # An older release's record ("warm-acceptance"): it named the pod the same way.
        legacy = json.loads(store.get_bytes(key))
        return str(legacy["pod"]) if legacy.get("kind") == "warm-acceptance" else None


async def task_log(
    source: JobSource, pod: str | None, job_id: str, tail: int | None, host: int = 0
) -> str:
    """The log of job `job_id`: its pod's, or its part of warm pod `pod` that ran it."""
    from kinetic_prefect.common.handover import task_section

    if pod is None:
        return await source.log(job_id, tail, host)
    log = await source.log(pod, None)
    section = task_section(log, job_id)
    if not section:
        section = (
            f"(job {job_id} ran in warm pod {pod}, whose log has no part marked for it; "
            "the whole pod log follows)\n" + log
        )
    lines = section.splitlines(keepends=True)
    return "".join(lines[-tail:] if tail else lines)


async def wait_until_started(source: JobSource, job_id: str) -> None:
    """Wait for the job's pod to start; an error when there is no such job."""
    while True:
        started = await source.started(job_id)
        if started is None:
            raise ConfigurationError(
                f"No job {job_id} here: check the job id, --namespace and --cluster "
                "(`kinetic-prefect jobs ls` lists the gke backend's)."
            )
        if started:
            return
        await asyncio.sleep(_poll_seconds())


async def attach(
    source: JobSource,
    task_run_id: str,
    emit: Callable[[str], None],
    announce: Callable[[str], None],
) -> Any:
    """Follow the task run's pods, attempt after attempt, until its state is final; returns it.

    `emit` gets each log line; `announce` a line naming each pod as it is followed.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        run_id = uuid.UUID(task_run_id)
    except ValueError as exc:
        raise ConfigurationError(f"{task_run_id!r} is not a task run id (a UUID).") from exc
    followed: set[str] = set()
    async with get_client() as client:
        while True:
            try:
                state = (await client.read_task_run(run_id)).state
            except ObjectNotFound as exc:
                raise ConfigurationError(
                    f"The Prefect API at {client.api_url} has no task run {task_run_id}: check "
                    "the id and PREFECT_API_URL."
                ) from exc
            job = await source.current_job(task_run_id)
            if job is not None and job not in followed and await source.started(job):
                followed.add(job)
                announce(f"pod {job}")
                async for line in source.follow(job):
                    emit(line)
                continue  # look at the state again now that the pod has ended
            if state is not None and state.is_final():
                return state
            await asyncio.sleep(_poll_seconds())
