"""Access to a Kubernetes cluster through `kubernetes-asyncio`, and the few API calls shared by
the gke backend, `kinetic-prefect jobs` and `doctor`.

Owns where the credentials come from, reading raw API responses, what an API error
means for the user, creating an object through a busy or restarting API server
(`with_retries`, `create_idempotently`), and the small calls several callers make (pod logs, a
Job's pods and events, deleting a Job, writing a Secret, listing nodes). Nothing
here interprets Job or pod status (that is `backends/gke/status.py`).

Creates are retried on what an API server answers when it is overloaded or
restarting (429 with its Retry-After, 500, 502, 503, 504) and on lost
connections, with backoff, for about `Retries.budget_seconds` in all. A
retried create is idempotent by name: its 409 AlreadyExists counts as success
when the object found under that name is ours (an earlier attempt created it and
its answer was lost), and as the failure it is otherwise. Any other error (403,
422 Invalid, ...) fails at once.

Where the credentials come from, first match wins:

1. the `KineticCluster` block's `kube_config` (a prefect-kubernetes `KubernetesClusterConfig`);
2. in-cluster config, when this process runs in a pod (a Prefect worker on GKE);
3. the local kubeconfig (`$KUBECONFIG` or `~/.kube/config`), its current context or
   `kube_context` (`KINETIC_KUBE_CONTEXT`).

`ClusterAccess.reload_credentials` reads them again from the same place, as
kubernetes-asyncio's loaders do on first use: the kubeconfig file as it is now, the
mounted service-account token (GKE's bound tokens rotate hourly), or the block's
exec/gcp provider asked for a new token.

Everything here is asyncio: call it on the loop that owns the client.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.kube_config import refresh_token
from prefect.logging import get_logger

from kinetic_prefect.common.intervals import Intervals
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

_NO_ACCESS_HINT = (
    "Set kube_config on the KineticCluster block "
    "(KineticCluster(kube_config=KubernetesClusterConfig.from_file(), ...)), run inside the "
    "cluster, or point kubectl at it (gcloud container clusters get-credentials CLUSTER "
    "--zone ZONE --project PROJECT)."
)


# Sets a client Configuration's server and credentials; returns the kubeconfig loader, if any.
LoadCredentials = Callable[[Any], Awaitable[Any]]


@dataclass
class ClusterAccess:
    """A configured API client and where its credentials came from."""

    client: Any  # kubernetes_asyncio.client.ApiClient
    source: str
    server: str | None
    context: str | None = None
    _loader: Any = field(default=None, repr=False)
    _load: LoadCredentials | None = field(default=None, repr=False)

    async def reload_credentials(self) -> None:
        """Read the credentials again from their source, into the client in use.

        For a token the API server stopped accepting (rotated, expired): every request
        made after this carries whatever the source holds now.
        """
        if self._load is None:
            return
        loader = await self._load(self.client.configuration)
        if loader is not None:
            self._loader = loader

    async def keep_token_fresh(self, every: float = Intervals.token_refresh_seconds) -> None:
        """Refresh short-lived exec/gcp tokens for as long as the client lives.

        Such tokens (GKE's gke-gcloud-auth-plugin) last an hour: `every` is well before.
        """
        loader = self._loader
        if loader is None:
            return
        user = getattr(loader, "_user", None)
        if loader.provider != "gcp" and not (user is not None and "exec" in user):
            return
        await refresh_token(loader, self.client.configuration, interval=int(every))

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
        name = context or kube_config.context_name

        async def load_block(configuration: Any) -> Any:
            return await config.load_kube_config_from_dict(
                config_dict=kube_config.config, context=name, client_configuration=configuration
            )

        try:
            return await _access(load_block, "the KineticCluster's kube_config")
        except (ConfigException, KeyError, AssertionError) as exc:
            raise ConfigurationError(
                f"The KineticCluster's kube_config cannot be used: {exc}. Recreate it with "
                "KubernetesClusterConfig.from_file(context_name=...)."
            ) from exc
    if os.environ.get("KUBERNETES_SERVICE_HOST"):

        async def load_in_cluster(configuration: Any) -> None:
            config.load_incluster_config(client_configuration=configuration)

        try:
            return await _access(load_in_cluster, "in-cluster config")
        except ConfigException as exc:
            logger.debug("In-cluster config unusable: %s", exc)
    path = kubeconfig_path()
    if not os.path.exists(path):
        raise ConfigurationError(f"No Kubernetes cluster configured (no {path}). {_NO_ACCESS_HINT}")

    async def load_file(configuration: Any) -> Any:
        return await config.load_kube_config(
            config_file=path,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )

    try:
        return await _access(load_file, f"kubeconfig {path}")
    except (ConfigException, KeyError, AssertionError, TypeError) as exc:
        raise ConfigurationError(
            f"The kubeconfig {path} cannot be used: {exc}. {_NO_ACCESS_HINT}"
        ) from exc


async def _access(load: LoadCredentials, source: str) -> ClusterAccess:
    """A client configured by `load`, which also serves to reload its credentials."""
    configuration = client.Configuration()
    loader = await load(configuration)
    name = (loader.current_context or {}).get("name") if loader is not None else None
    if name:
        source = f"{source} (context {name})"
    return ClusterAccess(
        client.ApiClient(configuration), source, configuration.host, name, loader, load
    )


async def read_json(response: Any) -> Any:
    """The body of a raw (`_preload_content=False`) response, raising on an error status.

    The `ApiException` keeps the response's headers and body (Retry-After, the Status).
    """
    body = await response.read()
    response.release()
    if not 200 <= response.status < 300:
        error = ApiException(status=response.status, reason=body.decode(errors="replace")[:500])
        error.headers = response.headers
        error.body = body
        raise error
    return json.loads(body)


# -- creating through a busy API server ------------------------------------------------------

# What an API server answers when it is overloaded (429: API Priority and Fairness) or
# cannot reach etcd or a webhook for a moment (5xx): the same request may succeed later.
_TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class Retries:
    """How long a request keeps trying through transient errors (see the module docstring)."""

    attempts: int = 5
    first_delay_seconds: float = 1.0
    max_delay_seconds: float = 8.0
    budget_seconds: float = 30.0


async def get_json(api: Any, path: str, path_params: dict[str, str] | None = None) -> Any:
    """GET `path` (its `{name}`s from `path_params`) as JSON, for APIs without a typed client."""
    return await read_json(
        await api.call_api(
            path,
            "GET",
            path_params or {},
            [],
            {"Accept": "application/json"},
            auth_settings=["BearerToken"],
            _preload_content=False,
        )
    )


def is_transient(exc: BaseException) -> bool:
    """Whether the same request may succeed later: 429, 5xx, a lost connection, a timeout."""
    if isinstance(exc, ApiException):
        return exc.status in _TRANSIENT_STATUSES
    lost = aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | TimeoutError
    return isinstance(exc, lost)


def _status_body(exc: BaseException) -> dict[str, Any]:
    """The Kubernetes Status object an API error carries, or {}."""
    raw = getattr(exc, "body", None) or getattr(exc, "reason", None)
    if isinstance(raw, bytes):
        raw = raw.decode(errors="replace")
    try:
        status = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return {}
    return status if isinstance(status, dict) and status.get("kind") == "Status" else {}


def retry_after_seconds(exc: BaseException) -> float | None:
    """How long the API server asked us to wait: its Retry-After header or Status details."""
    headers = getattr(exc, "headers", None) or {}
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
    if value is None:
        value = (_status_body(exc).get("details") or {}).get("retryAfterSeconds")
    try:
        return max(float(value), 0.0) if value is not None else None
    except (TypeError, ValueError):
        return None  # an HTTP date: Kubernetes never sends one


async def with_retries(
    send: Callable[[], Awaitable[Any]], what: str, retries: Retries = Retries()
) -> Any:
    """The JSON answer to `send()` (one raw request), sent again after transient errors.

    Waits what the server asked (Retry-After) or a jittered, doubling backoff; raises the
    last error once it is not transient, the attempts are spent or the next wait would
    pass the budget. Only for requests that may safely arrive twice.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retries.budget_seconds
    delay = retries.first_delay_seconds
    attempt = 0
    while True:
        attempt += 1
        try:
            return await read_json(await send())
        except (ApiException, aiohttp.ClientError, TimeoutError) as exc:
            wait = retry_after_seconds(exc)
            if wait is None:
                wait = delay * random.uniform(0.5, 1.0)  # jittered: many launches fail together
            spent = attempt >= retries.attempts or loop.time() + wait > deadline
            if spent or not is_transient(exc):
                raise
            logger.info(
                "%s: %s; trying again in %.1fs (attempt %d of %d)",
                what,
                api_error_message(exc),
                wait,
                attempt + 1,
                retries.attempts,
            )
        await asyncio.sleep(wait)
        delay = min(delay * 2, retries.max_delay_seconds)


async def create_idempotently(
    create: Callable[[], Awaitable[Any]],
    read_existing: Callable[[], Awaitable[Any]] | None,
    ours: Callable[[Mapping[str, Any]], bool],
    what: str,
    retries: Retries = Retries(),
) -> dict[str, Any]:
    """Create an object through transient errors; returns the object created (or found).

    `create` and `read_existing` make one raw (`_preload_content=False`) request each.
    A 409 AlreadyExists (an earlier attempt's answer was lost, or another process made
    it) is success when `ours` says the object found under the name is the one this
    create makes, and fails otherwise. Without `read_existing` a 409 is success as it
    is (for objects named by a digest of their contents) and returns {}.

    Example:
        ```python
        job = await create_idempotently(
            lambda: batch.create_namespaced_job(ns, body=manifest, _preload_content=False),
            lambda: batch.read_namespaced_job(name, ns, _preload_content=False),
            lambda found: found["metadata"]["labels"].get(LABEL_JOB_ID) == name,
            f"Job {ns}/{name}",
        )
        ```
    """
    try:
        return dict(await with_retries(create, f"Creating {what}", retries))
    except ApiException as exc:
        if exc.status != 409:
            raise
        if read_existing is None:
            return {}
        existing = await read_json(await read_existing())
        if ours(existing):
            return dict(existing)
        raise


def owner_reference(job: Mapping[str, Any]) -> dict[str, Any]:
    """An ownerReference to a created Job, for Kubernetes' garbage collector.

    The collector deletes a dependent once none of its owners exists. Not `controller`
    (a shared Secret has many owner Jobs and at most one may be its controller), and
    not `blockOwnerDeletion` (that would hold up deleting the Job, and setting it needs
    update on jobs/finalizers).
    """
    meta = job.get("metadata") or {}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": False,
        "blockOwnerDeletion": False,
    }


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


