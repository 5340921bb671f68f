"""Preemptions have their own budget, spot can fall back, a SIGTERM leaves time to save."""

from __future__ import annotations

import os
import signal

import pytest
from prefect import flow, task
from prefect.runtime import task_run

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.outputs.checkpoint import checkpoint_manager
from tests.support.waiting import recorded_history

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


@task(retries=0)
def preempted_on_first_two_pods() -> int:
    if task_run.run_count <= 2:
        os.kill(os.getpid(), signal.SIGTERM)
    return task_run.run_count


@task(retries=0)
def count_with_emergency_save(steps: int) -> int:
    """Saves every 5 steps; the first pod gets a SIGTERM at step 6 and saves step 7 on its way."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    manager = checkpoint_manager(save_interval_steps=5, save_on_preemption=True)
    latest = manager.latest_step()
    start = 0 if latest is None else latest + 1
    for step in range(start, steps):
        manager.save(step, args=ocp.args.StandardSave({"step": jnp.asarray(step)}))
        if step == 6 and task_run.run_count == 1:
            os.kill(os.getpid(), signal.SIGTERM)
    manager.wait_until_finished()
    return start


def _messages(task_run_id: object) -> list[str]:
    return [s.message or "" for s in recorded_history(task_run_id)]


def test_preemptions_do_not_use_the_tasks_retries_and_are_named_in_its_history():
    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[int, object, int]:
        future = preempted_on_first_two_pods.submit()
        return future.result(), future.task_run_id, len(future.job_ids)

    run_count, task_run_id, pods = run()

    assert (run_count, pods) == (3, 3)
    assert len([m for m in _messages(task_run_id) if m.startswith("Preempted:")]) == 2


def test_preemptions_past_their_budget_end_the_run_crashed():
    @flow(task_runner=KineticTaskRunner(preemption_retries=1))
    def run() -> tuple[str, int]:
        future = preempted_on_first_two_pods.submit()
        future.wait()
        return future.state.type.value, len(future.job_ids)

    assert run() == ("CRASHED", 2)


def test_spot_fallback_runs_the_last_attempt_on_demand(launched_manifests):
    @flow(task_runner=KineticTaskRunner(accelerator="l4", spot="fallback", preemption_retries=2))
    def run() -> int:
        return preempted_on_first_two_pods.submit().result()

    assert run() == 3
    spot = [
        m["spec"]["template"]["spec"]["nodeSelector"].get("cloud.google.com/gke-spot")
        for m in launched_manifests
    ]
    assert spot == ["true", "true", None]


def test_a_sigterm_lets_the_task_save_an_off_interval_checkpoint_before_the_pod_ends():
    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[int, int]:
        future = count_with_emergency_save.submit(12)
        return future.result(), len(future.job_ids)

    assert run() == (8, 2)


@task(retries=0)
def answer() -> int:
    return 42


def test_on_gke_pods_preempted_twice_by_the_node_use_no_retries_and_fall_back_to_on_demand(
    gke, cluster
):
    from tests.emulated.test_kubernetes_backend import _runner
    from tests.support.kube_objects import gke_nodes

    cluster.kubelet.nodes = [
        *gke_nodes("spot-l4", "l4", 1, spot=True),
        *gke_nodes("on-demand-l4", "l4", 1),
    ]
    cluster.kubelet.fault, cluster.kubelet.fault_pods_left = "preempt", 2

    @flow(task_runner=_runner(gke, accelerator="l4", spot="fallback", preemption_retries=2))
    def run() -> tuple[int, object]:
        future = answer.submit()
        return future.result(), future.task_run_id

    result, task_run_id = run()

    assert result == 42
    preemptions = [m for m in _messages(task_run_id) if m.startswith("Preempted:")]
    assert len(preemptions) == 2
    assert all("TerminationByKubelet" in m for m in preemptions)
    spot = [
        job["spec"]["template"]["spec"]["nodeSelector"].get("cloud.google.com/gke-spot")
        for job in cluster.created_jobs()
    ]
    assert spot == ["true", "true", None]
