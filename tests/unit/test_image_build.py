"""deployments/Dockerfile builds the image docs/worker.md deploys flows from."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _copied() -> set[str]:
    lines = (ROOT / "deployments" / "Dockerfile").read_text().splitlines()
    return {part for line in lines if line.startswith("COPY ") for part in line.split()[1:-1]}


def test_the_image_holds_the_package_and_the_flows_the_deployments_name():
    prefect_yaml = (ROOT / "deployments" / "prefect.yaml").read_text()

    assert {"kinetic_prefect", "flows"} <= _copied()
    assert "entrypoint: flows/" in prefect_yaml


def test_the_build_context_leaves_out_local_environments_and_state():
    ignored = (ROOT / ".dockerignore").read_text().split()

    assert {".venv", ".venv-lowest", ".tools", ".kinetic", ".git"} <= set(ignored)
