"""Every environment variable the orchestrator sets for a pod and the pod reads.

One name, one place: the manifest writes these, the pod side reads them, and
tests of either side use the same constants.
"""

from __future__ import annotations

# -- the task run and its attempt -------------------------------------------------
JOB_ID_ENV = "KINETIC_JOB_ID"
TASK_RUN_ID_ENV = "KINETIC_TASK_RUN_ID"
FLOW_RUN_ID_ENV = "KINETIC_FLOW_RUN_ID"
ATTEMPT_ENV = "KINETIC_ATTEMPT"
# The task run's durable output prefix, the same for every attempt.
OUTPUT_DIR_ENV = "KINETIC_OUTPUT_DIR"
# The pod's own accelerator, for the task to read; deliberately not the
# KINETIC_ACCELERATOR setting, so runners inside the pod do not inherit it.
POD_ACCELERATOR_ENV = "KINETIC_POD_ACCELERATOR"
# The pod's scratch directory (the code archive is extracted below it).
SCRATCH_DIR_ENV = "KINETIC_SCRATCH_DIR"
# The submitting client's versions (`common.versions.fingerprint()`), checked before unpickling.
CLIENT_VERSIONS_ENV = "KINETIC_CLIENT_VERSIONS"

# -- secrets (delivered through the pod's Kubernetes Secret) -------------------------
# The key that signs the pod's final-state records.
SIGNING_KEY_ENV = "KINETIC_RECORD_KEY"
# The key that signs the markers of environments unpacked in a node's cache. Unlike the
# record key it is the same for every flow run of one master key, so the next flow run's
# pods trust (after re-verifying) what an earlier one unpacked.
NODE_CACHE_KEY_ENV = "KINETIC_NODE_CACHE_KEY"
# Env var -> path in Prefect's settings, for the secret settings delivered as env vars.
SECRET_SETTING_PATHS_ENV = "KINETIC_SECRET_SETTING_PATHS"

# -- ownership: the runner's lease and the pod's watchdog -----------------------------
LEASE_URI_ENV = "KINETIC_LEASE_URI"
# When the runner renewed the lease last before launching the pod: no older lease counts.
LEASE_SINCE_ENV = "KINETIC_LEASE_SINCE"
ORPHAN_TIMEOUT_ENV = "KINETIC_ORPHAN_TIMEOUT_SECONDS"
# The intervals the pod waits on (`kinetic_prefect.common.intervals`), when not the defaults.
INTERVALS_ENV = "KINETIC_INTERVALS"


# -- data --------------------------------------------------------------------------
# Where `Data(..., fuse=True)` volumes are mounted.
MOUNT_ROOT_ENV = "KINETIC_DATA_MOUNT_ROOT"

# -- shipped environments ------------------------------------------------------------
# Where a pod unpacks its shipped environment: a node-wide cache when the node has one.
ENV_CACHE_ENV = "KINETIC_ENV_CACHE"
# What names a pod's metadata server, as google-auth reads it (newest name first).
METADATA_HOST_ENVS = ("GCE_METADATA_HOST", "GCE_METADATA_ROOT")
# The node cache's size cap in GB, for the bootstrap's pruning (`node_cache_max_gb`).
NODE_CACHE_MAX_GB_ENV = "KINETIC_NODE_CACHE_MAX_GB"
# Set by the bootstrap in a pod that runs on a shipped environment: its key, archive,
# sha256 and directory (JSON). A runner in that pod (a flow pod's) plans from it.
SHIPPED_ENV_ENV = "KINETIC_SHIPPED_ENVIRONMENT"

# -- warm pods -----------------------------------------------------------------------
WARM_DIR_ENV = "KINETIC_WARM_DIR"
WARM_IDLE_ENV = "KINETIC_WARM_IDLE_SECONDS"

# -- multi-host slices ---------------------------------------------------------------
SLICE_HOSTS_ENV = "KINETIC_SLICE_HOSTS"
# Set by GKE's TPU webhook on multi-host TPU pods (and by the local backend).
HOST_INDEX_ENV = "TPU_WORKER_ID"
HOSTNAMES_ENV = "TPU_WORKER_HOSTNAMES"
COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
