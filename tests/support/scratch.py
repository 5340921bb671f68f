"""The suite's scratch space: pytest's temporary directories and `TMPDIR` in RAM when
there is room.

A run writes and unpacks a few GB (nodes' environment caches, pods' working
directories, data and code archives, Prefect servers' SQLite databases). On this
machine, through ext4 on a virtual disk, the file-heavy cases took about a tenth more
CPU than on tmpfs (docs/testing.md, "Scratch in RAM"). So unless `--basetemp` is
given, each pytest run uses a directory of its own under `/dev/shm` when that is a tmpfs
that allows executables and has `MIN_FREE_BYTES` free; otherwise pytest's usual place.
A passing run removes it; a failing one leaves it and says where, and the next run of
the same checkout removes it once the run that made it has ended. Runs side by side (the
main suite and the lowest-Prefect run, or a focused run beside a whole one) never touch
each other's.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

SHM = "/dev/shm"
# A whole run has used about 5.4 GB there; the rest is headroom for the pods' own memory.
MIN_FREE_BYTES = 10 * 1024**3
_KEY = pytest.StashKey[Path]()
_PASSED = pytest.StashKey[bool]()


def tmpfs_root(mounts: str, mount_point: str, free_bytes: int) -> bool:
    """Whether `mount_point` (as /proc/mounts lists it) is a tmpfs that may hold the
    suite's scratch: executables allowed (pods run interpreters and scripts from their
    directories) and `free_bytes` at least `MIN_FREE_BYTES`."""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[1] == mount_point:
            options = fields[3].split(",")
            return (
                fields[2] == "tmpfs" and "noexec" not in options and (free_bytes >= MIN_FREE_BYTES)
            )
    return False


def scratch_dir(rootdir: Path, interpreter: str = sys.prefix) -> Path | None:
    """This run's scratch directory in RAM, or None where there is no room for it.

    Named after the checkout, the interpreter's environment and the run's process (the
    xdist controller, whose workers are told its `--basetemp`), by its pid and start time:
    no two runs share it.
    """
    try:
        mounts = Path("/proc/mounts").read_text()
        stats = os.statvfs(SHM)
    except OSError:
        return None
    if not tmpfs_root(mounts, SHM, stats.f_bavail * stats.f_frsize):
        return None
    digest = hashlib.sha256(f"{rootdir.resolve()}\0{interpreter}".encode()).hexdigest()[:12]
    pid = os.getpid()
    return Path(SHM) / f"kinetic-prefect-tests-{os.getuid()}-{digest}-{pid}-{_started(pid)}"


def ended_runs_scratch(root: Path) -> list[Path]:
    """The scratch directories of earlier runs like this one's whose process has ended (its
    pid gone, or taken by a process started at another time), and one named as before runs
    had their own."""
    prefix = root.name.rsplit("-", 2)[0]
    ended = [root.parent / prefix] if (root.parent / prefix).is_dir() else []
    for path in root.parent.glob(f"{prefix}-*-*"):
        pid, started = path.name.rsplit("-", 2)[1:]
        if path != root and pid.isdigit() and _started(int(pid)) != started:
            ended.append(path)
    return ended


def _started(pid: int) -> str:
    """When process `pid` started, in clock ticks since boot ("" if there is none)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    # Field 22; the command name (field 2) may hold spaces, so count after its ")".
    return stat.rsplit(")", 1)[1].split()[19]


def use_scratch(config: pytest.Config) -> None:
    """Point pytest's `--basetemp` and `TMPDIR` (this process's and every process it
    starts) into the scratch directory, unless `--basetemp` was given."""
    if config.option.basetemp:
        return
    root = scratch_dir(config.rootpath)
    if root is None:
        return
    for left in ended_runs_scratch(root):
        shutil.rmtree(left, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    (root / "tmp").mkdir(parents=True)
    config.option.basetemp = str(root / "pytest")
    os.environ["TMPDIR"] = str(root / "tmp")
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    config.stash[_KEY] = root
    # Registered first, so it runs last at exit: after the atexit clean-ups of what the run
    # made in it (Prefect's test harness removes its own directory then).
    atexit.register(_remove_after_a_pass, config)


def _remove_after_a_pass(config: pytest.Config) -> None:
    if config.stash.get(_PASSED, False):
        shutil.rmtree(config.stash[_KEY], ignore_errors=True)


def end_scratch(config: pytest.Config, exitstatus: int) -> None:
    """After a passing run, have the scratch directory removed at exit; after a failing
    one, say where it is (it holds RAM until removed)."""
    root = config.stash.get(_KEY, None)
    if root is None:
        return
    if exitstatus == 0:
        config.stash[_PASSED] = True  # removed at exit
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"The run's scratch is kept in RAM at {root}: remove it when done (the next run "
            "of this checkout removes it too)."
        )
