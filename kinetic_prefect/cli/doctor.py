"""`kinetic-prefect doctor`: every check a first run on a cluster depends on, each with its fix.

The launch-time checks (`kinetic_prefect.launch.preflight`) run again here, with
the cluster's own: access to its Jobs, and node pools for the accelerator.

GCS answers `testIamPermissions` only for the caller, so what the task pods may
do on the buckets is asked from a pod: a short Job (`cpu`, the cluster's image,
the task pods' service account, `backoffLimit: 0`, a TTL, the label
`kinetic-prefect.io/doctor`) runs the stdlib-only bootstrap's `test-iam`
(`kinetic_prefect.pod.bootstrap`) and prints the answer in its log.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from kinetic_prefect.common.gcs import (
    ENVIRONMENT_STORE_READ_PERMISSIONS,
    JOBS_BUCKET_PERMISSIONS,
    RESULTS_BUCKET_READ_PERMISSIONS,
    RESULTS_BUCKET_WRITE_PERMISSIONS,
    grant_hint,
    split_gs_uri,
    viewer_enough,
)
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.preflight import (
    check_api_reachable_by_pods,
    check_bucket_permissions,
    check_jobs_root,
    check_result_storage,
)


@dataclass(frozen=True)
class Check:
    """One line of `kinetic-prefect doctor`: `level` is ok, warn or fail."""

    name: str
    level: str
    detail: str


def _api_check(settings: Any) -> Check:
    from prefect import get_client

    try:
        url = (
            check_api_reachable_by_pods(settings)
            if settings.backend == "gke"
            else get_current_api_url()
        )
    except ConfigurationError as exc:
        return Check("Prefect API", "fail", str(exc))
    if not url:
        return Check("Prefect API", "ok", "no PREFECT_API_URL: local runs use an ephemeral API")
    with get_client(sync_client=True) as client:
        error = client.api_healthcheck()
    if error is not None:
        return Check("Prefect API", "fail", f"{url} does not answer from here: {error}")
    where = "pods will report to it" if settings.backend == "gke" else "reachable"
    return Check("Prefect API", "ok", f"{url} answers; {where}")


def get_current_api_url() -> str | None:
    from prefect.settings import get_current_settings

    return get_current_settings().api.url


def _bucket_checks(cluster: Any, settings: Any) -> list[Check]:
    checks: list[Check] = []
    try:
        jobs_root = settings.resolved_jobs_root()
        if "://" in jobs_root:
            check_jobs_root(jobs_root, cluster)
        checks.append(Check("Jobs bucket", "ok", f"{jobs_root} is reachable"))
    except ConfigurationError as exc:
        checks.append(Check("Jobs bucket", "fail", str(exc)))
    if settings.backend == "gke":
        storage: Any = getattr(cluster, "result_storage", None) if cluster is not None else None
        try:
            check_result_storage(storage)  # a saved GcsBucket, or ConfigurationError
            check_bucket_permissions(
                storage.bucket,
                RESULTS_BUCKET_READ_PERMISSIONS,
                "results bucket",
                "set bucket on the result storage's GcsBucket block",
                cluster,
            )
            checks.append(
                Check(
                    "Result storage",
                    "ok",
                    f"GcsBucket {storage.bucket}: you may read results "
                    f"({', '.join(RESULTS_BUCKET_READ_PERMISSIONS)})",
                )
            )
        except ConfigurationError as exc:
            checks.append(Check("Result storage", "fail", str(exc)))
    return checks


async def _cluster_checks(cluster: Any, settings: Any, accelerator: str | None) -> list[Check]:
    from kubernetes_asyncio import client

    from kinetic_prefect.backends.gke.client import (
        MANAGED_SELECTOR,
        api_error_message,
        connect,
        list_nodes,
        read_json,
    )

    try:
        access = await connect(cluster, settings.kube_context)
    except ConfigurationError as exc:
        return [Check("Cluster access", "fail", str(exc))]
    checks: list[Check] = []
    try:
        try:
            await read_json(
                await client.BatchV1Api(access.client).list_namespaced_job(
                    settings.namespace,
                    label_selector=MANAGED_SELECTOR,
                    limit=1,
                    _preload_content=False,
                )
            )
        except Exception as exc:
            checks.append(
                Check(
                    "Cluster access",
                    "fail",
                    f"{access.source} ({access.server}) cannot list Jobs in namespace "
                    f"{settings.namespace}: {api_error_message(exc)}",
                )
            )
            if getattr(exc, "status", None) not in {401, 403}:
                return checks  # no answer to go on with
        else:
            checks.append(
                Check(
                    "Cluster access",
                    "ok",
                    f"{access.source} ({access.server}), namespace {settings.namespace}",
                )
            )
        checks.append(await _rbac_check(access, settings))
        checks += await _service_account_checks(access, settings)
        if accelerator:
            checks.append(await _node_pool_check(access, settings, accelerator, list_nodes))
    finally:
        await access.close()
    return checks


async def _rbac_check(access: Any, settings: Any) -> Check:
    """A SelfSubjectAccessReview for every verb the runner uses with `settings`."""
    from kubernetes_asyncio import client

    from kinetic_prefect.backends.gke.client import api_error_message, read_json
    from kinetic_prefect.backends.gke.permissions import (
        RBAC_FILE,
        USER_BINDING_FILE,
        access_review,
        needed_access,
    )

    namespace = settings.namespace
    needed = needed_access(settings)
    api = client.AuthorizationV1Api(access.client)
    denied = []
    for wanted in needed:
        body: Any = access_review(namespace, wanted)  # a plain dict, as the API takes it
        try:
            review = await read_json(
                await api.create_self_subject_access_review(body, _preload_content=False)
            )
        except Exception as exc:
            return Check(
                "RBAC",
                "warn",
                f"cannot ask the API server what these credentials may do "
                f"({api_error_message(exc)}); check with kubectl auth can-i --list -n {namespace}",
            )
        if not (review.get("status") or {}).get("allowed"):
            denied.append(wanted)
    if denied:
        missing = "; ".join(f"{a.verb} {a.resource_name} ({a.why})" for a in denied)
        return Check(
            "RBAC",
            "fail",
            f"{access.source} may not, in namespace {namespace}: {missing}. Apply the Role "
            f"(kubectl apply -n {namespace} -f {RBAC_FILE}) and bind it to these credentials: "
            f"sed s/USER/YOUR_ACCOUNT/ {USER_BINDING_FILE} | kubectl apply -n {namespace} -f -",
        )
    return Check("RBAC", "ok", f"every verb the runner uses is granted ({len(needed)})")


async def _service_account_checks(access: Any, settings: Any) -> list[Check]:
    """The task pods' service account exists (and has a Google identity); so does the runner's."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    from kinetic_prefect.backends.gke.client import api_error_message, read_json
    from kinetic_prefect.backends.gke.permissions import (
        PODS_SERVICE_ACCOUNT,
        RBAC_FILE,
        RUNNER_SERVICE_ACCOUNT,
        WORKLOAD_IDENTITY_ANNOTATION,
    )

    core = client.CoreV1Api(access.client)
    namespace = settings.namespace
    apply = f"kubectl apply -n {namespace} -f {RBAC_FILE}"
    checks = []
    accounts = [(RUNNER_SERVICE_ACCOUNT, "deployed flows' pods (KineticWorker)")]
    if settings.service_account:
        accounts.insert(0, (settings.service_account, "task pods"))
    else:
        checks.append(
            Check(
                "Service account",
                "warn",
                f"task pods run as namespace {namespace}'s default service account; give them "
                f"their own: service_account='{PODS_SERVICE_ACCOUNT}' on the KineticCluster "
                f"(blocks/save_gke.py's default), created by {RBAC_FILE}",
            )
        )
    for account, role in accounts:
        name = f"Service account {account}"
        try:
            found = await read_json(
                await core.read_namespaced_service_account(
                    account, namespace, _preload_content=False
                )
            )
        except ApiException as exc:
            if exc.status == 404:
                level = "fail" if role == "task pods" else "warn"
                fix = (
                    f"{apply}, or set service_account= on the KineticCluster to an existing one"
                    if role == "task pods"
                    else apply
                )
                checks.append(Check(name, level, f"not found in {namespace}: {fix}"))
            else:
                checks.append(
                    Check(name, "warn", f"cannot read it ({api_error_message(exc)}); {apply}")
                )
            continue
        annotations = (found.get("metadata") or {}).get("annotations") or {}
        google = annotations.get(WORKLOAD_IDENTITY_ANNOTATION)
        if google:
            checks.append(Check(name, "ok", f"{role} act as {google} (Workload Identity)"))
        else:
            checks.append(
                Check(
                    name,
                    "warn",
                    f"{role} run as it but it has no {WORKLOAD_IDENTITY_ANNOTATION} annotation, so "
                    "they reach GCS only if its own Workload Identity principal is granted the "
                    f"bucket roles (docs/kubernetes.md); annotate it as {RBAC_FILE} shows",
                )
            )
    return checks


