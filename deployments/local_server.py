"""Run a command against a local Prefect server, starting one if none answers.

    python deployments/local_server.py -- python flows/quickstart.py

The server (SQLite under `.prefect/` in the project) keeps running afterwards
so the runs stay browsable in the UI; `python deployments/local_server.py --stop`
stops it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / ".prefect"
PID_FILE = STATE / "server.pid"
HOST, PORT = "127.0.0.1", 4200
API_URL = f"http://{HOST}:{PORT}/api"
UI_URL = f"http://{HOST}:{PORT}"
STARTUP_SECONDS = 120


def healthy(api_url: str = API_URL) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def start_server() -> None:
    STATE.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "PREFECT_HOME": str(STATE),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{STATE / 'prefect.db'}",
    }
    log = open(STATE / "server.log", "ab")  # noqa: SIM115 - the server outlives this process
    process = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", HOST, "--port", str(PORT)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    PID_FILE.write_text(str(process.pid))
    deadline = time.monotonic() + STARTUP_SECONDS
    while not healthy():
        if process.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"The Prefect server did not start; see {STATE / 'server.log'}.")
        time.sleep(0.5)


def stop_server() -> None:
    if not PID_FILE.exists():
        print("No server started by this script is recorded.")
        return
    pid = int(PID_FILE.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
        print(f"Stopped the Prefect server (pid {pid}).")
    except ProcessLookupError:
        print("The recorded server was not running.")
    PID_FILE.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop", action="store_true", help="stop the server this script started")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.stop:
        stop_server()
        return
    api_url = os.environ.get("PREFECT_API_URL") or API_URL
    if not healthy(api_url):
        if api_url != API_URL:
            sys.exit(f"PREFECT_API_URL={api_url} does not answer; start that server or unset it.")
        print(f"Starting a local Prefect server at {UI_URL} (SQLite in {STATE}) ...")
        start_server()
    command = [c for c in args.command if c != "--"]
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_UI_URL": api_url.removesuffix("/api")}
    if command:
        code = subprocess.call(command, env=env, cwd=ROOT)
        if code:
            sys.exit(code)
    print(
        f"\nPrefect UI: {api_url.removesuffix('/api')}  (Runs → the flow run → its task runs;"
        " each task run's Artifacts tab shows its pod, output dir and progress; the flow run's"
        " Artifacts show the metrics table and loss curves)."
        "\nStop the server with: make demo-stop (python deployments/local_server.py --stop)"
    )


if __name__ == "__main__":
    main()
