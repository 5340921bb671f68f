"""environment="ship" on the local backend: a bare Python plus the shipped environment."""

from __future__ import annotations

import site
import sys
from pathlib import Path

import pytest
from prefect import flow, task

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.backends import environments
from kinetic_prefect.launch.environment import Environments

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


@task
def inside_the_pod() -> dict[str, object]:
    import importlib.metadata as metadata
    import sys

    import inflection

    return {
        "inflection": inflection.__version__,
        "executable": sys.executable,
        "path": list(sys.path),
        "versions": {
            name: metadata.version(name) for name in ("prefect", "cloudpickle", "kinetic-prefect")
        },
    }


def run_in_pod(requirements: Path) -> dict[str, object]:
    @flow(task_runner=KineticTaskRunner(environment="ship", requirements=str(requirements)))
    def shipped() -> dict[str, object]:
        return inside_the_pod.submit().result()

    return shipped()


def test_a_shipped_environment_brings_what_the_orchestrator_lacks_and_nothing_of_its_own(
    shipped_requirements: Path,
) -> None:
    import importlib.metadata as metadata

    with pytest.raises(ImportError):
        import inflection  # noqa: F401  (the orchestrator must not have it)

    seen = run_in_pod(shipped_requirements)

    assert seen["inflection"] == "0.5.1"
    ours = {*site.getsitepackages(), site.getusersitepackages(), str(Path(sys.prefix))}
    assert not [p for p in seen["path"] if any(str(p).startswith(o) for o in ours)]
    assert seen["executable"] != sys.executable
    assert seen["versions"] == {
        name: metadata.version(name) for name in ("prefect", "cloudpickle", "kinetic-prefect")
    }


def test_a_second_flow_run_with_the_same_requirements_uploads_no_environment(
    shipped_requirements: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_in_pod(shipped_requirements)
    archives = list(Path(".kinetic/env-cache").glob("*/environment.tar.gz"))
    assert len(archives) == 1
    before = archives[0].stat()
    # As a new flow process would: nothing known yet, the store is asked.
    monkeypatch.setattr(environments, "ENVIRONMENTS", Environments())

    run_in_pod(shipped_requirements)

    after = archives[0].stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
