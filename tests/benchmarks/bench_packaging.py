"""Packaging a git checkout of 10,000 tracked files against `git ls-files` alone.

Run: `.venv/bin/python tests/benchmarks/bench_packaging.py [FILES]`.

Everything is measured in the same run on the same checkout: the baseline is
`git ls-files --cached --others --exclude-standard -z` as a subprocess (what
the listing starts from); `iter_package_files` adds the ignore files, the
never-shipped rules and a `stat` per file; `build_context_zip` adds reading,
the credential check of each file's head, deflating and the sha256. The same
files outside a checkout (walked instead of listed) are the last column. The
checkout also holds an ignored 1 GB sparse file, which no column reads. A
ratio is the time over the baseline's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kinetic_prefect.launch.ignore import iter_package_files
from kinetic_prefect.launch.packaging import ArchiveLimits, build_context_zip
from tests.benchmarks.bench_data_hashing import timed


def write_project(root: Path, files: int) -> None:
    """`files` small Python files in 100 packages, a .gitignore and a pyproject.toml."""
    (root / "pyproject.toml").write_text("[project]\nname = 'bench'\n")
    (root / ".gitignore").write_text("runs/\n")
    for index in range(files):
        path = root / f"pkg{index % 100:02d}" / f"module_{index:05d}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"VALUE = {index}\n\n\ndef value() -> int:\n    return VALUE\n")


def git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=b@example.com", "-c", "user.name=b", *args],
        cwd=root,
        check=True,
        capture_output=True,
    )


def main(files: int = 10_000) -> None:
    base = Path(tempfile.mkdtemp(prefix="kinetic-bench-packaging-"))
    checkout, plain = base / "checkout", base / "plain"
    checkout.mkdir()
    write_project(checkout, files)
    shutil.copytree(checkout, plain)
    git(checkout, "init", "-q")
    git(checkout, "add", ".")
    git(checkout, "commit", "-q", "-m", "bench")
    (checkout / "runs").mkdir()
    with (checkout / "runs" / "huge.bin").open("wb") as huge:
        huge.truncate(1 << 30)
    limits = ArchiveLimits(max_bytes=10**12, max_files=files + 10)
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"]

    baseline = timed(lambda: subprocess.run(listing, cwd=checkout, check=True, capture_output=True))
    listed = timed(lambda: list(iter_package_files(checkout)))
    built = timed(lambda: build_context_zip(checkout, limits=limits))
    walked = timed(lambda: build_context_zip(plain, limits=limits))
    shipped = len(list(iter_package_files(checkout)))

    print(f"\nPackaging {shipped} tracked files, median of 5, {os.cpu_count()} CPUs")
    print(f"{'step':<36}{'seconds':>10}{'ratio':>9}")
    for label, seconds in (
        ("git ls-files (baseline)", baseline),
        ("iter_package_files (git listing)", listed),
        ("build_context_zip (git listing)", built),
        ("build_context_zip (walk, no git)", walked),
    ):
        print(f"{label:<36}{seconds:>10.3f}{seconds / baseline:>8.1f}x")
    shutil.rmtree(base)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
