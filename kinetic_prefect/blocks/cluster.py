"""`KineticCluster`: where and how Kinetic pods run, and the settings it contributes."""

from __future__ import annotations

from typing import Any, Literal

from prefect.blocks.core import Block
from prefect_gcp.cloud_storage import GcsBucket
from prefect_gcp.credentials import GcpCredentials
from prefect_kubernetes.credentials import KubernetesClusterConfig
from pydantic import Field

from kinetic_prefect.blocks.credentials import DOCUMENTATION_URL
from kinetic_prefect.blocks.schema import SchemaOnce


class KineticCluster(SchemaOnce, Block):
    """Where and how Kinetic pods run: a GKE cluster, or this machine.

    Examples:
        Run a flow's tasks on a saved cluster:
        ```python
        from prefect import flow
        from kinetic_prefect import KineticCluster, KineticTaskRunner

        cluster = KineticCluster.load("BLOCK_NAME")

        @flow(task_runner=KineticTaskRunner(cluster=cluster, accelerator="tpu-v5e-4"))
        def train(): ...
        ```

        Save a GKE cluster once; runners then refer to it by name:
        ```python
        from prefect_gcp.cloud_storage import GcsBucket
        from kinetic_prefect import KineticCluster

        KineticCluster(
            project="my-project", zone="us-central2-b", cluster_name="ml",
            jobs_bucket="gs://my-kinetic-jobs", result_storage=GcsBucket.load("results"),
        ).save("gke")
        ```
    """

    _block_type_name = "Kinetic Cluster"
    _block_type_slug = "kinetic-cluster"
    _description = "Where Kinetic task and flow pods run: a GKE cluster or the local machine."
    _documentation_url = DOCUMENTATION_URL  # type: ignore[assignment]
    # Pods run on GKE: the block shows the Google Cloud logo prefect-gcp's blocks use.
    _logo_url = GcpCredentials._logo_url

    backend: Literal["gke", "local"] = Field(
        default="gke", description="gke: pods are Kubernetes Jobs; local: processes here."
    )
    project: str | None = Field(default=None, description="GCP project id.")
    zone: str | None = Field(default=None, description="GKE cluster zone (or use region).")
    region: str | None = Field(default=None, description="GKE cluster region.")
    cluster_name: str | None = Field(default=None, description="GKE cluster name.")
    namespace: str = Field(default="default", description="Kubernetes namespace for Jobs.")
    jobs_bucket: str | None = Field(
        default=None,
        description="gs://bucket[/prefix] for payloads, data cache and outputs "
        "(a local directory with the local backend).",
    )
    output_root: str | None = Field(
        default=None, description="Root of KINETIC_OUTPUT_DIR (default: {jobs_bucket}/outputs)."
    )
    result_storage: GcsBucket | None = Field(
        default=None, description="A saved GcsBucket block where task results are persisted."
    )
    gcp_credentials: GcpCredentials | None = Field(
        default=None,
        description="Whom this machine (runner, worker, CLI) acts as on the jobs bucket and "
        "when it reads results (default: ADC). Pods never get it: they use Workload Identity.",
    )
    kube_config: KubernetesClusterConfig | None = Field(
        default=None, description="Kubernetes cluster config (else in-cluster or kubeconfig)."
    )
    container_image: str | None = Field(default=None, description="Image for pod containers.")
    service_account: str | None = Field(default=None, description="Kubernetes service account.")
    accelerator: str | None = Field(default=None, description="Default accelerator.")
    max_parallel: int | None = Field(default=None, description="Pods running at once.")
    timeout_seconds: int | None = Field(default=None, description="Default pod deadline.")
    pending_timeout_seconds: float | None = Field(
        default=None,
        description="Fail a pod that can never be scheduled or cannot pull its image within "
        "this many seconds (time spent waiting for busy nodes does not count).",
    )
    queue_timeout_seconds: float | None = Field(
        default=None,
        description="Fail a pod that waits this long for capacity (nodes of its kind busy, or "
        "being added); unset: wait as long as it takes.",
    )
    queue_name: str | None = Field(
        default=None,
        description="Kueue LocalQueue in the namespace that admits every Job (docs/kueue.md): "
        "Jobs are created suspended and wait there; the pending timeout counts from admission.",
    )
    queued_provisioning: bool | None = Field(
        default=None,
        description="The queue_name's ClusterQueue provisions nodes through DWS flex-start "
        "with queued provisioning: pods tolerate the cloud.google.com/gke-queued taint.",
    )
    job_labels: dict[str, str] = Field(
        default_factory=dict,
        description="Labels added to every Job (e.g. a Kueue priority class, "
        "kueue.x-k8s.io/priority-class).",
    )
    job_annotations: dict[str, str] = Field(
        default_factory=dict,
        description="Annotations added to every Job (e.g. "
        "provreq.kueue.x-k8s.io/maxRunDurationSeconds for DWS).",
    )
    warm_pods: bool | None = Field(
        default=None,
        description="Keep a pod after its task for the next task run of the same pod spec.",
    )
    warm_pod_idle_seconds: float | None = Field(
        default=None, description="How long an idle warm pod waits for its next task run."
    )
    code_archive_max_mb: float | None = Field(
        default=None,
        description="The most the code archive's files may total before compression, in MB "
        "(default 200); past it a launch is refused before any upload.",
    )
    code_archive_max_files: int | None = Field(
        default=None,
        description="The most files the code archive may hold (default 20000); past it a "
        "launch is refused before any upload.",
    )
    node_cache_max_gb: float | None = Field(
        default=None,
        description="The most a node's cache of unpacked shipped environments may hold, in GB "
        "(default 20); least recently used ones no pod uses are removed past it.",
    )
    environment: Literal["auto", "ship", "image"] | None = Field(
        default=None,
        description="The task's Python environment: 'ship' (resolved, built once and "
        "unpacked in each pod on a stock python image), 'image' (the image has everything) "
        "or 'auto' (ship on gke).",
    )
    requirements: list[str] | str | None = Field(
        default=None,
        description="Requirement strings, or a requirements file's path; detected from the "
        "project (uv.lock, pylock.toml, requirements.txt, pyproject.toml) when unset.",
    )
    environment_builder: Literal["cluster", "local"] | None = Field(
        default=None,
        description="Where a new environment is built: a builder Job in the cluster, or "
        "this machine (for clusters without a route to a package index).",
    )
    builder_service_account: str | None = Field(
        default=None,
        description="The Kubernetes service account builder Jobs run as (default "
        "kinetic-prefect-runner, the flow pods'): it writes environment_store, which task "
        "pods only read.",
    )
    package_index_url: str | None = Field(
        default=None, description="The package index environments are built from (a mirror)."
    )
    accelerator_extras: list[str] | None = Field(
        default=None,
        description="What an accelerator adds to a shipped environment (default: jax[tpu] "
        "on a TPU, jax[cuda12] on a GPU); an empty list adds nothing.",
    )
    environment_store: str | None = Field(
        default=None,
        description="Where shipped environments are kept (gs://bucket[/prefix]); the jobs "
        "bucket when unset. Pods must be able to read it.",
    )
    cpu: str | None = Field(
        default=None,
        description="CPU request of every pod, a Kubernetes quantity (8, 500m); default: what "
        "the accelerator's machine leaves to pods, 1 for cpu.",
    )
    memory: str | None = Field(
        default=None,
        description="Memory request of every pod, a Kubernetes quantity (64Gi); default: what "
        "the accelerator's machine leaves to pods, 2Gi for cpu.",
    )
    pod_overrides: dict[str, Any] | None = Field(
        default=None,
        description="PodSpec fields merged into every pod's spec: tolerations, "
        "priorityClassName, imagePullSecrets, volumes, a reservation's nodeSelector "
        "(docs/kubernetes.md has the merge rule).",
    )
    intervals: dict[str, float] | None = Field(
        default=None,
        description="Intervals to change from their defaults, in seconds, e.g. "
        '{"settle_margin_seconds": 10} (docs/intervals.md lists them).',
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables for every pod launched with this cluster; a "
        "runner's env= or a work pool's env job variable overrides them. Give secrets as "
        "'{{ prefect.blocks.secret.NAME }}' so they travel as Kubernetes Secret refs.",
    )

    def jobs_root(self) -> str | None:
        """The jobs location as a URI: `gs://…` on GKE, a path with the local backend."""
        if not self.jobs_bucket:
            return None
        if self.backend == "gke" and "://" not in self.jobs_bucket:
            return f"gs://{self.jobs_bucket.strip('/')}"
        return self.jobs_bucket.rstrip("/")