async def list_nodes(access: ClusterAccess, label_selector: str = "") -> list[dict[str, Any]]:
    """The cluster's nodes, or those `label_selector` matches (needs a ClusterRole that may
    list nodes)."""
    listing = await read_json(
        await client.CoreV1Api(access.client).list_node(
            label_selector=label_selector, _preload_content=False
        )
    )
    return list(listing.get("items") or [])


async def job_events(
    core: Any, namespace: str, name: str, kind: str = "Job"
) -> list[dict[str, Any]]:
    """The events Kubernetes recorded about one Job (FailedCreate says why it has no pod), or
    about one object of another `kind` (a Pod: the cluster autoscaler's scale-up verdicts)."""
    listing = await read_json(
        await core.list_namespaced_event(
            namespace,
            field_selector=f"involvedObject.kind={kind},involvedObject.name={name}",
            _preload_content=False,
        )
    )
    return list(listing.get("items") or [])


async def put_secret(
    core: Any,
    namespace: str,
    name: str,
    values: Mapping[str, str],
    owners: Sequence[Mapping[str, Any]] = (),
    labels: Mapping[str, str] | None = None,
) -> None:
    """Create the Opaque Secret `name` holding `values`, owned by the Jobs `owners` names.

    Names are digests of their contents (`kinetic_prefect.launch.pod_secrets`), so an
    existing Secret of that name already holds these values: it is never read, and the
    runner needs no `get` on Secrets. Its labels default to the managed-by label
    (`kinetic-prefect jobs cleanup` removes such Secrets once no Job owns them).
    """
    data = {k: base64.b64encode(v.encode()).decode() for k, v in values.items()}
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels) if labels is not None else {LABEL_MANAGED_BY: MANAGED_BY},
    }
    if owners:
        metadata["ownerReferences"] = [dict(owner) for owner in owners]
    body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata}
    body["data"] = data
    try:
        await create_idempotently(
            lambda: core.create_namespaced_secret(namespace, body=body, _preload_content=False),
            None,
            lambda _: True,
            f"Secret {namespace}/{name}",
        )
    except Exception as exc:
        raise RuntimeError(
            f"Could not create Secret {namespace}/{name}: {api_error_message(exc)}"
        ) from exc


