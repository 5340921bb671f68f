"""Uploading local `Data` against `hashlib.sha256` and a plain google-cloud-storage upload.

Run: `.venv/bin/python tests/benchmarks/bench_data_upload.py [MB] [REPEATS]`.

Three ways over the same bytes in the same run, against one fake-gcs-server:
`hashlib.sha256` over the bytes already in memory (the floor for any
content-addressed upload), a plain `blob.upload_from_filename` per file, one
after the other (google-cloud-storage's defaults: 100 MiB resumable chunks,
crc32c checks), and `LocalDataHashes.ship`: hash, then parallel streaming
uploads whose bytes are hashed again as sent, then the marker. Ratios above 1
mean `ship` is faster. The two uploads run in turns. Absolute times say
little: the emulator keeps objects in memory on a shared machine.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from kinetic_prefect.common import gcs as kgcs
from kinetic_prefect.data.upload import LocalDataHashes

LAYOUTS = (1, 16, 1024)


def _plain_upload(client: object, bucket: str, directory: Path) -> None:
    target = client.bucket(bucket)  # type: ignore[attr-defined]
    prefix = uuid.uuid4().hex
    for path in sorted(directory.iterdir()):
        target.blob(f"plain/{prefix}/{path.name}").upload_from_filename(str(path))


def _ship(bucket: str, directory: Path) -> None:
    # A fresh jobs root and runner each time: the data cache would make a repeat free.
    store = kgcs.GcsStore(f"gs://{bucket}/{uuid.uuid4().hex}")
    _, uploaded = LocalDataHashes().ship(store, directory)
    assert uploaded > 0


def _interleaved(
    first: Callable[[], object], second: Callable[[], object], repeat: int
) -> tuple[float, float]:
    """Median times of two uploads run in turns: the emulator slows as objects pile up,
    so whichever ran later would look slower."""
    times: tuple[list[float], list[float]] = ([], [])
    for round_ in range(repeat):
        order = ((0, first), (1, second)) if round_ % 2 == 0 else ((1, second), (0, first))
        for index, fn in order:
            started = time.perf_counter()
            fn()
            times[index].append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def main(total_mb: int = 128, repeat: int = 3) -> None:
    # Run as a script, only tests/benchmarks is on sys.path; the emulator helper lives in tests/.
    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from tests.benchmarks.bench_data_hashing import timed, write_layout
    from tests.support.gcs import fake_gcs_server

    root = Path(tempfile.mkdtemp(prefix="kinetic-upload-"))
    with fake_gcs_server() as url:
        os.environ["STORAGE_EMULATOR_HOST"] = url
        client = kgcs.storage_client()
        bucket = client.create_bucket(f"bench-{uuid.uuid4().hex[:8]}").name
        print(f"\nData upload, {total_mb} MB, median of {repeat}, {os.cpu_count()} CPUs")
        print(
            f"{'layout':<14}{'hashlib MB/s':>14}{'plain MB/s':>12}{'ship MB/s':>11}"
            f"{'vs hashlib':>12}{'vs plain':>10}"
        )
        for files in LAYOUTS:
            directory, buffer = write_layout(root, files, total_mb)
            baseline = timed(lambda b=buffer: hashlib.sha256(b).hexdigest(), repeat)
            plain, ours = _interleaved(
                lambda d=directory: _plain_upload(client, bucket, d),
                lambda d=directory: _ship(bucket, d),
                repeat,
            )
            print(
                f"{f'{files} file(s)':<14}{total_mb / baseline:>14.0f}{total_mb / plain:>12.0f}"
                f"{total_mb / ours:>11.0f}{baseline / ours:>11.2f}x{plain / ours:>9.2f}x"
            )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
