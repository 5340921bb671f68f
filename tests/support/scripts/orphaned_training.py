"""A flow run whose task trains with a checkpoint per step, run in its own process.

`python -m tests.support.scripts.orphaned_training new` creates a flow run, prints its id and runs
it; `... again FLOW_RUN_ID` runs that flow run once more, as a retry of it would (or as a
flow process restarted for it).

Environment: `ORPHANED_TRAINING_CLUSTER` names a saved gke `KineticCluster` (the tests'
kmock cluster; local backend without it), `ORPHANED_TRAINING_ORPHAN_TIMEOUT` the runner's
`orphan_timeout_seconds` (4), `ORPHANED_TRAINING_STEPS` the steps to train (60),
`ORPHANED_TRAINING_PAUSE` the seconds between steps (0.2),
`ORPHANED_TRAINING_TTL` the Jobs' `ttl_seconds_after_finished` on gke (2),
`ORPHANED_TRAINING_QUEUE` the runner's Kueue `queue_name` and
`ORPHANED_TRAINING_PENDING_TIMEOUT` its `pending_timeout_seconds` on gke (none, 600),
`ORPHANED_TRAINING_WARM=1` gives the runner warm pods and has the flow run a short task
first, so the training is the warm pod's second task, and `ORPHANED_TRAINING_GATE` names a
file: a training that starts from step 0 stops after its second checkpoint until that file
exists (a test opens the gate once the restarted flow process has taken the pod over; a
pod that must end by other means waits at a gate nobody opens).
"""

from __future__ import annotations

import os
import sys
import time

from prefect import flow, get_client, task
from prefect.flow_engine import run_flow
from prefect.states import Scheduled

from kinetic_prefect import KineticTaskRunner, checkpoint_manager

# How long a gated training waits for its gate before it trains on regardless.
GATE_TIMEOUT = 300


def _wait_for_gate(gate: str) -> None:
    deadline = time.monotonic() + GATE_TIMEOUT
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)


@task
def train_slowly(steps: int, pause: float, gate: str = "") -> int:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    manager = checkpoint_manager(max_to_keep=2)
    latest = manager.latest_step()
    start = 0 if latest is None else latest + 1
    for step in range(start, steps):
        manager.save(step, args=ocp.args.StandardSave({"step": jnp.asarray(step)}))
        manager.wait_until_finished()
        if gate and step == 1:
            _wait_for_gate(gate)
        time.sleep(pause)
    return start


@task
def warm_up() -> int:
    return os.getpid()


@flow
def orphaned_training(steps: int) -> int:
    if os.environ.get("ORPHANED_TRAINING_WARM"):
        warm_up.submit().result()
    pause = float(os.environ.get("ORPHANED_TRAINING_PAUSE") or 0.2)
    gate = os.environ.get("ORPHANED_TRAINING_GATE") or ""
    return train_slowly.submit(steps, pause, gate).result()


def _runner() -> KineticTaskRunner:
    timeout = float(os.environ.get("ORPHANED_TRAINING_ORPHAN_TIMEOUT") or 4)
    options: dict[str, object] = {"orphan_timeout_seconds": timeout, "cancel_grace_seconds": 2}
    if os.environ.get("ORPHANED_TRAINING_WARM"):
        options.update(warm_pods=True, warm_pod_idle_seconds=120)
    cluster = os.environ.get("ORPHANED_TRAINING_CLUSTER")
    if not cluster:
        return KineticTaskRunner(**options)
    ttl = int(os.environ.get("ORPHANED_TRAINING_TTL") or 2)
    options["queue_name"] = os.environ.get("ORPHANED_TRAINING_QUEUE") or None
    options["pending_timeout_seconds"] = float(
        os.environ.get("ORPHANED_TRAINING_PENDING_TIMEOUT") or 600
    )
    return KineticTaskRunner(
        cluster=cluster, allow_loopback_api=True, ttl_seconds_after_finished=ttl, **options
    )


def main() -> None:
    training = orphaned_training.with_options(task_runner=_runner())
    steps = int(os.environ.get("ORPHANED_TRAINING_STEPS") or 60)
    with get_client(sync_client=True) as client:
        if sys.argv[1] == "new":
            flow_run = client.create_flow_run(training, parameters={"steps": steps})
        else:
            client.set_flow_run_state(sys.argv[2], Scheduled(), force=True)
            flow_run = client.read_flow_run(sys.argv[2])
    print(f"flow run {flow_run.id}", flush=True)
    print(f"result {run_flow(training, flow_run=flow_run, parameters=flow_run.parameters)}")


if __name__ == "__main__":
    main()
