"""The Secrets a gke backend's Jobs read their secretKeyRefs from, owned by those Jobs.

Secret names are digests of their contents (`kinetic_prefect.launch.pod_secrets`), and the
contents hold the flow run's record key, so the Jobs of one flow process share one Secret
(a restarted process of the same flow run computes the same one), and runners with
different credentials never overwrite each other's. A Secret is created once, before the
first Job that names it, and every Job created after it is added to its
`metadata.ownerReferences`: Kubernetes' garbage collector deletes it with the last of its
Jobs (after `ttlSecondsAfterFinished`, a cancel, `kinetic-prefect jobs cleanup`), also when
the flow process was SIGKILLed. The backend deletes it itself when it closes.

Owners are added in bulk: one strategic-merge patch (merged by uid, so owners another
process added stay) carries every Job created within `owner_batch_seconds` of the first
one waiting (or while the previous patch was on its way), so a sweep costs far fewer
patches than Jobs and a one-at-a-time flow one patch per Job.

Until its first owner is added a Secret belongs to no Job: a flow process killed in
between leaves it to `kinetic-prefect jobs cleanup` (`orphaned_secrets`). Once every Job
that owned it may be gone (deleted, or past its TTL), the garbage collector may have
deleted it while the flow process goes on: the next launch creates it again before its
Job, and a patch that finds it gone creates it with its owners.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from prefect.logging import get_logger

from kinetic_prefect.backends.base import Secrets
from kinetic_prefect.backends.gke.client import (
    MANAGED_SELECTOR,
    ClusterAccess,
    add_secret_owners,
    api_error_message,
    delete_secret,
    owner_reference,
    put_secret,
    read_json,
)
from kinetic_prefect.common.intervals import Intervals

logger = get_logger("kinetic_prefect.backends.gke.secrets")


# (namespace, Job name) -> whether that Job may still exist, as the backend knows it.
MayExist = Callable[[str, str], bool]


@dataclass
class _SharedSecret:
    namespace: str
    name: str
    values: Mapping[str, str]
    # Owner references by Job name: patched in, or on their way (`waiting`); those
    # that cannot exist any more are dropped (`owned` remembers there were some).
    owners: dict[str, dict[str, Any]] = field(default_factory=dict)
    owned: bool = False
    waiting: list[dict[str, Any]] = field(default_factory=list)
    flushing: asyncio.Task[None] | None = None


class JobSecrets:
    """The Secrets one backend created; used on the backend's event loop only.

    `may_exist(namespace, job)` says whether a Job that owns a Secret may still exist
    (the backend has not seen it deleted nor past its TTL).
    """

    def __init__(
        self, may_exist: MayExist, owner_batch_seconds: float = Intervals.owner_batch_seconds
    ) -> None:
        self._may_exist = may_exist
        # How long a Job created waits for others to share its owner patch: a map's Jobs
        # are created one after another, each create one round trip.
        self._owner_batch_seconds = owner_batch_seconds
        self._secrets: dict[tuple[str, str], _SharedSecret] = {}
        self._lock: asyncio.Lock | None = None
        self._closing = False

    async def ensure(self, core: Any, namespace: str, secrets: Secrets) -> None:
        """Create the Secrets the secretKeyRefs name, unless they are known to exist."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            for name, values in secrets.items():
                known = self._secrets.get((namespace, name))
                if known is not None and not self._maybe_collected(known):
                    continue
                await put_secret(core, namespace, name, values)
                if known is None:
                    self._secrets[(namespace, name)] = _SharedSecret(namespace, name, values)
                else:
                    known.owners.clear()
                    known.owned = False

    def add_owner(
        self, core: Any, namespace: str, names: Sequence[str], job: Mapping[str, Any]
    ) -> None:
        """Make the created `job` an owner of the Secrets `names` (patched in the background)."""
        reference = owner_reference(job)
        for name in names:
            secret = self._secrets.get((namespace, name))
            if secret is None or self._closing:
                continue
            secret.owners[reference["name"]] = reference
            secret.owned = True
            secret.waiting.append(reference)
            if secret.flushing is None or secret.flushing.done():
                secret.flushing = asyncio.get_running_loop().create_task(
                    self._flush(core, secret), name=f"kinetic-secret-owners-{name}"
                )

    async def delete_all(self, core: Any) -> None:
        """Delete every Secret created (every Job of the backend has ended by now)."""
        self._closing = True
        flushes = [s.flushing for s in self._secrets.values() if s.flushing is not None]
        await asyncio.gather(*flushes, return_exceptions=True)
        for namespace, name in sorted(self._secrets):
            try:
                await delete_secret(core, namespace, name)
            except Exception:
                logger.warning("Could not delete Secret %s/%s", namespace, name, exc_info=True)
        self._secrets.clear()

    def forget_gone_owners(self) -> None:
        """Drop the owners that cannot exist any more (the backend forgot them)."""
        for secret in self._secrets.values():
            secret.owners = {
                job: ref
                for job, ref in secret.owners.items()
                if self._may_exist(secret.namespace, job)
                or any(waiting is ref for waiting in secret.waiting)
            }

    def _maybe_collected(self, secret: _SharedSecret) -> bool:
        """Whether it had owners and all of them may be gone (so may the Secret be)."""
        return secret.owned and not any(
            self._may_exist(secret.namespace, job) for job in secret.owners
        )

    async def _flush(self, core: Any, secret: _SharedSecret) -> None:
        """Patch in the owners waiting, then those that arrived meanwhile, until none wait."""
        while secret.waiting and not self._closing:
            await asyncio.sleep(self._owner_batch_seconds)
            batch, secret.waiting = secret.waiting, []
            try:
                await self._add_owners(core, secret, batch)
            except Exception as exc:
                logger.warning(
                    "Could not make Jobs owners of Secret %s/%s (%s); it outlives them if the "
                    "flow process is killed: `kinetic-prefect jobs cleanup` removes it",
                    secret.namespace,
                    secret.name,
                    api_error_message(exc),
                )

    async def _add_owners(
        self, core: Any, secret: _SharedSecret, batch: list[dict[str, Any]]
    ) -> None:
        try:
            await add_secret_owners(core, secret.namespace, secret.name, batch)
        except ApiException as exc:
            if exc.status != 404:
                raise
            # Collected with its last owner: again, owned by the Jobs that may still exist.
            owners = [
                ref
                for job, ref in secret.owners.items()
                if self._may_exist(secret.namespace, job) or ref in batch
            ]
            await put_secret(core, secret.namespace, secret.name, secret.values, owners)


