"""Why a gke pod waits: capacity that exists (it queues) or a pod that can never be scheduled.

Pods, nodes and events are built as the scheduler and cluster autoscaler write them
(tests/support/kube_objects.py), or quoted from GKE as users reported them.
"""

from __future__ import annotations

from typing import Any

import pytest

from kinetic_prefect.backends.gke.status import nodes_down, pending, reads_nodes
from kinetic_prefect.launch.slices import build_workload
from tests.support.kube_objects import (
    Node,
    NodePool,
    event,
    gke_nodes,
    place,
    pod_of_job,
    pod_requests,
    scale_up_refused,
    scale_up_triggered,
    unschedulable_message,
    unschedulable_status,
)
from tests.unit.test_manifest import _spec


def _job(accelerator: str) -> dict[str, Any]:
    job = build_workload(_spec(accelerator)).job
    job["metadata"]["uid"] = "5e1b6f0c-3f0a-4f0e-9a57-0c1d2e3f4a5b"
    return job


def _unschedulable_pod(job: dict[str, Any], message: str | None) -> dict[str, Any]:
    pod = pod_of_job(job, f"{job['metadata']['name']}-x7k2p", job["metadata"]["namespace"])
    assert message is not None
    pod["status"] = unschedulable_status(message)
    return pod


def _scheduled_on(nodes: list[Node], job: dict[str, Any]) -> str:
    """The scheduler's message for one more pod of `job` once each node holds one."""
    spec = job["spec"]["template"]["spec"]
    for node in nodes:
        node.bind(pod_requests(spec))
    message = unschedulable_message(nodes, spec)
    assert message is not None
    return message


def test_a_pod_behind_busy_nodes_of_its_kind_waits_for_capacity():
    job = _job("tpu-v5e-4")
    nodes = [*gke_nodes("v5e-4", "tpu-v5e-4", 8), Node("cpu-1")]
    pod = _unschedulable_pod(job, _scheduled_on(nodes[:8], job))

    waiting = pending(pod, job)

    assert waiting is not None and waiting.waits_for_capacity
    assert waiting.reason.startswith(
        "waiting for capacity: 8/8 tpu-v5e-4 nodes busy (Insufficient google.com/tpu"
    )


def test_nodes_whose_taint_turns_the_pod_away_are_not_counted_as_its_kind():
    # Two busy L4 nodes beside a TPU pool: GKE's TPU taint turns the L4 pod away there.
    job = _job("l4")
    l4_nodes = gke_nodes("l4-pool", "l4", 2)
    _scheduled_on(l4_nodes, job)
    nodes = [*l4_nodes, *gke_nodes("v5e-4", "tpu-v5e-4", 4)]
    message = unschedulable_message(nodes, job["spec"]["template"]["spec"])
    assert message is not None and "4 node(s) had untolerated taint(s)" in message

    waiting = pending(_unschedulable_pod(job, message), job)

    assert waiting is not None and waiting.waits_for_capacity
    assert waiting.reason.startswith("waiting for capacity: 2/2 l4 nodes busy"), waiting.reason


def test_a_taint_named_as_kubernetes_before_1_34_names_it_also_leaves_those_nodes_out():
    job = _job("l4")
    message = (
        "0/6 nodes are available: 2 Insufficient nvidia.com/gpu, 4 node(s) had untolerated "
        "taint {google.com/tpu: present}. preemption: 0/6 nodes are available: 2 No "
        "preemption victims found for incoming pod, 4 Preemption is not helpful for scheduling."
    )

    waiting = pending(_unschedulable_pod(job, message), job)

    assert waiting is not None and waiting.waits_for_capacity
    assert waiting.reason.startswith("waiting for capacity: 2/2 l4 nodes busy"), waiting.reason


@pytest.mark.parametrize(
    "message",
    [
        # As GKE 1.36 writes it, with dynamic resource allocation's clause.
        "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. no new claims to deallocate, "
        "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.",
        # As Kubernetes before 1.34 writes it.
        "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are "
        "available: 2 Preemption is not helpful for scheduling.",
    ],
)
def test_nodes_too_small_even_when_empty_never_hold_the_pod_in_either_wording(message):
    job = _job("l4x8")

    never = pending(_unschedulable_pod(job, message), job)

    assert never is not None and not never.waits_for_capacity, never


