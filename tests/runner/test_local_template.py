"""Local pods forked from the preloaded template: the same pod a fresh process would be.

A forked pod must see exactly its own environment, arguments, working directory and
Prefect settings; it must be a process of its own (session, exit status); and the
template must only have been started with what it may share with its pods.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, task

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.backends.local.template import TEMPLATE_ENV, is_startup_variable
from kinetic_prefect.pod.template import PRELOADED

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


@task
def describe_process() -> dict[str, Any]:
    import prefect.context
    from kubernetes_asyncio.config import kube_config

    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    return {
        "env": dict(os.environ),
        "argv0": sys.argv[0],
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "session_leader": os.getsid(0) == os.getpid(),
        "parent": [part.decode() for part in parent if part],
        "global_api_url": str(prefect.context.GLOBAL_SETTINGS_CONTEXT.settings.api.url),
        "kubeconfig_default": kube_config.KUBE_CONFIG_DEFAULT_LOCATION,
        "collecting": gc.isenabled(),
    }


@task
def exit_with(code: int) -> None:
    os._exit(code)


@flow(task_runner=KineticTaskRunner())
def described() -> dict[str, Any]:
    return describe_process.submit().result()


def _comparable(env: dict[str, str]) -> dict[str, str]:
    """The environment with what names the task run's own pod (job id, output dir) masked."""
    job_id, output_dir = env["KINETIC_JOB_ID"], env["KINETIC_OUTPUT_DIR"]
    return {
        k: v.replace(output_dir, "<output dir>").replace(job_id, "<job id>") for k, v in env.items()
    }


def test_a_forked_pod_sees_exactly_the_environment_a_fresh_pod_would(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))

    @flow(task_runner=KineticTaskRunner())
    def forked_then_fresh() -> tuple[dict[str, Any], dict[str, Any]]:
        forked = describe_process.submit().result()
        monkeypatch.setenv(TEMPLATE_ENV, "0")
        return forked, describe_process.submit().result()

    forked, fresh = forked_then_fresh()

    assert "kinetic_prefect.pod.template" in forked["parent"]
    assert "kinetic_prefect.pod.template" not in fresh["parent"]
    assert _comparable(forked["env"]) == _comparable(fresh["env"])
    assert TEMPLATE_ENV not in fresh["env"]
    # Read on import by kubernetes-asyncio (imported in the pod, or re-read if the
    # template has it): the pod's own.
    for pod in (forked, fresh):
        assert pod["kubeconfig_default"] == pod["env"]["KUBECONFIG"] == str(tmp_path / "kubeconfig")
    assert forked["argv0"] == fresh["argv0"]
    assert forked["argv0"].endswith("kinetic_prefect/pod/__main__.py")
    assert forked["session_leader"] and fresh["session_leader"]
    # The pod starts without the garbage collector; the task runs with it.
    assert forked["collecting"] and fresh["collecting"]
    # The extracted code comes first on the path, then the pod's working directory.
    assert Path(forked["path0"]).parent == Path(forked["cwd"]).parent


@pytest.mark.lowest_prefect
def test_a_forked_pod_reads_prefect_settings_from_its_own_environment(prefect_api: str):
    # The template imported Prefect without any PREFECT_ variable; the pod's manifest
    # carries the API URL, and Prefect's global settings must have been read again.
    result = described()

    assert "kinetic_prefect.pod.template" in result["parent"]
    assert result["env"]["PREFECT_API_URL"] == prefect_api
    assert result["global_api_url"] == prefect_api


def test_a_forked_pods_exit_status_is_its_own_and_ends_only_that_pod(workdir: Path):
    @flow(task_runner=KineticTaskRunner())
    def exits() -> tuple[Any, Any]:
        crashed = exit_with.submit(3)
        crashed.wait()
        return crashed.state, describe_process.submit().result()

    crashed, after = exits()

    records = [json.loads(p.read_text()) for p in (workdir / ".kinetic/pods").glob("*.json")]
    assert crashed.is_crashed()
    assert [r["exit_code"] for r in records if r["job_id"].startswith("kp-exit-with")] == [3]
    assert "kinetic_prefect.pod.template" in after["parent"]


_RECORD_READS = """
import json, os, sys
seen = set()
cls = type(os.environ)
for name in ("__getitem__", "__contains__"):
    original = getattr(cls, name)
    def recording(self, key, _original=original):
        seen.add(key)
        return _original(self, key)
    setattr(cls, name, recording)
import importlib
for module in sys.argv[1:]:
    importlib.import_module(module)
print(json.dumps(sorted(seen)))
"""

# Prefect's settings that `reload_prefect_settings` reads again in the pod (its logging
# configuration included), `prefect.runtime`'s overrides, read on each use, and
# kubernetes-asyncio's default kubeconfig (`_reread_kubeconfig_location`).
_REREAD = {"PREFECT_HOME", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", "HOME", "KUBECONFIG"}
_REREAD_PREFIXES = ("PREFECT_LOGGING_", "PREFECT__RUNTIME__")


def test_the_preloaded_modules_read_only_startup_variables_at_import(tmp_path: Path):
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    read = subprocess.run(
        [sys.executable, "-c", _RECORD_READS, *PRELOADED],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    names = json.loads(read.stdout.splitlines()[-1])

    assert "PREFECT_HOME" in names  # the recording sees what Prefect reads
    unexpected = [
        n
        for n in names
        if n not in _REREAD and not n.startswith(_REREAD_PREFIXES) and not is_startup_variable(n)
    ]
    assert unexpected == [], (
        "read while the template preloads, so a pod with another value must not fork from it: "
        "add them to the startup variables in kinetic_prefect/backends/local/template.py"
    )
