"""`handle.json`: where a gke job's Job lives, written to its job directory before the Job exists.

`kinetic-prefect jobs logs|attach|cancel` read it to find the cluster, namespace
and Job of a job id without the runner that launched it.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from kinetic_prefect.common import layout
from kinetic_prefect.common.layout import HANDLE_FILE
from kinetic_prefect.common.storage import JobsStore


def write_handle(
    store: JobsStore,
    cluster: Any,
    runner_id: str,
    job_id: str,
    namespace: str,
    access: Any,
    created: bool | None,
    error: str | None = None,
) -> None:
    """Record where job `job_id` runs (`created=False` with the error when creating it failed)."""
    handle: dict[str, Any] = {
        "backend": "gke",
        "job_name": job_id,
        "namespace": namespace,
        "runner": runner_id,
        "cluster": {
            "name": getattr(cluster, "cluster_name", None),
            "project": getattr(cluster, "project", None),
            "location": getattr(cluster, "zone", None) or getattr(cluster, "region", None),
            "api_server": access.server,
            "context": access.context,
        },
        "written_at": datetime.datetime.now(datetime.UTC).isoformat(),
    }
    if created is False:
        handle["created"] = False
        handle["error"] = error
    store.put_bytes(layout.job_file(job_id, HANDLE_FILE), json.dumps(handle, indent=2).encode())
