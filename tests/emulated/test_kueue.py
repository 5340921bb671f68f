"""Jobs that wait in a Kueue LocalQueue (`queue_name`) on the emulated cluster and its test Kueue.

The queues are the ones docs/kueue.md tells users to apply (tests/support/kueue.py admits
by their quota): 16 chips of tpu-v5e-4, so 4 pods at once, and 16 chips of tpu-v5e-16.
What ran when comes from the cluster's own event history.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, get_client, task, unmapped
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from tests.emulated.test_kubernetes_backend import _runner
from tests.runner.test_multihost import CPU_JAX, gather_host_indices_and_pids
from tests.support.kube import NAMESPACE, KubeCluster
from tests.support.kube_objects import gke_nodes
from tests.support.waiting import recorded_history, recorded_task_run, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

DOCS = Path(__file__).resolve().parents[2] / "docs" / "kueue.md"
QUEUE = "tpu"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PENDING_TIMEOUT = 3.0
POSITION = re.compile(r"queued in Kueue LocalQueue tpu, position (\d+) in the LocalQueue")
# Kueue's message for a Workload that does not fit the quota left.
NO_QUOTA = (
    "couldn't assign flavors to pod set main: insufficient unused quota for google.com/tpu "
    "in flavor tpu-v5e-4, 4 more needed"
)


def _documented_queues(
    cluster: KubeCluster, version: str | None = None, kinds: tuple[str, ...] = ()
) -> None:
    """Apply the ResourceFlavors, ClusterQueue and LocalQueue of docs/kueue.md (at
    `version` of Kueue's API: their fields are the same in v1beta1 and v1beta2); only
    those of `kinds`, if given."""
    from tests.support.standins import apply, manifests

    section = DOCS.read_text().split("## A queue for a TPU node pool", 1)[1]
    text = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    docs = [doc for doc in manifests(text) if not kinds or doc["kind"] in kinds]
    for doc in docs if version else []:
        doc["apiVersion"] = f"kueue.x-k8s.io/{version}"
    apply(cluster.admin, NAMESPACE, docs)


@task
def hold(index: int, gate: str) -> int:
    pause = threading.Event()
    while not Path(gate).exists():
        pause.wait(0.05)
    return index


def _messages(task_run_id: object) -> list[str]:
    with get_client(sync_client=True) as client:
        states = client.read_task_run_states(task_run_id)  # type: ignore[arg-type]
    return [s.message or "" for s in sorted(states, key=lambda s: s.timestamp)]


def _positions(task_run_ids: list[object]) -> dict[object, list[int]]:
    """The queue positions each task run's Pending messages showed, in order."""
    return {
        run: [int(m.group(1)) for text in _messages(run) if (m := POSITION.search(text))]
        for run in task_run_ids
    }


def _waiting_for_quota(positions: dict[object, list[int]]) -> list[object]:
    """The task runs that showed a queue position and, in a state message, Kueue's reason."""
    return [
        run
        for run, shown in positions.items()
        if shown and any(NO_QUOTA in m for m in _messages(run))
    ]


def _finished(obj: dict[str, Any]) -> bool:
    """A Job with its Complete or Failed condition, or a Workload with its Finished one."""
    return any(
        c.get("type") in {"Complete", "Failed", "Finished"} and c.get("status") == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def _summary(obj: dict[str, Any]) -> dict[str, Any]:
    """What says why a Job or Workload is still there."""
    meta = obj["metadata"]
    return {
        "kind": obj.get("kind"),
        "name": meta["name"],
        "deletion": meta.get("deletionTimestamp"),
        "finalizers": meta.get("finalizers"),
        "owners": [o.get("name") for o in meta.get("ownerReferences") or []],
        "suspend": (obj.get("spec") or {}).get("suspend"),
        "status": obj.get("status"),
    }


def _admitted_at_once(cluster: KubeCluster) -> int:
    """From the cluster's Job events: the most Jobs unsuspended and not finished at once."""
    return cluster.most_at_once(
        "jobs",
        lambda kind, job: (
            kind != "DELETED" and not _finished(job) and not job["spec"].get("suspend")
        ),
    )


def _tpu_v5e_4_cluster(cluster: KubeCluster) -> None:
    cluster.kubelet.nodes = gke_nodes("tpu-v5e-4", "tpu-v5e-4", 4)
    _documented_queues(cluster)


def test_an_eight_task_map_waits_in_the_queue_and_runs_four_at_a_time(gke, cluster, workdir):
    _tpu_v5e_4_cluster(cluster)
    gate = workdir / "gate"

    @flow(task_runner=_runner(gke, accelerator="tpu-v5e-4", queue_name=QUEUE))
    def sweep() -> tuple[list[int], dict[object, list[int]]]:
        futures = hold.map(range(8), gate=unmapped(str(gate)))
        runs = [f.task_run_id for f in futures]
        # Four run at the gate; the other four wait in the queue and say where and why.
        # The gate stays shut until they have: opened earlier, a run read in the queue
        # before Kueue wrote its reason could be admitted before the next read.
        shown = wait_until(
            lambda: (p := _positions(runs)) and len(_waiting_for_quota(p)) >= 4 and p,
            90,
            "4 task runs to show their queue position and Kueue's reason",
        )
        gate.touch()
        return [f.result() for f in futures], shown

    results, shown = sweep()

    jobs = cluster.created_jobs()
    assert results == list(range(8))
    assert len(jobs) == 8
    assert all(j["spec"]["suspend"] is True for j in jobs)
    assert all(j["metadata"]["labels"][QUEUE_LABEL] == QUEUE for j in jobs)
    assert _admitted_at_once(cluster) == 4
    # Four waited for quota; one of the first four may have been read in the queue too.
    queued = [run for run, p in shown.items() if p]
    assert len(queued) >= 4
    assert all(1 <= position <= 8 for run in queued for position in shown[run])
    assert len(_waiting_for_quota(shown)) >= 4


@pytest.mark.slow
def test_a_flow_cancelled_while_jobs_are_queued_leaves_no_suspended_job_or_waiting_workload(
    gke, cluster, workdir
):
    _tpu_v5e_4_cluster(cluster)
    leave = workdir / "leave"

    @flow(task_runner=_runner(gke, accelerator="tpu-v5e-4", queue_name=QUEUE))
    def leave_them_queued() -> list[object]:
        futures = hold.map(range(6), gate=unmapped(str(workdir / "never")))
        wait_until(leave.exists, 120, "the test to have seen the queue")
        return [f.task_run_id for f in futures]

    running = _in_background(leave_them_queued)
    wait_until(
        lambda: (
            _suspended(cluster) == 2 and len(cluster.pods()) == 4 and len(cluster.workloads()) == 6
        ),
        90,
        "4 pods running, and 2 Jobs queued with their Workloads",
    )
    leave.touch()
    runs = running.result(timeout=120)

    # Deleted, or (a pod that ended itself once the lease said the flow run was over,
    # before the runner's delete) finished and left to ttlSecondsAfterFinished as
    # docs/kubernetes.md says, with its Workload Finished.
    wait_until(
        lambda: all(_finished(o) for o in cluster.jobs() + cluster.workloads()),
        60,
        "every Job and Workload to be deleted or finished",
        left=lambda: [_summary(o) for o in cluster.jobs() + cluster.workloads()],
    )
    assert _suspended(cluster) == 0
    assert [recorded_task_run(run).state.type.value for run in runs] == ["CANCELLED"] * 6


def _in_background(fn: Any) -> concurrent.futures.Future[Any]:
    """Run a flow in a thread of its own while the test watches the cluster.

    The flow's own code never touches the emulated cluster: whatever a flow closes over
    travels with its tasks' context.
    """
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flow")
    running = executor.submit(fn)
    executor.shutdown(wait=False)
    return running


def _suspended(cluster: KubeCluster) -> int:
    return sum(1 for job in cluster.jobs() if job["spec"].get("suspend"))


@pytest.mark.slow
def test_queued_longer_than_the_pending_timeout_the_task_still_runs(gke, cluster, workdir):
    _tpu_v5e_4_cluster(cluster)
    gate = workdir / "gate"
    # Once admitted, the fifth pod must start within the pending timeout: 3 s was not always
    # enough on a loaded machine (one clean-clone run: "pending for 3s" after admission).
    pending_timeout = 10.0
    runner = _runner(
        gke, accelerator="tpu-v5e-4", queue_name=QUEUE, pending_timeout_seconds=pending_timeout
    )

    @flow(task_runner=runner)
    def one_too_many() -> list[int]:
        futures = hold.map(range(5), gate=unmapped(str(gate)))
        return [f.result() for f in futures]

    running = _in_background(one_too_many)

    def queued_past_the_timeout() -> bool:
        waiting = [j for j in cluster.jobs() if j["spec"].get("suspend")]
        return len(waiting) == 1 and _age(waiting[0]) > 2 * pending_timeout

    wait_until(queued_past_the_timeout, 90, "a Job queued for twice the pending timeout")
    gate.touch()

    assert running.result(timeout=120) == [0, 1, 2, 3, 4]


def _age(job: dict[str, Any]) -> float:
    import datetime

    created = datetime.datetime.fromisoformat(
        job["metadata"]["creationTimestamp"].replace("Z", "+00:00")
    )
    return (datetime.datetime.now(datetime.UTC) - created).total_seconds()


@pytest.mark.slow
def test_a_multi_host_slice_is_one_workload_admitted_whole(gke, cluster):
    cluster.kubelet.nodes = gke_nodes("v5e-16", "tpu-v5e-16", 4)
    _documented_queues(cluster)

    @flow(task_runner=_runner(gke, accelerator="tpu-v5e-16", env=CPU_JAX, queue_name=QUEUE))
    def run() -> dict[str, object]:
        return gather_host_indices_and_pids.submit().result()

    result = run()

    (job,) = cluster.created_jobs()
    (workload,) = cluster.workloads()
    (pod_set,) = workload["spec"]["podSets"]
    (assignment,) = workload["status"]["admission"]["podSetAssignments"]
    assert result["processes"] == 4
    assert job["spec"]["suspend"] is True
    assert (pod_set["count"], assignment["count"]) == (4, 4)
    assert assignment["flavors"]["google.com/tpu"] == "tpu-v5e-16"
    assert assignment["resourceUsage"]["google.com/tpu"] == "16"
    assert _pods_created_after_admission(cluster, job["metadata"]["name"]) == 4


def _pods_created_after_admission(cluster: KubeCluster, job_name: str) -> int:
    """How many of the Job's pods were created, all after it was unsuspended (else -1)."""
    admitted = False
    created = 0
    for _, resource, event in cluster.call(lambda: list(cluster.emulator.events)):
        obj = event["object"]
        if resource.plural == "jobs" and obj["metadata"]["name"] == job_name:
            admitted = admitted or not obj["spec"].get("suspend")
        elif resource.plural == "pods" and event["type"] == "ADDED":
            owner = (obj["metadata"].get("labels") or {}).get("job-name")
            if owner == job_name:
                if not admitted:
                    return -1
                created += 1
    return created


def test_kinetic_jobs_ls_shows_a_queued_job_as_queued(gke, cluster, workdir):
    from typer.testing import CliRunner

    from kinetic_prefect.cli import app

    _tpu_v5e_4_cluster(cluster)
    gate = workdir / "gate"

    @flow(task_runner=_runner(gke, accelerator="tpu-v5e-4", queue_name=QUEUE))
    def five() -> list[int]:
        return [f.result() for f in hold.map(range(5), gate=unmapped(str(gate)))]

    running = _in_background(five)
    wait_until(
        lambda: _suspended(cluster) == 1 and len(cluster.pods()) == 4,
        90,
        "4 pods and a queued Job",
    )

    listed = CliRunner().invoke(app, ["jobs", "ls", "--cluster", gke, "-n", NAMESPACE])
    gate.touch()
    running.result(timeout=120)

    assert listed.exit_code == 0, listed.output
    rows = [line for line in listed.output.splitlines() if "kp-hold-" in line]
    queued = [
        row for row in rows if "Queued: waiting for Kueue to admit it from LocalQueue tpu" in row
    ]
    assert (len(rows), len(queued)) == (5, 1), listed.output


def _flow_run_messages(flow_run_id: str) -> list[str]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(flow_run_id)]))
        )
    return [text for run in runs for text in _messages(run.id)]


