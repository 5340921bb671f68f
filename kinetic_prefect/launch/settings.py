"""Settings resolution: the one place where a launch's settings are decided.

Precedence, highest first: a per-submission `resources(...)` override, the
`KineticTaskRunner(...)` arguments, the `KineticCluster` block, `KINETIC_*`
environment variables, then built-in defaults.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kinetic_prefect.common.intervals import Intervals, parse_intervals_env
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.accelerators import parse_quantity
from kinetic_prefect.launch.pod_overrides import check_pod_overrides
from kinetic_prefect.launch.pod_secrets import SecretValue, env_value

BACKENDS = ("local", "gke")
ENVIRONMENTS = ("auto", "ship", "image")
ENVIRONMENT_BUILDERS = ("cluster", "local")
# A stock image: with `environment="ship"` the task's environment is unpacked into it.
DEFAULT_IMAGE = f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"


@dataclass(frozen=True)
class LaunchSettings:
    """Everything a launch needs to know about where and how a pod runs."""

    accelerator: str = "cpu"
    # True, False, None (the accelerator's `:spot` suffix decides) or "fallback":
    # spot for every attempt but the last, which runs on-demand.
    spot: bool | str | None = None
    # Relaunches after a preemption, eviction or node loss; they do not use `retries`.
    preemption_retries: int = 3
    # A pod whose runner stopped renewing its lease this long ago ends itself.
    orphan_timeout_seconds: float = 300.0
    backend: str = "local"
    max_parallel: int | None = None
    container_image: str | None = None
    output_dir: str | None = None
    output_root: str | None = None
    jobs_root: str | None = None
    # Plain values, or `SecretValue`s (Prefect Secret blocks) delivered as Secret refs.
    env: Mapping[str, str | SecretValue] = field(default_factory=dict)
    timeout_seconds: int | None = None
    namespace: str = "default"
    service_account: str | None = None
    ttl_seconds_after_finished: int = 3600
    cancel_grace_seconds: float = 10.0
    # A pod that can never be scheduled (or cannot pull its image) fails after this long;
    # time spent waiting for capacity that exists does not count (docs/kubernetes.md).
    pending_timeout_seconds: float = 600.0
    # How long a pod may wait for capacity (busy nodes, a node being added); None: forever.
    queue_timeout_seconds: float | None = None
    # gke: the Kueue LocalQueue of the namespace that admits the Jobs (docs/kueue.md); they
    # are created suspended and wait in it, and the pending timeout counts from admission.
    queue_name: str | None = None
    # gke: the queue's ClusterQueue provisions nodes through DWS flex-start with queued
    # provisioning (docs/kueue.md): pods tolerate the taint GKE puts on those nodes.
    queued_provisioning: bool = False
    # gke: labels and annotations added to each Job's metadata, for what Kueue and GKE
    # read there (a Kueue priority class label, `provreq.kueue.x-k8s.io/*` annotations).
    job_labels: Mapping[str, str] = field(default_factory=dict)
    job_annotations: Mapping[str, str] = field(default_factory=dict)
    # gke: how long the cluster may refuse the credentials to watch a job's pod (401/403,
    # re-read meanwhile) before the job fails (docs/kubernetes.md).
    credentials_denied_timeout_seconds: float = 120.0
    # Pods on the gke backend reach the Prefect API by its URL; a loopback URL only works
    # where pods share the host's network (kind/minikube with hostNetwork, tests).
    allow_loopback_api: bool = False
    # The kubeconfig context for the gke backend when no kube_config block is given.
    kube_context: str | None = None
    # A pod stays after its task and takes the next task run of the same pod spec
    # (docs/warm-pods.md); an idle one ends after `warm_pod_idle_seconds`.
    warm_pods: bool = False
    warm_pod_idle_seconds: float = 60.0
    # The task's Python environment (docs/environments.md): "ship" travels with the task,
    # "image" is all in the image, "auto" ships on gke and runs this interpreter on local.
    environment: str = "auto"
    # Requirement strings, or a requirements file's path; detected from the project if None.
    requirements: tuple[str, ...] | str | None = None
    # Where a new environment is built: a builder Job on the cluster, or this machine.
    environment_builder: str = "cluster"
    # gke: the account a builder Job runs as. It writes the environment store, which the
    # task pods' account (`service_account`) only reads: the account of flow pods by default
    # (deployments/k8s/rbac.yaml), which ships environments for its tasks anyway.
    builder_service_account: str = "kinetic-prefect-runner"
    # The package index the environment is resolved and installed from (a mirror).
    package_index_url: str | None = None
    # What the accelerator adds (default: jax's TPU or CUDA parts); [] adds nothing.
    accelerator_extras: tuple[str, ...] | None = None
    # Where shipped environments are kept (`env-cache/` below it): the jobs store unless set,
    # e.g. one bucket for every team's jobs buckets.
    environment_store: str | None = None
    # The pod's cpu and memory requests (Kubernetes quantities: "8", "500m", "64Gi");
    # None: the accelerator's default, most of its machine (docs/kubernetes.md).
    cpu: str | None = None
    memory: str | None = None
    # Merged into the pod spec: tolerations, priorityClassName, volumes, ...
    # (`kinetic_prefect.launch.pod_overrides`). Layers combine key by key.
    pod_overrides: Mapping[str, Any] = field(default_factory=dict)
    # Whom this process acts as on GCS (the jobs store, result reads): a prefect-gcp
    # `GcpCredentials` block; None: Application Default Credentials. Never sent to pods.
    gcp_credentials: Any = None
    # The code archive's bounds (`kinetic_prefect.launch.packaging`): its files' total size
    # before compression, in MB, and their number. Past either, a launch is refused before
    # anything is read or uploaded, naming the largest files and directories.
    code_archive_max_mb: float = 200.0
    code_archive_max_files: int = 20_000
    # The most the node's cache of unpacked shipped environments may hold, in GB (10^9
    # bytes): a pod that unpacks a new one removes the least recently used environments no
    # running pod uses until the cache fits (docs/environments.md "The node cache").
    node_cache_max_gb: float = 20.0
    # Every interval the runner, its backend and its pods wait on (docs/intervals.md); pods
    # get the changed ones through their manifest.
    intervals: Intervals = field(default_factory=Intervals)

    def resolved_jobs_root(self) -> str:
        """Where `kinetic/{job_id}/…` artifacts live: a `gs://bucket[/prefix]` or a local dir."""
        if self.jobs_root:
            return self.jobs_root
        if self.backend == "local":
            return str(Path.cwd() / ".kinetic")
        raise ConfigurationError(
            "The gke backend needs a jobs bucket: set `jobs_bucket` on the KineticCluster "
            "block or KINETIC_JOBS_BUCKET=gs://your-bucket."
        )

    def resolved_image(self) -> str:
        """The pod container image; the local backend runs this interpreter whatever it is."""
        return self.container_image or DEFAULT_IMAGE

    def resolved_environment_store(self) -> str:
        """The store root of shipped environments: `environment_store`, else the jobs store."""
        return (self.environment_store or self.resolved_jobs_root()).rstrip("/")

    def ships_environment(self) -> bool:
        """Whether the task's environment travels with it ("auto": on gke, not on local)."""
        if self.environment == "auto":
            return self.backend == "gke"
        return self.environment == "ship"

    def resolved_output_root(self) -> str:
        """The root under which each task gets `{flow_run_id}/{task_key}`."""
        if self.output_root:
            return self.output_root.rstrip("/")
        return join_uri(self.resolved_jobs_root(), "outputs")


