"""When a tool reading a local pod's record may take the pod for gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kinetic_prefect.backends.local.pods import (
    process_start_ticks,
    read_pod,
    record_launch,
    record_update,
)


def _exited_pod(pods: Path, **record: object) -> subprocess.Popen[bytes]:
    """A pod record whose process has exited and is not reaped yet (a zombie)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    record_launch(pods, {"metadata": {"name": "kp-one", "labels": {}}})
    record_update(pods, "kp-one", pid=process.pid, pid_start=process_start_ticks(process.pid))
    if record:
        record_update(pods, "kp-one", **record)
    # The process has exited once waitid can see it, without reaping it.
    os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
    return process


def test_an_exited_pod_whose_watcher_lives_is_gone_only_once_its_end_is_recorded(tmp_path):
    process = _exited_pod(tmp_path)
    try:
        pod = read_pod(tmp_path, "kp-one")
        assert pod is not None and not pod.alive()
        # This process watches the pod and has yet to write its last log line and its end.
        assert not pod.gone()

        record_update(tmp_path, "kp-one", ended=True, exit_code=0)
        assert read_pod(tmp_path, "kp-one").gone()
    finally:
        process.wait()


def test_an_exited_pod_whose_watcher_died_is_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_start = process_start_ticks(dead.pid)
    dead.wait()
    process = _exited_pod(tmp_path, watcher=dead.pid, watcher_start=dead_start)
    try:
        assert read_pod(tmp_path, "kp-one").gone()
    finally:
        process.wait()
