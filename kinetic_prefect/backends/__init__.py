"""Where pods run. Every backend takes the same Job manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kinetic_prefect.backends.base import Backend, PodExit
from kinetic_prefect.config import LaunchSettings

__all__ = ["Backend", "PodExit", "create_backend"]


def create_backend(settings: LaunchSettings, jobs_root: str, cluster: Any = None) -> Backend:
    """The backend for `settings.backend`, created lazily on a runner's first launch."""
    if settings.backend == "local":
        from kinetic_prefect.backends.local import LocalBackend

        workspace = (
            Path(jobs_root) / "pods" if "://" not in jobs_root else Path.cwd() / ".kinetic" / "pods"
        )
        return LocalBackend(
            workspace,
            max_parallel=settings.max_parallel,
            cancel_grace_seconds=settings.cancel_grace_seconds,
        )
    from kinetic_prefect.errors import ConfigurationError

    raise ConfigurationError(
        f"The {settings.backend!r} backend is not available in this version; use backend='local'."
    )
