"""DWS flex-start through Kueue: the taint's toleration, and Job labels and annotations.

Queued-provisioning nodes carry `cloud.google.com/gke-queued=true:NoSchedule`
(docs/kueue.md cites GKE's pages); Kueue copies `provreq.kueue.x-k8s.io/*` Job annotations
into the ProvisioningRequest and reads a priority class from `kueue.x-k8s.io/priority-class`.
"""

from __future__ import annotations

import dataclasses

import pytest

from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.manifest import build_job_manifest
from kinetic_prefect.launch.settings import resolve_settings
from kinetic_prefect.worker.flow_pod import inherited_settings_env
from tests.support.kube_objects import gke_nodes, place
from tests.unit.test_manifest import _spec

GKE_QUEUED = {"key": "cloud.google.com/gke-queued", "value": "true", "effect": "NoSchedule"}


def _dws_nodes() -> list:
    nodes = gke_nodes("tpu-v5e-4-dws", "tpu-v5e-4", 1)
    for node in nodes:
        node.taints.append(dict(GKE_QUEUED))
        node.labels["cloud.google.com/gke-queued"] = "true"
    return nodes


@pytest.mark.parametrize(("queued_provisioning", "lands"), [(True, True), (False, False)])
def test_a_pod_lands_on_a_queued_provisioning_node_only_with_the_setting(
    queued_provisioning: bool, lands: bool
) -> None:
    job = build_job_manifest(
        _spec("tpu-v5e-4", queue_name="tpu-dws", queued_provisioning=queued_provisioning)
    )

    placed = place(_dws_nodes(), job["spec"]["template"]["spec"], 1)

    assert isinstance(placed, list) is lands, placed


def test_job_labels_and_annotations_reach_the_jobs_metadata_beside_the_runners() -> None:
    job = build_job_manifest(
        _spec(
            queue_name="tpu-dws",
            job_labels={"kueue.x-k8s.io/priority-class": "training"},
            job_annotations={"provreq.kueue.x-k8s.io/maxRunDurationSeconds": "7200"},
        )
    )

    meta = job["metadata"]
    assert meta["labels"]["kueue.x-k8s.io/priority-class"] == "training"
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-dws"
    assert meta["annotations"]["provreq.kueue.x-k8s.io/maxRunDurationSeconds"] == "7200"
    assert "kueue.x-k8s.io/priority-class" not in job["spec"]["template"]["metadata"]["labels"]


def test_a_job_label_the_runner_writes_is_refused_naming_the_setting_to_use() -> None:
    with pytest.raises(ConfigurationError, match="use queue_name= for the Kueue queue"):
        build_job_manifest(_spec(job_labels={"kueue.x-k8s.io/queue-name": "other"}))


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"queued_provisioning": True}, "queued_provisioning=True needs queue_name"),
        ({"job_labels": {"team": "ml research"}}, "is not a label value"),
        ({"job_labels": {"-team": "ml"}}, "is not a Kubernetes label key"),
        ({"job_labels": {"/team": "ml"}}, "is not a Kubernetes label key"),
        ({"job_labels": {"a..b/team": "ml"}}, "is not a Kubernetes label key"),
        ({"job_labels": {"kinetic-prefect.io/warm": "true"}}, "kinetic-prefect's own"),
        ({"job_labels": {"kueue.x-k8s.io/queue-name": "tpu"}}, "set queue_name= instead"),
        ({"job_annotations": {"provreq.kueue.x-k8s.io/maxRunDurationSeconds": 600}}, "quote"),
        ({"job_annotations": ["a"]}, "must be a mapping"),
    ],
)
def test_bad_dws_settings_are_refused_saying_what_to_do(settings: dict, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        resolve_settings(runner=settings, environ={})


def test_layers_combine_job_labels_key_by_key_and_env_carries_them() -> None:
    settings = resolve_settings(
        runner={"job_labels": {"team": "ml"}},
        block={"job_labels": {"kueue.x-k8s.io/priority-class": "training", "team": "x"}},
        environ={"KINETIC_JOB_ANNOTATIONS": '{"note": "nightly"}'},
    )

    assert settings.job_labels == {"kueue.x-k8s.io/priority-class": "training", "team": "ml"}
    assert settings.job_annotations == {"note": "nightly"}
    # A flow pod passes them on to its task pods' runner.
    env = inherited_settings_env(dataclasses.replace(settings, backend="local"))
    again = resolve_settings(environ={k: v for k, v in env.items() if "JOB_" in k})
    assert (again.job_labels, again.job_annotations) == (
        settings.job_labels,
        settings.job_annotations,
    )


def test_a_work_pools_job_variables_reach_the_flow_pods_settings() -> None:
    from kinetic_prefect.worker.flow_pod import flow_pod_settings
    from kinetic_prefect.worker.worker import KineticJobConfiguration

    configuration = KineticJobConfiguration(
        queue_name="tpu-dws",
        queued_provisioning=True,
        job_labels={"kueue.x-k8s.io/priority-class": "nightly"},
        job_annotations={"provreq.kueue.x-k8s.io/maxRunDurationSeconds": "3600"},
    )

    settings = flow_pod_settings(configuration)

    assert settings.queued_provisioning is True
    assert settings.job_labels == {"kueue.x-k8s.io/priority-class": "nightly"}
    assert settings.job_annotations == {"provreq.kueue.x-k8s.io/maxRunDurationSeconds": "3600"}


def test_a_builder_job_carries_the_users_job_metadata_but_no_queue() -> None:
    from kinetic_prefect.backends.environments import builder_spec
    from kinetic_prefect.launch.environment import EnvironmentPlan

    settings = resolve_settings(
        runner={
            "backend": "gke",
            "queue_name": "tpu-dws",
            "job_labels": {"cost-center": "ml-research"},
            "job_annotations": {"provreq.kueue.x-k8s.io/maxRunDurationSeconds": "7200"},
        },
        environ={},
    )
    plan = EnvironmentPlan(
        key="0123456789abcdef",
        python="3.11",
        platform="linux_x86_64",
        pins=("inflection==0.5.1",),
        wheels=(),
        index_url=None,
        requirements_source="requirements.txt",
    )

    job = build_job_manifest(builder_spec(settings, plan, "gs://b/spec.json", "gs://b/env"))

    meta = job["metadata"]
    assert meta["labels"]["cost-center"] == "ml-research"
    assert meta["annotations"]["provreq.kueue.x-k8s.io/maxRunDurationSeconds"] == "7200"
    assert "kueue.x-k8s.io/queue-name" not in meta["labels"]
