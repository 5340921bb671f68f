"""When the suite's scratch goes to RAM (tests/support/scratch.py): rows of /proc/mounts."""

from __future__ import annotations

import pytest

from tests.support.scratch import MIN_FREE_BYTES, ended_runs_scratch, tmpfs_root

ROOT = "/dev/vda / ext4 rw,relatime,discard 0 0"
SHM = "tmpfs /dev/shm tmpfs rw,relatime,size=24684084k 0 0"


@pytest.mark.parametrize(
    ("mounts", "free", "expected"),
    [
        pytest.param(f"{ROOT}\n{SHM}", MIN_FREE_BYTES, True, id="a tmpfs with room"),
        pytest.param(f"{ROOT}\n{SHM}", MIN_FREE_BYTES - 1, False, id="a tmpfs too full"),
        pytest.param(
            f"{ROOT}\ntmpfs /dev/shm tmpfs rw,nosuid,nodev,noexec,relatime 0 0",
            MIN_FREE_BYTES,
            False,
            id="noexec: pods could not run their interpreters from it",
        ),
        pytest.param(
            f"{ROOT}\n/dev/vdb /dev/shm ext4 rw 0 0", MIN_FREE_BYTES, False, id="not a tmpfs"
        ),
        pytest.param(ROOT, MIN_FREE_BYTES, False, id="not mounted"),
    ],
)
def test_scratch_goes_to_ram_only_on_a_roomy_executable_tmpfs(
    mounts: str, free: int, expected: bool
) -> None:
    assert tmpfs_root(mounts, "/dev/shm", free) is expected


def test_a_run_removes_only_the_scratch_of_ended_runs_of_its_checkout(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from tests.support.scratch import _started

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    mine = tmp_path / f"kinetic-prefect-tests-0-abc-{os.getpid()}-{_started(os.getpid())}"
    going = os.getppid()
    dirs = {
        "mine": mine,
        "an ended run": tmp_path / f"kinetic-prefect-tests-0-abc-{ended.pid}-123",
        "a run still going": tmp_path / f"kinetic-prefect-tests-0-abc-{going}-{_started(going)}",
        "its pid now another process's": tmp_path / f"kinetic-prefect-tests-0-abc-{going}-1",
        "named as before": tmp_path / "kinetic-prefect-tests-0-abc",
        "another checkout": tmp_path / f"kinetic-prefect-tests-0-def-{ended.pid}-123",
    }
    for path in dirs.values():
        path.mkdir()

    assert sorted(ended_runs_scratch(mine)) == sorted(
        dirs[k] for k in ("an ended run", "its pid now another process's", "named as before")
    )
