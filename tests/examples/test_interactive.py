"""README's "From a notebook": tasks from notebook cells and stdin scripts run in local pods.

The notebook's cells are the README's, run by nbclient in a real IPython kernel of
this environment's Python (a kernel spec written for the test names `sys.executable`),
started in the notebook's folder beside the README's `helpers.py`, with the test's
Prefect API, as Jupyter would run them.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

from tests.support.gcs_iam import doc_section

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
KERNEL = "kinetic-prefect-tests"
# A cell runs a flow of three pods; on a busy two-core machine that can take a while.
CELL_SECONDS = 240

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


def _readme_code() -> tuple[str, list[str]]:
    """The section's `helpers.py` and its notebook, split into cells at `# %%`."""
    helpers, notebook = re.findall(
        r"```python\n(.*?)```", doc_section(README, "## From a notebook"), re.S
    )
    cells = [cell.strip() for cell in re.split(r"^# %%.*$", notebook, flags=re.M)]
    return helpers, [cell for cell in cells if cell]


@pytest.fixture
def kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A kernel spec for this environment's Python, the only one its JUPYTER_PATH holds."""
    spec = tmp_path / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    # No IPython profile or startup file of this machine's user.
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    return KERNEL


def _cell_index(cells: list[Any], text: str) -> int:
    (index,) = [i for i, cell in enumerate(cells) if text in cell.source]
    return index


def _value(cell: Any) -> Any:
    """The cell's result (its `execute_result`), as the Python value it displays."""
    (result,) = [out for out in cell.outputs if out.output_type == "execute_result"]
    return ast.literal_eval(result.data["text/plain"])


def _losses(helpers: str, loss_cell: str, ws: list[float]) -> list[float]:
    """What the README's `loss` of `dataset()` is for each w, computed in this process."""
    namespace: dict[str, Any] = {}
    exec(helpers, namespace)
    exec(loss_cell, namespace)
    return [namespace["loss"](w, namespace["dataset"]()) for w in ws]


def test_readme_notebook_maps_a_cell_task_over_pods_and_reruns_an_edited_cell(
    workdir: Path, kernel: str, prefect_api: str, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    helpers, sources = _readme_code()
    folder = workdir / "analysis"
    folder.mkdir()
    (folder / "helpers.py").write_text(helpers)
    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in sources]
        + [nbformat.v4.new_code_cell('"KINETIC_JOB_ID" in os.environ')]
    )
    cells = notebook.cells
    loss_at, run_at = _cell_index(cells, "def loss("), _cell_index(cells, "sweep([")
    (inputs,) = re.findall(r"sweep\((\[.*?\])\)", cells[run_at].source)
    ws = ast.literal_eval(inputs)
    original_loss = cells[loss_at].source
    edited_loss = original_loss.replace("** 2", "** 4")
    client = NotebookClient(
        notebook,
        kernel_name=kernel,
        timeout=CELL_SECONDS,
        resources={"metadata": {"path": str(folder)}},
    )

    with client.setup_kernel():
        for index, cell in enumerate(cells):
            client.execute_cell(cell, index)
        first = _value(cells[run_at])
        cells[loss_at].source = edited_loss
        client.execute_cell(cells[loss_at], loss_at)
        client.execute_cell(cells[run_at], run_at)
        second = _value(cells[run_at])

    jobs = [row["job"] for row in first + second]
    assert [row["w"] for row in first] == [row["w"] for row in second] == ws
    assert [row["loss"] for row in first] == _losses(helpers, original_loss, ws)
    assert [row["loss"] for row in second] == _losses(helpers, edited_loss, ws)
    assert [row["loss"] for row in second] != [row["loss"] for row in first]
    # Every value came from a pod of its own, launched from the notebook's folder; the
    # kernel itself is no pod.
    assert len(set(jobs)) == 2 * len(ws)
    assert all((folder / ".kinetic" / "pods" / f"{job}.log").is_file() for job in jobs)
    assert _value(cells[-1]) is False


STDIN_SCRIPT = """
import json, os
from dataclasses import dataclass
from prefect import flow, task
from kinetic_prefect import KineticTaskRunner

@dataclass
class Trial:
    x: int

def doubled(x):
    return 2 * x

@task
def compute(trial):
    from beside import offset  # imported in the pod, from the code archive

    return {"value": doubled(offset(trial.x)), "job": os.environ["KINETIC_JOB_ID"]}

@flow(task_runner=KineticTaskRunner())
def one(trial):
    return compute.submit(trial).result()

print("RESULT " + json.dumps(one(Trial(20))))
"""


def test_script_on_stdin_runs_in_a_pod_that_imports_the_module_beside_it_in_its_project(
    workdir: Path, prefect_api: str
):
    # The session's folder is below its project's root: the archive holds the whole
    # project, and the pod imports from the session's folder as the session did.
    (workdir / "pyproject.toml").write_text("[project]\nname = 'analysis'\n")
    session = workdir / "sessions"
    session.mkdir()
    (session / "beside.py").write_text("def offset(x):\n    return x + 1\n")

    result = subprocess.run(
        [sys.executable, "-"],
        input=STDIN_SCRIPT,
        cwd=session,
        env={**os.environ, "PREFECT_API_URL": prefect_api},
        capture_output=True,
        text=True,
        timeout=CELL_SECONDS,
    )
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), "")
    assert line, f"the script exited with {result.returncode}:\n{result.stderr[-3000:]}"
    outcome = json.loads(line.removeprefix("RESULT "))

    assert outcome["value"] == 2 * (20 + 1)
    assert (session / ".kinetic" / "pods" / f"{outcome['job']}.log").is_file()
