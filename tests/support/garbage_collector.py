"""A test garbage collector: deletes the objects whose owners are all gone, as Kubernetes' does.

Kubernetes' garbage collector (in kube-controller-manager) deletes an object once
none of the owners its `metadata.ownerReferences` name exists. An owner counts by
uid, not name (a new object under the same name is another owner), and one being
deleted (with a `deletionTimestamp`: Foreground deletion waits on its dependents)
no longer counts. An object created or patched with owners that are all gone
already is deleted too. Like the real one, this one is just another client of the
API: it follows the emulator's events and deletes over HTTP (Background).

Pods are left to the test kubelet, which ends their containers before it deletes
them (tests/support/kubelet.py). Not emulated: removing dangling references from
an object that still has a live owner (Kubernetes patches them out), and
`blockOwnerDeletion` holding up a Foreground deletion for anything but pods.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.support.kube_emulator import PODS, ClusterEmulator

GARBAGE_COLLECTOR_AGENT = "test-garbage-collector"


@dataclass(frozen=True)
class _Dependent:
    path: str
    owners: frozenset[str]


def _object_path(resource: Any, namespace: str | None, name: str) -> str:
    base = (
        f"/api/{resource.version}"
        if not resource.group
        else f"/apis/{resource.group}/{resource.version}"
    )
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"{base}{scope}/{resource.plural}/{name}"


class GarbageCollector:
    """Deletes dependents whose owners are gone (see the module docstring)."""

    def __init__(self, emulator: ClusterEmulator) -> None:
        self.emulator = emulator
        # Exceptions of its own: a broken collector must fail the test.
        self.errors: list[BaseException] = []
        # The uids of objects that exist and are not being deleted.
        self._solid: set[str] = set()
        self._dependents: dict[str, _Dependent] = {}  # by uid
        self._deleting: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def run(self, base_url: str) -> None:
        self._session = aiohttp.ClientSession(
            base_url=base_url, headers={"User-Agent": GARBAGE_COLLECTOR_AGENT}
        )
        try:
            async for batch in self.emulator.event_batches():
                for _, resource, event in batch:
                    self._observe(resource, event["type"], event["object"])
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._session.close()

    def _observe(self, resource: Any, event_type: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid")
        if not uid:
            return
        if event_type == "DELETED" or meta.get("deletionTimestamp"):
            self._dependents.pop(uid, None)
            if uid in self._solid:
                self._solid.discard(uid)
                self._collect_dependents_of(uid)
            return
        self._solid.add(uid)
        owners = frozenset(ref["uid"] for ref in meta.get("ownerReferences") or [])
        if not owners or resource.plural == PODS:
            self._dependents.pop(uid, None)
            return
        path = _object_path(resource, meta.get("namespace"), meta["name"])
        self._dependents[uid] = _Dependent(path, owners)
        if not owners & self._solid:
            self._delete(uid)

    def _collect_dependents_of(self, owner: str) -> None:
        for uid, dependent in list(self._dependents.items()):
            if owner in dependent.owners and not dependent.owners & self._solid:
                self._delete(uid)

    def _delete(self, uid: str) -> None:
        if uid in self._deleting:
            return
        self._deleting.add(uid)
        path = self._dependents[uid].path
        task = asyncio.get_running_loop().create_task(self._request_delete(path))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    async def _request_delete(self, path: str) -> None:
        assert self._session is not None
        body = {"propagationPolicy": "Background"}
        async with self._session.delete(path, json=body) as response:
            if response.status >= 400 and response.status != 404:
                raise RuntimeError(f"DELETE {path}: {response.status} {await response.text()}")

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]
