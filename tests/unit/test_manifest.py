"""The Job manifest contract of DESIGN.md, checked with kubernetes-validate (strict)."""

from __future__ import annotations

import json
import re

import kubernetes_validate
import pytest
from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch import prefect_context
from kinetic_prefect.launch.accelerators import parse_accelerator
from kinetic_prefect.launch.manifest import (
    LaunchSpec,
    SecretRef,
    build_job_manifest,
    new_job_id,
)
from kinetic_prefect.launch.pod_secrets import PodSecrets

SECRET = "pnu_test_key_0123456789"


def _spec(accelerator: str = "cpu", **changes: object) -> LaunchSpec:
    values: dict[str, object] = dict(
        job_id=new_job_id("train model"),
        task_name="train model",
        task_run_id="7c8f5a56-6a43-4b8e-9b7a-1f0e1c2d3e4f",
        flow_run_id="0b9c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3",
        accelerator=parse_accelerator(accelerator),
        image="python:3.11-slim",
        namespace="ml",
        payload_uri="gs://jobs/kinetic/j/payload.pkl",
        payload_sha256="a" * 64,
        context_uri="gs://jobs/kinetic/j/context.zip",
        context_sha256="b" * 64,
        job_dir_uri="gs://jobs/kinetic/j",
        output_dir="gs://jobs/outputs/f/train-0",
        env={"PREFECT_API_URL": "https://prefect.example/api"},
        secret_env=(SecretRef("PREFECT_API_KEY", "kinetic-prefect-api", "api-key"),),
        timeout_seconds=3600,
    )
    values.update(changes)
    return LaunchSpec(**values)  # type: ignore[arg-type]


@pytest.mark.parametrize("accelerator", ["cpu", "l4x2:spot", "tpu-v5e-4", "h100x8", "tpu-v6e-16"])
def test_manifest_passes_strict_kubernetes_validation(accelerator: str):
    manifest = build_job_manifest(_spec(accelerator))

    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


def test_kubernetes_never_retries_or_restarts_the_pod():
    manifest = build_job_manifest(_spec())

    assert manifest["spec"]["backoffLimit"] == 0
    assert manifest["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_deadline_and_ttl_come_from_the_spec():
    spec = build_job_manifest(_spec(timeout_seconds=120, ttl_seconds_after_finished=60))["spec"]

    assert (spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) == (120, 60)


def test_labels_identify_job_task_run_and_flow_run_but_never_prefects_own_flow_run_label():
    manifest = build_job_manifest(_spec())
    labels = manifest["spec"]["template"]["metadata"]["labels"]

    assert labels == manifest["metadata"]["labels"]
    assert labels["app.kubernetes.io/managed-by"] == "kinetic-prefect"
    assert labels["kinetic-prefect.io/job-id"] == manifest["metadata"]["name"]
    assert labels["kinetic-prefect.io/task-run-id"] == "7c8f5a56-6a43-4b8e-9b7a-1f0e1c2d3e4f"
    assert labels["kinetic-prefect.io/flow-run-id"] == "0b9c1d2e-3f40-4a5b-8c6d-7e8f90a1b2c3"
    assert "prefect.io/flow-run-id" not in labels


def test_api_key_comes_from_a_secret_ref_and_is_never_a_literal():
    settings = {PREFECT_API_URL: "https://prefect.example/api", PREFECT_API_KEY: SECRET}
    # What the runner puts in a pod's spec: Prefect's settings as env, its secrets as refs.
    with temporary_settings(settings):
        secrets = PodSecrets(prefect_context.secret_values())
        env = prefect_context.pod_settings_env()
    manifest = build_job_manifest(_spec(env=env, secret_env=secrets.refs()))
    container_env = manifest["spec"]["template"]["spec"]["containers"][0]["env"]

    assert {
        "name": "PREFECT_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": secrets.secret_name, "key": "prefect-api-key"}},
    } in container_env
    assert secrets.contents() == {secrets.secret_name: {"prefect-api-key": SECRET}}
    assert SECRET not in json.dumps(manifest)


def test_container_runs_the_pod_module_with_artifact_uris_and_hashes():
    container = build_job_manifest(_spec())["spec"]["template"]["spec"]["containers"][0]

    assert container["command"] == ["python", "-m", "kinetic_prefect.pod"]
    assert container["args"][container["args"].index("--payload-sha256") + 1] == "a" * 64
    assert (
        container["args"][container["args"].index("--context") + 1]
        == "gs://jobs/kinetic/j/context.zip"
    )


