"""Orbax checkpoints on GCS against a plain upload and download of the same bytes.

Run: `.venv/bin/python tests/benchmarks/bench_checkpoint_gcs.py [REPEATS]`.

Both paths talk to the same fake-gcs-server in the same run, so the ratio is
what `checkpoint_manager()` adds (Orbax metadata, TensorStore's chunked
writes, gcsfs listings) over moving the bytes once each way with
google-cloud-storage. Absolute times say little: the emulator keeps objects
in memory on this machine.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

# Keep JAX off any accelerator it might probe for: the arrays are host data either way.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

SIZES_MB = (1, 16, 64)
ARRAYS = 4  # a pytree of a few arrays, like a small model's parameters


class _BucketTypeMisses(logging.Filter):
    """Counts, and keeps off the console, gcsfs's failed bucket-type lookups.

    Against the emulator gcsfs cannot ask the storage control API for the
    bucket's layout (no credentials, no gRPC endpoint); it does not cache the
    failure, so it asks again on every call. Real GCS answers once per bucket,
    so these lookups are a cost of the emulator that inflates the Orbax column.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "Could not determine bucket type" in record.getMessage():
            self.count += 1
            return False
        return True


_MISSES = _BucketTypeMisses()


def _tree(size_mb: int, seed: int) -> dict[str, Any]:
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    per_array = size_mb * 2**20 // 4 // ARRAYS
    return {
        f"w{i}": jnp.asarray(rng.standard_normal(per_array, dtype=np.float32))
        for i in range(ARRAYS)
    }


def _assert_equal(restored: dict[str, Any], tree: dict[str, Any]) -> None:
    import numpy as np

    assert restored.keys() == tree.keys(), (restored.keys(), tree.keys())
    for key, value in tree.items():
        np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(value))


def _orbax_round_trip(tree: dict[str, Any], output_dir: str) -> tuple[float, int]:
    import jax
    import orbax.checkpoint as ocp

    from kinetic_prefect.outputs.checkpoint import checkpoint_manager

    os.environ["KINETIC_OUTPUT_DIR"] = output_dir
    # Manager construction lists the directory; a pod pays it too, but it is not
    # part of moving the checkpoint, so it stays outside the timed span.
    manager = checkpoint_manager()
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    misses = _MISSES.count
    started = time.perf_counter()
    manager.save(0, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()
    restored = manager.restore(0, args=ocp.args.StandardRestore(template))
    jax.block_until_ready(restored)
    elapsed = time.perf_counter() - started
    misses = _MISSES.count - misses
    manager.close()
    _assert_equal(restored, tree)
    return elapsed, misses


def _plain_round_trip(tree: dict[str, Any], bucket: Any, name: str) -> float:
    import numpy as np

    # Serialising and splitting back are part of the plain path, as they are of Orbax's.
    started = time.perf_counter()
    arrays = [np.asarray(x) for x in tree.values()]
    blob = bucket.blob(name)
    blob.upload_from_string(b"".join(a.tobytes() for a in arrays))
    data = blob.download_as_bytes()
    restored, offset = {}, 0
    for key, array in zip(tree, arrays, strict=True):
        restored[key] = np.frombuffer(data, dtype=array.dtype, count=array.size, offset=offset)
        offset += array.nbytes
    elapsed = time.perf_counter() - started
    _assert_equal(restored, tree)
    return elapsed


def _delete_prefix(bucket: Any, prefix: str) -> None:
    # The emulator holds every object in memory; 64 MB checkpoints add up.
    for blob in bucket.client.list_blobs(bucket.name, prefix=prefix):
        blob.delete()


def main(repeats: int = 3) -> None:
    # Run as a script, only tests/benchmarks is on sys.path; the emulator helper lives in tests/.
    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from tests.support.gcs import fake_gcs_server

    with fake_gcs_server() as url:
        # gcsfs, TensorStore and google-cloud-storage read these when first used.
        os.environ["STORAGE_EMULATOR_HOST"] = url
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = url
        from kinetic_prefect.common import gcs as kgcs

        logging.getLogger("gcsfs").addFilter(_MISSES)

        kgcs._clients.clear()
        client = kgcs.storage_client()
        bucket = client.create_bucket(f"bench-{uuid.uuid4().hex[:12]}")

        # First use pays for imports, JAX start-up and credential discovery.
        warm = _tree(1, seed=0)
        _orbax_round_trip(warm, f"gs://{bucket.name}/bench/warm")
        _plain_round_trip(warm, bucket, "bench/warm/plain.bin")
        _delete_prefix(bucket, "bench/warm/")

        rows = []
        for size in SIZES_MB:
            orbax_times, plain_times, misses = [], [], []
            for rep in range(repeats):
                tree = _tree(size, seed=size * 100 + rep)
                prefix = f"bench/{size}mb/{rep}"
                elapsed, missed = _orbax_round_trip(tree, f"gs://{bucket.name}/{prefix}")
                orbax_times.append(elapsed)
                misses.append(missed)
                plain_times.append(_plain_round_trip(tree, bucket, f"{prefix}/plain.bin"))
                _delete_prefix(bucket, prefix + "/")
            rows.append(
                (
                    size,
                    statistics.median(orbax_times),
                    statistics.median(plain_times),
                    statistics.median(misses),
                )
            )

    print(
        f"\nCheckpoint save+restore on GCS, median of {repeats}, {ARRAYS} float32 arrays, "
        f"{os.cpu_count()} CPUs"
    )
    print("Both paths use the same fake-gcs-server in this run; the ratio is what matters.")
    print(
        f"{'size MB':>8}{'orbax s':>10}{'plain s':>10}{'orbax/plain':>13}"
        f"{'orbax MB/s':>12}{'gcsfs misses':>14}"
    )
    for size, orbax, plain, missed in rows:
        # MB/s counts the bytes once each way, as both paths move them.
        print(
            f"{size:>8}{orbax:>10.3f}{plain:>10.3f}{orbax / plain:>12.1f}x"
            f"{2 * size / orbax:>12.1f}{missed:>14.0f}"
        )
    print(
        "gcsfs misses: failed gcsfs bucket-type lookups per Orbax save+restore, "
        "an emulator-only cost (see _BucketTypeMisses)."
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
