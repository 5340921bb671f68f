"""kmock's Kubernetes emulator, completed where a watching client relies on more.

`ClusterEmulator` is `kmock.KubernetesEmulator` plus, through kmock's own handler
API: resourceVersions, label and field selectors, watches that resume from a
resourceVersion (410 Gone once compacted) or end on a server-side timeout or a
cut, Foreground deletion (a finalizer the kubelet releases), strategic-merge
patches of `metadata.ownerReferences` (merged by uid), pod logs, and injected API
errors: a request answered with an error Status, as the API server writes one,
before anything is stored; once (`fail_next`) or until lifted (`refuse`, e.g. a
token that was rotated away, or watches the credentials may no longer open).
Every request is authenticated and authorized, and pods pass ServiceAccount
admission, as kube-apiserver does them (tests/support/kube_auth.py), and the admission
profiles of tests/support/kube_admission.py (GKE Autopilot, Pod Security "baseline"). A
create with `dryRun=All` is authorized and admitted and then answered without storing.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import aiobus

from tests.support import kube_admission, kube_auth
from tests.support.kube_objects import now

JOBS = "jobs"
PODS = "pods"
_LOG_PATH = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/log")
# Far more requests than are ever in flight at once in a test.
_MATCHING_WINDOW = 64
# The request this task is serving: the only one kmock's matching asks the views about.
_SERVING: contextvars.ContextVar[kmock.Request | None] = contextvars.ContextVar(
    "kp_serving", default=None
)


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Kubernetes equality-based label selectors: `a=b`, `a==b`, `a!=b`, `a`, `!a`."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _fields_match(selector: str, obj: dict[str, Any]) -> bool:
    """Field selectors as `a.b=c` on the object's dotted paths."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        path, _, expected = term.replace("==", "=").partition("=")
        value: Any = obj
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if str(value if value is not None else "") != expected:
            return False
    return True


@dataclass(frozen=True)
class ApiFault:
    """An error the API server answers one request with (see `ClusterEmulator.fail_next`)."""

    method: str
    plural: str
    code: int
    reason: str
    message: str
    retry_after: int | None = None
    details: dict[str, Any] | None = None
    # Only watch requests (True), only other ones (False), or both (None).
    watch: bool | None = None
    # Only requests bearing this token (None: any).
    token: str | None = None

    def matches(self, request: kmock.Request) -> bool:
        """`method` and `plural` may be "*" (any)."""
        resource = request.resource
        if resource is None or self.plural not in {"*", resource.plural}:
            return False
        if self.method != "*" and request.method.value.upper() != self.method.upper():
            return False
        watching = request.params.get("watch", "").lower() in {"true", "1"}
        if self.watch is not None and watching != self.watch:
            return False
        bearer = request.headers.get("Authorization", "")
        return self.token is None or bearer == f"Bearer {self.token}"

    def response(self) -> aiohttp.web.Response:
        """A `Status` object with the fault's code, as kube-apiserver writes errors."""
        details = dict(self.details or {})
        headers = {}
        if self.retry_after is not None:
            details["retryAfterSeconds"] = self.retry_after
            headers["Retry-After"] = str(self.retry_after)
        status = kube_auth.status(self.code, self.reason, self.message, details)
        return aiohttp.web.json_response(status, status=self.code, headers=headers)


def _status_response(status: dict[str, Any]) -> aiohttp.web.Response:
    return aiohttp.web.json_response(status, status=status["code"])


def _merge_owner_references(patch: dict[str, Any], stored: dict[str, Any]) -> None:
    """Strategic merge of `metadata.ownerReferences`: by uid, keeping the stored ones."""
    new = (patch.get("metadata") or {}).get("ownerReferences")
    if not isinstance(new, list):
        return
    kept = (stored.get("metadata") or {}).get("ownerReferences") or []
    merged = {ref["uid"]: ref for ref in kept}
    merged.update((ref["uid"], ref) for ref in new)
    patch["metadata"]["ownerReferences"] = list(merged.values())


class _Buses(dict):  # type: ignore[type-arg]
    """kmock's per-resource event buses, each stamping and recording what it carries."""

    def __init__(self, emulator: ClusterEmulator) -> None:
        super().__init__()
        self.emulator = emulator

    def __missing__(self, resource: Any) -> aiobus.Bus[Any]:
        bus = _RecordingBus(emulator=self.emulator, resource=resource)
        self[resource] = bus
        return bus


