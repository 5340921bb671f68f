"""Shared fixtures: a real Prefect API, an isolated working directory, manifest checks."""

from __future__ import annotations

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.3")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kinetic_prefect.backends.local import LocalBackend


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real Prefect API server (SQLite) for the whole session."""
    from prefect.settings import get_current_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield str(get_current_settings().api.url)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a fresh directory so `.kinetic/` artifacts and outputs stay per test."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("KINETIC_"):
            monkeypatch.delenv(name)
    return tmp_path


@pytest.fixture
def launched_manifests(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every manifest the local backend launches in the test, validated afterwards."""
    seen: list[dict[str, Any]] = []
    original = LocalBackend.launch

    def recording_launch(
        self: LocalBackend, manifest: dict[str, Any], *args: Any, **kw: Any
    ) -> None:
        seen.append(manifest)
        original(self, manifest, *args, **kw)

    monkeypatch.setattr(LocalBackend, "launch", recording_launch)
    yield seen
    for manifest in seen:
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
