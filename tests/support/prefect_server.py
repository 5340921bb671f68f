"""A real `prefect server start` on SQLite, and the `prefect` CLI and worker processes around it.

Every process gets an environment of its own: nothing `PREFECT_*` or
`KINETIC_*` leaks in from the test process, so each one talks to this server
only and keeps its files under the given root.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_until

_ISOLATED_PREFIXES = ("PREFECT_", "KINETIC_")
# Parts of a Prefect server no test here uses, each a loop (or, for triggers, work on every
# event): marking workers offline, runs late, pauses expired, leases and leftovers
# reclaimed, automations; and the UI's static files, copied into each new home. Every
# server of the suite starts without them (tests/conftest.py sets them for the session's).
UNUSED_SERVER_PARTS = dict.fromkeys(
    (
        "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED",
        "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED",
        "PREFECT_SERVER_SERVICES_PAUSE_EXPIRATIONS_ENABLED",
        "PREFECT_SERVER_SERVICES_REPOSSESSOR_ENABLED",
        "PREFECT_SERVER_SERVICES_CLEANUP_RECONCILER_ENABLED",
        "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED",
        "PREFECT_SERVER_UI_ENABLED",
    ),
    "false",
)
_STOP_TIMEOUT_SECONDS = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without Prefect or Kinetic settings, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ISOLATED_PREFIXES)}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env.update(extra)
    return env


def log_tail(path: Path, lines: int = 60) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Process:
    """A background `prefect ...` process with its log file."""

    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        """Interrupt it as Ctrl-C would, then kill its process group if it lingers."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=_STOP_TIMEOUT_SECONDS)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def start_prefect(args: list[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> Process:
    """`prefect *args` in the background, in a process group of its own."""
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "prefect", *args],
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Process(process, log_path)


@dataclass
class PrefectServer:
    """A running server: its API URL and where its clients keep their files."""

    api_url: str
    root: Path
    process: Process
    auth_string: str | None = None

    def client_env(self, **extra: str) -> dict[str, str]:
        """Environment for a process that talks to this server (CLI, worker)."""
        auth = {"PREFECT_API_AUTH_STRING": self.auth_string} if self.auth_string else {}
        return clean_environ(
            PREFECT_API_URL=self.api_url,
            PREFECT_HOME=str(self.root / "client-home"),
            **auth,
            **extra,
        )

    def cli(
        self, *args: str, cwd: Path | None = None, timeout: float = 120, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run `prefect *args` to completion; fail with its output if it fails."""
        result = subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            env=self.client_env(PREFECT_CLI_WRAP_LINES="false", COLUMNS="200", **env),
            cwd=cwd or self.root,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert result.returncode == 0, (
            f"`prefect {' '.join(args)}` exited with {result.returncode}:\n"
            f"{result.stdout}\n{result.stderr}"
        )
        return result

    def client(self) -> Any:
        """A sync Prefect client for this server (use it as a context manager)."""
        from prefect.client.orchestration import SyncPrefectClient

        return SyncPrefectClient(api=self.api_url, auth_string=self.auth_string)


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def migrated_database(cache: Path) -> Path:
    """An empty Prefect database with every migration applied, made once under `cache`.

    Migrating a new SQLite database is half of a server's start-up (about 6 s of CPU);
    servers that start from a copy of this one skip it. Processes that share `cache`
    (pytest-xdist workers) take turns: the first makes it, the rest wait and reuse it.
    """
    cache.mkdir(parents=True, exist_ok=True)
    database = cache / "migrated.db"
    with open(cache / "migrated.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not database.exists():
            making = cache / "migrating.db"
            making.unlink(missing_ok=True)
            result = subprocess.run(
                [sys.executable, "-m", "prefect", "server", "database", "upgrade", "--yes"],
                env=clean_environ(
                    PREFECT_HOME=str(cache / "home"),
                    PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{making}",
                ),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert result.returncode == 0, (
                f"Migrating {making} failed:\n{result.stdout}\n{result.stderr}"
            )
            making.rename(database)
    return database


@contextlib.contextmanager
def prefect_server(
    root: Path,
    auth_string: str | None = None,
    startup_timeout: float = 120.0,
    database: Path | None = None,
) -> Iterator[PrefectServer]:
    """`prefect server start` on a new SQLite database under `root`, stopped on exit.

    With `auth_string` ("user:password") the API demands HTTP basic auth of every client.
    With `database` (see `migrated_database`) the new database starts as a copy of it.
    """
    root.mkdir(parents=True, exist_ok=True)
    if database is not None:
        shutil.copyfile(database, root / "prefect.db")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = clean_environ(
        PREFECT_HOME=str(root / "server-home"),
        PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{root / 'prefect.db'}",
        # New deployments get their runs within a second or two, not a minute.
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="1",
        PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS="1",
        PREFECT_SERVER_LOGGING_LEVEL="WARNING",
        **UNUSED_SERVER_PARTS,
        **({"PREFECT_SERVER_API_AUTH_STRING": auth_string} if auth_string else {}),
    )
    process = start_prefect(
        ["server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        root,
        root / "server.log",
    )
    try:

        def up() -> bool:
            if process.process.poll() is not None:
                raise AssertionError(
                    f"prefect server exited with {process.process.returncode}:\n"
                    f"{process.log_tail()}"
                )
            return _healthy(api_url)

        wait_until(up, startup_timeout, f"prefect server at {api_url} to answer /health")
        yield PrefectServer(api_url=api_url, root=root, process=process, auth_string=auth_string)
    finally:
        process.stop()


@contextlib.contextmanager
def prefect_worker(
    server: PrefectServer,
    pool: str,
    worker_type: str,
    cwd: Path,
    startup_timeout: float = 90.0,
    **env: str,
) -> Iterator[Process]:
    """`prefect worker start --pool POOL --type TYPE`, ready once the API lists it online."""
    name = f"{worker_type}-test-worker"
    process = start_prefect(
        ["worker", "start", "--pool", pool, "--type", worker_type, "--name", name],
        server.client_env(**env),
        cwd,
        cwd / "worker.log",
    )
    try:

        def online() -> bool:
            if process.process.poll() is not None:
                raise AssertionError(
                    f"prefect worker exited with {process.process.returncode}:\n"
                    f"{process.log_tail()}"
                )
            with server.client() as client:
                workers = client.read_workers_for_work_pool(pool)
            return any(w.name == name and w.status.value == "ONLINE" for w in workers)

        wait_until(online, startup_timeout, f"worker {name} to be online in pool {pool}")
        yield process
    finally:
        process.stop()