def test_gpu_accelerator_sets_selector_limit_and_toleration():
    pod = build_job_manifest(_spec("l4x2"))["spec"]["template"]["spec"]

    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert pod["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


def test_job_names_are_dns_labels_of_at_most_63_characters():
    names = [new_job_id(name) for name in ["Train Model!", "x" * 200, "___", "ünïcode task"]]

    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63 for n in names)


def test_task_pods_get_no_service_account_token():
    pod = build_job_manifest(_spec(service_account="kinetic-prefect-pods"))["spec"]["template"]

    assert pod["spec"]["serviceAccountName"] == "kinetic-prefect-pods"
    assert pod["spec"]["automountServiceAccountToken"] is False


# -- resources: no pod is BestEffort ----------------------------------------------------------


def _resources(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]["containers"][0]["resources"]


@pytest.mark.parametrize("accelerator", ["cpu", "l4", "a100x8", "tpu-v5e-4", "tpu-v6e-16"])
def test_every_pod_requests_cpu_and_memory(accelerator: str):
    requests = _resources(build_job_manifest(_spec(accelerator)))["requests"]

    assert requests["cpu"] and requests["memory"]
    assert {k: v for k, v in requests.items() if k in ("cpu", "memory")} == (
        parse_accelerator(accelerator).default_requests
    )


@pytest.mark.parametrize(
    ("accelerator", "resource", "count"),
    [("l4x2", "nvidia.com/gpu", "2"), ("tpu-v5e-16", "google.com/tpu", "4")],
)
def test_accelerator_resources_are_limits_equal_to_their_requests(
    accelerator: str, resource: str, count: str
):
    resources = _resources(build_job_manifest(_spec(accelerator)))

    assert resources["limits"] == {resource: count}
    assert resources["requests"][resource] == count


def test_cpu_and_memory_settings_replace_the_default_requests():
    manifest = build_job_manifest(_spec("tpu-v5e-4", cpu="8", memory="64Gi"))

    assert _resources(manifest)["requests"] == {
        "cpu": "8",
        "memory": "64Gi",
        "google.com/tpu": "4",
    }
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


# -- termination: inside the notice GKE gives a reclaimed Spot VM's pods -----------------------

# https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms: a 30 s notice, of which
# graceful node shutdown gives non-system pods up to 15 s.
GKE_SPOT_POD_GRACE_SECONDS = 15


def test_the_pods_grace_and_its_emergency_checkpoint_window_fit_gkes_spot_notice():
    manifest = build_job_manifest(_spec("tpu-v5e-4:spot"))
    pod = manifest["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    # What the pod reads: the defaults, the manifest carrying no change.
    window = Intervals.from_environ(env).emergency_window_seconds

    assert pod["terminationGracePeriodSeconds"] <= GKE_SPOT_POD_GRACE_SECONDS
    # The emergency save and the pod's own SIGKILL end with time left to report.
    assert window <= pod["terminationGracePeriodSeconds"] - 5


class _RecordingBackend:
    """Takes the builder Job's manifest and ends it at once, as a finished pod would."""

    def __init__(self) -> None:
        self.manifests: list[dict] = []

    def launch(self, manifest: dict, on_exit: object, secrets: object) -> None:
        from kinetic_prefect.backends.base import PodExit

        self.manifests.append(manifest)
        on_exit(PodExit(job_id=manifest["metadata"]["name"], exit_code=0))  # type: ignore[operator]


def test_builder_jobs_request_cpu_and_memory_and_take_the_pod_overrides():
    from kinetic_prefect.backends.environments import cluster_builder
    from kinetic_prefect.launch.environment import EnvironmentPlan
    from kinetic_prefect.launch.settings import resolve_settings

    toleration = {"key": "team", "operator": "Exists", "effect": "NoSchedule"}
    settings = resolve_settings(
        runner={
            "backend": "gke",
            "jobs_root": "gs://jobs",
            "pod_overrides": {"tolerations": [toleration]},
        },
        environ={},
    )
    backend = _RecordingBackend()
    plan = EnvironmentPlan("k" * 64, "3.11", "linux_x86_64", ("six==1.16.0",), (), None, "test")

    cluster_builder(settings, backend)(plan, "gs://jobs/spec.json", "gs://jobs/env")  # type: ignore[arg-type]

    (manifest,) = backend.manifests
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    assert _resources(manifest)["requests"] == {"cpu": "1", "memory": "2Gi"}
    assert manifest["spec"]["template"]["spec"]["tolerations"] == [toleration]


def test_more_cpu_than_a_tpu_machine_gives_pods_is_refused_naming_the_most_it_can_have():
    with pytest.raises(ConfigurationError, match=r"cpu=200 is more than a ct5lp-hightpu-4t node"):
        build_job_manifest(_spec("tpu-v5e-4", cpu="200"))
