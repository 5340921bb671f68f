"""The Secrets a gke backend's Jobs read their secretKeyRefs from: created once, deleted at close.

Secret names are digests of their contents (`kinetic_prefect.launch.pod_secrets`), so a
Secret is created once per namespace however many Jobs name it, and runners with
different credentials never overwrite each other's. They go when the backend
closes, with the Jobs that read them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from prefect.logging import get_logger

from kinetic_prefect.backends.base import Secrets
from kinetic_prefect.backends.gke.client import delete_secret, put_secret

logger = get_logger("kinetic_prefect.backends.gke.secrets")


class JobSecrets:
    """The Secrets one backend created; used on the backend's event loop only."""

    def __init__(self) -> None:
        self._created: set[tuple[str, str]] = set()
        self._lock: asyncio.Lock | None = None

    async def ensure(self, core: Any, namespace: str, secrets: Secrets) -> None:
        """Create the Secrets the secretKeyRefs name, once each."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            for name, values in secrets.items():
                if (namespace, name) in self._created:
                    continue
                await put_secret(core, namespace, name, values)
                self._created.add((namespace, name))

    async def delete_all(self, core: Any) -> None:
        """Delete every Secret created (every Job of the backend has ended by now)."""
        for namespace, name in sorted(self._created):
            try:
                await delete_secret(core, namespace, name)
            except Exception:
                logger.warning("Could not delete Secret %s/%s", namespace, name, exc_info=True)
        self._created.clear()
