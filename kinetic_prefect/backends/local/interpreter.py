"""Which Python runs a local pod: this interpreter, or a bare one as a stock image has.

A pod whose environment is shipped (`environment="ship"`) starts, on GKE, from a
`python:*-slim` image: an interpreter with its standard library and pip, and
nothing else. The local backend gives such a pod the same: a virtualenv of this
machine's base Python without its site-packages, made once per Python in the
cache. What the pod imports then comes only from the environment it unpacks,
so a local run proves what GKE will run. Other pods run this interpreter.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kinetic_prefect.common.env import ENV_CACHE_ENV, METADATA_HOST_ENVS, SHIPPED_ENV_ENV
from kinetic_prefect.launch.environment import UNPACKED_MARKER, cache_dir, node_cache_entry
from kinetic_prefect.launch.manifest import container_of


def bare_python() -> str:
    """A Python with only its standard library and pip (made once, then reused)."""
    minor = f"{sys.version_info.major}.{sys.version_info.minor}"
    root = cache_dir() / "bare-python" / minor
    python = root / "bin" / "python"
    if python.exists():
        return str(python)
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{minor}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not python.exists():
            partial = root.with_name(f".{minor}.partial")
            shutil.rmtree(partial, ignore_errors=True)
            base = getattr(sys, "_base_executable", sys.executable)
            subprocess.run([base, "-m", "venv", str(partial)], check=True, capture_output=True)
            os.replace(partial, root)
    return str(python)


def runs_bootstrap(manifest: Mapping[str, Any]) -> bool:
    """Whether the pod's container runs the shipped-environment bootstrap (`python -c`)."""
    command = container_of(manifest).get("command", [])
    return command[:2] in (["python", "-c"], ["python3", "-c"])


def started_from_node_copy(
    command: list[str], env: Mapping[str, str]
) -> tuple[list[str], dict[str, str]] | None:
    """A bootstrap pod whose environment the node already holds, as the bootstrap would run it.

    On a node cache hit the bootstrap only puts the unpacked environment first on
    the path and runs its module; this is that command (`python -m MODULE ARGS`)
    and environment, so the local backend can fork the pod from a template
    preloaded from the node's copy. None when the node must download it first, or
    when the bootstrap first waits for the metadata server (an environment in GCS
    and a metadata server named, as on the emulated cluster).
    """
    if command[1:2] != ["-c"] or command[3:4] != ["run"] or "--" not in command:
        return None
    split = command.index("--")
    options = dict(zip(command[4:split:2], command[5:split:2], strict=False))
    cache = env.get(ENV_CACHE_ENV)
    if not cache or "--key" not in options or "--module" not in options:
        return None
    directory = Path(cache) / node_cache_entry(options["--key"], options.get("--sha256", ""))
    if not (directory / UNPACKED_MARKER).is_file():
        return None
    if options.get("--archive", "").startswith("gs://") and any(
        env.get(name) for name in METADATA_HOST_ENVS
    ):
        return None
    shipped = {
        "key": options["--key"],
        "archive": options.get("--archive", ""),
        "sha256": options.get("--sha256", ""),
        "directory": str(directory),
    }
    rewritten = {**env, "PYTHONPATH": str(directory), SHIPPED_ENV_ENV: json.dumps(shipped)}
    return [command[0], "-m", options["--module"], *command[split + 1 :]], rewritten


def default_interpreter(manifest: Mapping[str, Any]) -> str:
    """A bare Python for a pod with a shipped environment, else this interpreter."""
    return bare_python() if runs_bootstrap(manifest) else sys.executable
