"""Hashing throughput of `Data` content hashing against plain `hashlib.sha256` in memory.

Run: `.venv/bin/python tests/benchmarks/bench_data_hashing.py [MB]`.

Both sides hash the same bytes in the same run: the baseline is one sha256
over the whole buffer already in memory; `hash_local` reads the files from
disk (page cache after the first pass), hashes them in parallel threads and
combines per-file digests. A ratio above 1 means faster than the baseline.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kinetic_prefect.data import hash_local


def _timed(fn: object, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(total_mb: int = 256) -> None:
    root = Path(tempfile.mkdtemp(prefix="kinetic-hash-"))
    print(f"\nContent hashing, {total_mb} MB, median of 5, {os.cpu_count()} CPUs")
    print(f"{'layout':<22}{'hashlib MB/s':>14}{'hash_local MB/s':>17}{'ratio':>8}")
    for files in (1, 16, 256):
        directory = root / f"{files}-files"
        directory.mkdir()
        size = total_mb * 1024 * 1024 // files
        chunks = [os.urandom(size) for _ in range(files)]
        for index, chunk in enumerate(chunks):
            (directory / f"part-{index:04d}.bin").write_bytes(chunk)
        buffer = b"".join(chunks)
        baseline = _timed(lambda buffer=buffer: hashlib.sha256(buffer).hexdigest())
        ours = _timed(lambda directory=directory: hash_local(directory))
        print(
            f"{f'{files} file(s)':<22}{total_mb / baseline:>14.0f}{total_mb / ours:>17.0f}"
            f"{baseline / ours:>7.2f}x"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