async def _node_pool_check(access: Any, settings: Any, name: str, list_nodes: Any) -> Check:
    """The nodes that match the task pod's node selector, and whether they can hold it.

    The pod is the one a runner with `settings` would launch for accelerator `name`; it fits
    a node as kube-scheduler's NodeResourcesFit decides (`kinetic_prefect.cli.node_fit`).
    """
    from kinetic_prefect.backends.gke.status import nodes_down
    from kinetic_prefect.cli.node_fit import node_fit
    from kinetic_prefect.launch.accelerators import parse_accelerator
    from kinetic_prefect.launch.slices import build_workload, hosts_of

    try:
        accelerator = parse_accelerator(name)
        job = build_workload(
            _doctor_spec(
                settings,
                accelerator,
                f"kinetic-prefect doctor: a task pod on {name}",
                cpu=settings.cpu,
                memory=settings.memory,
                queued_provisioning=settings.queued_provisioning,
            )
        ).job
    except (ConfigurationError, ValueError) as exc:
        return Check("Node pools", "fail", str(exc))
    pod_spec = job["spec"]["template"]["spec"]
    try:
        nodes = await list_nodes(access)
    except Exception as exc:
        return Check(
            "Node pools",
            "warn",
            f"cannot list nodes ({getattr(exc, 'status', exc)}); grant it with the ClusterRole "
            "in deployments/k8s/rbac.yaml, or check with gcloud container node-pools list",
        )
    selector = pod_spec.get("nodeSelector") or {}
    wanted = ", ".join(f"{k}={v}" for k, v in selector.items()) or "no node selector"
    matching = [
        node
        for node in nodes
        if all(
            ((node.get("metadata") or {}).get("labels") or {}).get(k) == v
            for k, v in selector.items()
        )
    ]
    if not matching:
        return Check(
            "Node pools",
            "warn",
            f"no node has {wanted} now; a node pool that scales from zero shows no node until a "
            "pod asks for one (gcloud container node-pools list --cluster CLUSTER)",
        )
    offered = []
    for resource, amount in accelerator.resource_limits.items():
        free = [
            ((n.get("status") or {}).get("allocatable") or {}).get(resource, "0") for n in matching
        ]
        enough = sum(1 for f in free if int(str(f)) >= int(amount))
        offered.append(f"{enough} with {resource} >= {amount}")
    detail = f"{accelerator.name}: {len(matching)} node(s) with {wanted}" + (
        f" ({', '.join(offered)})" if offered else ""
    )
    down = nodes_down(matching)
    if down:
        named = "; ".join(f"{node}: {why}" for node, why in sorted(down.items())[:4])
        detail += f"; {len(down)} not ready or cordoned, which take no pod now ({named})"
        matching = [n for n in matching if (n.get("metadata") or {}).get("name") not in down]
        if not matching:
            return Check(
                "Node pools",
                "warn",
                f"{detail}. GKE may be repairing or recreating them; run doctor again once "
                "they are Ready (kubectl get nodes)",
            )
    hosts = hosts_of(job)
    unlisted = await _may_list_pods(access)
    fits = []
    for node in matching:
        pods: list[dict[str, Any]] = []
        if unlisted is None:
            try:
                pods = await _pods_on(access, (node.get("metadata") or {}).get("name", ""))
            except Exception as exc:
                unlisted = _api_error(exc)
        fits.append(node_fit(pod_spec, node, pods))
        if unlisted is None and len(_able(fits, hosts)) >= hosts:
            break  # enough nodes hold it now: the rest need not be asked about
    level, verdict = _fit_verdict(fits, hosts)
    if down and level == "fail":
        level = "warn"
        verdict += (
            "; nodes of its kind are down meanwhile, so this may change once they are back: "
            "run doctor again once they are Ready (kubectl get nodes)"
        )
    if unlisted is not None:
        verdict += (
            f" (the pods already on the nodes were not counted: {unlisted}. Their requests, "
            "GKE's system DaemonSets' among them, are left out, so this compares with "
            "allocatable alone: let these credentials list pods in all namespaces, e.g. "
            "roles/container.viewer on GKE, for the whole answer)"
        )
        level = "warn" if level == "ok" else level
    return Check("Node pools", level, f"{detail}; {verdict}")