SETTING_NAMES = tuple(f.name for f in dataclasses.fields(LaunchSettings))

# KINETIC_* variables and how to read them; names follow the setting names.
_ENV_PARSERS: dict[str, Any] = {
    "accelerator": str,
    "spot": lambda v: (
        "fallback" if v.strip().lower() == "fallback" else _parse_bool("KINETIC_SPOT", v)
    ),
    "preemption_retries": int,
    "orphan_timeout_seconds": float,
    "backend": str,
    "max_parallel": int,
    "container_image": str,
    "output_root": str,
    "jobs_root": str,
    "timeout_seconds": int,
    "namespace": str,
    "service_account": str,
    "ttl_seconds_after_finished": int,
    "cancel_grace_seconds": float,
    "pending_timeout_seconds": float,
    "queue_timeout_seconds": float,
    "queue_name": str,
    "queued_provisioning": lambda v: _parse_bool("KINETIC_QUEUED_PROVISIONING", v),
    # JSON objects of strings.
    "job_labels": json.loads,
    "job_annotations": json.loads,
    "credentials_denied_timeout_seconds": float,
    "allow_loopback_api": lambda v: _parse_bool("KINETIC_ALLOW_LOOPBACK_API", v),
    "kube_context": str,
    "warm_pods": lambda v: _parse_bool("KINETIC_WARM_PODS", v),
    "warm_pod_idle_seconds": float,
    "environment": str,
    # A requirements file's path.
    "requirements": str,
    "environment_builder": str,
    "builder_service_account": str,
    "package_index_url": str,
    "environment_store": str,
    "accelerator_extras": lambda v: tuple(p.strip() for p in v.split(",") if p.strip()),
    "cpu": str,
    "memory": str,
    # A JSON object.
    "pod_overrides": json.loads,
    "code_archive_max_mb": float,
    "code_archive_max_files": int,
    "node_cache_max_gb": float,
    # A JSON object of the intervals to change (`kinetic_prefect.common.intervals`).
    "intervals": parse_intervals_env,
}
# The saved `KineticCluster` a runner without `cluster=` uses (`KINETIC_CLUSTER=gke`).
CLUSTER_ENV = "KINETIC_CLUSTER"
# The saved result storage (its block document id) of a runner without a cluster: a
# `kinetic` worker hands its cluster's down to the flow pod with the cluster's settings.
RESULT_STORAGE_ENV = "KINETIC_RESULT_STORAGE"


