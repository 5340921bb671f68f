"""Planning a shipped environment: where requirements come from, the contract with the bootstrap."""

from __future__ import annotations

from pathlib import Path

import pytest

from kinetic_prefect.common import env as common_env
from kinetic_prefect.common import records
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.common.layout import FINAL_STATE_JSON
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch import environment
from kinetic_prefect.launch.accelerators import parse_accelerator
from kinetic_prefect.launch.settings import LaunchSettings, resolve_settings
from kinetic_prefect.pod import bootstrap, runner
from kinetic_prefect.runner import record_key

REPO = Path(__file__).resolve().parents[2]


def test_the_bootstrap_speaks_the_contract_the_package_writes() -> None:
    # The bootstrap cannot import kinetic_prefect (the pod has none yet): its copies must agree.
    assert bootstrap.ENV_CACHE_ENV == common_env.ENV_CACHE_ENV
    assert bootstrap.SHIPPED_ENV_ENV == common_env.SHIPPED_ENV_ENV
    assert bootstrap.SIGNING_KEY_ENV == common_env.SIGNING_KEY_ENV
    assert bootstrap.NODE_CACHE_KEY_ENV == common_env.NODE_CACHE_KEY_ENV
    assert bootstrap.node_cache_key("master") == record_key.node_cache_key("master")
    assert bootstrap.NODE_CACHE_MAX_GB_ENV == common_env.NODE_CACHE_MAX_GB_ENV
    assert bootstrap.INTERVALS_ENV == common_env.INTERVALS_ENV
    assert bootstrap.METADATA_HOST_ENVS == common_env.METADATA_HOST_ENVS
    assert LaunchSettings().node_cache_max_gb == bootstrap.DEFAULT_NODE_CACHE_MAX_GB
    assert bootstrap.metadata_wait() == Intervals().metadata_wait_seconds
    assert bootstrap.FINAL_STATE_JSON == FINAL_STATE_JSON
    assert bootstrap.STATUS_PHASE_FAILED == records.STATUS_PHASE_FAILED
    assert bootstrap.PHASE in records.PHASES
    assert bootstrap.EXIT_PHASE_FAILED == runner.EXIT_PHASE_FAILED
    for name in ("ARCHIVE_FILE", "MANIFEST_FILE", "MARKER_FILE", "SPEC_FILE", "ENV_SPEC_FILE",
                 "UNPACKED_MARKER"):  # fmt: skip
        assert getattr(bootstrap, name) == getattr(environment, name)
    key, sha256 = "k" * 64, "0123456789abcdef" * 4
    assert bootstrap.node_cache_entry(key, sha256) == environment.node_cache_entry(key, sha256)


def test_the_bootstrap_imports_only_the_standard_library() -> None:
    import ast
    import sys

    tree = ast.parse(environment.BOOTSTRAP_SOURCE.read_text())
    imported = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    # `uv` is looked up only in the builder, where it may be installed; absent is fine.
    assert imported - {"uv", "__future__"} <= set(sys.stdlib_module_names)


def test_a_records_signature_made_by_the_bootstrap_verifies_with_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(common_env.SIGNING_KEY_ENV, "k" * 32)
    bootstrap.record_failure(str(tmp_path), "Failed during environment: no", ValueError("no"))
    record = records.FinalRecord.decode(
        (tmp_path / FINAL_STATE_JSON).read_bytes(), FINAL_STATE_JSON
    )
    assert record.signed_by("k" * 32)
    assert (record.status, record.phase) == (records.STATUS_PHASE_FAILED, "environment")


@pytest.mark.parametrize(
    ("files", "source"),
    [
        ({"pylock.toml": '[[packages]]\nname = "inflection"\nversion = "0.5.1"\n'}, "pylock.toml"),
        ({"requirements.txt": "inflection==0.5.1\n", "pyproject.toml": ""}, "requirements.txt"),
        (
            {"pyproject.toml": '[project]\nname = "x"\ndependencies = ["inflection==0.5.1"]\n'},
            "pyproject.toml [project.dependencies]",
        ),
    ],
)
def test_requirements_are_detected_in_order(
    tmp_path: Path, files: dict[str, str], source: str
) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    found = environment.detect_requirements(tmp_path)
    assert found.source.endswith(source)
    assert any("inflection" in part for part in found.digest_parts())


def test_a_uv_lock_is_exported_without_dev_groups_or_the_project() -> None:
    found = environment.detect_requirements(REPO)
    assert found.source.endswith("uv.lock")
    names = {line.split("==")[0] for line in found.lines}
    assert "prefect" in names
    assert not names & {"pytest", "kmock", "kinetic-prefect"}


def test_without_any_project_file_the_interpreters_distributions_are_pinned(tmp_path: Path) -> None:
    from importlib.metadata import version

    found = environment.detect_requirements(tmp_path)
    assert f"prefect=={version('prefect')}" in found.lines


def test_kinetic_prefect_and_its_dependencies_come_at_this_interpreters_versions() -> None:
    from importlib.metadata import version

    pins, local = environment.self_pins("3.11")
    assert f"prefect=={version('prefect')}" in pins
    assert f"cloudpickle=={version('cloudpickle')}" in pins
    # An editable kinetic-prefect (this checkout) is built into a wheel, not pinned.
    assert local == [REPO]


@pytest.mark.parametrize(
    ("accelerator", "extra"), [("tpu-v5e-4", "jax[tpu]"), ("l4", "jax[cuda12]"), ("cpu", None)]
)
def test_accelerators_add_jax_parts_at_jaxs_version(accelerator: str, extra: str | None) -> None:
    added = environment.accelerator_extras(parse_accelerator(accelerator), ["jax==0.10.2"])
    assert added == ([f"{extra}==0.10.2"] if extra else [])
    overridden = environment.accelerator_extras(parse_accelerator(accelerator), [], ["x==1"])
    assert overridden == ["x==1"]


def test_environment_settings_refuse_unknown_values_with_what_to_use() -> None:
    with pytest.raises(ConfigurationError, match="'ship'"):
        resolve_settings(runner={"environment": "docker"}, environ={})
    with pytest.raises(ConfigurationError, match="'cluster'"):
        resolve_settings(runner={"environment_builder": "cloudbuild"}, environ={})
    with pytest.raises(ConfigurationError, match="container_image"):
        resolve_settings(runner={"environment": "image", "backend": "gke"}, environ={})
    gke = resolve_settings(runner={"backend": "gke"}, environ={})
    local = resolve_settings(runner={"backend": "local"}, environ={})
    assert gke.ships_environment() and not local.ships_environment()
    from_env = resolve_settings(environ={"KINETIC_ENVIRONMENT": "ship"})
    assert from_env.ships_environment()