def _able(fits: list[Any], hosts: int, ours_gone: bool = False) -> list[Any]:
    """The nodes that can take one pod each: for a multi-host slice, the most in one pool."""
    from kinetic_prefect.launch.slices import NODE_POOL_LABEL

    able = [fit for fit in fits if not fit.short(ours_gone)]
    if hosts <= 1:
        return able
    pools: dict[str | None, list[Any]] = {}
    for fit in able:
        pools.setdefault(fit.labels.get(NODE_POOL_LABEL), []).append(fit)
    return max(pools.values(), key=len, default=[])


def _fit_verdict(fits: list[Any], hosts: int) -> tuple[str, str]:
    """ok and how many nodes hold the pod, or fail naming the closest node and the fix."""
    from kinetic_prefect.cli.node_fit import listed

    asked = listed(fits[0].asked)
    pod = f"each of its {hosts} pods (one per host, in one node pool)" if hosts > 1 else "its pod"
    now, later = _able(fits, hosts), _able(fits, hosts, ours_gone=True)
    if len(now) >= hosts:
        return "ok", f"{pod} ({asked}) fits {_named(now)} now"
    if len(later) >= hosts:
        return "ok", (
            f"{pod} ({asked}) fits {_named(later)} once kinetic-prefect's own pods there end; "
            "until then it waits for them"
        )
    closest = min(fits, key=lambda fit: len(fit.short(ours_gone=True)))
    fixes = "; ".join(_fixes(closest))
    if not closest.short(ours_gone=True):
        return "fail", (
            f"{pod} ({asked}) fits {len(later)} node(s) of one node pool, not {hosts}: give the "
            f"slice's node pool {hosts} nodes (gcloud container node-pools describe)"
        )
    return "fail", (
        f"none can hold {pod}, which asks {asked}: {closest.describe()}. {fixes[:1].upper()}"
        f"{fixes[1:]}"
    )