def saved_block_reference(block: Any) -> str | None:
    """The block document id of a saved block (`Block.load_from_ref` takes it), else None."""
    document_id = getattr(block, "_block_document_id", None)
    return str(document_id) if document_id else None


ENV_ALIASES = {"jobs_root": ("KINETIC_JOBS_ROOT", "KINETIC_JOBS_BUCKET")}


def _parse_bool(name: str, value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigurationError(f"{name}={value!r} is not a boolean; use true or false.")


def env_variable_names(setting: str) -> tuple[str, ...]:
    """The `KINETIC_*` variables that set `setting`, in order of precedence."""
    return ENV_ALIASES.get(setting, (f"KINETIC_{setting.upper()}",))


def settings_from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """Read the `KINETIC_*` variables that are set into setting values."""
    found: dict[str, Any] = {}
    for setting, parse in _ENV_PARSERS.items():
        for name in env_variable_names(setting):
            if name in environ and environ[name] != "":
                try:
                    found[setting] = parse(environ[name])
                except ValueError as exc:
                    raise ConfigurationError(f"{name}={environ[name]!r} is invalid: {exc}") from exc
                break
    return found


_NO_OVERRIDES: Mapping[str, Any] = MappingProxyType({})
_overrides: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "kinetic_prefect_resource_overrides", default=_NO_OVERRIDES
)


@contextlib.contextmanager
def resources(**overrides: Any) -> Iterator[None]:
    """Override runner settings for every submission made inside the block.

    Example:
        ```python
        with resources(accelerator="l4", spot=True, timeout_seconds=3600):
            futures = train.map(configs)
        ```
    """
    _check_names(overrides, "resources()")
    token = _overrides.set({**_overrides.get(), **overrides})
    try:
        yield
    finally:
        _overrides.reset(token)


def current_overrides() -> dict[str, Any]:
    """The `resources(...)` overrides active in this context."""
    return dict(_overrides.get())


def _check_names(values: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(values) - set(SETTING_NAMES))
    if unknown:
        import difflib

        close = {n: difflib.get_close_matches(n, SETTING_NAMES, n=1) for n in unknown}
        hints = [f"{n} (did you mean {m[0]}?)" if m else n for n, m in close.items()]
        raise ConfigurationError(
            f"{where} got unknown setting(s) {', '.join(hints)}; "
            f"valid settings are: {', '.join(SETTING_NAMES)}."
        )


