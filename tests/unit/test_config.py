"""Settings resolution order: resources() > runner > block > KINETIC_* env > defaults."""

from __future__ import annotations

import pytest

from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.settings import current_overrides, resolve_settings, resources


def test_defaults_are_cpu_on_the_local_backend():
    settings = resolve_settings(environ={})

    assert (settings.accelerator, settings.backend) == ("cpu", "local")


def test_each_layer_overrides_the_ones_below_it():
    environ = {
        "KINETIC_ACCELERATOR": "t4",
        "KINETIC_TIMEOUT_SECONDS": "10",
        "KINETIC_NAMESPACE": "env",
    }
    settings = resolve_settings(
        environ=environ,
        block={"accelerator": "l4", "timeout_seconds": 20},
        runner={"accelerator": "a100", "max_parallel": None},
        overrides={"accelerator": "h100"},
    )

    assert (settings.accelerator, settings.timeout_seconds, settings.namespace) == (
        "h100",
        20,
        "env",
    )


def test_env_settings_merge_across_layers():
    settings = resolve_settings(
        environ={}, runner={"env": {"A": "1", "B": "1"}}, overrides={"env": {"B": "2"}}
    )

    assert dict(settings.env) == {"A": "1", "B": "2"}


def test_resources_overrides_nest_and_unwind():
    with resources(accelerator="l4"), resources(spot=True):
        inner = current_overrides()

    assert inner == {"accelerator": "l4", "spot": True}
    assert current_overrides() == {}


def test_unknown_setting_in_resources_lists_valid_settings():
    with (
        pytest.raises(ConfigurationError, match="valid settings are: accelerator"),
        resources(acelerator="l4"),
    ):
        pass


def test_a_misspelled_setting_is_named_with_the_setting_it_is_close_to():
    with pytest.raises(ConfigurationError, match=r"warm_pod \(did you mean warm_pods\?\)"):
        resolve_settings(environ={}, runner={"warm_pod": True})


def test_invalid_environment_value_names_the_variable():
    with pytest.raises(ConfigurationError, match="KINETIC_MAX_PARALLEL"):
        resolve_settings(environ={"KINETIC_MAX_PARALLEL": "many"})


def test_gke_backend_without_a_jobs_bucket_says_what_to_set():
    settings = resolve_settings(environ={}, runner={"backend": "gke"})

    with pytest.raises(ConfigurationError, match="KINETIC_JOBS_BUCKET"):
        settings.resolved_jobs_root()


def test_warm_pod_settings_come_from_the_runner_the_block_or_kinetic_variables():
    from_env = resolve_settings(
        environ={"KINETIC_WARM_PODS": "true", "KINETIC_WARM_POD_IDLE_SECONDS": "120"}
    )
    from_block = resolve_settings(environ={}, block={"warm_pods": True})
    from_runner = resolve_settings(environ={}, runner={"warm_pod_idle_seconds": 5})

    assert (from_env.warm_pods, from_env.warm_pod_idle_seconds) == (True, 120.0)
    assert (from_block.warm_pods, from_block.warm_pod_idle_seconds) == (True, 60.0)
    assert (from_runner.warm_pods, from_runner.warm_pod_idle_seconds) == (False, 5)


def test_a_warm_pod_idle_time_too_short_to_reuse_a_pod_is_refused_saying_what_to_use():
    on_gcs = {"warm_pods": True, "warm_pod_idle_seconds": 2, "jobs_root": "gs://bucket/jobs"}

    with pytest.raises(ConfigurationError, match=r"idle_seconds=1 leaves .* at least 2,"):
        resolve_settings(environ={}, runner={"warm_pods": True, "warm_pod_idle_seconds": 1})
    with pytest.raises(ConfigurationError, match=r"over 2s of its idle time .* at least 4,"):
        resolve_settings(environ={}, runner=on_gcs)
    assert resolve_settings(environ={}, runner={**on_gcs, "warm_pod_idle_seconds": 4}).warm_pods
    with pytest.raises(ConfigurationError, match=r"over 2s of its idle time"):
        resolve_settings(environ={}, runner={"backend": "gke", **on_gcs, "jobs_root": None})