def _named(fits: list[Any]) -> str:
    names = ", ".join(fit.node for fit in fits[:3])
    more = f" and {len(fits) - 3} more" if len(fits) > 3 else ""
    return f"node{'s' if len(fits) > 1 else ''} {names}{more}"


def _fixes(fit: Any) -> list[str]:
    """What to change for each resource `fit`'s node is short of."""
    from kinetic_prefect.cli.node_fit import CPU, MEMORY, PODS, show

    fixes = []
    for resource in fit.short(ours_gone=True):
        left = fit.free(resource, ours_gone=True)
        if resource in (CPU, MEMORY):
            smaller = (
                f"set a smaller {resource}= (at most {show(resource, left)}) on the runner, in "
                f"resources(...), on the KineticCluster or as KINETIC_{resource.upper()}, or "
                if left > 0
                else ""
            )
            fixes.append(f"{smaller}give the node pool a bigger machine type")
        elif resource == PODS:
            fixes.append("the node holds as many pods as it may: add nodes to the node pool")
        else:
            fixes.append(
                f"the node offers {show(resource, fit.allocatable.get(resource, 0))} {resource}: "
                "choose an accelerator that asks at most that per host, or a node pool whose "
                "machine has more"
            )
    return fixes


async def _may_list_pods(access: Any) -> str | None:
    """None if these credentials may list pods in all namespaces, else why not."""
    from kubernetes_asyncio import client

    from kinetic_prefect.backends.gke.client import read_json
    from kinetic_prefect.backends.gke.permissions import Access, access_review

    wanted = Access("", "pods", "list", "doctor: what the pods on each node request")
    body: Any = access_review("", wanted)  # "": every namespace
    try:
        review = await read_json(
            await client.AuthorizationV1Api(access.client).create_self_subject_access_review(
                body, _preload_content=False
            )
        )
    except Exception:
        return None  # no answer: the listing itself will tell
    if (review.get("status") or {}).get("allowed"):
        return None
    return f"{access.source} may not list pods in all namespaces"