def resolve_settings(
    *,
    runner: Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    block: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> LaunchSettings:
    """Merge every source of settings into one validated `LaunchSettings`.

    `None` values never override: they mean "not set here".
    """
    layers = [
        settings_from_environ(os.environ if environ is None else environ),
        dict(block or {}),
        dict(runner or {}),
        dict(overrides or {}),
    ]
    merged: dict[str, Any] = {}
    env: dict[str, str | SecretValue] = {}
    pod_overrides: dict[str, Any] = {}
    intervals: dict[str, Any] = {}
    # Job labels and annotations of each layer combine key by key, as env does.
    metadata: dict[str, dict[str, Any]] = {"job_labels": {}, "job_annotations": {}}
    for layer in layers:
        _check_names(layer, "settings")
        for key, value in layer.items():
            if value is None:
                continue
            if key == "env":
                env.update({str(k): env_value(str(k), v) for k, v in dict(value).items()})
            elif key == "pod_overrides":
                pod_overrides.update(check_pod_overrides(value))
            elif key in metadata:
                if not isinstance(value, Mapping):
                    raise ConfigurationError(f"{key} must be a mapping of names to strings.")
                metadata[key].update(value)
            elif key == "intervals":
                intervals.update(value.changed() if isinstance(value, Intervals) else dict(value))
            else:
                merged[key] = value
    merged["env"] = env
    merged["pod_overrides"] = pod_overrides
    merged.update(metadata)
    merged["intervals"] = Intervals.of(intervals)
    for key in ("cpu", "memory"):
        if isinstance(merged.get(key), int | float) and not isinstance(merged[key], bool):
            merged[key] = f"{merged[key]:g}"
    for key in ("requirements", "accelerator_extras"):
        if isinstance(merged.get(key), list | tuple):
            merged[key] = tuple(str(item) for item in merged[key])
    settings = LaunchSettings(**merged)
    _validate(settings)
    return settings


def _validate(settings: LaunchSettings) -> None:
    if settings.backend not in BACKENDS:
        raise ConfigurationError(
            f"Unknown backend {settings.backend!r}; use one of {', '.join(BACKENDS)}."
        )
    if settings.spot not in (None, True, False, "fallback"):
        raise ConfigurationError(
            f"spot={settings.spot!r} is not valid: use True, False or 'fallback' (spot for every "
            "attempt but the last, which runs on-demand)."
        )
    if settings.orphan_timeout_seconds <= 0:
        raise ConfigurationError("orphan_timeout_seconds must be a positive number of seconds.")
    if settings.preemption_retries < 0:
        raise ConfigurationError("preemption_retries must be 0 or more.")
    if settings.max_parallel is not None and settings.max_parallel < 1:
        raise ConfigurationError("max_parallel must be at least 1.")
    if settings.timeout_seconds is not None and settings.timeout_seconds < 1:
        raise ConfigurationError("timeout_seconds must be a positive number of seconds.")
    if settings.pending_timeout_seconds <= 0:
        raise ConfigurationError("pending_timeout_seconds must be a positive number of seconds.")
    if settings.queue_timeout_seconds is not None and settings.queue_timeout_seconds <= 0:
        raise ConfigurationError(
            "queue_timeout_seconds must be a positive number of seconds, or None to wait for "
            "capacity as long as it takes."
        )
    if settings.warm_pod_idle_seconds <= 0:
        raise ConfigurationError(
            "warm_pod_idle_seconds must be a positive number of seconds (how long an idle "
            "warm pod waits for its next task run)."
        )
    if settings.code_archive_max_mb <= 0 or settings.code_archive_max_files < 1:
        raise ConfigurationError(
            "code_archive_max_mb and code_archive_max_files must be above zero (the most the "
            "code archive may hold); leave large files out with .kineticignore instead."
        )
    if settings.node_cache_max_gb <= 0:
        raise ConfigurationError(
            "node_cache_max_gb must be above zero: the most, in GB, the node's cache of "
            "unpacked environments may hold (an environment for a TPU stack is about 1.3 GB)."
        )
    _check_warm_idle(settings)
    _check_queue_name(settings.queue_name)
    if settings.queued_provisioning and not settings.queue_name:
        raise ConfigurationError(
            "queued_provisioning=True needs queue_name: the Kueue LocalQueue whose "
            "ClusterQueue provisions the nodes through DWS (docs/kueue.md)."
        )
    _check_metadata("job_labels", settings.job_labels, labels=True)
    _check_metadata("job_annotations", settings.job_annotations, labels=False)
    _check_environment(settings)
    _check_quantity("cpu", settings.cpu, "8 or 500m")
    _check_quantity("memory", settings.memory, "64Gi or 512Mi")
    for key in settings.env:
        if not key or "=" in key:
            raise ConfigurationError(f"Invalid environment variable name {key!r} in env=.")


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def _check_queue_name(queue_name: str | None) -> None:
    if queue_name is not None and not _DNS_SUBDOMAIN.fullmatch(queue_name):
        raise ConfigurationError(
            f"queue_name={queue_name!r} is not a LocalQueue name: use the name of a Kueue "
            "LocalQueue in the Jobs' namespace (lowercase letters, digits, '-' and '.'; "
            "kubectl get localqueues -n NAMESPACE lists them)."
        )


# Kubernetes' object metadata syntax
# (https://kubernetes.io/docs/concepts/overview/working-with-objects/labels/#syntax-and-character-set):
# an optional DNS-subdomain prefix and a slash, then a name of at most 63 characters;
# a label's value is at most 63 characters of the same set, or empty.
_METADATA_NAME = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
# A DNS subdomain as Kubernetes checks a key's prefix: dot-separated DNS labels.
_KEY_PREFIX = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
# Job metadata the runner writes and reads back (a Job's identity, its role, its queue):
# a user's value there would make the runner mistake one Job for another.
RESERVED_JOB_METADATA = ("kinetic-prefect.io/", "app.kubernetes.io/managed-by")
_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def _check_metadata(setting: str, items: Mapping[str, str], labels: bool) -> None:
    if not isinstance(items, Mapping):
        raise ConfigurationError(f"{setting} must be a mapping of names to strings.")
    for key, value in items.items():
        prefix, slash, name = str(key).rpartition("/")
        valid = bool(name) and _METADATA_NAME.fullmatch(name) is not None
        if slash and not _KEY_PREFIX.fullmatch(prefix):
            valid = False
        if not valid:
            raise ConfigurationError(
                f"{setting}: {key!r} is not a Kubernetes {'label' if labels else 'annotation'} "
                "key: an optional DNS-subdomain prefix and '/', then at most 63 letters, digits, "
                "'-', '_' or '.', starting and ending with a letter or digit."
            )
        if str(key) == _QUEUE_LABEL:
            raise ConfigurationError(
                f"{setting}: {key!r} is the runner's own: set queue_name= instead (the runner "
                "then creates the Jobs suspended for Kueue to admit)."
            )
        if str(key).startswith(RESERVED_JOB_METADATA):
            raise ConfigurationError(
                f"{setting}: {key!r} is kinetic-prefect's own (it finds and tells apart its "
                f"Jobs by {', '.join(RESERVED_JOB_METADATA)}): use another key."
            )
        if not isinstance(value, str):
            raise ConfigurationError(
                f"{setting}: the value of {key!r} must be a string, not {value!r} "
                '(quote numbers: "600").'
            )
        if labels and not _METADATA_NAME.fullmatch(value):
            raise ConfigurationError(
                f"job_labels: {value!r} (for {key!r}) is not a label value: at most 63 "
                "letters, digits, '-', '_' or '.', starting and ending with a letter or digit."
            )


def _check_quantity(name: str, value: str | None, example: str) -> None:
    if value is None:
        return
    try:
        positive = parse_quantity(value) > 0
    except ValueError:
        positive = False
    if not positive:
        raise ConfigurationError(
            f"{name}={value!r} is not a Kubernetes quantity above zero; use e.g. {example} "
            "(https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/)."
        )


def _check_warm_idle(settings: LaunchSettings) -> None:
    from kinetic_prefect.common.handover import reuse_margin

    # The gke backend's jobs store is always a gs:// bucket.
    margin = reuse_margin(settings.jobs_root or ("gs://" if settings.backend == "gke" else ""))
    if settings.warm_pods and settings.warm_pod_idle_seconds <= margin:
        raise ConfigurationError(
            f"warm_pod_idle_seconds={settings.warm_pod_idle_seconds:g} leaves no time to reuse a "
            f"warm pod: a task goes only to a pod with over {margin:g}s of its idle time left "
            f"on this jobs store. Use at least {2 * margin:g}, or warm_pods=False."
        )


def _check_environment(settings: LaunchSettings) -> None:
    if settings.environment not in ENVIRONMENTS:
        raise ConfigurationError(
            f"environment={settings.environment!r} is not valid: use 'ship' (the task's Python "
            "environment travels with it), 'image' (the image has everything) or 'auto'."
        )
    if settings.environment_builder not in ENVIRONMENT_BUILDERS:
        raise ConfigurationError(
            f"environment_builder={settings.environment_builder!r} is not valid: use 'cluster' "
            "(a builder Job) or 'local' (this machine builds and uploads)."
        )
    if (
        settings.environment == "image"
        and settings.backend == "gke"
        and not (settings.container_image)
    ):
        raise ConfigurationError(
            "environment='image' needs container_image: an image with kinetic-prefect and every "
            "library your tasks import (deployments/Dockerfile builds one). Or use "
            "environment='ship', which needs no image build."
        )


def spot_request(spot: bool | str | None, *, last_attempt: bool = False) -> bool | None:
    """The spot choice for one attempt: "fallback" means spot unless it is the last."""
    if spot == "fallback":
        return not last_attempt
    return spot if isinstance(spot, bool) else None


def join_uri(root: str, *parts: str) -> str:
    """Join path parts onto a local path or a `gs://` URI."""
    cleaned = [p.strip("/") for p in parts if p and p.strip("/")]
    if not cleaned:
        return root
    return "/".join([root.rstrip("/"), *cleaned])