CPU_QUEUES = """
apiVersion: kueue.x-k8s.io/v1beta1
kind: ResourceFlavor
metadata:
  name: default-flavor
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: ClusterQueue
metadata:
  name: cpu
spec:
  namespaceSelector: {}
  resourceGroups:
    - coveredResources: ["cpu", "memory"]
      flavors:
        - name: default-flavor
          resources:
            - name: cpu
              nominalQuota: {cpu}
            - name: memory
              nominalQuota: 16Gi
---
apiVersion: kueue.x-k8s.io/v1beta1
kind: LocalQueue
metadata:
  name: cpu
spec:
  clusterQueue: cpu
"""


def _cpu_quota(cluster: KubeCluster, cpus: int) -> None:
    from tests.support.standins import apply, manifests

    apply(cluster.admin, NAMESPACE, manifests(CPU_QUEUES.replace("{cpu}", str(cpus))))


@pytest.mark.slow
def test_a_restarted_flow_process_adopts_its_queued_job_and_keeps_waiting(
    gke: str, cluster: KubeCluster, gcs: object
):
    from tests.emulated.test_reattach import RESTART, _kill, _orchestrator, _result

    _cpu_quota(cluster, 0)
    options = {**RESTART, "queue": "cpu", "pending_timeout": PENDING_TIMEOUT}
    first = _orchestrator("new", cluster=gke, **options)
    flow_run_id = first.stdout.readline().split()[-1]  # type: ignore[union-attr]
    wait_until(lambda: [j for j in cluster.jobs() if j["spec"].get("suspend")], 90, "a queued Job")
    _kill(first)

    second = _orchestrator("again", flow_run_id, cluster=gke, **options)
    wait_until(
        lambda: any(m.startswith("Reattached") for m in _flow_run_messages(flow_run_id)),
        240,
        "the restarted flow process to adopt the queued Job",
    )
    adopted = time.monotonic()
    wait_until(
        lambda: time.monotonic() - adopted > 2 * PENDING_TIMEOUT and second.poll() is None,
        30,
        "the adopted Job to stay queued past the pending timeout",
    )
    _cpu_quota(cluster, 8)
    (Path.cwd() / "gate").touch()
    resumed_from = _result(second)

    assert resumed_from == 0
    assert len(cluster.created_jobs()) == 1