def load_cluster(cluster: KineticCluster | str) -> KineticCluster:
    """A `KineticCluster` from a block or its saved name."""
    if isinstance(cluster, KineticCluster):
        return cluster
    loaded = KineticCluster.load(cluster)
    assert isinstance(loaded, KineticCluster)
    return loaded


def cluster_settings(cluster: KineticCluster) -> dict[str, Any]:
    """The settings layer a cluster block contributes (see `kinetic_prefect.launch.settings`)."""
    return {
        "backend": cluster.backend,
        "jobs_root": cluster.jobs_root(),
        "output_root": cluster.output_root,
        "namespace": cluster.namespace,
        "container_image": cluster.container_image,
        "service_account": cluster.service_account,
        "accelerator": cluster.accelerator,
        "max_parallel": cluster.max_parallel,
        "timeout_seconds": cluster.timeout_seconds,
        "pending_timeout_seconds": cluster.pending_timeout_seconds,
        "queue_timeout_seconds": cluster.queue_timeout_seconds,
        "queue_name": cluster.queue_name,
        "queued_provisioning": cluster.queued_provisioning,
        "job_labels": dict(cluster.job_labels),
        "job_annotations": dict(cluster.job_annotations),
        "warm_pods": cluster.warm_pods,
        "warm_pod_idle_seconds": cluster.warm_pod_idle_seconds,
        "code_archive_max_mb": cluster.code_archive_max_mb,
        "code_archive_max_files": cluster.code_archive_max_files,
        "node_cache_max_gb": cluster.node_cache_max_gb,
        "environment": cluster.environment,
        "requirements": cluster.requirements,
        "environment_builder": cluster.environment_builder,
        "builder_service_account": cluster.builder_service_account,
        "package_index_url": cluster.package_index_url,
        "environment_store": cluster.environment_store,
        "accelerator_extras": cluster.accelerator_extras,
        "cpu": cluster.cpu,
        "memory": cluster.memory,
        "pod_overrides": cluster.pod_overrides,
        "intervals": cluster.intervals,
        "env": dict(cluster.env),
        "gcp_credentials": cluster.gcp_credentials,
    }
