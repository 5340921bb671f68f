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
    return result.returncode, FinalRecord.from_json((job_dir / "final-state.json").read_bytes())


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
    record = FinalRecord.from_json((job_dir / "final-state.json").read_bytes())

    assert (result.returncode, record.phase) == (2, "download")
    assert "Failed during download" in result.stderr.decode()