@pytest.mark.parametrize(
    ("accelerator", "nodes", "scheduler_says"),
    [
        # No node pool has the accelerator: GKE's GPU taint turns the TPU pod away first.
        (
            "tpu-v5e-4",
            gke_nodes("l4", "l4", 3),
            "3 node(s) had untolerated taint(s)",
        ),
        # Nodes of another TPU topology tolerate it but do not match its selector.
        ("tpu-v5e-4", gke_nodes("v5e-16", "tpu-v5e-16", 4), "4 node(s) didn't match Pod's node"),
        # Nodes with four L4 GPUs each: eight never fit, however long the pod waits.
        ("l4x8", gke_nodes("l4x4", "l4x4", 2), "2 Insufficient nvidia.com/gpu"),
    ],
)
def test_a_pod_no_node_can_ever_hold_is_never_scheduled(accelerator, nodes, scheduler_says):
    job = _job(accelerator)
    pod = _unschedulable_pod(job, unschedulable_message(nodes, job["spec"]["template"]["spec"]))

    never = pending(pod, job)

    assert never is not None and not never.waits_for_capacity
    assert scheduler_says in never.reason
    assert f"{len(nodes)} Preemption is not helpful for scheduling" in never.reason
    assert f"accelerator {accelerator} needs a node with" in never.reason


def test_a_node_pool_growing_from_zero_nodes_makes_an_unmatched_pod_wait():
    job = _job("l4")
    pool = NodePool("l4-autoscaled", "l4", max_nodes=4)
    message = unschedulable_message([Node("cpu-1")], job["spec"]["template"]["spec"])
    pod = _unschedulable_pod(job, message or "")
    grows = event(pod, "e1", "TriggeredScaleUp", scale_up_triggered(pool, 0), "cluster-autoscaler")

    alone = pending(pod, job)
    with_events = pending(pod, job, [grows])

    assert alone is not None and not alone.waits_for_capacity
    assert with_events is not None and with_events.waits_for_capacity
    assert "the cluster autoscaler is adding a node (pod triggered scale-up: [{" in (
        with_events.reason
    )
    assert "gke-kinetic-l4-autoscaled-grp 0->1 (max: 4)}])" in with_events.reason


def test_busy_nodes_in_node_pools_at_their_maximum_size_still_wait():
    job = _job("tpu-v5e-4")
    pod = _unschedulable_pod(job, _scheduled_on(gke_nodes("v5e-4", "tpu-v5e-4", 4), job))
    refused = event(
        pod, "e1", "NotTriggerScaleUp", scale_up_refused(["max node group size reached"]), "ca"
    )

    waiting = pending(pod, job, [refused])

    assert waiting is not None and waiting.waits_for_capacity
    assert "4/4 tpu-v5e-4 nodes busy" in waiting.reason
    assert "its node pools are at their maximum size" in waiting.reason


def test_a_pod_whose_selector_no_node_group_matches_says_what_the_autoscaler_said():
    job = _job("h100x8")
    # As GKE users report it (kubernetes/autoscaler#5692, #3503).
    message = (
        "0/12 nodes are available: 12 node(s) didn't match Pod's node affinity/selector. "
        "preemption: 0/12 nodes are available: 12 Preemption is not helpful for scheduling."
    )
    pod = _unschedulable_pod(job, message)
    refused = event(
        pod,
        "e1",
        "NotTriggerScaleUp",
        "pod didn't trigger scale-up: 3 node(s) didn't match Pod's node affinity/selector",
        "cluster-autoscaler",
    )

    never = pending(pod, job, [refused])

    assert never is not None and not never.waits_for_capacity
    assert "(cluster autoscaler: pod didn't trigger scale-up: 3 node(s) didn't match" in (
        never.reason
    )


def test_a_message_without_the_preemption_verdict_takes_insufficient_nodes_for_busy_ones():
    job = _job("l4")
    pod = _unschedulable_pod(job, "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")

    waiting = pending(pod, job)

    assert waiting is not None and waiting.waits_for_capacity
    assert "3/3 l4 nodes busy (Insufficient nvidia.com/gpu)" in waiting.reason


