"""Access to a Kubernetes cluster through `kubernetes-asyncio`, and the few API calls shared by
the gke backend, `kinetic-prefect jobs` and `doctor`.

Owns where the credentials come from, reading raw API responses, what an API error
means for the user, and the small calls several callers make (pod logs, a Job's
pods and events, deleting a Job, writing a Secret, listing nodes). Nothing here
interprets Job or pod status (that is `backends/kube_status.py`).

Where the credentials come from, first match wins:

1. the `KineticCluster` block's `kube_config` (a prefect-kubernetes `KubernetesClusterConfig`);
2. in-cluster config, when this process runs in a pod (a Prefect worker on GKE);
3. the local kubeconfig (`$KUBECONFIG` or `~/.kube/config`), its current context or
   `kube_context` (`KINETIC_KUBE_CONTEXT`).

Everything here is asyncio: call it on the loop that owns the client.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.kube_config import refresh_token
from prefect.logging import get_logger

from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.manifest import (
    CONTAINER_NAME,
    LABEL_JOB_ID,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)

logger = get_logger("kinetic_prefect.backends.gke.client")

# Every object kinetic-prefect creates carries this label; tools select on it.
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
# exec / gcp-auth tokens (GKE's gke-gcloud-auth-plugin) last an hour; refresh well before.
_TOKEN_REFRESH_SECONDS = 300

_NO_ACCESS_HINT = (
    "Set kube_config on the KineticCluster block "
    "(KineticCluster(kube_config=KubernetesClusterConfig.from_file(), ...)), run inside the "
    "cluster, or point kubectl at it (gcloud container clusters get-credentials CLUSTER "
    "--zone ZONE --project PROJECT)."
)


@dataclass
class ClusterAccess:
    """A configured API client and where its credentials came from."""

    client: Any  # kubernetes_asyncio.client.ApiClient
    source: str
    server: str | None
    context: str | None = None
    _loader: Any = field(default=None, repr=False)

    async def keep_token_fresh(self) -> None:
        """Refresh short-lived exec/gcp tokens for as long as the client lives."""
        loader = self._loader
        if loader is None:
            return
        user = getattr(loader, "_user", None)
        if loader.provider != "gcp" and not (user is not None and "exec" in user):
            return
        await refresh_token(loader, self.client.configuration, interval=_TOKEN_REFRESH_SECONDS)

    async def close(self) -> None:
        await self.client.close()


def kubeconfig_path() -> str:
    """The kubeconfig kubectl would read (first entry of `$KUBECONFIG`)."""
    configured = os.environ.get("KUBECONFIG", "")
    first = configured.split(os.pathsep)[0] if configured else ""
    return os.path.expanduser(first or "~/.kube/config")


async def connect(cluster: Any = None, context: str | None = None) -> ClusterAccess:
    """An API client for `cluster` (a `KineticCluster` or None); see the module docstring.

    Example:
        ```python
        access = await connect(KineticCluster.load("gke"))
        jobs = await BatchV1Api(access.client).list_namespaced_job("default")
        ```
    """
    kube_config = getattr(cluster, "kube_config", None) if cluster is not None else None
    if kube_config is not None:
        configuration = client.Configuration()
        try:
            loader = await config.load_kube_config_from_dict(
                config_dict=kube_config.config,
                context=context or kube_config.context_name,
                client_configuration=configuration,
            )
        except (ConfigException, KeyError, AssertionError) as exc:
            raise ConfigurationError(
                f"The KineticCluster's kube_config cannot be used: {exc}. Recreate it with "
                "KubernetesClusterConfig.from_file(context_name=...)."
            ) from exc
        name = context or kube_config.context_name
        return ClusterAccess(
            client.ApiClient(configuration),
            f"the KineticCluster's kube_config (context {name})",
            configuration.host,
            name,
            loader,
        )
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as exc:
            logger.debug("In-cluster config unusable: %s", exc)
        else:
            return ClusterAccess(
                client.ApiClient(configuration), "in-cluster config", configuration.host
            )
    path = kubeconfig_path()
    if not os.path.exists(path):
        raise ConfigurationError(f"No Kubernetes cluster configured (no {path}). {_NO_ACCESS_HINT}")
    configuration = client.Configuration()
    try:
        loader = await config.load_kube_config(
            config_file=path,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )
    except (ConfigException, KeyError, AssertionError, TypeError) as exc:
        raise ConfigurationError(
            f"The kubeconfig {path} cannot be used: {exc}. {_NO_ACCESS_HINT}"
        ) from exc
    name = (loader.current_context or {}).get("name")
    return ClusterAccess(
        client.ApiClient(configuration),
        f"kubeconfig {path} (context {name})",
        configuration.host,
        name,
        loader,
    )


async def read_json(response: Any) -> Any:
    """The body of a raw (`_preload_content=False`) response, raising on an error status."""
    body = await response.read()
    response.release()
    if not 200 <= response.status < 300:
        raise ApiException(status=response.status, reason=body.decode(errors="replace")[:500])
    return json.loads(body)


async def pod_log(core: Any, namespace: str, pod: str, tail: int | None = None) -> str:
    """The task container's log, or its last `tail` lines."""
    kwargs: dict[str, Any] = {"container": CONTAINER_NAME}
    if tail:
        kwargs["tail_lines"] = tail
    # Raw, so a log line that happens to be JSON is not parsed as the response body.
    response = await core.read_namespaced_pod_log(pod, namespace, _preload_content=False, **kwargs)
    body = await response.read()
    response.release()
    if response.status != 200:
        raise ApiException(status=response.status, reason=body.decode(errors="replace")[:500])
    return body.decode(errors="replace")


