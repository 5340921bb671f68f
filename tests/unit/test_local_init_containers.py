"""A local pod's init containers: run before its task container, off the backend's watcher."""

from __future__ import annotations

import os
import queue
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kinetic_prefect.backends.base import PodExit
from kinetic_prefect.backends.local.backend import LocalBackend

DEADLINE = 60


def _manifest(name: str, task: str, init: str | None = None) -> dict:
    pod_spec: dict = {"containers": [{"name": "task", "command": ["python", "-c", task]}]}
    if init is not None:
        pod_spec["initContainers"] = [{"name": "init", "command": ["python", "-c", init]}]
    return {"metadata": {"name": name, "labels": {}}, "spec": {"template": {"spec": pod_spec}}}


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[LocalBackend]:
    local = LocalBackend(
        tmp_path / "pods",
        max_parallel=2,
        interpreter=lambda manifest: sys.executable,
        node_root=tmp_path / "node",
    )
    yield local
    local.close()


def _launch(backend: LocalBackend, manifest: dict) -> queue.Queue[PodExit]:
    exits: queue.Queue[PodExit] = queue.Queue()
    backend.launch(manifest, on_exit=exits.put, secrets={})
    return exits


def test_another_pods_exit_is_noticed_while_an_init_container_runs(
    backend: LocalBackend, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    # Held open for writing, so the init container's open never waits: only its read does.
    writer = os.open(gate, os.O_RDWR)
    ran = tmp_path / "ran"
    blocked = _launch(
        backend,
        _manifest(
            "kp-blocked",
            task=f"open({str(ran)!r}, 'w').close()",
            init=f"import os; os.read(os.open({str(gate)!r}, os.O_RDONLY), 1)",
        ),
    )
    quick = _launch(backend, _manifest("kp-quick", task="raise SystemExit(0)"))

    quick_exit = quick.get(timeout=DEADLINE)
    waiting = blocked.empty() and not ran.exists()
    os.write(writer, b"x")
    blocked_exit = blocked.get(timeout=DEADLINE)
    os.close(writer)

    assert quick_exit.exit_code == 0
    assert waiting
    assert blocked_exit.exit_code == 0 and ran.exists()


def test_a_failed_init_container_ends_the_pod_with_its_code_before_the_task_starts(
    backend: LocalBackend, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    exits = _launch(
        backend,
        _manifest("kp-init-fails", task=f"open({str(ran)!r}, 'w').close()", init="exit(3)"),
    )

    assert exits.get(timeout=DEADLINE).exit_code == 3
    assert not ran.exists()