def test_a_warm_pod_idle_time_that_is_not_positive_is_refused():
    with pytest.raises(ConfigurationError, match="warm_pod_idle_seconds must be a positive"):
        resolve_settings(environ={}, runner={"warm_pod_idle_seconds": 0})


def test_cpu_and_memory_come_from_the_runner_the_block_or_kinetic_variables():
    from_env = resolve_settings(environ={"KINETIC_CPU": "4", "KINETIC_MEMORY": "16Gi"})
    from_block = resolve_settings(block={"cpu": "2", "memory": "8Gi"}, environ={})
    from_runner = resolve_settings(runner={"cpu": 0.5, "memory": "512Mi"}, environ={})

    assert (from_env.cpu, from_env.memory) == ("4", "16Gi")
    assert (from_block.cpu, from_block.memory) == ("2", "8Gi")
    assert (from_runner.cpu, from_runner.memory) == ("0.5", "512Mi")


@pytest.mark.parametrize(
    ("setting", "value"), [("cpu", "four"), ("cpu", "0"), ("memory", "16GB"), ("memory", "-1Gi")]
)
def test_a_cpu_or_memory_that_is_no_kubernetes_quantity_is_refused(setting: str, value: str):
    with pytest.raises(ConfigurationError, match=f"{setting}=.*Kubernetes quantity"):
        resolve_settings(runner={setting: value}, environ={})


def test_a_cluster_blocks_cpu_memory_and_pod_overrides_are_settings():
    from kinetic_prefect.blocks import KineticCluster, cluster_settings

    block = KineticCluster(cpu="4", memory="16Gi", pod_overrides={"priorityClassName": "batch"})

    settings = resolve_settings(block=cluster_settings(block), environ={})

    assert (settings.cpu, settings.memory) == ("4", "16Gi")
    assert settings.pod_overrides == {"priorityClassName": "batch"}


@pytest.mark.parametrize("name", ["KineticCluster", "KineticGcpCredentials"])
def test_a_blocks_schema_is_prefects_built_once_and_handed_out_as_a_copy(name: str):
    from prefect.blocks.core import Block

    import kinetic_prefect.blocks
    from kinetic_prefect.blocks.schema import SchemaOnce

    block = getattr(kinetic_prefect.blocks, name)
    built = Block.model_json_schema.__func__(block)  # type: ignore[attr-defined]
    first = block.model_json_schema()
    assert first == built
    first["properties"].clear()
    assert block.model_json_schema() == built
    assert issubclass(block, SchemaOnce)


def test_code_archive_limits_come_from_resources_the_runner_the_block_or_kinetic_variables():
    from kinetic_prefect.blocks import KineticCluster, cluster_settings

    env = {"KINETIC_CODE_ARCHIVE_MAX_MB": "50", "KINETIC_CODE_ARCHIVE_MAX_FILES": "900"}
    block = cluster_settings(KineticCluster(code_archive_max_mb=80))

    assert resolve_settings(environ={}).code_archive_max_mb == 200
    assert resolve_settings(environ={}).code_archive_max_files == 20_000
    from_env = resolve_settings(environ=env)
    assert (from_env.code_archive_max_mb, from_env.code_archive_max_files) == (50.0, 900)
    assert resolve_settings(environ=env, block=block).code_archive_max_mb == 80
    on_runner = resolve_settings(environ=env, block=block, runner={"code_archive_max_mb": 300})
    assert on_runner.code_archive_max_mb == 300
    with resources(code_archive_max_files=5):
        overridden = resolve_settings(environ=env, overrides=current_overrides())
    assert overridden.code_archive_max_files == 5


@pytest.mark.parametrize("setting", ["code_archive_max_mb", "code_archive_max_files"])
def test_a_code_archive_limit_that_is_not_positive_is_refused(setting: str):
    with pytest.raises(ConfigurationError, match="code_archive_max_mb and code_archive_max_files"):
        resolve_settings(environ={}, runner={setting: 0})
