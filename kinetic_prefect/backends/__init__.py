"""Where pods run. Every backend takes the same Job manifest."""

from __future__ import annotations

from typing import Any

from kinetic_prefect.backends.base import Backend, PodExit
from kinetic_prefect.launch.settings import LaunchSettings

__all__ = ["Backend", "PodExit", "create_backend"]


def create_backend(settings: LaunchSettings, jobs_root: str, cluster: Any = None) -> Backend:
    """The backend for `settings.backend`, created lazily on a runner's first launch."""
    if settings.backend == "local":
        from kinetic_prefect.backends.local.backend import LocalBackend
        from kinetic_prefect.backends.local.pods import local_pods_dir

        return LocalBackend(
            local_pods_dir(jobs_root),
            max_parallel=settings.max_parallel,
            cancel_grace_seconds=settings.cancel_grace_seconds,
        )
    if settings.backend == "gke":
        from kinetic_prefect.backends.gke.backend import KubernetesBackend
        from kinetic_prefect.launch import preflight

        # Before any Job exists: a pod that cannot reach the Prefect API cannot run its task.
        preflight.check_api_reachable_by_pods(settings)
        return KubernetesBackend(
            jobs_root,
            cluster=cluster,
            max_parallel=settings.max_parallel,
            pending_timeout_seconds=settings.pending_timeout_seconds,
            queue_timeout_seconds=settings.queue_timeout_seconds,
            cancel_grace_seconds=settings.cancel_grace_seconds,
            kube_context=settings.kube_context,
            credentials_denied_timeout_seconds=settings.credentials_denied_timeout_seconds,
            intervals=settings.intervals,
        )
    from kinetic_prefect.errors import ConfigurationError

    raise ConfigurationError(
        f"Unknown backend {settings.backend!r}; use backend='local' or backend='gke'."
    )
