"""What a local pod is made of: its processes, its command, its env and its FUSE volumes.

The local backend runs a Job manifest's container as a process on this machine;
this module turns the manifest into that process's command line and environment
and realises its GCS FUSE volumes as local copies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect.logging import get_logger

from kinetic_prefect.backends.base import OnExit, Secrets
from kinetic_prefect.backends.local.interpreter import started_from_node_copy
from kinetic_prefect.backends.local.template import TemplateChild, forkable, templates
from kinetic_prefect.data.data import materialise_fuse_volume
from kinetic_prefect.launch.manifest import ENV_CACHE_VOLUME, GCSFUSE_DRIVER, container_of

logger = get_logger("kinetic_prefect.backends.local.backend")

# Variables of the submitting process that must not leak into a pod: the pod's
# Prefect settings and Kinetic settings come from its manifest only.
_ISOLATED_PREFIXES = ("PREFECT_", "KINETIC_", "JAX_", "XLA_", "TPU_", "MEGASCALE_")


def container_env(
    manifest: Mapping[str, Any],
    secrets: Secrets,
    fields: Mapping[str, str] | None = None,
    base_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The pod's environment: a base plus the manifest's env.

    The base is `base_env` when given (what an image would set), else this
    machine's environment without Prefect, Kinetic and accelerator settings.
    `fields` gives the values of the fieldRefs the manifest uses, by field path.
    """
    if base_env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_ISOLATED_PREFIXES)}
    else:
        env = dict(base_env)
    for item in container_of(manifest).get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
            continue
        field_ref = item["valueFrom"].get("fieldRef")
        if field_ref is not None:
            path = field_ref["fieldPath"]
            if fields is None or path not in fields:
                raise KeyError(f"The local backend cannot fill {item['name']} from {path}")
            env[item["name"]] = fields[path]
            continue
        ref = item["valueFrom"]["secretKeyRef"]
        try:
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        except KeyError as exc:
            raise KeyError(
                f"Secret {ref['name']}/{ref['key']} for {item['name']} was not provided"
            ) from exc
    return env


def container_command(manifest: Mapping[str, Any], interpreter: str = sys.executable) -> list[str]:
    """The container's command and args, with `python` run as `interpreter`."""
    container = container_of(manifest)
    command = [*container.get("command", []), *container.get("args", [])]
    if command and command[0] in {"python", "python3"}:
        command[0] = interpreter
    return command


def env_cache_directory(manifest: Mapping[str, Any], node_root: Path, scratch: Path) -> Path:
    """Where the pod's environment cache volume lives here: the node's hostPath directory
    under `node_root`, or the pod's own directory for an emptyDir."""
    for volume in manifest["spec"]["template"]["spec"].get("volumes") or []:
        if volume["name"] == ENV_CACHE_VOLUME and "hostPath" in volume:
            return node_root / volume["hostPath"]["path"].lstrip("/")
    return scratch / "volumes" / ENV_CACHE_VOLUME


def has_init_containers(manifest: Mapping[str, Any]) -> bool:
    """Whether the pod has init containers to run before its task container."""
    return bool(manifest["spec"]["template"]["spec"].get("initContainers"))


def run_init_containers(
    manifest: Mapping[str, Any], interpreter: str, env: Mapping[str, str], cwd: Path, log: Path
) -> int:
    """Run the pod's init containers in order, as the kubelet does; the first failing code.

    They run with the task container's env (the product gives them the same one).
    """
    for init in manifest["spec"]["template"]["spec"].get("initContainers") or []:
        command = [*init.get("command", []), *init.get("args", [])]
        if command and command[0] in {"python", "python3"}:
            command[0] = interpreter
        with open(log, "ab") as out:
            code = subprocess.run(
                command, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            ).returncode
        if code != 0:
            return code
    return 0


def start_process(
    command: list[str], env: Mapping[str, str], cwd: Path, log_path: Path
) -> tuple[subprocess.Popen[bytes] | TemplateChild, int]:
    """Start one host process of a pod, forked from a template when it can be; it and its pidfd.

    Either way it leads a session of its own and writes stdout and stderr to `log_path`.
    """
    from_node = started_from_node_copy(command, env)
    if from_node is not None:
        command, env = from_node
    if forkable(command):
        try:
            return templates.spawn(command, env, cwd, log_path)
        except OSError as exc:
            logger.warning("Starting a pod as a fresh process (%s): %s", log_path.stem, exc)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, os.pidfd_open(process.pid)


def materialise_fuse_volumes(manifest: Mapping[str, Any], root: Path) -> Path | None:
    """Realise the manifest's GCS FUSE volumes as read-only local copies under `root`."""
    volumes = [
        v
        for v in manifest["spec"]["template"]["spec"].get("volumes", [])
        if v.get("csi", {}).get("driver") == GCSFUSE_DRIVER
    ]
    for volume in volumes:
        attributes = volume["csi"]["volumeAttributes"]
        options = dict(
            option.partition("=")[::2] for option in attributes.get("mountOptions", "").split(",")
        )
        materialise_fuse_volume(
            attributes["bucketName"], options.get("only-dir", ""), root / volume["name"]
        )
    return root if volumes else None


@dataclass
class HostProcess:
    """One host process of a pod (a single-host pod has one, host 0)."""

    index: int
    process: subprocess.Popen[bytes] | TemplateChild
    pidfd: int | None
    log_path: Path


@dataclass
class PodProcess:
    """A pod as the local backend runs it: its hosts' processes and how it is ending."""

    job_id: str
    manifest: dict[str, Any]
    on_exit: OnExit
    secrets: Secrets
    log_path: Path
    hosts: list[HostProcess] = field(default_factory=list)
    # The first host that ended badly: its exit is the pod's.
    failed_host: HostProcess | None = None
    deadline: float | None = None
    kill_at: float | None = None
    cancelled: bool = False
    deadline_exceeded: bool = False
    launched_at: float = field(default_factory=time.monotonic)
    started_at: float = 0.0
