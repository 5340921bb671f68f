"""A multi-host TPU slice: an Indexed Job of one pod per host, and a headless Service."""

from __future__ import annotations

import kubernetes_validate
import pytest

from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.accelerators import parse_accelerator
from kinetic_prefect.launch.manifest import build_job_manifest
from kinetic_prefect.launch.slices import build_workload, refuse_for_flow_runs
from tests.unit.test_manifest import _spec


def _env(job: dict) -> dict[str, object]:
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("accelerator", ["tpu-v5e-16", "tpu-v6e-32", "tpu-v5p-32"])
def test_slice_job_and_service_pass_strict_kubernetes_validation(accelerator: str):
    workload = build_workload(_spec(accelerator))

    for obj in (workload.job, workload.service):
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize(
    ("accelerator", "hosts", "topology"),
    [("tpu-v5e-16", 4, "4x4"), ("tpu-v6e-32", 8, "4x8"), ("tpu-v5p-32", 4, "2x2x4")],
)
def test_a_slice_is_an_indexed_job_of_one_pod_per_host_on_the_slices_topology(
    accelerator: str, hosts: int, topology: str
):
    workload = build_workload(_spec(accelerator))
    spec = workload.job["spec"]
    pod = spec["template"]["spec"]

    assert (spec["completions"], spec["parallelism"], spec["completionMode"]) == (
        hosts,
        hosts,
        "Indexed",
    )
    assert spec["backoffLimit"] == 0
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": "4"}
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]


def test_the_hosts_meet_through_a_headless_service_named_by_the_pods_subdomain():
    spec = _spec("tpu-v5e-16")
    workload = build_workload(spec)
    assert workload.service is not None
    env = _env(workload.job)

    assert workload.service["spec"]["clusterIP"] == "None"
    assert workload.service["spec"]["selector"] == {"kinetic-prefect.io/job-id": spec.job_id}
    assert (
        workload.job["spec"]["template"]["spec"]["subdomain"]
        == workload.service["metadata"]["name"]
    )
    assert env["TPU_WORKER_HOSTNAMES"] == ",".join(
        f"{spec.job_id}-{k}.{spec.job_id}" for k in range(4)
    )
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{spec.job_id}-0.{spec.job_id}:8482"
    assert env["TPU_WORKER_ID"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert env["KINETIC_SLICE_HOSTS"] == "4"


@pytest.mark.parametrize("accelerator", ["cpu", "l4x2:spot", "tpu-v5e-4", "tpu-v5e-8"])
def test_single_host_accelerators_keep_exactly_the_single_job_manifest(accelerator: str):
    spec = _spec(accelerator)

    workload = build_workload(spec)

    assert (workload.job, workload.service) == (build_job_manifest(spec), None)


def test_a_flow_run_pod_refuses_a_multi_host_slice_and_says_to_use_a_task():
    with pytest.raises(ConfigurationError, match="4-host TPU slice") as info:
        refuse_for_flow_runs(parse_accelerator("tpu-v5e-16"))

    assert "KineticTaskRunner(accelerator='tpu-v5e-16')" in str(info.value)


def test_a_slices_hosts_require_one_node_pool_and_shun_other_slices():
    workload = build_workload(_spec("tpu-v5e-16"))
    template = workload.job["spec"]["template"]
    job_id = workload.job["metadata"]["name"]
    affinity = template["spec"]["affinity"]
    (together,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (apart,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]

    assert template["metadata"]["labels"]["kinetic-prefect.io/slice"] == job_id
    assert together == {
        "labelSelector": {"matchLabels": {"kinetic-prefect.io/slice": job_id}},
        "topologyKey": "cloud.google.com/gke-nodepool",
    }
    assert apart["topologyKey"] == "cloud.google.com/gke-nodepool"
    assert apart["labelSelector"]["matchExpressions"] == [
        {"key": "kinetic-prefect.io/slice", "operator": "Exists"},
        {"key": "kinetic-prefect.io/slice", "operator": "NotIn", "values": [job_id]},
    ]


def test_pod_overrides_reach_every_host_of_a_slice_and_keep_its_affinity():
    toleration = {"key": "team", "operator": "Exists", "effect": "NoSchedule"}
    workload = build_workload(_spec("tpu-v5e-16", pod_overrides={"tolerations": [toleration]}))
    pod = workload.job["spec"]["template"]["spec"]

    assert toleration in pod["tolerations"]
    assert "podAffinity" in pod["affinity"]
    kubernetes_validate.validate(workload.job, kubernetes_validate.latest_version(), strict=True)
