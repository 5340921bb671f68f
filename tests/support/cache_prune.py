"""Keep the suite's environment caches on this machine from growing run after run.

Each commit changes the kinetic-prefect wheel, so each run of the suite builds a new
shipped environment (about 400 MB archived, 1.3 GB unpacked where a case unpacks it)
and unpacks the thin stand-in of tests/support/thin_environment.py under a new key.
The suite reuses them across runs on purpose; at the start of a run it keeps only the
newest few of each cache.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kinetic_prefect.launch.environment import cache_dir

KEEP = 2
_NODE_ENVIRONMENTS = Path("var/cache/kinetic-prefect/environments")


def environment_caches(root: Path) -> list[Path]:
    """This machine's build cache and the node caches the suite's local nodes unpack into."""
    return [
        root / "environments",
        *(root / node / _NODE_ENVIRONMENTS for node in ("node", "test-node")),
    ]


def prune_oldest(directory: Path, keep: int = KEEP) -> list[Path]:
    """Remove all but the `keep` newest entries of `directory` (by modification time)."""
    if not directory.is_dir():
        return []
    entries = sorted(
        (p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    removed = entries[keep:]
    for entry in removed:
        shutil.rmtree(entry, ignore_errors=True)
    return removed


def prune_environment_caches() -> None:
    for directory in environment_caches(cache_dir()):
        prune_oldest(directory)
