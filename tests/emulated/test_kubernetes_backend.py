"""The gke backend end to end: real kubernetes-asyncio against kmock, a test kubelet, fake GCS.

Pods import this module to run its tasks: prefect-kubernetes (seconds of imports)
is imported only in the test that uses it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import kmock
import kubernetes_validate
import pytest
import yaml
from prefect import flow, task
from prefect.exceptions import TerminationSignal
from prefect.futures import wait
from prefect.settings import PREFECT_API_KEY, temporary_settings

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.manifest import LABEL_JOB_ID
from tests.emulated.test_results_and_retries import train_to_ten
from tests.runner.test_task_runner import raise_in_a_pod
from tests.support.gcs_iam import PODS_MEMBER
from tests.support.kube import TESTER, KubeCluster
from tests.support.kube_auth import User
from tests.support.waiting import recorded_history, wait_for_task_run_state, wait_until

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

TEST_API_KEY = "pnu_kinetic-test-key-0123456789abcdef"
MISSING_IMAGE = "registry.example.com/ml/trainer:no-such-tag"


@task
def cube(x: int) -> int:
    return x**3


@task
def explode() -> None:
    raise ValueError("boom")


@task
def trivial(x: int) -> int:
    return x


@task
def environment_of_the_pod(names: list[str]) -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in names}


@task
def wait_for_gate(gate: str) -> str:
    pause = threading.Event()
    while not Path(gate).exists():
        pause.wait(0.05)
    return "opened"


def _runner(gke: str, **options: object) -> KineticTaskRunner:
    # The test kubelet runs pods on this machine, so they can reach the loopback API.
    return KineticTaskRunner(cluster=gke, allow_loopback_api=True, **options)


def _state_messages(task_run_id: object) -> list[tuple[str, str]]:
    """(type, message) of each state the API recorded for an ended task run, oldest first."""
    return [(s.type.value, s.message or "") for s in recorded_history(task_run_id)]


def _failed_run(runner: KineticTaskRunner, submitted: object = trivial) -> tuple[str, str, str]:
    @flow(task_runner=runner)
    def run() -> tuple[str, str, str]:
        future = submitted.submit(1)  # type: ignore[attr-defined]
        future.wait()
        return future.state.type.value, future.state.message or "", future.job_id

    return run()


# -- the core and results/retries cases, on Jobs ---------------------------------------------


def test_mapped_results_come_back_from_job_pods_through_gcs_result_storage(gke, cluster, gcs):
    @flow(task_runner=_runner(gke))
    def cubes() -> tuple[list[int], list[str]]:
        futures = cube.map([1, 2, 3])
        return [f.result() for f in futures], [f.job_id for f in futures]

    results, job_ids = cubes()

    assert results == [1, 8, 27]
    assert sorted(j["metadata"]["name"] for j in cluster.created_jobs()) == sorted(job_ids)
    assert len(gcs.names("results/")) >= 3
    assert all(f"kinetic/{job_id}/final-state.json" in gcs.names("kinetic/") for job_id in job_ids)


@task
def cube_noting_prefect_gcp_at_exit(x: int, note: str) -> int:
    """x**3; once the pod has written its result and final state, the prefect-gcp modules
    its process imported go to the file `note` (an exit handler: the pod's own runs last)."""
    import atexit
    import sys

    def write_note() -> None:
        imported = sorted(m for m in sys.modules if m.split(".")[0] == "prefect_gcp")
        Path(note).write_text(json.dumps(imported))

    atexit.register(write_note)
    return x**3


def test_a_gke_task_pod_writes_its_result_without_importing_prefect_gcp(gke, gcs, tmp_path):
    note = tmp_path / "prefect-gcp-modules.json"

    @flow(task_runner=_runner(gke))
    def one() -> int:
        return cube_noting_prefect_gcp_at_exit.submit(3, str(note)).result()

    assert one() == 27  # small: it travels in the signed final-state record
    assert len(gcs.names("results/")) == 1
    assert json.loads(note.read_text()) == []


def test_a_twelve_task_map_costs_under_3_kubernetes_api_requests_per_task(gke, cluster):
    cluster.kubelet.run_containers = False  # the pod ends with exit 0 as soon as it runs
    set_up = len(cluster.client_requests())  # the administrator's, before the flow

    @flow(task_runner=_runner(gke))
    def fan_out() -> list[str]:
        futures = trivial.map(range(12))
        wait(futures)
        return [f.job_id for f in futures]

    job_ids = fan_out()

    # Watches, not polls: the count does not grow with how long the pods take (the
    # benchmark bench_kube_scale.py prints it at 100 and 500 tasks).
    assert len(cluster.created_jobs()) == len(set(job_ids)) == 12
    assert len(cluster.client_requests()) - set_up < 3 * 12


def test_a_pod_sees_its_manifests_env_but_not_a_variable_set_only_in_the_test_process(
    gke, cluster, gcs, monkeypatch
):
    monkeypatch.setenv("KP_ONLY_IN_THE_TEST_PROCESS", "leaked")
    names = ["KP_ONLY_IN_THE_TEST_PROCESS", "KP_FROM_THE_RUNNER", "STORAGE_EMULATOR_HOST"]

    @flow(task_runner=_runner(gke, env={"KP_FROM_THE_RUNNER": "carried"}))
    def inspect() -> dict[str, str | None]:
        return environment_of_the_pod.submit(names).result()

    seen = inspect()

    assert seen == {
        "KP_ONLY_IN_THE_TEST_PROCESS": None,
        "KP_FROM_THE_RUNNER": "carried",
        # From the cluster block's env, as a user's emulator settings would travel; the
        # kubelet points it at the pod's own identity (tests/support/pod_env.py).
        "STORAGE_EMULATOR_HOST": gcs.iam.endpoint(PODS_MEMBER),
    }


def test_task_exception_is_reraised_with_the_pod_traceback_and_the_run_is_failed(gke, cluster):
    formatted, task_run_id = raise_in_a_pod(_runner(gke))

    assert "Traceback from the pod" in formatted
    assert 'raise ValueError("boom")' in formatted
    wait_for_task_run_state(task_run_id, "FAILED")


@pytest.mark.slow
def test_killed_training_pod_resumes_from_its_last_checkpoint_in_a_new_job(gke, cluster):
    @flow(task_runner=_runner(gke))
    def train() -> tuple[dict[str, object], list[str]]:
        future = train_to_ten.submit("kill")
        return future.result(), future.job_ids

    result, job_ids = train()

    assert result["start"] >= 5
    assert result["count"] == 10.0
    assert len(job_ids) == 2
    assert {j["metadata"]["name"] for j in cluster.created_jobs()} == set(job_ids)


def test_job_created_despite_an_error_response_is_watched_not_abandoned(gke, cluster):
    def first_create_fails(request: object) -> object:
        # The API server stores the Job but the response is lost (kmock keeps the object).
        if failures:
            failures.pop()
            return kmock.KubernetesError(status=504, reason="Timeout", message="etcd timed out")
        return NotImplemented

    failures = [True]
    cluster.call(lambda: cluster.emulator["post", re.compile(r".*/jobs")] << first_create_fails)

    @flow(task_runner=_runner(gke))
    def run() -> int:
        return cube.submit(2).result()

    assert run() == 8
    # Its retry found the Job the lost answer had created: one Job, under one name.
    assert len({j["metadata"]["name"] for j in cluster.created_jobs()}) == 1


def _job_posts(cluster: KubeCluster) -> list[object]:
    return [
        r
        for r in cluster.client_requests()
        if r.method.value == "POST" and r.resource is not None and r.resource.plural == "jobs"
    ]


def _flow_of_one_cube(runner: KineticTaskRunner) -> tuple[int, str]:
    @flow(task_runner=runner)
    def run() -> tuple[int, str]:
        future = cube.submit(2)
        return future.result(), future.job_id

    return run()


def test_a_job_create_answered_503_once_still_runs_its_task(gke, cluster):
    cluster.fail_next("post", "jobs", 503, "ServiceUnavailable", "etcdserver: leader changed")

    result, job_id = _flow_of_one_cube(_runner(gke))

    assert result == 8
    assert [j["metadata"]["name"] for j in cluster.jobs()] == [job_id]
    assert len(_job_posts(cluster)) == 2


def test_a_job_create_answered_429_waits_its_retry_after_and_runs_its_task(gke, cluster):
    cluster.fail_next(
        "post",
        "jobs",
        429,
        "TooManyRequests",
        "Too many requests, please try again later.",
        retry_after=2,
    )

    result, job_id = _flow_of_one_cube(_runner(gke))

    first, second = _job_posts(cluster)
    arrived = cluster.call(lambda: dict(cluster.emulator.arrived_at))
    assert result == 8
    assert [j["metadata"]["name"] for j in cluster.jobs()] == [job_id]
    assert arrived[second.id] - arrived[first.id] >= 2


@pytest.mark.parametrize(
    ("code", "reason", "message", "says"),
    [
        (
            422,
            "Invalid",
            'Job.batch "kp-x" is invalid: spec.template.spec.containers[0].image: Required value',
            "422 Invalid: Job.batch",
        ),
        (
            403,
            "Forbidden",
            'jobs.batch is forbidden: User "ci" cannot create resource "jobs"',
            "apply deployments/k8s/rbac.yaml",
        ),
    ],
)
def test_a_job_create_refused_for_good_is_not_retried_and_fails_saying_why(
    gke, cluster, code, reason, message, says
):
    cluster.fail_next("post", "jobs", code, reason, message)

    state, failure, _ = _failed_run(_runner(gke))

    assert state == "FAILED"
    assert says in failure and message in failure
    assert len(_job_posts(cluster)) == 1
    assert cluster.jobs() == []


# -- watching --------------------------------------------------------------------------------


def _pod_phase(cluster: KubeCluster, job_id: str) -> str | None:
    pods = [p for p in cluster.pods() if p["metadata"]["labels"].get(LABEL_JOB_ID) == job_id]
    return pods[0].get("status", {}).get("phase") if pods else None


def _only_job_id(cluster: KubeCluster) -> str | None:
    jobs = cluster.jobs()
    return jobs[0]["metadata"]["name"] if len(jobs) == 1 else None


@contextmanager
def alongside(scenario: Callable[[], None]) -> Iterator[None]:
    """Run `scenario` in a thread while the block runs a flow.

    A flow cannot close over the cluster: the flow object travels to pods in their payload.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            scenario()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(timeout=120)
    if errors:
        raise errors[0]


def _complete_during_outage(cluster: KubeCluster, gate: Path, compact: bool) -> Callable[[], int]:
    """Cut (and hold) every watch while the pod finishes; returns the request count at the cut."""
    cut_at: list[int] = []

    def scenario() -> None:
        job_id = wait_until(lambda: _only_job_id(cluster), 60, "the Job to be created")
        wait_until(lambda: _pod_phase(cluster, job_id) == "Running", 60, "the pod to run")
        cut_at.append(len(cluster.client_requests()))
        cluster.cut_watches(hold=True)
        gate.touch()
        wait_until(lambda: _pod_phase(cluster, job_id) == "Succeeded", 60, "the pod to finish")
        if compact:
            cluster.compact()
        cluster.release_watches()

    scenario.cut_at = cut_at  # type: ignore[attr-defined]
    return scenario  # type: ignore[return-value]


def _gated_flow(runner: KineticTaskRunner, gate: Path) -> str:
    @flow(task_runner=runner)
    def gated() -> str:
        return wait_for_gate.submit(str(gate)).result(timeout=120)

    return gated()


def test_pod_finishing_while_the_watch_is_cut_is_noticed_when_the_watch_resumes(
    gke, cluster, workdir
):
    scenario = _complete_during_outage(cluster, workdir / "gate", compact=False)

    with alongside(scenario):
        result = _gated_flow(_runner(gke), workdir / "gate")

    assert result == "opened"
    after_cut = cluster.client_requests()[scenario.cut_at[0] :]  # type: ignore[attr-defined]
    resumed = [r for r in after_cut if r.params.get("watch") and r.params.get("resourceVersion")]
    assert {r.resource.plural for r in resumed} == {"jobs", "pods"}


def test_pod_finishing_while_history_is_compacted_is_noticed_by_relisting(gke, cluster, workdir):
    scenario = _complete_during_outage(cluster, workdir / "gate", compact=True)

    with alongside(scenario):
        result = _gated_flow(_runner(gke), workdir / "gate")

    assert result == "opened"
    after_cut = cluster.client_requests()[scenario.cut_at[0] :]  # type: ignore[attr-defined]
    assert [r.resource.plural for r in after_cut if not r.params.get("watch")].count("pods") == 1


# -- credentials refused --------------------------------------------------------------------

UNAUTHORIZED = (401, "Unauthorized", "Unauthorized")
FORBIDDEN_WATCH = (
    403,
    "Forbidden",
    'pods is forbidden: User "system:serviceaccount:default:kinetic-prefect-runner" '
    'cannot watch resource "pods" in API group "" in the namespace "default"',
)
DENIED_TIMEOUT = 2.0


def _while_the_pod_runs(
    cluster: KubeCluster,
    act: Callable[[], None],
    gate: Path | None = None,
    until: Callable[[], bool] = lambda: True,
    what: str = "",
) -> Callable[[], None]:
    """Once the only Job's pod runs: `act`, end every watch (the runner reopens them), and
    open `gate` once `until` holds."""

    def scenario() -> None:
        job_id = wait_until(lambda: _only_job_id(cluster), 60, "the Job to be created")
        wait_until(lambda: _pod_phase(cluster, job_id) == "Running", 60, "the pod to run")
        act()
        cluster.cut_watches()
        if gate is not None:
            wait_until(until, 30, what)
            gate.touch()

    return scenario


def _watches_reopened_with(cluster: KubeCluster, token: str) -> set[str]:
    return {
        r.resource.plural
        for r in cluster.client_requests()
        if r.params.get("watch") and r.headers.get("Authorization") == f"Bearer {token}"
    }


def test_a_watch_answered_401_once_fails_no_task(gke, cluster, workdir):
    gate = workdir / "gate"

    def refuse_once() -> None:
        cluster.fail_next("get", "pods", *UNAUTHORIZED, watch=True)
        cluster.fail_next("get", "jobs", *UNAUTHORIZED, watch=True)

    refused = _while_the_pod_runs(
        cluster,
        refuse_once,
        gate,
        lambda: not cluster.call(lambda: cluster.emulator.faults),
        "both watches to be refused",
    )
    with alongside(refused):
        result = _gated_flow(_runner(gke), gate)

    assert result == "opened"


def test_a_rotated_token_in_the_kubeconfig_is_picked_up_when_the_old_one_is_refused(
    gke, cluster, workdir
):
    gate = workdir / "gate"
    old_token = cluster.kubeconfig_dict()["users"][0]["user"]["token"]

    def rotate() -> None:
        # The same user, a new token (GKE's bound tokens rotate hourly).
        cluster.call(lambda: cluster.emulator.tokens.update({"rotated-token": User(TESTER)}))
        rotated = cluster.kubeconfig_dict()
        rotated["users"][0]["user"]["token"] = "rotated-token"
        cluster.kubeconfig.write_text(json.dumps(rotated))
        cluster.refuse(*UNAUTHORIZED, token=old_token)

    rotated = _while_the_pod_runs(
        cluster,
        rotate,
        gate,
        lambda: _watches_reopened_with(cluster, "rotated-token") == {"jobs", "pods"},
        "the watches to reopen with the rotated token",
    )
    with alongside(rotated):
        result = _gated_flow(_runner(gke), gate)

    assert result == "opened"


def test_credentials_refused_for_good_fail_the_task_after_the_bound_saying_since_when(
    gke, cluster, workdir
):
    refused_at: list[float] = []

    def refuse_for_good() -> None:
        refused_at.append(time.monotonic())
        cluster.refuse(*FORBIDDEN_WATCH, watch=True)

    @flow(task_runner=_runner(gke, credentials_denied_timeout_seconds=DENIED_TIMEOUT))
    def run() -> tuple[str, str]:
        future = wait_for_gate.submit(str(workdir / "never"))
        future.wait()
        return future.state.type.value, future.state.message or ""

    with alongside(_while_the_pod_runs(cluster, refuse_for_good)):
        state, message = run()
        failed_at = time.monotonic()

    assert state == "FAILED"
    assert "the cluster refused the credentials to watch" in message
    assert re.search(r"since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", message)
    assert "credentials_denied_timeout_seconds=2" in message
    assert FORBIDDEN_WATCH[2] in message
    assert failed_at - refused_at[0] >= DENIED_TIMEOUT


# -- pods that never start -------------------------------------------------------------------

PENDING_TIMEOUT = 3.0


# Which reasons a waiting pod gives, and when it fails, are tables
# (tests/unit/test_gke_status.py, test_gke_decisions.py, test_outcome_deadlines.py); the
# wiring of a pod that never starts (the run fails with the reason, the Job is deleted,
# no retry) is this case's.
def test_image_pull_error_fails_the_task_run_naming_the_image_and_deletes_its_job(gke, cluster):
    cluster.kubelet.missing_images.add(MISSING_IMAGE)
    runner = _runner(gke, container_image=MISSING_IMAGE, pending_timeout_seconds=PENDING_TIMEOUT)

    state, message, _ = _failed_run(runner)

    assert state == "FAILED"
    assert f"cannot pull image {MISSING_IMAGE} (ImagePullBackOff" in message
    assert f"longer than pending_timeout_seconds={PENDING_TIMEOUT:g}" in message
    assert len(cluster.created_jobs()) == 1
    wait_until(lambda: cluster.jobs() == [], 30, "the Job to be deleted")


def test_quota_error_shows_as_the_pending_message_before_the_run_fails(gke, cluster):
    cluster.kubelet.quota_exceeded = True
    runner = _runner(gke, pending_timeout_seconds=PENDING_TIMEOUT)

    @flow(task_runner=runner)
    def run() -> object:
        future = trivial.submit(1)
        future.wait()
        return future.task_run_id

    history = _state_messages(run())

    pending = [message for kind, message in history if kind == "PENDING"]
    assert any("is pending: cannot create the pod" in m and "exceeded quota" in m for m in pending)
    assert history[-1][0] == "FAILED"
    assert "exceeded quota: gpu-quota" in history[-1][1]


# -- pods that Kubernetes ends --------------------------------------------------------------


# The reason for each way Kubernetes ends a pod is a row of tests/unit/test_gke_decisions.py;
# these two differ in wiring: a preempted pod is relaunched until its budget runs out, a
# pod past its deadline is gone before its Job says why.
@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("preempt", "preempted: the node is shutting down"),
        ("deadline", "DeadlineExceeded: Job was active longer than specified deadline"),
    ],
)
def test_pod_ended_by_kubernetes_crashes_the_task_run_with_the_reason(gke, cluster, fault, reason):
    cluster.kubelet.fault = fault

    state, message, _ = _failed_run(_runner(gke))

    assert state == "CRASHED"
    assert reason in message


# -- safety ----------------------------------------------------------------------------------


def test_loopback_api_url_is_refused_before_any_job_exists(gke, cluster):
    @flow(task_runner=KineticTaskRunner(cluster=gke))
    def run() -> int:
        return trivial.submit(1).result()

    with pytest.raises(ConfigurationError, match="loopback address") as info:
        run()

    assert "KINETIC_ALLOW_LOOPBACK_API=true" in str(info.value)
    assert cluster.created_jobs() == []


def test_api_key_reaches_pods_only_through_the_kubernetes_secret(gke, cluster, gcs):
    @flow(task_runner=_runner(gke))
    def run() -> int:
        return cube.submit(2).result()

    with temporary_settings({PREFECT_API_KEY: TEST_API_KEY}):
        assert run() == 8

    (job,) = cluster.created_jobs()
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env["PREFECT_API_KEY"]["valueFrom"]["secretKeyRef"]
    (secret,) = [s for s in cluster.created("secrets") if s["metadata"]["name"] == ref["name"]]
    assert base64.b64decode(secret["data"][ref["key"]]).decode() == TEST_API_KEY
    assert cluster.secret("default", ref["name"]) is None  # deleted with the runner's Jobs
    assert all(TEST_API_KEY not in json.dumps(job) for job in cluster.created_jobs())
    bucket = gcs.client.bucket(gcs.name)
    leaks = [n for n in gcs.names() if TEST_API_KEY.encode() in bucket.blob(n).download_as_bytes()]
    assert leaks == []


def _last_state_of_secret(cluster: KubeCluster, name: str) -> dict[str, object]:
    events = cluster.call(lambda: list(cluster.emulator.events))
    states = [e["object"] for _, r, e in events if r.plural == "secrets"]
    return [obj for obj in states if obj["metadata"]["name"] == name][-1]


def test_the_runners_secret_is_owned_by_every_job_that_reads_it(gke, cluster):
    cluster.kubelet.run_containers = False

    @flow(task_runner=_runner(gke))
    def fan_out() -> None:
        wait(trivial.map(range(4)))

    fan_out()

    (secret,) = {s["metadata"]["name"] for s in cluster.created("secrets")}
    owners = _last_state_of_secret(cluster, secret)["metadata"]["ownerReferences"]
    jobs = cluster.jobs()
    assert {o["uid"] for o in owners} == {j["metadata"]["uid"] for j in jobs}
    assert {(o["apiVersion"], o["kind"]) for o in owners} == {("batch/v1", "Job")}
    assert not any(o["controller"] or o["blockOwnerDeletion"] for o in owners)
    assert cluster.secret("default", secret) is None  # deleted when the runner closed


def _wait_for_file(path: str) -> None:
    wait_until(lambda: Path(path).exists(), 120, f"{path} to exist")


def test_a_secret_collected_with_its_last_job_is_created_again_for_the_next_one(
    gke, cluster, workdir
):
    gate = workdir / "gate"

    def collect_between_tasks() -> None:
        wait_until(lambda: cluster.created_jobs(), 60, "the first Job")
        wait_until(
            lambda: not cluster.jobs() and not cluster.secrets(), 60, "Job and Secret collected"
        )
        gate.touch()

    runner = _runner(gke, ttl_seconds_after_finished=1, pending_timeout_seconds=PENDING_TIMEOUT)

    @flow(task_runner=runner)
    def one_then_another() -> tuple[int, int]:
        first = cube.submit(2).result()
        _wait_for_file(str(gate))
        return first, cube.submit(3).result()

    with alongside(collect_between_tasks):
        results = one_then_another()

    assert results == (8, 27)
    assert len(cluster.created("secrets")) == 2


def test_cancelling_the_flow_run_deletes_its_jobs(gke, cluster, workdir):
    from prefect._internal import control_listener

    def cancel() -> None:
        wait_until(
            lambda: [p["status"].get("phase") for p in cluster.pods()] == ["Running"] * 2,
            90,
            "both pods to run",
        )
        # How a Prefect worker or runner cancels a flow run: it says so, then sends SIGTERM.
        control_listener._set_intent("cancel")
        os.kill(os.getpid(), signal.SIGTERM)

    @flow(task_runner=_runner(gke))
    def hanging() -> None:
        futures = [wait_for_gate.submit(str(workdir / f"never-{i}")) for i in range(2)]
        futures[0].result(timeout=120)

    try:
        with alongside(cancel), pytest.raises(TerminationSignal):
            hanging()
    finally:
        control_listener.clear_intent()

    assert len(cluster.created_jobs()) == 2
    wait_until(lambda: cluster.jobs() == [] and cluster.pods() == [], 30, "Jobs and pods gone")


def _most_jobs_running_at_once(cluster: KubeCluster) -> int:
    """From the cluster's events: the most Jobs at once whose pod had not ended.

    A Job counts from its creation until its pod reaches Succeeded or Failed (or the Job
    is complete or deleted): the runner may create the next Job as soon as a pod has
    ended, before the Job controller has marked that pod's Job complete.
    """
    running: set[str] = set()
    most = 0
    for _, resource, event in cluster.call(lambda: list(cluster.emulator.events)):
        obj = event["object"]
        if resource.plural == "pods":
            phase = (obj.get("status") or {}).get("phase")
            if event["type"] == "DELETED" or phase in ("Succeeded", "Failed"):
                running.discard((obj["metadata"].get("labels") or {}).get(LABEL_JOB_ID, ""))
            continue
        if resource.plural != "jobs":
            continue
        name = obj["metadata"]["name"]
        conditions = obj.get("status", {}).get("conditions") or []
        if event["type"] == "ADDED":
            running.add(name)
        elif event["type"] == "DELETED" or any(c["type"] == "Complete" for c in conditions):
            running.discard(name)
        most = max(most, len(running))
    return most


def test_max_parallel_holds_jobs_back_until_a_running_one_ends(gke, cluster):
    cluster.kubelet.run_containers = False

    @flow(task_runner=_runner(gke, max_parallel=1))
    def fan_out() -> None:
        wait(trivial.map(range(3)))

    fan_out()

    assert len(cluster.created_jobs()) == 3
    assert _most_jobs_running_at_once(cluster) == 1


# -- cluster access --------------------------------------------------------------------------


def test_kube_config_block_wins_over_the_local_kubeconfig(gke, cluster, tmp_path, monkeypatch):
    from prefect_kubernetes.credentials import KubernetesClusterConfig

    from kinetic_prefect.blocks import KineticCluster

    cluster.kubelet.run_containers = False
    unreachable = {**cluster.kubeconfig_dict()}
    unreachable["clusters"] = [{"name": "kmock", "cluster": {"server": "http://127.0.0.1:9"}}]
    (tmp_path / "elsewhere.json").write_text(json.dumps(unreachable))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "elsewhere.json"))
    block = KineticCluster.load(gke)
    block.kube_config = KubernetesClusterConfig(
        config=cluster.kubeconfig_dict(), context_name="kmock"
    )

    _failed_run(KineticTaskRunner(cluster=block, allow_loopback_api=True))

    assert len(cluster.created_jobs()) == 1


def test_deployment_manifests_validate_strictly():
    documents = [
        doc
        for path in sorted(Path(__file__).parents[2].glob("deployments/k8s/*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
    ]

    assert {d["kind"] for d in documents} >= {"ServiceAccount", "Role", "RoleBinding"}
    for document in documents:
        kubernetes_validate.validate(document, kubernetes_validate.latest_version(), strict=True)


def test_dependents_of_a_gate_leave_room_for_the_task_that_opens_it_on_gke(gke, workdir):
    from tests.runner.test_waiting_upstreams import DEPENDENTS, dependents_then_their_opener

    results, opener = dependents_then_their_opener(_runner(gke, max_parallel=4), workdir / "gate")

    assert opener == "opener ran"
    assert results == [("opened", index) for index in range(DEPENDENTS)]