async def _pods_on(access: Any, node: str) -> list[dict[str, Any]]:
    """The pods bound to `node`, in every namespace."""
    from kubernetes_asyncio import client

    from kinetic_prefect.backends.gke.client import read_json

    listing = await read_json(
        await client.CoreV1Api(access.client).list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={node}", _preload_content=False
        )
    )
    return list(listing.get("items") or [])


def _api_error(exc: BaseException) -> str:
    from kinetic_prefect.backends.gke.client import api_error_message

    return f"listing them was refused ({api_error_message(exc)})"


def _doctor_spec(settings: Any, accelerator: Any, task_name: str, **fields: Any) -> Any:
    """A LaunchSpec for one of the doctor's pods, from `settings` as the runner makes one."""
    from kinetic_prefect.launch.manifest import LaunchSpec, new_job_id

    return LaunchSpec(
        job_id=new_job_id("doctor"),
        task_name=task_name,
        task_run_id=None,
        flow_run_id=None,
        accelerator=accelerator,
        image=settings.resolved_image(),
        namespace=settings.namespace,
        output_dir="",
        intervals=settings.intervals,
        service_account=settings.service_account,
        pod_overrides=settings.pod_overrides,
        **fields,
    )


LABEL_DOCTOR = "kinetic-prefect.io/doctor"
POD_CHECK = "Task pods' bucket access"


def pods_wanted_permissions(cluster: Any, settings: Any) -> dict[str, list[str]]:
    """What the task pods need on each bucket: bucket -> permissions."""
    wanted: dict[str, set[str]] = {}
    jobs_bucket, _ = split_gs_uri(settings.resolved_jobs_root())
    wanted.setdefault(jobs_bucket, set()).update(JOBS_BUCKET_PERMISSIONS)
    storage: Any = getattr(cluster, "result_storage", None)
    if isinstance(getattr(storage, "bucket", None), str):
        wanted.setdefault(storage.bucket, set()).update(RESULTS_BUCKET_WRITE_PERMISSIONS)
    store = settings.resolved_environment_store()
    if settings.ships_environment() and store.startswith("gs://"):
        # Pods only read their environment; builder Jobs (another account) write it.
        wanted.setdefault(split_gs_uri(store)[0], set()).update(ENVIRONMENT_STORE_READ_PERMISSIONS)
    return {bucket: sorted(permissions) for bucket, permissions in wanted.items()}


