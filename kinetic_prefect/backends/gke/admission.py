"""Whether a namespace's admission lets task pods mount the node's environment cache.

The node cache is a hostPath volume. GKE Autopilot's Warden admission refuses a
writable hostPath outside `/var/log/`, and a namespace enforcing Pod Security
"baseline" refuses any hostPath; either refuses the pod itself, after its Job was
accepted. So before the first Job with the cache in a namespace, the backend asks
the API server to create that Job's pod with `dryRun=All` (admission runs, nothing
is stored). If admission refuses the hostPath, or the dry-run itself is not allowed,
the namespace's Jobs unpack their environment into an emptyDir instead
(`launch.manifest.without_node_cache`), which both profiles admit. The answer is
kept for the backend's life. docs/kubernetes.md "Admission" has the rules.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from prefect.logging import get_logger

from kinetic_prefect.backends.gke.client import api_error_message, with_retries
from kinetic_prefect.launch.manifest import uses_node_cache, without_node_cache

logger = get_logger("kinetic_prefect.backends.gke.admission")

# An RBAC refusal of the dry-run itself (kube-apiserver's responsewriters.Forbidden).
_RBAC_REFUSAL = 'cannot create resource "pods"'


def node_cache_verdict(status: int | None, message: str = "") -> bool:
    """Whether to keep the node cache, from the dry-run pod create's answer.

    `status` None: admitted. A 403 naming a hostPath: admission forbids the cache. A 403
    from RBAC (the Role lacks pods "create"): nothing is known, and an emptyDir works on
    every cluster. Any other refusal is not about the cache: the real pod gets the same
    answer and its FailedCreate says why, so the manifest stays as it is.
    """
    refused_cache = status == 403 and ("hostPath" in message or _RBAC_REFUSAL in message)
    return status is None or not refused_cache


def dry_run_pod(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The pod the Job controller would create from `manifest`'s template."""
    template = copy.deepcopy(dict(manifest["spec"]["template"]))
    meta = template.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**meta, "generateName": f"{manifest['metadata']['name']}-"},
        "spec": template["spec"],
    }


class NodeCacheAdmission:
    """Per namespace, whether its pods may mount the node cache (asked once, on the loop)."""

    def __init__(self) -> None:
        self._verdicts: dict[str, bool] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def admit(self, core: Any, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """`manifest` as the namespace admits it: with the node cache, or with an emptyDir."""
        if not uses_node_cache(manifest):
            return manifest
        lock = self._locks.setdefault(namespace, asyncio.Lock())
        async with lock:
            if namespace not in self._verdicts:
                self._verdicts[namespace] = await self._ask(core, namespace, manifest)
        return manifest if self._verdicts[namespace] else without_node_cache(manifest)

    async def _ask(self, core: Any, namespace: str, manifest: dict[str, Any]) -> bool:
        try:
            await with_retries(
                lambda: core.create_namespaced_pod(
                    namespace, body=dry_run_pod(manifest), dry_run="All", _preload_content=False
                ),
                f"Dry-run pod in {namespace}",
            )
        except ApiException as exc:
            message = api_error_message(exc)
            keep = node_cache_verdict(exc.status, message)
            if not keep:
                logger.info(
                    "Namespace %s does not admit the node's environment cache (%s): its pods "
                    "unpack their environment into an emptyDir",
                    namespace,
                    message,
                )
            return keep
        return True
