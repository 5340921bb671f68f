"""README's GCS emulator steps, run as written against a plain fake-gcs-server.

No IAM proxy in front: the emulator answers as a user's would (it has no
`testIamPermissions`). The steps run through bash, in order, from a copy of the
checkout's `blocks/` and `flows/`; the one substitution is the emulator's address,
which is this test's server's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from flows.quickstart import DEFAULT_CONFIGS

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