async def follow_pod_log(core: Any, namespace: str, pod: str) -> AsyncIterator[str]:
    """The task container's log line by line, until the container ends."""
    response = await core.read_namespaced_pod_log(
        pod, namespace, container=CONTAINER_NAME, follow=True, _preload_content=False
    )
    try:
        if response.status != 200:
            raise ApiException(status=response.status, reason=(await response.text())[:500])
        while True:
            line = await response.content.readline()
            if not line:
                return
            yield line.decode(errors="replace")
    finally:
        response.release()


async def pods_of_job(core: Any, namespace: str, job_id: str) -> list[dict[str, Any]]:
    """The pods of one Kinetic job, newest first."""
    listing = await read_json(
        await core.list_namespaced_pod(
            namespace, label_selector=f"{LABEL_JOB_ID}={job_id}", _preload_content=False
        )
    )
    items: list[dict[str, Any]] = listing.get("items") or []
    return sorted(
        items, key=lambda p: p.get("metadata", {}).get("creationTimestamp") or "", reverse=True
    )


def run_sync(coro: Any) -> Any:
    """Run a coroutine from synchronous code that has no loop of its own (the CLI)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    raise RuntimeError("run_sync cannot be used inside a running event loop.")


async def delete_job(access: ClusterAccess, namespace: str, name: str) -> bool:
    """Delete a Job and (Foreground) its pods; False when it does not exist."""
    try:
        await read_json(
            await client.BatchV1Api(access.client).delete_namespaced_job(
                name, namespace, propagation_policy="Foreground", _preload_content=False
            )
        )
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


async def list_nodes(access: ClusterAccess) -> list[dict[str, Any]]:
    """The cluster's nodes (needs a ClusterRole that may list nodes)."""
    listing = await read_json(
        await client.CoreV1Api(access.client).list_node(_preload_content=False)
    )
    return list(listing.get("items") or [])


async def job_events(core: Any, namespace: str, job_name: str) -> list[dict[str, Any]]:
    """The events Kubernetes recorded about one Job (FailedCreate says why it has no pod)."""
    listing = await read_json(
        await core.list_namespaced_event(
            namespace,
            field_selector=f"involvedObject.kind=Job,involvedObject.name={job_name}",
            _preload_content=False,
        )
    )
    return list(listing.get("items") or [])


async def put_secret(core: Any, namespace: str, name: str, values: Mapping[str, str]) -> None:
    """Create the Opaque Secret `name` holding `values`.

    Names are digests of their contents (`kinetic_prefect.launch.pod_secrets`), so an
    existing Secret of that name already holds these values: it is never read
    or patched, and the runner needs neither `get` nor `patch` on Secrets.
    """
    data = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
    body = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {LABEL_MANAGED_BY: MANAGED_BY},
        },
        "data": data,
    }
    try:
        await read_json(
            await core.create_namespaced_secret(namespace, body=body, _preload_content=False)
        )
    except ApiException as exc:
        if exc.status != 409:
            raise RuntimeError(
                f"Could not create Secret {namespace}/{name}: {api_error_message(exc)}"
            ) from exc


async def delete_secret(core: Any, namespace: str, name: str) -> None:
    """Delete the Secret `name`; one already gone is fine."""
    try:
        await read_json(
            await core.delete_namespaced_secret(name, namespace, _preload_content=False)
        )
    except ApiException as exc:
        if exc.status != 404:
            raise


def api_error_message(exc: BaseException) -> str:
    """An API error as a user reads it; 401 and 403 say which permissions are missing."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or getattr(exc, "body", None) or str(exc)
    if status in {401, 403}:
        return (
            f"{status} {reason} — the credentials may not create Jobs, Secrets or watch pods in "
            "this namespace; apply deployments/k8s/rbac.yaml"
        )
    return f"{status} {reason}" if status else f"{type(exc).__name__}: {exc}"
