"""`kinetic-prefect env show|build`: the environment's key, pins and place in the store."""

from __future__ import annotations

from importlib.metadata import requires, version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kinetic_prefect.cli import app

pytestmark = pytest.mark.usefixtures("workdir")


def _jax_tpu_libtpu() -> str:
    """The libtpu version jax[tpu] asks for, from the installed jax's own metadata."""
    pinned = next(r for r in requires("jax") or [] if r.startswith("libtpu") and "tpu" in r)
    return pinned.split("==")[1].split(";")[0].strip().rstrip("*").rstrip(".")


def test_env_show_resolves_libtpu_for_a_tpu_and_the_cuda_plugin_for_a_gpu_without_them(
    monkeypatch: pytest.MonkeyPatch, shipped_requirements: Path
) -> None:
    monkeypatch.setenv("KINETIC_REQUIREMENTS", str(shipped_requirements))
    tpu = CliRunner().invoke(app, ["env", "show", "--accelerator", "tpu-v5e-4"])
    assert tpu.exit_code == 0, tpu.output
    libtpu = [line.strip() for line in tpu.output.splitlines() if "libtpu==" in line]
    assert len(libtpu) == 1 and libtpu[0].startswith(f"libtpu=={_jax_tpu_libtpu()}")
    assert f"jax=={version('jax')}" in tpu.output

    gpu = CliRunner().invoke(app, ["env", "show", "--accelerator", "l4"])
    assert gpu.exit_code == 0, gpu.output
    assert f"jax-cuda12-plugin=={version('jax')}" in gpu.output
    assert "libtpu==" not in gpu.output


def test_env_build_puts_the_environment_in_the_store_and_env_show_then_finds_it(
    monkeypatch: pytest.MonkeyPatch, shipped_requirements: Path
) -> None:
    monkeypatch.setenv("KINETIC_REQUIREMENTS", str(shipped_requirements))
    before = CliRunner().invoke(app, ["env", "show"])
    assert before.exit_code == 0, before.output
    assert "not in" in before.output and "env build" in before.output

    built = CliRunner().invoke(app, ["env", "build"])
    assert built.exit_code == 0, built.output
    key = next(line.split()[-1] for line in before.output.splitlines() if line.startswith("key:"))
    assert f"environment {key}" in built.output
    assert (Path(".kinetic") / "env-cache" / key / "ready.json").is_file()

    after = CliRunner().invoke(app, ["env", "show"])
    assert "environment.tar.gz" in after.output and "MB" in after.output


def test_env_show_names_an_unresolvable_requirement() -> None:
    Path("requirements.txt").write_text("kinetic-prefect-no-such-package==1.0\n")
    Path("pyproject.toml").write_text('[project]\nname = "p"\nversion = "0"\n')
    shown = CliRunner().invoke(app, ["env", "show"])
    assert shown.exit_code == 1
    assert "kinetic-prefect-no-such-package" in shown.output
