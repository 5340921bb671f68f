"""The node's environment cache: what pruning removes, and never an environment in use."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kinetic_prefect.pod import bootstrap

GB = 10**9


@pytest.mark.parametrize(
    ("entries", "max_bytes", "keep", "removed"),
    [
        # (key, size, last use), the cap, in use or being readied, what goes (oldest first)
        ([("a", GB, 1.0), ("b", GB, 2.0)], 3 * GB, set(), []),
        ([("a", GB, 1.0), ("b", GB, 2.0)], 2 * GB, set(), []),
        ([("a", GB, 1.0), ("b", GB, 3.0), ("c", GB, 2.0)], 2 * GB, set(), ["a"]),
        ([("a", GB, 1.0), ("b", GB, 3.0), ("c", GB, 2.0)], GB, set(), ["a", "c"]),
        ([("a", GB, 1.0), ("b", GB, 3.0), ("c", GB, 2.0)], 2 * GB, {"a"}, ["c"]),
        ([("a", 3 * GB, 2.0), ("b", GB, 1.0)], 2 * GB, set(), ["b", "a"]),
        ([("new", 3 * GB, 9.0), ("b", GB, 1.0)], 2 * GB, {"new"}, ["b"]),
        ([("a", GB, 1.0), ("b", GB, 2.0)], 0, {"a", "b"}, []),
        ([], GB, set(), []),
    ],
)
def test_prune_plan_removes_least_recently_used_until_the_cache_fits(
    entries, max_bytes, keep, removed
):
    assert bootstrap.prune_plan(entries, max_bytes, keep) == removed


def _environment(cache: Path, key: str, size: int) -> None:
    (cache / key).mkdir(parents=True)
    (cache / key / "payload.bin").write_bytes(b"x" * size)
    (cache / key / bootstrap.UNPACKED_MARKER).write_text(key)


def test_pruning_never_removes_an_environment_a_running_pod_holds(tmp_path: Path):
    for key in ("held", "idle", "new"):
        _environment(tmp_path, key, 1000)
    bootstrap.hold_in_use(tmp_path, "held")  # this process stands for a running pod

    removed = bootstrap.prune_cache(tmp_path, 1500, keep="new")

    assert removed == ["idle"]
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "held",
        "new",
    ]


def test_a_removed_environment_leaves_the_cache_at_once_and_its_files_are_deleted_behind(
    tmp_path: Path,
):
    for key in ("idle", "new"):
        _environment(tmp_path, key, 1000)
    leftover = tmp_path / f".0123456789ab{bootstrap._REMOVED}x" / "old"
    leftover.mkdir(parents=True)  # what a pod that pruned before left half deleted

    removed = bootstrap.prune_cache(tmp_path, 1500, keep="new")

    assert removed == ["idle"]
    assert not (tmp_path / "idle").exists()
    deadline = time.monotonic() + 60
    while list(tmp_path.glob(f".*{bootstrap._REMOVED}*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(f".*{bootstrap._REMOVED}*")) == []


@pytest.mark.parametrize(
    ("archive", "metadata_host", "forked"),
    [
        ("gs://envs/k.tar.gz", "", True),
        ("gs://envs/k.tar.gz", "127.0.0.1:8080", False),  # the bootstrap waits for it first
        ("/store/k.tar.gz", "127.0.0.1:8080", True),
    ],
)
def test_a_node_copy_starts_without_the_bootstrap_unless_it_first_waits_for_the_metadata_server(
    tmp_path: Path, archive: str, metadata_host: str, forked: bool
):
    from kinetic_prefect.backends.local.interpreter import started_from_node_copy

    _environment(tmp_path, bootstrap.node_cache_entry("k", "s"), 10)
    command = ["python", "-c", "SOURCE", "run", "--archive", archive, "--sha256", "s"]
    command += ["--key", "k", "--module", "kinetic_prefect.pod", "--", "job"]
    env = {bootstrap.ENV_CACHE_ENV: str(tmp_path), "GCE_METADATA_HOST": metadata_host}

    started = started_from_node_copy(command, env)

    assert (started is not None) == forked
