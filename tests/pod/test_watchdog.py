"""The pod's watchdog trusts only leases signed with its flow run's key, and asks Prefect nothing.

Each test runs the watchdog in its own process, as a pod does (`start_watchdog()`),
with its lease at a named pipe: every look the watchdog takes at its lease is a
read the test answers (each from a pipe of its own), so the test decides what
each look sees and counts the looks, without timing anything.
"""

from __future__ import annotations

import errno
import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from kinetic_prefect.common.env import (
    FLOW_RUN_ID_ENV,
    LEASE_SINCE_ENV,
    LEASE_URI_ENV,
    ORPHAN_TIMEOUT_ENV,
    SIGNING_KEY_ENV,
)
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.common.lease import LeaseRecord
from tests.support.waiting import wait_until

KEY = "the-flow-runs-key"
FLOW_RUN_ID = "0b1c7a52-51a4-4b35-9bd1-1d1e5f7e0e11"
WATCHDOG = (
    "import threading\n"
    "from kinetic_prefect.pod.watchdog import start_watchdog\n"
    "import os\n"
    "from kinetic_prefect.common.intervals import Intervals\n"
    "start_watchdog(Intervals.from_environ(os.environ).watchdog_look_seconds)\n"
    "threading.Event().wait()\n"
)


@dataclass
class Pod:
    process: subprocess.Popen[bytes]
    lease: Path
    looks: int = 0

    def answer(self, key: str = KEY, ending: str | None = None, age: float = 0.0) -> bool:
        """Hand the watchdog's next look at its lease a lease signed with `key`, renewed `age`
        seconds before that look; False if the pod ended first.

        The lease is made once the look has opened it: on a loaded machine the look may come
        well after the call (the test serves several pods in turn), and a lease made before
        would be that much older than asked, past a short orphan timeout.
        """

        def next_look() -> int | str | None:
            if self.process.poll() is not None:
                return "ended"
            try:
                return os.open(self.lease, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nobody reading yet
                    return None
                raise

        opened = wait_until(next_look, 60, "the watchdog's next look at its lease")
        if opened == "ended":
            return False
        assert isinstance(opened, int)
        # A fresh pipe in the lease's place: the next look cannot join this one's read.
        fresh = self.lease.with_suffix(".next")
        os.mkfifo(fresh)
        fresh.replace(self.lease)
        with os.fdopen(opened, "wb") as pipe:
            pipe.write(lease(key, ending, age).encode())
        self.looks += 1
        return True

    def ended_because(self) -> str:
        self.process.wait(timeout=60)
        assert self.process.stderr is not None
        return self.process.stderr.read().decode()


@contextmanager
def watchdog_pod(tmp_path: Path, timeout: float, **env: str) -> Iterator[Pod]:
    lease = tmp_path / f"lease-{os.urandom(4).hex()}.json"
    os.mkfifo(lease)
    process = subprocess.Popen(
        [sys.executable, "-c", WATCHDOG],
        env={
            **os.environ,
            LEASE_URI_ENV: str(lease),
            LEASE_SINCE_ENV: repr(time.time()),
            ORPHAN_TIMEOUT_ENV: str(timeout),
            SIGNING_KEY_ENV: KEY,
            FLOW_RUN_ID_ENV: FLOW_RUN_ID,
            **Intervals.of(
                Intervals.from_environ(os.environ),
                {"emergency_window_seconds": 5},
            ).to_env(),
            **env,
        },
        stderr=subprocess.PIPE,
    )
    try:
        yield Pod(process, lease)
    finally:
        process.kill()
        process.wait()


def lease(key: str = KEY, ending: str | None = None, age: float = 0.0) -> LeaseRecord:
    record = LeaseRecord(
        flow_run_id=FLOW_RUN_ID,
        renewed_at=time.time() - age,
        sequence=1,
        writer="runner",
        ending=ending,
    )
    record.sign(key)
    return record


def test_a_forged_fresh_lease_does_not_keep_an_orphaned_pod_alive(tmp_path: Path):
    with watchdog_pod(tmp_path, timeout=2) as pod:
        while pod.answer(key="not-the-flow-runs-key"):
            assert pod.looks < 100, "the pod outlived its orphan timeout on forged leases"

        reason = pod.ended_because()

    assert "nobody owns this pod" in reason
    assert "unverified lease(s) ignored" in reason
    # It looked again and again (every timeout/4 s, fewer on a loaded machine) and found no
    # renewal it could trust.
    assert pod.looks >= 2


def test_a_forged_ending_lease_does_not_end_a_live_pod_and_a_signed_one_does(tmp_path: Path):
    with watchdog_pod(tmp_path, timeout=6) as pod:
        for _ in range(4):
            assert pod.answer(key="not-the-flow-runs-key", ending="cancelled")
            assert pod.answer()
        # The runner's own ending lease from before the pod was launched: an old one, replayed.
        assert pod.answer(ending="cancelled", age=30)
        assert pod.answer()
        assert pod.process.poll() is None

        assert pod.answer(ending="cancelled")
        reason = pod.ended_because()

    assert "the runner marked its lease: the flow run is cancelled" in reason


class _CountingApi(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (the handler's protocol)
        type(self).requests.append(self.path)
        self.send_error(503)

    do_POST = do_PATCH = do_GET  # noqa: N815

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def counting_api() -> Iterator[tuple[str, list[str]]]:
    """A stand-in Prefect API that answers nothing and counts every request it gets."""
    requests: list[str] = []
    handler = type("Handler", (_CountingApi,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/api", requests
    finally:
        server.shutdown()


@pytest.mark.parametrize("pods", [1, 4])
def test_watchdogs_send_no_prefect_api_request_however_many_pods(
    tmp_path: Path, counting_api: tuple[str, list[str]], pods: int
):
    api_url, requests = counting_api
    with ExitStack() as stack:
        running = [
            stack.enter_context(watchdog_pod(tmp_path, 2, PREFECT_API_URL=api_url))
            for _ in range(pods)
        ]
        for _ in range(4):
            for pod in running:
                assert pod.answer()
        for pod in running:
            assert pod.answer(ending="cancelled")
        reasons = [pod.ended_because() for pod in running]

    assert all("the flow run is cancelled" in reason for reason in reasons)
    assert requests == []


# A pod's task as its container's PID 1, as on GKE: the watchdog ends it (then it would sleep
# on until the case's deadline). The kernel drops signals PID 1 sends itself without a handler.
AS_PID_1 = (
    "import os, threading\n"
    "from kinetic_prefect.pod.watchdog import _end_pod\n"
    "assert os.getpid() == 1\n"
    "_end_pod('the test says so')\n"
    "threading.Event().wait()  # until ended: the case's subprocess timeout is the deadline\n"
    "raise SystemExit(3)\n"
)


@pytest.mark.parametrize(
    ("handler", "code"),
    [
        pytest.param("", 143, id="no SIGTERM handler: exits as SIGTERM would end it"),
        pytest.param(
            "import signal\n"
            "signal.signal(signal.SIGTERM, lambda *_: print('saving', flush=True))\n",
            137,
            id="a SIGTERM handler runs, then the grace ends it",
        ),
    ],
)
def test_a_pod_that_is_its_containers_pid_1_ends_itself(handler: str, code: int):
    intervals = '{"emergency_window_seconds": 1, "termination_grace_seconds": 2}'
    ended = subprocess.run(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", handler + AS_PID_1],
        env={**os.environ, "KINETIC_INTERVALS": intervals},
        capture_output=True,
        text=True,
        timeout=30,
    )

    assert ended.returncode == code, ended.stderr
    assert "ending, nobody owns this pod: the test says so" in ended.stderr
    assert ("saving" in ended.stdout) is bool(handler)
