"""Pods on finite node pools: waiting for capacity queues, a pod that can never fit fails.

The emulated cluster's scheduler uses nodes up (tests/support/kube_objects.py): a pod
that does not fit stays Unschedulable until a pod ends, or until the autoscaler adds a
node. Pods import this module to run its tasks: it imports nothing a pod lacks.
"""

from __future__ import annotations

import re
import time

import pytest
from prefect import flow, task
from prefect.futures import wait

from kinetic_prefect import resources
from tests.runner.test_task_runner import wait_for_gate
from tests.support.kube_objects import gke_nodes
from tests.support.waiting import (
    recorded_history,
    recorded_task_run,
    wait_for_task_run_state,
    wait_past_jobs,
    wait_until,
)

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

PENDING_TIMEOUT = 4.0


@task
def echo(x: int) -> int:
    return x


def _runner(gke: str, **options: object):  # type: ignore[no-untyped-def]
    from tests.emulated.test_kubernetes_backend import _runner

    return _runner(gke, **options)


def _history(task_run_id: object) -> list[tuple[str, str]]:
    from tests.emulated.test_kubernetes_backend import _state_messages

    return _state_messages(task_run_id)


def test_four_tasks_on_two_nodes_all_complete_waiting_for_capacity_past_the_pending_timeout(
    gke, cluster, workdir
):
    from tests.emulated.test_kubernetes_backend import alongside

    cluster.kubelet.nodes.extend(gke_nodes("l4-pool", "l4", 2))
    gate = workdir / "gate"
    # A pod bound to a node still starts its container within the pending timeout: on a
    # loaded machine that can take longer than the 4 s the tests of pods that never fit use.
    pending_timeout = 3 * PENDING_TIMEOUT
    runner = _runner(
        gke, accelerator="l4", pending_timeout_seconds=pending_timeout, warm_pods=False
    )

    @flow(task_runner=runner)
    def sweep(gate: str) -> tuple[list[str], list[object]]:
        futures = wait_for_gate.map([gate] * 4)
        return [f.result() for f in futures], [f.task_run_id for f in futures]

    def open_the_gate_once_two_waited_past_the_pending_timeout() -> None:
        try:
            wait_past_jobs(
                cluster, 4, 2 * pending_timeout, "the waiting pods to wait past their timeout"
            )
        finally:
            gate.touch()

    with alongside(open_the_gate_once_two_waited_past_the_pending_timeout):
        results, task_run_ids = sweep(str(gate))

    assert results == ["opened"] * 4
    assert cluster.kubelet.most_bound["l4-pool"] == 2
    assert len(cluster.created_jobs()) == 4  # one pod each: none failed to start, none retried
    runs = [recorded_task_run(i) for i in task_run_ids]
    assert {r.run_count for r in runs} == {1}
    waited = [m for i in task_run_ids for kind, m in _history(i) if kind == "PENDING"]
    assert any(
        " is waiting for capacity: 2/2 l4 nodes busy (Insufficient nvidia.com/gpu" in m
        for m in waited
    )
    assert _pod_event_reads(cluster) == 0  # the scheduler's message alone says it waits


def test_a_pod_asking_for_an_accelerator_no_node_pool_has_fails_naming_its_pending_timeout(
    gke, cluster
):
    from tests.emulated.test_kubernetes_backend import _failed_run

    cluster.kubelet.nodes.extend(gke_nodes("l4-pool", "l4", 4))
    runner = _runner(gke, accelerator="tpu-v5e-4", pending_timeout_seconds=PENDING_TIMEOUT)

    # When it fails is tests/unit/test_outcome_deadlines.py's (a fake clock); this is the wiring.
    state, message, _ = _failed_run(runner, echo)

    assert state == "FAILED"
    # GKE's GPU taint turns the TPU pod away from the L4 nodes, the default pool's node
    # does not match its selector.
    assert (
        "0/5 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
        "4 node(s) had untolerated taint(s)."
    ) in message
    assert "accelerator tpu-v5e-4 needs a node with" in message
    assert (
        "(cluster autoscaler: pod didn't trigger scale-up (it wouldn't fit if a new node is "
        "added): 1 node(s) had untolerated taint(s))"
    ) in message
    assert f"longer than pending_timeout_seconds={PENDING_TIMEOUT:g}" in message
    wait_until(lambda: cluster.jobs() == [], 30, "the Job to be deleted")


def test_a_pod_waiting_for_capacity_past_queue_timeout_fails_naming_the_setting(
    gke, cluster, workdir
):
    from tests.emulated.test_kubernetes_backend import alongside

    cluster.kubelet.nodes.extend(gke_nodes("l4-pool", "l4", 1))
    gate = workdir / "gate"
    runner = _runner(
        gke, accelerator="l4", pending_timeout_seconds=PENDING_TIMEOUT, queue_timeout_seconds=8
    )

    @flow(task_runner=runner)
    def two(gate: str) -> list[tuple[str, str, object]]:
        futures = [wait_for_gate.submit(gate), wait_for_gate.submit(gate)]
        wait(futures)
        return [(f.state.type.value, f.state.message or "", f.task_run_id) for f in futures]

    def open_the_gate_once_one_gave_up() -> None:
        try:
            wait_until(
                lambda: len(cluster.created_jobs()) == 2 and len(cluster.jobs()) == 1,
                60,
                "the waiting pod's Job to be deleted",
            )
        finally:  # the holder ends either way
            gate.touch()

    with alongside(open_the_gate_once_one_gave_up):
        outcomes = sorted(two(str(gate)))

    (completed, _, _), (failed, message, queued_id) = outcomes
    assert (completed, failed) == ("COMPLETED", "FAILED")
    # The whole queue timeout waited (the product rounds the seconds; a loaded machine
    # looks a little late).
    waited = re.search(r"waited (\d+)s for capacity, longer than queue_timeout_seconds=8;", message)
    assert waited is not None and int(waited.group(1)) >= 8, message
    assert "1/1 l4 nodes busy (Insufficient nvidia.com/gpu)" in message
    pending = [m for kind, m in _history(queued_id) if kind == "PENDING"]
    assert any(" is waiting for capacity: 1/1 l4 nodes busy" in m for m in pending)