async def add_secret_owners(
    core: Any, namespace: str, name: str, owners: Sequence[Mapping[str, Any]]
) -> None:
    """Add `owners` to the Secret's ownerReferences, keeping those it has.

    A strategic-merge patch: Kubernetes merges ownerReferences by uid, so owners that
    another process added at the same time stay. Raises `ApiException` 404 when the
    Secret is gone.
    """
    patch = {"metadata": {"ownerReferences": [dict(owner) for owner in owners]}}
    await with_retries(
        lambda: core.patch_namespaced_secret(name, namespace, patch, _preload_content=False),
        f"Adding owners to Secret {namespace}/{name}",
    )


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
    body = _status_body(exc)
    if body.get("message"):
        reason = f"{body.get('reason') or 'Failure'}: {body['message']}"
    if status == 403:
        return f"{status} {reason} — {_forbidden_hint(str(body.get('message') or reason))}"
    if status == 401:
        return (
            f"{status} {reason} — the cluster did not accept the credentials (expired or revoked "
            "token, or a deleted service account); get new ones (gcloud container clusters "
            "get-credentials CLUSTER) or check the KineticCluster's kube_config"
        )
    return f"{status} {reason}" if status else f"{type(exc).__name__}: {exc}"


# kube-apiserver's words for a request RBAC denied.
_FORBIDDEN = re.compile(
    r'User "(?P<user>[^"]*)" cannot (?P<verb>\S+) resource "(?P<resource>[^"]*)" '
    r'in API group "(?P<group>[^"]*)"(?: in the namespace "(?P<namespace>[^"]*)")?'
)
_SERVICE_ACCOUNT_USER = re.compile(r"system:serviceaccount:(?P<namespace>[^:]+):(?P<name>.+)")