# -- cleanup -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SecretSummary:
    """One Secret kinetic-prefect created, as `jobs cleanup` sees it."""

    name: str
    owner_uids: frozenset[str]
    created: str


async def list_kinetic_secrets(access: ClusterAccess, namespace: str) -> list[SecretSummary]:
    """Every Secret kinetic-prefect created in `namespace` (needs list on secrets)."""
    listing = await read_json(
        await client.CoreV1Api(access.client).list_namespaced_secret(
            namespace, label_selector=MANAGED_SELECTOR, _preload_content=False
        )
    )
    found = []
    for item in listing.get("items") or []:
        meta = item.get("metadata") or {}
        owners = frozenset(o.get("uid", "") for o in meta.get("ownerReferences") or [])
        found.append(SecretSummary(meta["name"], owners, meta.get("creationTimestamp") or ""))
    return sorted(found, key=lambda s: (s.created, s.name))


def orphaned_secrets(
    secrets: Sequence[SecretSummary],
    live_job_uids: set[str],
    named_by_live_jobs: set[str],
    created_before: datetime.datetime,
) -> list[str]:
    """The Secrets no live Job owns or names, created before `created_before`.

    A younger Secret may be one a flow process has just created for the Job it is
    creating (its owner is added after the Job): `created_before` leaves it be.
    """
    orphans = []
    for secret in secrets:
        if secret.owner_uids & live_job_uids or secret.name in named_by_live_jobs:
            continue
        if not secret.created:
            continue
        created = datetime.datetime.fromisoformat(secret.created.replace("Z", "+00:00"))
        if created <= created_before:
            orphans.append(secret.name)
    return orphans