def _most_pods_at_once(cluster: KubeCluster) -> int:
    """From the cluster's pod events: the most pods alive (not ended, not deleted) at once."""
    return cluster.most_at_once(
        "pods",
        lambda kind, pod: (
            kind != "DELETED"
            and (pod.get("status") or {}).get("phase") not in {"Succeeded", "Failed"}
        ),
    )


def test_a_job_kueue_evicts_while_its_pod_runs_runs_again_once_never_beside_itself(
    gke, cluster, workdir
):
    _tpu_v5e_4_cluster(cluster)
    gate = workdir / "gate"

    @flow(task_runner=_runner(gke, accelerator="tpu-v5e-4", queue_name=QUEUE))
    def one() -> tuple[int, object]:
        future = hold.submit(7, str(gate))
        return future.result(), future.task_run_id

    running = _in_background(one)

    def running_pod() -> list[dict[str, Any]]:
        return [p for p in cluster.pods() if (p.get("status") or {}).get("phase") == "Running"]

    (first,) = wait_until(running_pod, 90, "the task's pod to run")
    job_name = first["metadata"]["labels"]["job-name"]
    cluster.run(cluster.kueue.preempt(NAMESPACE, job_name))
    wait_until(
        lambda: [p for p in running_pod() if p["metadata"]["labels"]["job-name"] != job_name],
        90,
        "the task's next pod to run",
    )
    gate.touch()
    result, task_run = running.result(timeout=120)

    assert result == 7
    assert len(cluster.created_jobs()) == 2  # run again once
    assert _most_pods_at_once(cluster) == 1
    assert _suspended(cluster) == 0
    assert job_name not in {j["metadata"]["name"] for j in cluster.jobs()}
    # On the preemption budget: the task has no retries of its own.
    messages = [s.message or "" for s in recorded_history(task_run)]
    assert any(m.startswith("Preempted: ") and "Kueue evicted" in m for m in messages)


