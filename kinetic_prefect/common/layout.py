"""The jobs store's layout: where every record and artifact lives, below the store's root.

The jobs store is one prefix, `gs://{jobs bucket}/...` on gke or `.kinetic/` locally::

    kinetic/{job_id}/payload.pkl         the pickled task run (one per attempt)
    kinetic/{job_id}/final-state.json    the pod's signed word on how it ended (and its Prefect
                                         state, when the task ran), written last
    kinetic/{job_id}/warm-pod.json       the warm pod that claimed this job's task (or the runner)
    kinetic/{pod_id}/warm/assign-{n}.json   hand-overs to a warm pod
    code-cache/{sha256}.zip, .done       code archives, shared by every job with that code
    data-cache/{sha256}/...              local `Data`, one object per file
    data-markers/{sha256}                its file list, written last
    env-cache/{key}/...                  shipped environments (launch/environment.py)
    leases/{flow_run_id}.json            the runner's lease over its flow run's pods
    result-seals/{sha256}.json           a pod's signed digest of a result record it persisted
    outputs/{flow_run_id}/{task_key}/    KINETIC_OUTPUT_DIR (default root); never cleaned up
"""

from __future__ import annotations

JOBS_PREFIX = "kinetic"
CODE_CACHE_PREFIX = "code-cache"
DATA_CACHE_PREFIX = "data-cache"
DATA_MARKER_PREFIX = "data-markers"
ENV_CACHE_PREFIX = "env-cache"
LEASES_PREFIX = "leases"
RESULT_SEALS_PREFIX = "result-seals"
OUTPUTS_PREFIX = "outputs"

PAYLOAD_FILE = "payload.pkl"
FINAL_STATE_JSON = "final-state.json"
# A pickled final state too large to travel inside `final-state.json` (records.py).
FINAL_STATE_PICKLE = "final-state.pkl"
WARM_POD_JSON = "warm-pod.json"


def job_dir(job_id: str) -> str:
    """A job's directory: everything one attempt's pod reads and leaves."""
    return f"{JOBS_PREFIX}/{job_id}"


def job_file(job_id: str, name: str) -> str:
    return f"{job_dir(job_id)}/{name}"


def warm_dir(pod_id: str) -> str:
    """Where the runner hands task runs to warm pod `pod_id`, and the pod accepts them."""
    return f"{job_dir(pod_id)}/warm"


def code_archive_keys(sha256: str) -> tuple[str, str]:
    """The code archive's key and the marker written after it."""
    return f"{CODE_CACHE_PREFIX}/{sha256}.zip", f"{CODE_CACHE_PREFIX}/{sha256}.done"


def data_cache_key(digest: str, relative: str = "") -> str:
    return f"{DATA_CACHE_PREFIX}/{digest}" + (f"/{relative}" if relative else "")


def data_marker_key(digest: str) -> str:
    return f"{DATA_MARKER_PREFIX}/{digest}"


def lease_key(flow_run_id: str) -> str:
    return f"{LEASES_PREFIX}/{flow_run_id}.json"


def result_seal_key(storage_block_id: str, storage_key: str) -> str:
    """The seal of the result record at `storage_key` in result storage block `storage_block_id`."""
    import hashlib

    digest = hashlib.sha256(f"{storage_block_id}/{storage_key}".encode()).hexdigest()
    return f"{RESULT_SEALS_PREFIX}/{digest}.json"


def store_root_of(job_dir_uri: str) -> str:
    """The jobs store's root, from the URI of one of its job directories."""
    suffix = "/" + job_dir(job_dir_uri.rstrip("/").rsplit("/", 1)[-1])
    return job_dir_uri.rstrip("/").removesuffix(suffix)
