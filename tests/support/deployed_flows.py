"""Flows the worker tests deploy; `prefect flow-run execute` loads them in a flow pod.

`gated_cube_on_gke` names its cluster: the test saves a gke
`KineticCluster` block under `GKE_CLUSTER` (and its result storage under `GKE_RESULTS`) in
the test's server.
"""

from __future__ import annotations

from prefect import flow, task

from kinetic_prefect import KineticTaskRunner

GKE_CLUSTER = "worker-gke"
GKE_RESULTS = f"{GKE_CLUSTER}-results"


@task
def cube_after_gate(x: int, gate: str) -> int:
    """Cubes `x` once the file `gate` exists (the test creates it when it has seen enough)."""
    import threading
    from pathlib import Path

    pause = threading.Event()
    while not Path(gate).exists():
        pause.wait(0.05)
    return x**3


@flow(
    task_runner=KineticTaskRunner(cluster=GKE_CLUSTER),
    persist_result=True,
    result_storage=f"gcs-bucket/{GKE_RESULTS}",
)
def gated_cube_on_gke(x: int, gate: str) -> int:
    return cube_after_gate.submit(x, gate).result()
