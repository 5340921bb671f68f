"""Kueue without a cluster: the queued Job's manifest, how it reads, and what the runner may ask."""

from __future__ import annotations

import kubernetes_validate
import pytest

from kinetic_prefect.backends.gke.kueue import (
    listing_positions,
    missing_queue,
    queued_message,
    served_version,
    workload_of,
)
from kinetic_prefect.backends.gke.permissions import RUNNER_ACCESS, needed_access
from kinetic_prefect.backends.gke.status import job_status
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.settings import resolve_settings
from kinetic_prefect.launch.slices import build_workload
from tests.support.kube_emulator import version_priority
from tests.unit.test_manifest import _spec

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def _workload(name: str, created: str, job_uid: str, reserved: bool = False) -> dict:
    conditions = [{"type": "QuotaReserved", "status": "True" if reserved else "False",
                   "message": "couldn't assign flavors to pod set main: insufficient unused "
                   "quota for google.com/tpu in flavor tpu-v5e-4, 4 more needed"}]  # fmt: skip
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": created,
            "ownerReferences": [{"kind": "Job", "uid": job_uid}],
        },
        "spec": {"queueName": "tpu", "priority": 0},
        "status": {"conditions": conditions},
    }


@pytest.mark.parametrize("accelerator", ["tpu-v5e-4", "tpu-v5e-16"])
def test_a_queued_job_is_one_suspended_job_labelled_for_its_local_queue(accelerator: str):
    workload = build_workload(_spec(accelerator, queue_name="tpu"))

    job = workload.job
    assert job["metadata"]["labels"][QUEUE_LABEL] == "tpu"
    assert job["spec"]["suspend"] is True
    assert QUEUE_LABEL not in job["spec"]["template"]["metadata"]["labels"]
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)


def test_without_a_queue_name_a_job_is_neither_suspended_nor_labelled():
    job = build_workload(_spec("tpu-v5e-4")).job

    assert "suspend" not in job["spec"]
    assert QUEUE_LABEL not in job["metadata"]["labels"]


def test_a_queue_name_that_is_not_a_local_queue_name_is_refused_with_the_fix():
    with pytest.raises(ConfigurationError, match="kubectl get localqueues"):
        resolve_settings(runner={"queue_name": "TPU queue"}, environ={})


def test_queue_name_comes_from_the_environment_like_every_setting():
    assert resolve_settings(environ={"KINETIC_QUEUE_NAME": "tpu"}).queue_name == "tpu"


def test_the_status_of_a_suspended_job_of_a_queue_reads_queued_naming_its_local_queue():
    job = build_workload(_spec("tpu-v5e-4", queue_name="tpu")).job

    status, finished, _ = job_status(job, None)

    assert (status, finished) == (
        "Queued: waiting for Kueue to admit it from LocalQueue tpu",
        False,
    )


def test_the_message_names_queue_position_and_kueues_reason():
    workload = _workload("job-a", "2026-01-01T00:00:01Z", "uid-a")

    text = queued_message("tpu", workload, {"positionInLocalQueue": 2, "positionInClusterQueue": 5})

    assert text == (
        "queued in Kueue LocalQueue tpu, position 3 in the LocalQueue (6 in its ClusterQueue): "
        "couldn't assign flavors to pod set main: insufficient unused quota for google.com/tpu "
        "in flavor tpu-v5e-4, 4 more needed"
    )


def _reserved(status: str, reason: str, message: str) -> dict:
    condition = {"type": "QuotaReserved", "status": status, "reason": reason, "message": message}
    return {"status": {"conditions": [condition]}}


