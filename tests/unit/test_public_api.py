"""The public names of `../shared/DESIGN.md` import from where the design says they do."""

from __future__ import annotations

import importlib
import subprocess
import sys

import kinetic_prefect

PUBLIC = [
    "Checkpoint",
    "KineticTaskRunner",
    "KineticFuture",
    "KineticCluster",
    "KineticGcpCredentials",
    "Data",
    "resources",
    "output_dir",
    "checkpoint_manager",
    "report_progress",
    "summarize_sweep",
]


def test_every_public_name_imports_from_the_package():
    missing = [name for name in PUBLIC if getattr(kinetic_prefect, name, None) is None]

    assert missing == []
    assert sorted(kinetic_prefect.__all__) == sorted(PUBLIC)


def test_the_cli_and_the_work_pool_type_are_where_the_entry_points_say():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    collections = {e.name: e.value for e in entry_points(group="prefect.collections")}
    cli_module, _, cli_attr = scripts["kinetic-prefect"].partition(":")
    plugin = importlib.import_module(collections["kinetic_prefect"])
    worker_module = importlib.import_module(plugin.WORKER_TYPES["kinetic"])

    assert callable(getattr(importlib.import_module(cli_module), cli_attr))
    assert worker_module.KineticWorker.type == "kinetic"


def test_the_pod_entrypoint_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "kinetic_prefect.pod", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0
    assert "--payload-sha256" in result.stdout


def test_the_cli_runs_as_a_module():
    result = subprocess.run(
        [sys.executable, "-m", "kinetic_prefect.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 0, result.stderr
    assert "accelerators" in result.stdout
