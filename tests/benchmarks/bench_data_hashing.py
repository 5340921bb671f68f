"""Hashing throughput of `Data` content hashing against plain `hashlib.sha256` in memory.

Run: `.venv/bin/python tests/benchmarks/bench_data_hashing.py [MB]`.

Both sides hash the same bytes in the same run: the baseline is one sha256
over the whole buffer already in memory; `hash_local` reads the files from
disk (page cache after the first pass), hashes them in parallel threads and
combines per-file digests. The last column is a runner's second look at the
same unchanged data (`LocalDataHashes`: one stat per file, no reading). A
ratio above 1 means faster than the baseline.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kinetic_prefect.data.upload import LocalDataHashes, hash_local


def timed(fn: Callable[[], object], repeat: int = 5) -> float:
    """Median wall time of `repeat` calls."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def write_layout(root: Path, files: int, total_mb: int) -> tuple[Path, bytes]:
    """`files` random files totalling `total_mb` under `root/{files}-files`, and their bytes."""
    directory = root / f"{files}-files"
    directory.mkdir()
    size = total_mb * 1024 * 1024 // files
    chunks = [os.urandom(size) for _ in range(files)]
    for index, chunk in enumerate(chunks):
        (directory / f"part-{index:04d}.bin").write_bytes(chunk)
    return directory, b"".join(chunks)


def main(total_mb: int = 256) -> None:
    root = Path(tempfile.mkdtemp(prefix="kinetic-hash-"))
    print(f"\nContent hashing, {total_mb} MB, median of 5, {os.cpu_count()} CPUs")
    print(
        f"{'layout':<14}{'hashlib MB/s':>14}{'hash_local MB/s':>17}{'ratio':>8}"
        f"{'cached MB/s':>13}{'ratio':>10}"
    )
    for files in (1, 16, 256, 4096):
        directory, buffer = write_layout(root, files, total_mb)
        baseline = timed(lambda buffer=buffer: hashlib.sha256(buffer).hexdigest())
        ours = timed(lambda directory=directory: hash_local(directory))
        hashes = LocalDataHashes()
        hashes.content(directory)
        cached = timed(lambda directory=directory, h=hashes: h.content(directory))
        print(
            f"{f'{files} file(s)':<14}{total_mb / baseline:>14.0f}{total_mb / ours:>17.0f}"
            f"{baseline / ours:>7.2f}x{total_mb / cached:>13.0f}{baseline / cached:>9.1f}x"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