@pytest.mark.parametrize(
    ("workload", "says"),
    [
        # Kueue's messages (its workload controller's getQueueBlocker), either reason.
        (
            _reserved("False", "Inadmissible", "LocalQueue tpu doesn't exist"),
            "LocalQueue tpu doesn't exist; set queue_name to a LocalQueue of namespace ml "
            "(kubectl get localqueues -n ml)",
        ),
        (
            _reserved("False", "Misconfigured", "LocalQueue tpu is terminating or missing"),
            "LocalQueue tpu is terminating or missing; set queue_name",
        ),
        (
            _reserved("False", "Inadmissible", "ClusterQueue cluster-tpu doesn't exist"),
            "ClusterQueue cluster-tpu doesn't exist; create ClusterQueue cluster-tpu",
        ),
        # Waits that end by themselves are not failures.
        (_reserved("False", "Inadmissible", "LocalQueue tpu is inactive"), None),
        (_reserved("False", "Pending", "couldn't assign flavors to pod set main"), None),
        (_reserved("True", "QuotaReserved", "Quota reserved in ClusterQueue tpu"), None),
        ({"status": {}}, None),
        (None, None),
    ],
)
def test_a_workload_whose_queue_does_not_exist_fails_naming_the_fix(workload, says):
    found = missing_queue(workload, "ml")

    if says is None:
        assert found is None
    else:
        assert found is not None and says in found and found.endswith("The Job was deleted")


def test_a_missing_queue_fails_a_job_only_once_every_read_for_the_grace_said_so():
    from kinetic_prefect.backends.gke.kueue import QueueReader

    now = [0.0]
    reader = QueueReader(
        {},
        lambda: None,
        lambda job, reason: None,
        lambda job, reason: None,
        missing_queue_grace_seconds=60,
        clock=lambda: now[0],
    )
    seen = []
    for at in (0, 10, 59.9, 60, 61):
        now[0] = at
        seen.append(reader._missing_for_good("kp-a"))
    now[0] = 70
    late = reader._missing_for_good("kp-b")  # another Job: its own clock

    assert seen == [False, False, False, True, True]
    assert late is False


def test_without_the_visibility_api_positions_follow_creation_among_pending_workloads():
    workloads = [
        _workload("job-c", "2026-01-01T00:00:03Z", "uid-c"),
        _workload("job-a", "2026-01-01T00:00:01Z", "uid-a", reserved=True),
        _workload("job-b", "2026-01-01T00:00:02Z", "uid-b"),
    ]

    assert listing_positions(workloads) == {"job-b": 0, "job-c": 1}
    assert workload_of(workloads, "uid-c") is workloads[0]


def test_doctor_asks_for_kueue_verbs_only_of_a_runner_with_a_queue_name():
    kueue = {a for a in RUNNER_ACCESS if "kueue" in a.group}

    assert kueue and not kueue & set(needed_access(resolve_settings(environ={})))
    assert kueue <= set(needed_access(resolve_settings(runner={"queue_name": "tpu"}, environ={})))


def test_the_emulated_discovery_orders_versions_as_kubernetes_documents():
    # The example order of "Version priority" in Kubernetes' CRD versioning page.
    documented = ["v10", "v2", "v1", "v11beta2", "v10beta3", "v3beta1", "v12alpha1", "v11alpha2"]
    documented += ["foo1", "foo10"]
    assert sorted(reversed(documented), key=version_priority) == documented


def _group(preferred: str | None, *served: str) -> dict:
    listed = [{"groupVersion": f"kueue.x-k8s.io/{v}", "version": v} for v in served]
    chosen = {"groupVersion": f"kueue.x-k8s.io/{preferred}", "version": preferred}
    return {"kind": "APIGroup", "versions": listed, "preferredVersion": chosen}


@pytest.mark.parametrize(
    ("group", "version"),
    [
        # Kueue 0.14 and older.
        (_group("v1beta1", "v1beta1"), "v1beta1"),
        # 0.15 to 0.19: both served, v1beta2 first by version priority.
        (_group("v1beta2", "v1beta2", "v1beta1"), "v1beta2"),
        # v1beta1 no longer served (kubernetes-sigs/kueue#13957).
        (_group("v1beta2", "v1beta2"), "v1beta2"),
        # A newer version this runner does not speak is preferred: the newest it speaks.
        (_group("v1", "v1", "v1beta2"), "v1beta2"),
        (_group("v1", "v1"), None),
        (None, None),
    ],
)
def test_the_kueue_version_spoken_is_the_preferred_one_this_runner_knows(group, version):
    assert served_version(group) == version