def pods_bucket_check(cluster: Any, settings: Any) -> Check:
    """Run the doctor's pod as the task pods' account; what it lacks, each with its grant."""
    from kinetic_prefect.backends import create_backend
    from kinetic_prefect.backends.base import run_to_end
    from kinetic_prefect.launch.accelerators import parse_accelerator
    from kinetic_prefect.launch.environment import test_iam_command
    from kinetic_prefect.launch.manifest import build_job_manifest
    from kinetic_prefect.launch.pod_secrets import split_env
    from kinetic_prefect.pod.bootstrap import IAM_ANSWER_PREFIX

    try:
        wanted = pods_wanted_permissions(cluster, settings)
    except (ConfigurationError, ValueError) as exc:
        return Check(POD_CHECK, "warn", f"not run: no jobs bucket to ask about ({exc})")
    account = settings.service_account or "default"
    # The doctor's pod: how long it may take, pending included, and how long it is kept.
    timeout = settings.intervals.doctor_pod_timeout_seconds
    try:
        backend = create_backend(
            dataclasses.replace(settings, pending_timeout_seconds=timeout),
            settings.resolved_jobs_root(),
            cluster,
        )
    except ConfigurationError as exc:
        return Check(POD_CHECK, "fail", f"cannot start the doctor's pod: {exc}")
    plain_env, _ = split_env(settings.env)
    spec = _doctor_spec(
        settings,
        parse_accelerator("cpu"),
        "kinetic-prefect doctor: task pods' bucket access",
        env=plain_env,
        timeout_seconds=math.ceil(timeout),
        ttl_seconds_after_finished=math.ceil(settings.intervals.doctor_pod_ttl_seconds),
        command=tuple(test_iam_command(wanted)),
        extra_labels={LABEL_DOCTOR: "bucket-access"},
    )
    pod = f"the doctor's pod {spec.job_id} (service account {account}, image {spec.image})"
    skip = "; or skip this check with --no-pod-check"
    try:
        outcome = run_to_end(
            backend,
            build_job_manifest(spec),
            timeout + settings.cancel_grace_seconds,
        )
        if outcome is None:
            return Check(POD_CHECK, "fail", f"{pod} did not end in {timeout:g}s{skip}")
        log = backend.logs(spec.job_id)
    except Exception as exc:
        return Check(POD_CHECK, "fail", f"{pod} could not run: {exc}{skip}")
    finally:
        backend.close()
    answers = [
        line.partition(IAM_ANSWER_PREFIX)[2]
        for line in log.splitlines()
        if IAM_ANSWER_PREFIX in line
    ]
    if not answers:
        tail = f"; its log ends: {log.strip()[-500:]}" if log.strip() else ""
        return Check(POD_CHECK, "fail", f"{pod}: {outcome.describe()}{tail}{skip}")
    return _pods_bucket_verdict(account, wanted, json.loads(answers[-1]))


def _pods_bucket_verdict(account: str, wanted: dict[str, list[str]], answer: Any) -> Check:
    email = answer.get("account")
    who = f"task pods ({account}" + (f", acting as {email})" if email else ")")
    member = f"serviceAccount:{email}" if email else None
    problems = []
    for bucket, permissions in wanted.items():
        granted = answer["buckets"].get(bucket)
        if isinstance(granted, dict):
            problems.append(f"cannot ask GCS about gs://{bucket}: {granted.get('error')}")
            continue
        missing = [p for p in permissions if p not in set(granted or [])]
        if missing:
            problems.append(
                f"lack {', '.join(missing)} on gs://{bucket}. "
                # Where the pods only read (the environment store), the docs grant a viewer.
                + grant_hint(bucket, missing, member, read_only=viewer_enough(permissions))
            )
    if problems:
        return Check(POD_CHECK, "fail", f"{who}: " + " ".join(problems))
    buckets = ", ".join(f"gs://{b}" for b in wanted)
    return Check(POD_CHECK, "ok", f"{who} hold what they need on {buckets}")


def doctor_checks(
    cluster: Any, settings: Any, accelerator: str | None = None, pod_check: bool = True
) -> list[Check]:
    """Every check `kinetic-prefect doctor` prints, in order.

    `pod_check`: run the doctor's pod to ask what the task pods may do on the buckets.
    """
    from kinetic_prefect.backends.gke.client import run_sync

    checks = [_api_check(settings), *_bucket_checks(cluster, settings)]
    wanted = accelerator or (settings.accelerator if settings.accelerator != "cpu" else None)
    if settings.backend == "gke" or accelerator:
        checks += run_sync(_cluster_checks(cluster, settings, wanted))
    if settings.backend == "gke" and pod_check:
        if any(c.name == "Cluster access" and c.level == "fail" for c in checks):
            checks.append(Check(POD_CHECK, "warn", "not run: no access to the cluster"))
        else:
            checks.append(pods_bucket_check(cluster, settings))
    return checks
