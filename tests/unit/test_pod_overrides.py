"""`pod_overrides`: merged into the pod spec by one rule; what the runner owns is refused."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.manifest import build_job_manifest
from kinetic_prefect.launch.pod_overrides import PodOverrideError
from kinetic_prefect.launch.settings import resolve_settings
from tests.unit.test_manifest import _spec

TEAM_TOLERATION = {"key": "team", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
RESERVATION = "cloud.google.com/reservation-name"


def _pod(accelerator: str = "tpu-v5e-4", **overrides: Any) -> dict[str, Any]:
    manifest = build_job_manifest(_spec(accelerator, pod_overrides=overrides))
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    return manifest["spec"]["template"]["spec"]


def test_tolerations_are_added_to_the_accelerators_own():
    pod = _pod(tolerations=[TEAM_TOLERATION])

    assert pod["tolerations"] == [
        {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"},
        TEAM_TOLERATION,
    ]


def test_priority_class_and_image_pull_secrets_are_set():
    pod = _pod(priorityClassName="training", imagePullSecrets=[{"name": "registry"}])

    assert (pod["priorityClassName"], pod["imagePullSecrets"]) == (
        "training",
        [{"name": "registry"}],
    )


def test_a_memory_backed_dev_shm_is_a_volume_and_a_mount_of_the_task_container():
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
    pod = _pod(
        volumes=[shm],
        containers=[{"name": "task", "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
    )
    (container,) = pod["containers"]

    assert shm in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert container["command"][:3] == ["python", "-m", "kinetic_prefect.pod"]


def test_a_reservation_is_a_node_selector_next_to_the_accelerators():
    pod = _pod(nodeSelector={RESERVATION: "my-tpus"})

    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x2",
        RESERVATION: "my-tpus",
    }


def test_a_reservation_can_be_a_node_affinity():
    term = {"matchExpressions": [{"key": RESERVATION, "operator": "In", "values": ["my-tpus"]}]}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
        }
    }

    assert _pod(affinity=affinity)["affinity"] == affinity


def test_a_sidecar_container_is_appended():
    sidecar = {"name": "metrics", "image": "busybox"}

    assert [c["name"] for c in _pod("cpu", containers=[sidecar])["containers"]] == [
        "task",
        "metrics",
    ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"containers": [{"name": "task", "command": ["sh"]}]}, "containers\\[task\\].command"),
        ({"containers": [{"name": "task", "args": []}]}, "containers\\[task\\].args"),
        (
            {"containers": [{"name": "task", "resources": {"limits": {"google.com/tpu": "8"}}}]},
            "use accelerator=, cpu= and memory=",
        ),
        (
            {"containers": [{"name": "task", "env": [{"name": "KINETIC_JOB_ID", "value": "x"}]}]},
            "env\\[KINETIC_JOB_ID\\].*use env=",
        ),
        (
            {"nodeSelector": {"cloud.google.com/gke-tpu-topology": "4x4"}},
            "change nodeSelector.cloud.google.com/gke-tpu-topology from '2x2' to '4x4'",
        ),
        ({"restartPolicy": "OnFailure"}, "retries are Prefect's"),
        ({"resources": {"requests": {"cpu": "4"}}}, "use cpu= and memory="),
        ({"tolerration": []}, "not a PodSpec field \\(did you mean 'tolerations'\\?\\)"),
    ],
)
def test_overrides_of_what_the_runner_owns_are_refused_saying_what_to_use(
    overrides: dict[str, Any], message: str
):
    with pytest.raises(PodOverrideError, match=message):
        build_job_manifest(_spec("tpu-v5e-4", pod_overrides=overrides))


def test_pod_overrides_from_the_block_and_the_runner_combine_key_by_key():
    settings = resolve_settings(
        block={"pod_overrides": {"tolerations": [TEAM_TOLERATION], "priorityClassName": "low"}},
        runner={"pod_overrides": {"priorityClassName": "high"}},
        environ={},
    )

    assert settings.pod_overrides == {"tolerations": [TEAM_TOLERATION], "priorityClassName": "high"}


def test_a_typo_in_pod_overrides_fails_when_the_settings_are_resolved():
    with pytest.raises(ConfigurationError, match="not a PodSpec field"):
        resolve_settings(runner={"pod_overrides": {"priorityclassname": "x"}}, environ={})


def test_pod_overrides_come_from_kinetic_pod_overrides_as_json():
    settings = resolve_settings(environ={"KINETIC_POD_OVERRIDES": '{"priorityClassName": "x"}'})

    assert settings.pod_overrides == {"priorityClassName": "x"}
