"""Job artifacts in the jobs store: listing and cleanup.

Cleanup removes `kinetic/{job_id}/` (payload, final state) and local
pod workspaces. It never touches `outputs/` (checkpoints and results outlive
every pod), `data-cache/` or `code-cache/`: code archives are shared by every
job with the same code, so one may still be in use by a running job; remove old
ones yourself (a bucket lifecycle rule) when nothing runs.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kinetic_prefect.common import layout
from kinetic_prefect.common.storage import open_store


def cleanup_jobs(jobs_root: str, job_ids: Iterable[str], gcp_credentials: Any = None) -> int:
    """Delete the artifacts of `job_ids` under `jobs_root`; returns files removed.

    `gcp_credentials` (a prefect-gcp `GcpCredentials` block) is whom a `gs://` jobs root
    is cleaned up as; None: Application Default Credentials.

    Example:
        ```python
        cleanup_jobs(".kinetic", [future.job_id for future in futures])
        ```
    """
    store = open_store(jobs_root, gcp_credentials)
    removed = 0
    for job_id in job_ids:
        if not job_id or "/" in job_id or job_id in {".", ".."}:
            raise ValueError(f"Invalid job id {job_id!r}.")
        removed += store.delete_prefix(layout.job_dir(job_id))
        if "://" not in jobs_root:
            workspace = Path(jobs_root) / "pods" / job_id
            if workspace.is_dir():
                shutil.rmtree(workspace)
    return removed