def test_a_pod_that_waited_for_capacity_still_gets_the_whole_pending_timeout_to_start(
    gke, cluster, workdir
):
    from tests.emulated.test_kubernetes_backend import MISSING_IMAGE, alongside

    cluster.kubelet.nodes.extend(gke_nodes("l4-pool", "l4", 1))
    cluster.kubelet.missing_images.add(MISSING_IMAGE)
    gate = workdir / "gate"
    runner = _runner(gke, accelerator="l4", pending_timeout_seconds=PENDING_TIMEOUT)

    @flow(task_runner=runner)
    def two(gate: str) -> tuple[str, str]:
        holder = wait_for_gate.submit(gate)
        wait_for_task_run_state(holder.task_run_id, "RUNNING", 120)
        with resources(container_image=MISSING_IMAGE):
            stuck = echo.submit(1)
        wait([holder, stuck])
        return stuck.state.type.value, stuck.state.message or ""

    def open_the_gate_once_the_second_waited_past_the_pending_timeout() -> None:
        try:
            wait_until(lambda: len(cluster.created_jobs()) == 2, 60, "the second Job")
            queued = time.monotonic()
            wait_until(
                lambda: (
                    time.monotonic() - queued > 2 * PENDING_TIMEOUT and len(cluster.jobs()) == 2
                ),
                60,
                "the second pod queued past its pending timeout",
            )
        finally:
            gate.touch()

    with alongside(open_the_gate_once_the_second_waited_past_the_pending_timeout):
        state, message = two(str(gate))

    waited = re.search(r"pending for (\d+)s", message)
    assert state == "FAILED"
    assert waited is not None and PENDING_TIMEOUT <= int(waited.group(1)) < 2 * PENDING_TIMEOUT
    assert f"cannot pull image {MISSING_IMAGE}" in message


def _pod_event_reads(cluster) -> int:  # type: ignore[no-untyped-def]
    return sum(
        r.resource is not None
        and r.resource.plural == "events"
        and "involvedObject.kind=Pod" in str(r.params.get("fieldSelector"))
        for r in cluster.client_requests()
    )


def test_a_pod_waits_past_the_pending_timeout_while_the_autoscaler_adds_a_node(gke, cluster):
    from tests.emulated.test_kubernetes_backend import alongside

    cluster.kubelet.add_node_pool("l4-autoscaled", "l4", nodes=0, max_nodes=2)
    cluster.call(cluster.kubelet.hold_scale_ups)
    runner = _runner(gke, accelerator="l4", pending_timeout_seconds=PENDING_TIMEOUT)

    @flow(task_runner=runner)
    def two() -> list[tuple[int, object]]:
        return [(f.result(), f.task_run_id) for f in echo.map([1, 2])]

    def add_the_nodes_past_the_pending_timeout() -> None:
        wait_until(lambda: len(cluster.created_jobs()) == 2, 60, "both Jobs")
        created = time.monotonic()
        wait_until(
            lambda: (
                _pod_event_reads(cluster) == 2 and time.monotonic() - created > 2 * PENDING_TIMEOUT
            ),
            60,
            "both pods' events read, and their pending timeout long past",
        )
        cluster.call(cluster.kubelet.release_scale_ups)

    with alongside(add_the_nodes_past_the_pending_timeout):
        (one, first_id), (two_, _) = two()

    assert (one, two_) == (1, 2)
    said = [m for kind, m in _history(first_id) if kind == "PENDING"]
    assert any(
        "is waiting for capacity: the cluster autoscaler is adding a node" in m for m in said
    )
    assert [n.name for n in cluster.kubelet.nodes if n.pool == "l4-autoscaled"] == [
        "gke-l4-autoscaled-0",
        "gke-l4-autoscaled-1",
    ]
    assert _pod_event_reads(cluster) == 2  # one read each, once pending a probe interval


def test_a_pods_deadline_counts_the_time_it_waits_for_a_busy_node(gke, cluster, workdir):
    """Kubernetes counts activeDeadlineSeconds from the Job's start, as the README's
    `timeout_seconds` row says: a pod that waits for a node past it never runs."""
    cluster.kubelet.nodes.extend(gke_nodes("l4-pool", "l4", 1))
    gate = workdir / "gate"
    # Past pytest-timeout's backstop: no failure here can come from the pending timeout.
    runner = _runner(gke, accelerator="l4", pending_timeout_seconds=3600)

    @flow(task_runner=runner)
    def two() -> tuple[str, str, bool, object]:
        holder = wait_for_gate.submit(str(gate))
        wait_for_task_run_state(holder.task_run_id, "RUNNING", 120)
        with resources(timeout_seconds=3):
            late = echo.submit(1)
        late.wait()
        # The node was still taken when the late run ended: its pod waited the whole time.
        node_held = not holder.state.is_final()
        gate.touch()
        holder.wait()
        return late.state.type.value, late.state.message or "", node_held, late.task_run_id

    state, message, node_held, late_id = two()

    assert (state, node_held) == ("CRASHED", True)
    assert "DeadlineExceeded" in message
    assert "counts it from the Job's start, time the pod waited for a node included" in message
    # It never ran: its history shows it waiting for the node, and no Running state.
    history = [s.type.value for s in recorded_history(late_id)]
    assert "RUNNING" not in history and history[-1] == "CRASHED"
