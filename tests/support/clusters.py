"""Saved `KineticCluster` blocks for tests.

Pods import the test module that defines the task they run, so test modules
with tasks keep Prefect collections (prefect-gcp, prefect-kubernetes: seconds
per pod) out of their top-level imports; this helper imports them when called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SHIPPED_REQUIREMENTS = Path(__file__).parent / "shipped-requirements.txt"


@contextlib.contextmanager
def schemas_built_once(*classes: Any) -> Iterator[None]:
    """While saving blocks: each of `classes` builds its JSON schema once, not per field.

    Prefect's `Block.save` asks a block for its schema again for every field it serializes,
    and prefect-gcp's `GcsBucket` builds it anew each time (kinetic-prefect's own blocks keep
    theirs: `blocks/schema.SchemaOnce`). What is saved is the same; only the time differs.
    """
    from kinetic_prefect.blocks.schema import built_once

    real = {cls: cls.model_json_schema for cls in classes}
    own = {cls: cls.__dict__.get("model_json_schema") for cls in classes}

    def once(cls: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return built_once(cls, real[cls], *args, **kwargs)

    for cls in classes:
        cls.model_json_schema = classmethod(once)
    try:
        yield
    finally:
        for cls in classes:
            if own[cls] is None:
                del cls.model_json_schema
            else:
                cls.model_json_schema = own[cls]


def gcs_cluster(gcs: Any, name: str, backend: str = "local") -> str:
    """Save a KineticCluster with jobs and results in the test bucket; returns its name.

    The cluster's `env` carries the emulator's address to its pods, as a user's
    settings would carry anything a pod needs.
    """
    from prefect_gcp.cloud_storage import GcsBucket

    from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials

    with schemas_built_once(GcsBucket):
        GcsBucket(
            bucket=gcs.name, bucket_folder="results", gcp_credentials=KineticGcpCredentials()
        ).save(f"{name}-results", overwrite=True)
        result_storage = GcsBucket.load(f"{name}-results")
        KineticCluster(
            backend=backend,
            jobs_bucket=gcs.uri,
            result_storage=result_storage,
            env=gcs.pod_env,
            # The task pods' account of rbac.yaml, whose Workload Identity the docs set up.
            service_account="kinetic-prefect-pods" if backend == "gke" else None,
            # One shipped environment for the whole suite (tests/conftest.py).
            requirements=str(SHIPPED_REQUIREMENTS) if backend == "gke" else None,
            environment_builder="local" if backend == "gke" else None,
            environment_store=gcs.environment_store or None,
            # No TPU or GPU here: their jax parts would only add gigabytes to the one environment.
            accelerator_extras=[] if backend == "gke" else None,
        ).save(name, overwrite=True)
    return name