def _forbidden_hint(message: str) -> str:
    """What to do about a 403: the verb and resource the identity lacks, and how to grant it."""
    denied = _FORBIDDEN.search(message)
    if denied is None:
        return (
            "the credentials may not create Jobs, Secrets or watch pods in this namespace; "
            "apply deployments/k8s/rbac.yaml"
        )
    user, verb, resource = denied.group("user", "verb", "resource")
    group = denied.group("group")
    namespace = denied.group("namespace") or "NAMESPACE"
    what = f'"{verb}" on {resource}' + (f" (API group {group})" if group else "")
    account = _SERVICE_ACCOUNT_USER.fullmatch(user)
    if account is not None and account.group("name") == "kinetic-prefect-runner":
        grant = f"apply it: kubectl apply -n {namespace} -f deployments/k8s/rbac.yaml"
    elif account is not None:
        grant = (
            f"run as the service account kinetic-prefect-runner, or bind the Role "
            f"kinetic-prefect-runner to {account.group('name')} (deployments/k8s/rbac.yaml)"
        )
    else:
        grant = (
            f"apply deployments/k8s/rbac.yaml and bind its Role to {user} "
            f"(sed s/USER/{user}/ deployments/k8s/user-binding.yaml | kubectl apply -n "
            f"{namespace} -f -)"
        )
    return (
        f"{user} lacks {what} in namespace {namespace}, which kinetic-prefect needs "
        f"(the Role kinetic-prefect-runner grants it); {grant}"
    )