def test_a_slice_behind_a_slice_holding_its_pool_waits_and_one_split_over_pools_never_fits():
    job = _job("tpu-v5e-16")
    spec = job["spec"]["template"]["spec"]
    whole = gke_nodes("v5e-16", "tpu-v5e-16", 4)
    split = [*gke_nodes("pool-a", "tpu-v5e-16", 2), *gke_nodes("pool-b", "tpu-v5e-16", 2)]
    holder = place(whole, spec, 4)
    assert isinstance(holder, list)
    for node in holder:
        node.bind(pod_requests(spec))

    behind = pending(_unschedulable_pod(job, str(place(whole, spec, 4))), job)
    never = pending(_unschedulable_pod(job, str(place(split, spec, 4))), job)

    assert behind is not None and behind.waits_for_capacity
    assert "4/4 tpu-v5e-16 nodes busy (Insufficient google.com/tpu)" in behind.reason
    assert never is not None and not never.waits_for_capacity
    assert "didn't match pod affinity rules" in never.reason


def _slice_behind_nodes_that_lost_contact() -> tuple[dict[str, Any], dict[str, Any], list[Node]]:
    job = _job("tpu-v5e-16")
    nodes = [*gke_nodes("v5e-16", "tpu-v5e-16", 4), Node("cpu-1")]
    for node in nodes[:4]:
        node.lose_contact()
    message = unschedulable_message(nodes, job["spec"]["template"]["spec"], 4)
    assert message is not None and "4 node(s) had untolerated taint(s)" in message
    return job, _unschedulable_pod(job, message), nodes


def test_a_slice_whose_nodes_lost_contact_waits_for_them_to_come_back():
    job, pod, nodes = _slice_behind_nodes_that_lost_contact()

    waiting = pending(pod, job, [], [n.as_object() for n in nodes[:4]])

    assert waiting is not None and waiting.waits_for_capacity and waiting.waits_for_nodes
    assert waiting.reason.startswith(
        "waiting for capacity: 4/4 tpu-v5e-16 nodes not ready (gke-v5e-16-"
    ), waiting.reason
    assert "Ready=Unknown, node.kubernetes.io/unreachable" in waiting.reason


def test_nodes_turned_away_by_a_taint_that_are_all_ready_never_take_the_pod():
    # The TPU taint on another kind's nodes, or nodes of its kind all back: never by waiting.
    job, pod, nodes = _slice_behind_nodes_that_lost_contact()
    for node in nodes[:4]:
        node.come_back()

    never = pending(pod, job, [], [n.as_object() for n in nodes[:4]])

    assert never is not None and not never.waits_for_capacity
    assert "node-reader" not in never.reason


def test_a_runner_that_cannot_list_nodes_is_told_what_to_grant_to_wait_for_them():
    job, pod, _ = _slice_behind_nodes_that_lost_contact()

    refused = pending(pod, job, nodes_refused=True)
    not_read_yet = pending(pod, job)

    assert refused is not None and not refused.waits_for_capacity
    assert (
        "let the runner list nodes (the ClusterRole kinetic-prefect-node-reader" in refused.reason
    )
    assert not_read_yet is not None and "node-reader" not in not_read_yet.reason


@pytest.mark.parametrize(
    ("accelerator", "pool", "count", "down", "hosts"),
    [
        # Eight L4s asked of 4-GPU nodes: one of them down changes nothing.
        ("l4x8", "l4x4", 2, 1, 1),
        # Two nodes of its kind for a four-host slice, both down.
        ("tpu-v5e-16", "tpu-v5e-16", 2, 2, 4),
    ],
    ids=["too big for every node", "fewer nodes than hosts"],
)
def test_a_pod_its_kinds_nodes_could_never_hold_never_waits_for_those_that_are_down(
    accelerator, pool, count, down, hosts
):
    job = _job(accelerator)
    nodes = gke_nodes(pool, pool, count)
    for node in nodes[:down]:
        node.lose_contact()
    message = unschedulable_message(nodes, job["spec"]["template"]["spec"], hosts)
    assert message is not None

    never = pending(_unschedulable_pod(job, message), job, [], [n.as_object() for n in nodes])

    assert never is not None and not never.waits_for_capacity


def test_a_cordoned_node_pool_is_waited_for_as_kube_scheduler_words_it():
    job = _job("tpu-v5e-4")
    nodes = gke_nodes("v5e-4", "tpu-v5e-4", 2)
    for node in nodes:
        node.cordoned = True
    message = unschedulable_message(nodes, job["spec"]["template"]["spec"])
    assert message is not None and "2 node(s) were unschedulable" in message
    pod = _unschedulable_pod(job, message)
    assert reads_nodes(pod, job)

    waiting = pending(pod, job, [], [n.as_object() for n in nodes])

    assert waiting is not None and waiting.waits_for_nodes
    assert "2/2 tpu-v5e-4 nodes not ready (gke-v5e-4-0: cordoned;" in waiting.reason


