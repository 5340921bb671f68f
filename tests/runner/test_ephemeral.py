"""The embedded default works in Prefect's ephemeral mode: no API URL, no server to start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import json, os
from prefect import flow, task
from kinetic_prefect import KineticTaskRunner

@task
def pid_and_square(x):
    return x * x, os.getpid()

@flow(task_runner=KineticTaskRunner())
def squares():
    return [f.result() for f in pid_and_square.map([1, 2, 3])]

print("RESULT " + json.dumps({"results": squares(), "flow_pid": os.getpid()}))
"""


@pytest.mark.lowest_prefect
@pytest.mark.slow
def test_runner_with_no_settings_runs_pods_in_prefect_ephemeral_mode(
    tmp_path: Path, prefect_database: Path
):
    # A Prefect home used before: its database (where the ephemeral server keeps its
    # state) is migrated already, so the server skips the migrations.
    home = tmp_path / "prefect-home"
    home.mkdir()
    shutil.copyfile(prefect_database, home / "prefect.db")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KINETIC_"))}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        # Prefect's 20 s for its ephemeral server to answer is short on a busy two-core machine.
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
    )

    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), "")
    assert line, f"the flow exited with {result.returncode}:\n{result.stderr[-3000:]}"
    outcome = json.loads(line.removeprefix("RESULT "))

    assert [value for value, _ in outcome["results"]] == [1, 4, 9]
    assert outcome["flow_pid"] not in {pid for _, pid in outcome["results"]}
    assert (tmp_path / ".kinetic" / "kinetic").is_dir()
