"""A pod's cold start: what the collections entry point and a pod import, and when."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.filesystems import LocalFileSystem

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.pod.blocks import build_known_blocks

HEAVY_MODULES = ("prefect_gcp", "prefect_kubernetes", "kinetic_prefect.worker.worker")
# Files a task opened and never closed, kept alive until the pod process ends.
_left_open: list[object] = []


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@task
def heavy_modules_in_this_process() -> list[str]:
    return sorted(name for name in HEAVY_MODULES if name in sys.modules)


@task
def write_and_leave_open(path: str) -> None:
    handle = open(path, "w")  # noqa: SIM115 - left open on purpose
    handle.write("written before exit")
    _left_open.append(handle)


def test_collections_entry_point_imports_neither_gcp_kubernetes_nor_the_worker():
    out = _python(
        f"""
        import sys
        from importlib.metadata import entry_points
        (plugin,) = entry_points(group="prefect.collections", name="kinetic_prefect")
        plugin.load()
        print(sorted(name for name in {HEAVY_MODULES!r} if name in sys.modules))
        """
    )

    assert out == "[]"


@pytest.mark.lowest_prefect
def test_deferred_registration_reaches_prefects_registry():
    # Fails if a Prefect upgrade changes how block and worker types are looked up.
    out = _python(
        """
        from importlib.metadata import entry_points
        from prefect.blocks.core import Block
        from prefect.workers.base import BaseWorker
        (plugin,) = entry_points(group="prefect.collections", name="kinetic_prefect")
        plugin.load()
        print(Block.get_block_class_from_key("kinetic-cluster").__name__)
        print(Block.get_block_class_from_key("kinetic-gcp-credentials").__name__)
        print(BaseWorker.get_worker_class_from_type("kinetic").__name__)
        print("kinetic" in BaseWorker.get_all_available_worker_types())
        """
    )

    assert out.split() == ["KineticCluster", "KineticGcpCredentials", "KineticWorker", "True"]


# Test modules whose tasks run in pods: a pod imports the module of its task.
POD_TASK_MODULES = (
    "tests.emulated.test_results_and_retries",
    "tests.emulated.test_kubernetes_backend",
    "tests.emulated.test_data",
    "tests.emulated.test_data_cache",
    "tests.emulated.test_code_cache",
    "tests.emulated.test_gcs_faults",
    "tests.emulated.test_secrets",
    "tests.emulated.test_multihost_gke",
)


def test_test_modules_whose_tasks_run_in_pods_import_no_prefect_collection():
    out = _python(
        f"""
        import importlib, sys
        for module in {POD_TASK_MODULES!r}:
            importlib.import_module(module)
        print(sorted(name for name in {HEAVY_MODULES!r} if name in sys.modules))
        """
    )

    assert out == "[]"


def test_listing_prefects_block_registry_includes_the_deferred_block_types():
    out = _python(
        """
        from importlib.metadata import entry_points
        from prefect.blocks.core import Block
        from prefect.utilities.dispatch import get_registry_for_type
        (plugin,) = entry_points(group="prefect.collections", name="kinetic_prefect")
        plugin.load()
        registry = get_registry_for_type(Block)
        print(sorted(c.__name__ for c in registry.values() if c.__module__.startswith("kinetic")))
        """
    )

    assert out == "['KineticCluster', 'KineticGcpCredentials']"


def test_a_serialized_block_of_a_registered_type_is_built_without_a_lookup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from prefect.blocks.core import Block

    def no_lookup(key: str) -> None:
        raise AssertionError(f"Prefect's block lookup was asked for {key!r}")

    # Prefect's lookup by slug (it first imports every installed collection).
    monkeypatch.setattr(Block, "get_block_class_from_key", no_lookup)
    serialized = {"store": {"block_type_slug": "local-file-system", "basepath": str(tmp_path)}}

    built = build_known_blocks(serialized)

    assert built["store"] == LocalFileSystem(basepath=str(tmp_path))


def test_a_serialized_block_of_an_unregistered_type_is_left_to_prefect():
    serialized = {"block_type_slug": "no-such-block-type", "bucket": "b"}

    assert build_known_blocks(serialized) == serialized


@pytest.mark.usefixtures("prefect_api", "workdir")
def test_a_pod_with_default_result_storage_imports_no_collection(monkeypatch: pytest.MonkeyPatch):
    # A cold pod, as on GKE: a forked one has the template's preloaded modules.
    monkeypatch.setenv("KINETIC_LOCAL_TEMPLATE", "0")

    @flow(task_runner=KineticTaskRunner())
    def probe() -> list[str]:
        return heavy_modules_in_this_process.submit().result()

    assert probe() == []


@pytest.mark.usefixtures("prefect_api")
def test_a_file_the_task_left_open_is_flushed_when_the_pod_exits(workdir: Path):
    target = workdir / "left-open.txt"

    @flow(task_runner=KineticTaskRunner())
    def leave_open() -> None:
        write_and_leave_open.submit(str(target)).result()

    leave_open()

    assert target.read_text() == "written before exit"
