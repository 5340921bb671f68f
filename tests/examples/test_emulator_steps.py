"""README's GCS emulator steps, run as written against a plain fake-gcs-server.

No IAM proxy in front: the emulator answers as a user's would (it has no
`testIamPermissions`). The steps run through bash, in order, from a copy of the
checkout's `blocks/` and `flows/`; the one substitution is the emulator's address,
which is this test's server's. The bucket check before launching is also run on it
directly, for a bucket that exists and one that does not.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from flows.quickstart import DEFAULT_CONFIGS
from kinetic_prefect.common import gcs as kgcs
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.preflight import check_jobs_root

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCUMENTED_EMULATOR = "http://127.0.0.1:4443"
STEPS_SECONDS = 480

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


def _emulator_steps() -> str:
    """The ```sh block that follows the README's `save_local_emulator.py` mention."""
    text = README.read_text()
    (block,) = re.findall(r"```sh\n(export STORAGE_EMULATOR_HOST=.*?)```", text, re.S)
    assert "python blocks/save_local_emulator.py" in block
    return block


@pytest.mark.slow
def test_readme_emulator_steps_run_the_quickstart_on_a_plain_fake_gcs_server(
    workdir: Path, gcs_server: str, prefect_api: str
):
    for part in ("blocks", "flows"):
        shutil.copytree(ROOT / part, workdir / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", workdir)
    steps = _emulator_steps().replace(DOCUMENTED_EMULATOR, gcs_server)
    env = {
        **{k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PREFECT_API_URL": prefect_api,
    }

    result = subprocess.run(
        ["bash", "-e", "-c", steps],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=STEPS_SECONDS,
    )

    assert result.returncode == 0, f"{steps}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    emulator = storage.Client(
        project="emulator",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": gcs_server},
    )
    job_files = emulator.list_blobs("kinetic-jobs", prefix="kinetic/")
    results = emulator.list_blobs("kinetic-results", prefix="results/")
    # One pod per configuration, each with its result record in the results bucket.
    assert len({blob.name.split("/")[1] for blob in job_files}) == len(DEFAULT_CONFIGS)
    assert len(list(results)) == len(DEFAULT_CONFIGS)


@pytest.fixture
def plain_gcs(gcs_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Emulator mode straight on fake-gcs-server (no IAM proxy), with a new bucket."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    kgcs._clients.clear()
    bucket = kgcs.storage_client().create_bucket(f"kp-{uuid.uuid4().hex[:12]}")
    yield bucket.name
    kgcs._clients.clear()


def test_jobs_bucket_check_passes_on_an_emulator_without_test_iam_permissions(
    plain_gcs: str, caplog: pytest.LogCaptureFixture
):
    with caplog.at_level(logging.INFO, logger="prefect.kinetic_prefect.launch.preflight"):
        check_jobs_root(f"gs://{plain_gcs}/jobs", None)

    assert f"cannot tell the permissions on the jobs bucket gs://{plain_gcs}" in caplog.text


def test_jobs_bucket_check_on_an_emulator_still_says_a_missing_bucket_does_not_exist(
    plain_gcs: str,
):
    with pytest.raises(ConfigurationError, match="gs://kp-no-such-bucket does not exist"):
        check_jobs_root("gs://kp-no-such-bucket", None)
