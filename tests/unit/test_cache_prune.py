"""The suite keeps only the newest few environments in each cache it fills."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.cache_prune import environment_caches, prune_oldest


def test_only_the_newest_environments_are_kept(tmp_path: Path):
    for age, name in enumerate(["newest", "middle", "oldest"]):
        entry = tmp_path / name
        (entry / "lib").mkdir(parents=True)
        os.utime(entry, (1_000_000 - age, 1_000_000 - age))
    (tmp_path / ".lock").write_text("")

    removed = prune_oldest(tmp_path, keep=2)

    assert [p.name for p in removed] == ["oldest"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "middle", "newest"]


def test_the_build_cache_and_both_node_caches_are_pruned(tmp_path: Path):
    assert environment_caches(tmp_path) == [
        tmp_path / "environments",
        tmp_path / "node/var/cache/kinetic-prefect/environments",
        tmp_path / "test-node/var/cache/kinetic-prefect/environments",
    ]