def test_with_kueue_serving_only_v1beta2_a_queued_task_run_still_shows_its_position(
    gke, cluster, workdir
):
    cluster.call(lambda: cluster.kueue.serve("v1beta2"))
    cluster.kubelet.nodes = gke_nodes("tpu-v5e-4", "tpu-v5e-4", 4)
    _documented_queues(cluster, "v1beta2")
    gate = workdir / "gate"

    @flow(task_runner=_runner(gke, accelerator="tpu-v5e-4", queue_name=QUEUE))
    def sweep() -> list[int]:
        futures = hold.map(range(5), gate=unmapped(str(gate)))
        runs = [f.task_run_id for f in futures]
        wait_until(
            lambda: _waiting_for_quota(_positions(runs)),
            90,
            "a task run to show its queue position and Kueue's reason",
        )
        gate.touch()
        return [f.result() for f in futures]

    assert sweep() == list(range(5))
    # What the runner asked of Kueue's APIs, all at the served version.
    paths = [r.url.path for r in cluster.client_requests() if "kueue.x-k8s.io/" in r.url.path]
    assert paths and not [p for p in paths if "/v1beta1/" in p]


def test_a_queue_name_kueue_has_no_local_queue_for_fails_the_task_naming_it(gke, cluster):
    _tpu_v5e_4_cluster(cluster)
    # Past pytest-timeout's backstop: a run that waited for its pending timeout cannot pass.
    runner = _runner(
        gke, accelerator="tpu-v5e-4", queue_name="tpu-typo", pending_timeout_seconds=3600
    )

    @flow(task_runner=runner)
    def one() -> tuple[str, str]:
        future = hold.submit(1, gate="")
        future.wait()
        return future.state.type.value, future.state.message or ""

    state, message = one()

    assert state == "FAILED"
    assert "Kueue cannot admit the Job: LocalQueue tpu-typo doesn't exist" in message
    assert f"kubectl get localqueues -n {NAMESPACE}" in message
    wait_until(
        lambda: not cluster.jobs() and not cluster.workloads(),
        60,
        "the Job and its Workload to be deleted",
        left=lambda: [_summary(o) for o in cluster.jobs() + cluster.workloads()],
    )