@attrs.mutable(weakref_slot=True)
class _RecordingBus(aiobus.Bus[Any]):
    emulator: Any = None
    resource: Any = None

    async def put(self, *items: Any) -> None:
        for item in items:
            await self.emulator._record(self.resource, item)
        await super().put(*items)


_VERSION = re.compile(r"v(\d+)(?:(alpha|beta)(\d+))?")


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Sort key of Kubernetes' version priority: GA, then beta, then alpha, each newest first;
    anything else last, by name."""
    match = _VERSION.fullmatch(version)
    if match is None:
        return (3, 0, 0, version)
    major, level, minor = match.groups()
    rank = {None: 0, "beta": 1, "alpha": 2}[level]
    return (rank, -int(major), -int(minor or 0), version)


@attrs.define(kw_only=True)
class ClusterEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with what a watching client relies on."""

    version: int = attrs.field(default=0, init=False)
    compacted_version: int = attrs.field(default=0, init=False)
    events: list[tuple[int, Any, dict[str, Any]]] = attrs.field(factory=list, init=False)
    log_files: dict[tuple[str, str], Path] = attrs.field(factory=dict, init=False)
    finished_logs: set[tuple[str, str]] = attrs.field(factory=set, init=False)
    _changed: asyncio.Condition = attrs.field(factory=asyncio.Condition, init=False)
    # Held by writes to an object that has a deletionTimestamp (see `_handle`).
    _finalizing: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _cuts: int = attrs.field(default=0, init=False)
    _released: asyncio.Event = attrs.field(factory=asyncio.Event, init=False)
    # Injected errors: answering one request each (`fail_next`), or every matching request
    # until lifted (`refuse`). Neither is authorization's doing, so neither is in `refusals`.
    faults: list[ApiFault] = attrs.field(factory=list, init=False)
    standing_faults: list[ApiFault] = attrs.field(factory=list, init=False)
    # time.monotonic() at which each request arrived, by request id.
    arrived_at: dict[int, float] = attrs.field(factory=dict, init=False)
    # Authentication: bearer token -> user; these User-Agents are the cluster's controllers.
    tokens: dict[str, kube_auth.User] = attrs.field(factory=dict, init=False)
    controller_agents: set[str] = attrs.field(factory=set, init=False)
    policy: kube_auth.Policy = attrs.field(factory=kube_auth.Policy, init=False)
    # Every 401 and RBAC 403 authorization answered (never an injected fault):
    # (code, method, path, message).
    refusals: list[tuple[int, str, str, str]] = attrs.field(factory=list, init=False)
    # Admission profiles (tests/support/kube_admission.py): "autopilot" plays GKE Autopilot's
    # Warden on every namespace; a namespace's labels here may enforce a Pod Security level.
    admission: str | None = attrs.field(default=None, init=False)
    namespace_labels: dict[str, dict[str, str]] = attrs.field(factory=dict, init=False)
    # Kueue's visibility API: (namespace, LocalQueue) -> its PendingWorkloadsSummary.
    pending_workloads: Any = attrs.field(default=None, init=False)
    # API groups whose served versions are set here (Kueue's CRDs and its aggregated
    # visibility API): discovery lists them, and a request for any other version is 404.
    served_versions: dict[str, tuple[str, ...]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._buses = _Buses(self)
        self._released.set()

    # -- kmock's request matching ----------------------------------------------------

    def __iter__(self) -> Iterator[kmock.Request]:
        # kmock decides which reaction serves a request by asking each reaction's view
        # whether it contains the request, and a view answers by scanning every request
        # the server has had, oldest first, through its filters: the N-th request of a test
        # would cost O(N) for each reaction it does not match. While a request is served
        # (`_handle`), the views see that request alone: it is the one asked about, and no
        # view here counts or slices requests. Elsewhere they see the newest few, newest
        # first; the whole history stays in `requests`.
        serving = _SERVING.get()
        if serving is not None:
            yield serving
            return
        yield from reversed(self._requests[-_MATCHING_WINDOW:])

    @property
    def requests(self) -> list[kmock.Request]:
        """Every request the emulator has had, oldest first."""
        return list(self._requests)

    # -- injected errors ----------------------------------------------------------------

    def fail_next(
        self,
        method: str,
        plural: str,
        code: int,
        reason: str,
        message: str,
        retry_after: int | None = None,
        details: dict[str, Any] | None = None,
        watch: bool | None = None,
    ) -> None:
        """Answer the next `method` request on `plural` with an error, storing nothing.

        Faults queue up: each answers one request, in the order they were added.
        `retry_after` sets the Retry-After header and the Status' `retryAfterSeconds`,
        as the API server's priority and fairness does with a 429. `watch=True` answers
        only a watch (a GET with `watch=true`), `watch=False` only other requests.
        """
        fault = ApiFault(method, plural, code, reason, message, retry_after, details, watch)
        self.faults.append(fault)

    def refuse(
        self,
        code: int,
        reason: str,
        message: str,
        method: str = "*",
        plural: str = "*",
        watch: bool | None = None,
        token: str | None = None,
    ) -> None:
        """Answer every matching request with an error until `stop_refusing()`.

        `token` refuses only requests bearing it (a rotated-away token); `watch` as in
        `fail_next`.
        """
        self.standing_faults.append(
            ApiFault(method, plural, code, reason, message, None, None, watch, token)
        )

    def stop_refusing(self) -> None:
        """Lift every `refuse`; the log of authorization's `refusals` stays."""
        self.standing_faults.clear()

    def _take_fault(self, request: kmock.Request) -> ApiFault | None:
        for index, fault in enumerate(self.faults):
            if fault.matches(request):
                return self.faults.pop(index)
        return next((fault for fault in self.standing_faults if fault.matches(request)), None)

    # -- state changes --------------------------------------------------------------

    def _user(self, request: kmock.Request) -> kube_auth.User | None:
        if request.headers.get("User-Agent") in self.controller_agents:
            return kube_auth.CONTROLLERS
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return kube_auth.authenticate(token, self.tokens, self.policy.account_exists)

    def _attributes(self, request: kmock.Request, user: kube_auth.User) -> kube_auth.Attributes:
        resource = request.resource
        if resource is None or not resource.plural:
            # Discovery (`/apis/GROUP`, `/apis/GROUP/VERSION`) names no resource: kube-apiserver
            # authorizes it as a non-resource URL, with the HTTP method as its verb.
            verb = request.method.value.lower()
            return kube_auth.Attributes(user, verb, request.url.path, resource_request=False)
        verb = kube_auth.request_verb(request.method.value, request.name, dict(request.params))
        return kube_auth.Attributes(
            user,
            verb,
            request.url.path,
            api_group=resource.group or "",
            api_version=resource.version or "",
            resource=resource.plural or "",
            subresource=request.subresource or "",
            namespace=request.namespace or "",
            name=request.name or "",
        )

    def _refusal(self, request: kmock.Request) -> aiohttp.web.Response | None:
        """401, 403 or an admission's 403 for a request kube-apiserver would not serve."""
        status = self._authorization_refusal(request)
        if status is not None:
            path = str(request.url.path_qs)
            self.refusals.append((status["code"], request.method.value, path, status["message"]))
            return _status_response(status)
        resource = request.resource
        if resource is not None and resource.plural == PODS and request.method.value == "POST":
            pod = request.data if isinstance(request.data, dict) else {}
            refused = kube_auth.missing_service_account(pod, request.namespace or "", self.policy)
            if refused is None and self.admission == kube_admission.AUTOPILOT:
                refused = kube_admission.warden_refusal(pod)
            if refused is None:
                labels = self.namespace_labels.get(request.namespace or "", {})
                refused = kube_admission.pod_security_refusal(pod, labels)
            if refused is not None:
                return _status_response(refused)
        return None

    def _authorization_refusal(self, request: kmock.Request) -> dict[str, Any] | None:
        user = self._user(request)
        if user is None:
            return kube_auth.unauthorized()
        attrs = self._attributes(request, user)
        allowed, reason = self.policy.authorize(attrs)
        return None if allowed else kube_auth.denied(attrs, reason)

    def _access_review(self, request: kmock.Request) -> aiohttp.web.Response | None:
        """The answer to a SelfSubjectAccessReview (its creator is authorized already)."""
        resource = request.resource
        if resource is None or resource.plural != "selfsubjectaccessreviews":
            return None
        user = self._user(request)
        assert user is not None
        review = request.data if isinstance(request.data, dict) else {}
        answer = kube_auth.access_review(user, review, self.policy)
        return aiohttp.web.json_response(answer, status=201)

    async def _handle(self, request: kmock.Request) -> Any:
        serving = _SERVING.set(request)
        try:
            return await self._serve(request)
        finally:
            _SERVING.reset(serving)

    async def _serve(self, request: kmock.Request) -> Any:
        self.arrived_at[request.id] = time.monotonic()
        refusal = self._refusal(request)
        if refusal is not None:
            return refusal
        resource = request.resource
        if (
            resource is not None
            and resource.group in self.served_versions
            and isinstance(resource.version, str)
            and resource.version not in self.served_versions[resource.group]
        ):
            # A CRD version with `served: false` "results in a not found error"
            # (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
            # custom-resource-definition-versioning/, "Version removal").
            raise kmock.KubernetesResourceNotFoundError()
        review = self._access_review(request)
        if review is not None:
            return review
        fault = self._take_fault(request)
        if fault is not None:
            return fault.response()
        if request.action == kmock.action.CREATE and request.params.get("dryRun") == "All":
            # Authorized and admitted: the object as it would be stored, storing nothing.
            return aiohttp.web.json_response(request.data, status=201)
        if (
            request.resource is not None
            and request.action == kmock.action.UPDATE
            and "strategic-merge-patch" in request.headers.get("Content-Type", "")
            and isinstance(request.data, dict)
        ):
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                _merge_owner_references(request.data, self.objects[key].raw)
        if request.resource is not None and request.action == kmock.action.CREATE:
            meta = request.data.setdefault("metadata", {})
            if request.namespace:
                meta.setdefault("namespace", request.namespace)
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", now())
        if request.resource is not None and request.action == kmock.action.DELETE:
            policy = request.params.get("propagationPolicy") or (
                (request.data or {}).get("propagationPolicy") if request.data else None
            )
            key = (request.resource, request.namespace, request.name)
            if policy == "Foreground" and key in self.objects and not self.objects[key].deleted:
                # The garbage collector holds a Foreground-deleted owner until its pods are gone.
                async with self._lock:
                    self.objects[key].patch({"metadata": {"finalizers": ["foregroundDeletion"]}})
        if request.resource is not None and request.name is not None:
            key = (request.resource, request.namespace, request.name)
            stored = self.objects[key] if key in self.objects else None  # noqa: SIM401 (no .get)
            if (
                stored is not None
                and not stored.deleted
                and stored.raw["metadata"].get("deletionTimestamp")
            ):
                # kmock removes an object whose last finalizer went after it answered, outside
                # its lock: two writes at once to an object being deleted (the kubelet's
                # finalizer removal and Kueue's admission, say) both remove it, and the second
                # fails with a 500. One at a time, the second finds it gone: a 404, as
                # Kubernetes answers.
                async with self._finalizing:
                    return await super()._handle(request)
        return await super()._handle(request)

    async def _record(self, resource: Any, event: dict[str, Any]) -> None:
        """Give every change a resourceVersion, on the stored object too, and log it."""
        self.version += 1
        obj = event.get("object") or {}
        if event.get("type") == "DELETED":
            obj = copy.deepcopy(obj)
            event = {**event, "object": obj}
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        if resource.plural in kube_auth.POLICY_PLURALS:
            self.policy.record(resource.plural, str(event.get("type")), copy.deepcopy(obj))
        async with self._changed:
            self.events.append((self.version, resource, copy.deepcopy(event)))
            self._changed.notify_all()

    async def event_batches(self) -> AsyncIterator[list[tuple[int, Any, dict[str, Any]]]]:
        """Every event since the start, in batches as they are written (for in-process clients)."""
        position = 0
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda seen=position: len(self.events) > seen)
                batch = self.events[position:]
                position = len(self.events)
            yield batch

    # -- listing and watching --------------------------------------------------------

    def _matches(
        self, request: kmock.Request, resource: Any, namespace: str | None, obj: Any
    ) -> bool:
        if resource != request.resource:
            return False
        if request.namespace is not None and namespace != request.namespace:
            return False
        meta = obj.get("metadata") or {}
        labels = request.params.get("labelSelector")
        fields = request.params.get("fieldSelector")
        if labels and not _selector_matches(labels, meta.get("labels") or {}):
            return False
        return not (fields and not _fields_match(fields, obj))

    def _current(self, request: kmock.Request) -> list[dict[str, Any]]:
        found = []
        for (resource, namespace, _), obj in self.objects.items():
            if obj.deleted:
                continue
            raw = copy.deepcopy(obj.raw)
            if self._matches(request, resource, namespace, raw):
                found.append(raw)
        return found

    async def _serve_list(self, request: kmock.Request) -> Any:
        if request.params.get("watch", "").lower() in {"true", "1"}:
            return self._serve_watch(request)
        async with self._lock:
            items = self._current(request)
            version = self.version
        return {"kind": "List", "metadata": {"resourceVersion": str(version)}, "items": items}

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:  # type: ignore[override]
        yield b""
        cuts = self._cuts
        await self._released.wait()
        since = request.params.get("resourceVersion")
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = asyncio.get_running_loop().time() + timeout
        async with self._lock:
            if since not in {None, "", "0"} and int(since) < self.compacted_version:
                yield {
                    "type": "ERROR",
                    "object": {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": f"too old resource version: {since} ({self.compacted_version})",
                        "reason": "Expired",
                        "code": 410,
                    },
                }
                return
            if since in {None, "", "0"}:
                initial = [{"type": "ADDED", "object": o} for o in self._current(request)]
                position = len(self.events)
            else:
                initial = []
                position = next(
                    (i for i, (v, _, _) in enumerate(self.events) if v > int(since)),
                    len(self.events),
                )
        for event in initial:
            yield event
        while True:
            async with self._changed:
                remaining = deadline - asyncio.get_running_loop().time()
                try:
                    await asyncio.wait_for(
                        self._changed.wait_for(
                            lambda seen=position: len(self.events) > seen or self._cuts != cuts
                        ),
                        max(remaining, 0),
                    )
                except TimeoutError:
                    return
                if self._cuts != cuts:
                    return
                batch = self.events[position:]
                position = len(self.events)
            for _, resource, event in batch:
                obj = event.get("object") or {}
                namespace = (obj.get("metadata") or {}).get("namespace")
                if self._matches(request, resource, namespace, obj):
                    yield event

    async def cut_watches(self, hold: bool = False) -> None:
        """End every open watch stream; with `hold`, new watches wait for `release_watches()`."""
        if hold:
            self._released.clear()
        async with self._changed:
            self._cuts += 1
            self._changed.notify_all()

    def release_watches(self) -> None:
        self._released.set()

    def compact(self) -> None:
        """Forget history: a watch resuming from an older resourceVersion gets 410 Gone."""
        self.compacted_version = self.version

    # -- discovery of the groups with set versions ------------------------------------

    async def _serve_group(self, request: kmock.Request) -> Any:
        group = request.resource.group if request.resource is not None else None
        if group not in self.served_versions:
            return await super()._serve_group(request)
        # Served versions in Kubernetes' version priority, the first one preferred
        # (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
        # custom-resource-definition-versioning/, "Version priority").
        versions = sorted(self.served_versions[group], key=version_priority)
        listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {
            "apiVersion": "v1",
            "kind": "APIGroup",
            "name": group,
            "versions": listed,
            "preferredVersion": listed[0],
        }

    # -- pod logs ---------------------------------------------------------------------

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        # Served from kmock's own fallback for reads rather than a reaction of its own: kmock
        # matches every request against every reaction by scanning all earlier requests,
        # so each reaction adds work that grows with the test's request count.
        if request.subresource == "log":
            return await self._serve_log(request)
        resource = request.resource
        if (
            request.subresource == "pendingworkloads"
            and resource is not None
            and resource.group == "visibility.kueue.x-k8s.io"
            and self.pending_workloads is not None
        ):
            return self.pending_workloads(request.namespace, request.name)
        return await super()._serve_fetch(request)

    async def _serve_log(self, request: kmock.Request) -> Any:
        match = _LOG_PATH.fullmatch(request.url.path)
        assert match is not None
        key = (match.group(1), match.group(2))
        path = self.log_files.get(key)
        if path is None:
            raise kmock.KubernetesObjectNotFoundError()
        if request.params.get("follow", "").lower() in {"true", "1"}:
            return self._follow_log(key, path)
        lines = path.read_bytes().splitlines(keepends=True) if path.exists() else []
        tail = request.params.get("tailLines")
        return b"".join(lines[-int(tail) :] if tail else lines)

    async def _follow_log(self, key: tuple[str, str], path: Path) -> AsyncIterator[bytes]:
        yield b""
        offset = 0
        while True:
            finished = key in self.finished_logs
            data = path.read_bytes()[offset:] if path.exists() else b""
            if data:
                offset += len(data)
                yield data
            elif finished:
                return
            else:
                await asyncio.sleep(0.05)

    # -- reading objects (on the emulator's loop) ----------------------------------------

    def live(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj.raw)
            for (resource, ns, _), obj in self.objects.items()
            if resource.plural == plural and not obj.deleted and namespace in {None, ns}
        ]

    def find(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        for (resource, ns, object_name), obj in self.objects.items():
            if (resource.plural, ns, object_name) == (plural, namespace, name) and not obj.deleted:
                return copy.deepcopy(obj.raw)
        return None
