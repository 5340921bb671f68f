"""The key that signs a flow run's final-state records, the same for every process that runs it.

Each flow run's records are signed with a key derived from a master key and the
flow run id, so a flow process that is restarted (or a Prefect retry of the flow
run on the same machine) verifies the records of pods its predecessor launched,
and a leaked per-flow-run key says nothing about other flow runs.

The master key is `KINETIC_RECORD_KEY` when set (give every machine that runs a
flow run the same value, e.g. from a secret store), else a random key created
once in `{PREFECT_HOME}/kinetic-record-key` with 0600 permissions. It never
leaves the orchestrator: pods get only their flow run's derived key, through
their Secret.

The node-cache key signs the markers of environments a pod unpacks into its node's
cache. It is derived from the master key alone, so every flow run of one master key
reuses (after re-verifying it) what another unpacked; a flow pod, which holds the master
key, derives it in its bootstrap (`kinetic_prefect.pod.bootstrap.node_cache_key`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from kinetic_prefect.common.env import SIGNING_KEY_ENV
from kinetic_prefect.errors import ConfigurationError

MASTER_KEY_ENV = SIGNING_KEY_ENV
KEY_FILE_NAME = "kinetic-record-key"


def key_file() -> Path:
    """Where the master key lives when `KINETIC_RECORD_KEY` is not set."""
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home).expanduser() / KEY_FILE_NAME


def _read_or_create(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as created:
            created.write(secrets.token_hex(32))
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigurationError(
            f"The record key file {path} can be read by other users (mode {mode:o}); "
            f"restrict it with `chmod 600 {path}`, or set {MASTER_KEY_ENV} instead."
        )
    key = path.read_text().strip()
    if not key:
        raise ConfigurationError(
            f"The record key file {path} is empty; delete it (a new key is created on the next "
            f"run) or set {MASTER_KEY_ENV}."
        )
    return key


def master_key() -> str:
    """`KINETIC_RECORD_KEY`, else the key file under Prefect's home (created on first use)."""
    configured = os.environ.get(MASTER_KEY_ENV, "").strip()
    return configured or _read_or_create(key_file())


def flow_run_key(master: str, flow_run_id: str) -> str:
    """The signing key of one flow run's records, derived from the master key."""
    message = f"kinetic-prefect record key/{flow_run_id}".encode()
    return hmac.new(master.encode(), message, hashlib.sha256).hexdigest()


def node_cache_key(master: str) -> str:
    """The key of node-cache markers: one per master key, whatever the flow run.

    Written again in the standard-library bootstrap, which a unit test keeps equal.
    """
    message = b"kinetic-prefect node cache key"
    return hmac.new(master.encode(), message, hashlib.sha256).hexdigest()