def test_a_local_queue_created_while_kueue_says_it_is_missing_still_runs_the_task(
    gke, cluster, workdir
):
    cluster.kubelet.nodes = gke_nodes("tpu-v5e-4", "tpu-v5e-4", 4)
    _documented_queues(cluster, kinds=("ResourceFlavor", "ClusterQueue"))
    runner = _runner(
        gke,
        accelerator="tpu-v5e-4",
        queue_name=QUEUE,
        intervals={"missing_queue_grace_seconds": 600},
    )

    def said_missing() -> bool:
        return any(
            c.get("message") == f"LocalQueue {QUEUE} doesn't exist"
            for w in cluster.workloads()
            for c in (w.get("status") or {}).get("conditions") or []
        )

    @flow(task_runner=runner)
    def one() -> int:
        return hold.submit(5, gate="").result()

    running = _in_background(one)
    wait_until(said_missing, 90, "Kueue to say the LocalQueue does not exist")
    # Past the suite's grace, so the runner's own (600 s) is what keeps the Job.
    suite_grace = json.loads(os.environ["KINETIC_INTERVALS"])["missing_queue_grace_seconds"]
    said_at = time.monotonic()
    wait_until(
        lambda: time.monotonic() - said_at > 2 * suite_grace,
        2 * suite_grace + 30,
        "twice the suite's missing-queue grace",
    )
    assert cluster.jobs(), "the Job was deleted within the runner's grace"
    _documented_queues(cluster, kinds=("LocalQueue",))

    assert running.result(timeout=120) == 5