def _node(
    ready: str | None, taints: list[dict[str, str]], cordoned: bool = False
) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": ready}] if ready else []
    spec: dict[str, Any] = {"taints": taints, **({"unschedulable": True} if cordoned else {})}
    return {"metadata": {"name": "n"}, "spec": spec, "status": {"conditions": conditions}}


_NOT_READY = {"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}
_CORDON = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
_TPU = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("node", "down"),
    [
        (_node("True", [_TPU]), None),
        (_node("False", [_NOT_READY, _TPU]), "Ready=False, node.kubernetes.io/not-ready"),
        (_node("True", [_CORDON], cordoned=True), "node.kubernetes.io/unschedulable"),
        (_node("True", [], cordoned=True), "cordoned"),
        (_node(None, [_NOT_READY]), "node.kubernetes.io/not-ready"),
        (_node("True", [{**_NOT_READY, "effect": "PreferNoSchedule"}]), None),
        (
            _node("True", [{"key": "node.kubernetes.io/memory-pressure", "effect": "NoSchedule"}]),
            None,
        ),
    ],
    ids=[
        "ready, TPU taint",
        "not ready",
        "cordoned, tainted",
        "cordoned",
        "no status",
        "soft",
        "under pressure, ready",
    ],
)
def test_nodes_down_are_those_not_ready_tainted_for_a_condition_or_cordoned(node, down):
    assert nodes_down([node]).get("n") == down


@pytest.mark.parametrize(
    ("message", "reads"),
    [
        (
            "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are "
            "available: 2 No preemption victims found for incoming pod.",
            False,
        ),
        (
            "0/5 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
            "4 node(s) had untolerated taint(s). no new claims to deallocate, preemption: 0/5 "
            "nodes are available: 5 Preemption is not helpful for scheduling.",
            True,
        ),
        ("0/3 nodes are available: 3 node(s) were unschedulable.", True),
    ],
    ids=["busy", "tainted", "cordoned"],
)
def test_the_nodes_are_read_only_when_a_taint_or_cordon_turned_the_pod_away(message, reads):
    job, cpu_job = _job("l4"), _job("cpu")
    assert reads_nodes(_unschedulable_pod(job, message), job) is reads
    # Any node is a cpu pod's kind: not worth listing them all.
    assert reads_nodes(_unschedulable_pod(cpu_job, message), cpu_job) is False


def _no_victims(short: str) -> str:
    """kube-scheduler's message (GKE 1.36 form) for two matching nodes short of `short`."""
    return (
        f"0/2 nodes are available: 2 Insufficient {short}. no new claims to deallocate, "
        "preemption: 0/2 nodes are available: 2 No preemption victims found for incoming pod."
    )


@pytest.mark.parametrize(
    ("accelerator", "short", "noted"),
    [
        # An accelerator pod whose nodes lack only cpu: its GPUs are free, so the request
        # may not fit beside the nodes' system pods (kubernetes#131345 marks only requests
        # over the allocatable as unresolvable).
        ("l4", "cpu", True),
        ("l4", "memory", True),
        # The accelerator itself is taken: busy nodes.
        ("l4", "nvidia.com/gpu", False),
        # Short of what no request of the product sets: no advice about cpu or memory.
        ("l4", "ephemeral-storage", False),
        # A cpu pod: no accelerator to tell the two apart by.
        ("cpu", "cpu", False),
    ],
)
def test_busy_nodes_short_of_cpu_alone_note_the_system_pods_for_an_accelerator_pod(
    accelerator: str, short: str, noted: bool
):
    job = _job(accelerator)

    waiting = pending(_unschedulable_pod(job, _no_victims(short)), job)

    assert waiting is not None and waiting.waits_for_capacity
    assert f"2/2 {accelerator} nodes busy (Insufficient {short})" in waiting.reason
    assert (
        f"beside its system pods (`kubectl describe node`, Allocated resources): lower its {short}"
        in waiting.reason
    ) is noted, waiting.reason
