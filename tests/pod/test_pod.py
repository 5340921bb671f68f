"""The pod entrypoint's phases, run as `python -m kinetic_prefect.pod` in a real process."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import cloudpickle

from kinetic_prefect.common.records import FinalRecord


def _pod_command(job_dir: Path, payload_sha: str, context_sha: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kinetic_prefect.pod",
        "--job-dir",
        str(job_dir),
        "--payload",
        str(job_dir / "payload.pkl"),
        "--payload-sha256",
        payload_sha,
        "--context",
        str(job_dir / "context.zip"),
        "--context-sha256",
        context_sha,
    ]


def _run_pod(
    job_dir: Path,
    payload: bytes,
    context: bytes,
    env: dict[str, str] | None = None,
    payload_sha: str | None = None,
) -> tuple[int, FinalRecord]:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "payload.pkl").write_bytes(payload)
    (job_dir / "context.zip").write_bytes(context)
    result = subprocess.run(
        _pod_command(
            job_dir,
            payload_sha or hashlib.sha256(payload).hexdigest(),
            hashlib.sha256(context).hexdigest(),
        ),
        env={"PATH": "/usr/bin:/bin", "KINETIC_SCRATCH_DIR": str(job_dir), **(env or {})},
        capture_output=True,
        timeout=120,
    )
    return result.returncode, FinalRecord.decode(
        (job_dir / "final-state.json").read_bytes(), str(job_dir)
    )


def _zip(entries: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in entries.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def test_sha256_mismatch_refuses_to_unpickle_and_names_the_verify_phase(tmp_path: Path):
    code, record = _run_pod(tmp_path / "job", b"payload", _zip({}), payload_sha="0" * 64)

    assert code == 2
    assert (record.status, record.phase) == ("phase-failed", "verify")
    assert "sha256 mismatch for payload.pkl" in (record.message or "")


def test_archive_entry_escaping_its_directory_is_refused_in_the_extract_phase(tmp_path: Path):
    code, record = _run_pod(tmp_path / "job", b"payload", _zip({"../escape.txt": b"x"}))

    assert (code, record.phase) == (2, "extract")
    assert "escapes the extraction directory" in (record.message or "")
    assert not (tmp_path / "escape.txt").exists()


def test_version_skew_between_client_and_pod_is_named_before_unpickling(tmp_path: Path):
    client = {
        "python": "3.11",
        "cloudpickle": "0.0.1",
        "prefect": "3.0.0",
        "kinetic-prefect": "0.1.0",
    }
    env = {"KINETIC_CLIENT_VERSIONS": json.dumps(client)}

    code, record = _run_pod(tmp_path / "job", cloudpickle.dumps({}), _zip({}), env=env)

    assert (code, record.phase) == (2, "unpickle")
    assert "cloudpickle: client 0.0.1" in (record.message or "")
    assert "prefect: client 3.0.0" in (record.message or "")


def test_unreadable_payload_fails_in_the_download_phase(tmp_path: Path):
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    result = subprocess.run(
        _pod_command(job_dir, "0" * 64, "0" * 64), capture_output=True, timeout=120
    )
    record = FinalRecord.decode((job_dir / "final-state.json").read_bytes(), str(job_dir))

    assert (result.returncode, record.phase) == (2, "download")
    assert "Failed during download" in result.stderr.decode()


def _slice_host_0(coordinator: str) -> dict[str, str]:
    return {
        "KINETIC_SLICE_HOSTS": "2",
        "TPU_WORKER_ID": "0",
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "JAX_PLATFORMS": "cpu",
    }


def test_a_slice_host_connects_before_unpickling_and_names_its_coordinator_when_it_cannot(
    tmp_path: Path,
):
    # No port: jax.distributed.initialize fails at once, in its own code.
    env = _slice_host_0("127.0.0.1")

    code, record = _run_pod(tmp_path / "job", b"not a pickle", _zip({}), env=env)

    assert (code, record.phase) == (2, "distributed")
    assert "host 0 of 2 could not join the slice (coordinator 127.0.0.1): IndexError" in (
        record.message or ""
    )


def test_jax_imported_before_the_slice_is_connected_fails_naming_who_imported_it(
    tmp_path: Path,
):
    startup = tmp_path / "startup"
    startup.mkdir()
    (startup / "sitecustomize.py").write_text("import jax\n")
    env = {**_slice_host_0("127.0.0.1:8482"), "PYTHONPATH": str(startup)}

    code, record = _run_pod(tmp_path / "job", b"not a pickle", _zip({}), env=env)

    assert (code, record.phase) == (2, "distributed")
    assert "JAX was imported before jax.distributed.initialize" in (record.message or "")
    assert "the interpreter's start-up imported it: sitecustomize" in (record.message or "")


def test_the_jax_import_watch_names_the_phase_file_and_line_that_imported_jax(tmp_path: Path):
    (tmp_path / "trains.py").write_text("import os\nimport jax.numpy\n")
    script = (
        "from kinetic_prefect.pod.slice import JaxImportWatch\n"
        "watch = JaxImportWatch.start()\n"
        "watch.phase = 'unpickle'\n"
        "import trains\n"
        "print(watch.stop())\n"
    )

    result = subprocess.run(
        [sys.executable, "-c", script],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert f"during the pod's unpickle phase, at {tmp_path / 'trains.py'}:2" in result.stdout


def test_result_storage_on_gcs_unpickles_in_a_pod_without_prefect_kubernetes():
    """A pod whose task's results go to GCS unpickles a `GcsBucket` holding
    `KineticGcpCredentials`; only `KineticCluster` needs prefect-kubernetes (about half
    a second of CPU per pod)."""
    from prefect_gcp.cloud_storage import GcsBucket

    from kinetic_prefect.blocks import KineticGcpCredentials

    storage = GcsBucket(bucket="results", gcp_credentials=KineticGcpCredentials())
    payload = cloudpickle.dumps(storage)
    script = (
        "import sys, cloudpickle\n"
        "storage = cloudpickle.loads(sys.stdin.buffer.read())\n"
        "print(type(storage.gcp_credentials).__module__)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'prefect_kubernetes'))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], input=payload, capture_output=True, check=True
    )

    assert result.stdout.decode().split("\n")[:2] == ["kinetic_prefect.blocks.credentials", "[]"]
