"""`Data` at real size on a gs:// jobs root: streamed uploads, hash cache, verified downloads."""

from __future__ import annotations

import hashlib
import io
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect import flow, task, unmapped

from kinetic_prefect import Data, KineticTaskRunner
from kinetic_prefect.data.upload import HashingReader, LocalDataHashes, hash_local
from kinetic_prefect.errors import PodPhaseError
from tests.emulated.test_data import _upload_to_bucket, digest_in_pod, tree_digest
from tests.support.clusters import gcs_cluster
from tests.support.gcs import FaultInjectingProxy

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")
MIB = 1024 * 1024


def _write_random(path: Path, size: int, rng: random.Random) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(rng.randbytes(size))
    return path


def _mixed_tree(root: Path, rng: random.Random) -> Path:
    """160 MiB: three 40 MiB files (two 32 MiB upload chunks each: `UPLOAD_CHUNK_BYTES`),
    1500 small ones of 1 to 40 KiB, and one filling the rest."""
    for index in range(3):
        _write_random(root / "large" / f"shard-{index}.bin", 40 * MIB, rng)
    sizes = [rng.randint(1024, 40 * 1024) for _ in range(1500)]
    for index, size in enumerate(sizes):
        _write_random(root / "small" / f"{index % 20:02d}" / f"item-{index}.bin", size, rng)
    _write_random(root / "medium.bin", 40 * MIB - sum(sizes), rng)
    return root


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@task
def digests_of(file: str, directory: str) -> dict[str, dict[str, str]]:
    return {"file": tree_digest(file), "directory": tree_digest(directory)}


@task
def sha256_of(index: int, file: str) -> str:
    return hashlib.sha256(Path(file).read_bytes()).hexdigest()


def _data_uploads(gcs, prefix: str = "data-cache/", since: int = 0) -> list[str]:
    """The objects under `prefix` of the uploads GCS was sent after the first `since` (the
    IAM proxy's record of every upload begun), sorted."""
    return sorted(name for name in gcs.iam.uploaded[since:] if name.startswith(prefix))


@pytest.mark.slow
def test_64_mib_file_and_160_mib_tree_are_verified_in_the_pod_and_uploaded_once(gcs, workdir):
    rng = random.Random(7)
    big = _write_random(workdir / "weights.bin", 64 * MIB, rng)
    tree = _mixed_tree(workdir / "corpus", rng)
    # Warm pods: each task still resolves its Data in the pod, without a cold start each.
    runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "data-big"), max_parallel=4, warm_pods=True)

    @flow(task_runner=runner)
    def run() -> tuple[object, list[str]]:
        file, directory = Data(big), Data(tree)
        first = digests_of.submit(file, directory)
        first.wait()
        again = sha256_of.map(range(8), file=unmapped(file))
        return first.result(), [f.result() for f in again]

    seen, file_hashes = run()
    stored = gcs.client.list_blobs(gcs.name, prefix="data-cache/")

    assert seen == {"file": tree_digest(str(big)), "directory": tree_digest(str(tree))}
    assert file_hashes == [_file_sha256(big)] * 8
    # The file, and the tree's 3 large, 1500 small and one medium file: each uploaded once.
    assert _data_uploads(gcs) == gcs.names("data-cache/")
    assert len(_data_uploads(gcs)) == 1 + 1504
    assert sum(blob.size for blob in stored) == (64 + 160) * MIB
    assert len(_data_uploads(gcs, "data-markers/")) == 2


def test_gcs_prefix_resolves_to_exactly_its_objects_not_a_sibling_sharing_its_name(gcs, workdir):
    rng = random.Random(3)
    digits = workdir / "digits"
    for name in ("a.bin", "nested/b.bin"):
        _write_random(digits / name, 2048, rng)
    _write_random(workdir / "digits-extra" / "c.bin", 2048, rng)
    _upload_to_bucket(gcs, digits, "datasets/digits")
    _upload_to_bucket(gcs, workdir / "digits-extra", "datasets/digits-extra")
    runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "data-prefix"))
    prefix = Data(f"{gcs.uri}/datasets/digits/")

    @flow(task_runner=runner)
    def run() -> dict[str, str]:
        return digest_in_pod.submit(prefix).result()

    assert run() == tree_digest(str(digits))


class TestThroughGcsAnswering503ToEverySecondRequest:
    @pytest.fixture
    def fault_proxy(self, gcs_server: str) -> Iterator[FaultInjectingProxy]:
        with FaultInjectingProxy(gcs_server, every=2) as proxy:
            yield proxy

    @pytest.fixture
    def gcs_endpoint(self, fault_proxy: FaultInjectingProxy) -> str:
        return fault_proxy.url

    def test_resumable_upload_answered_503_midway_stores_the_right_bytes(
        self, gcs, fault_proxy, workdir
    ):
        big = _write_random(workdir / "weights.bin", 40 * MIB, random.Random(5))
        runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "data-503"))

        @flow(task_runner=runner)
        def run() -> dict[str, str]:
            return digest_in_pod.submit(Data(big)).result()

        assert run() == tree_digest(str(big))
        assert fault_proxy.injected >= 3


def test_hashing_reader_rewound_into_a_sent_chunk_hashes_each_byte_once_as_last_sent():
    payload = random.Random(11).randbytes(10 * MIB)
    reader = HashingReader(io.BytesIO(payload))
    reader.read(4 * MIB)
    reader.read(4 * MIB)
    reader.seek(5 * MIB + 17)  # the server confirmed only part of the second chunk
    reader.read(5 * MIB - 17)
    reader.seek(0, io.SEEK_END)
    reader.seek(10 * MIB)

    assert (reader.tell(), reader.sha256()) == (10 * MIB, hashlib.sha256(payload).hexdigest())


def _small_tree(root: Path) -> Path:
    for index in range(4):
        _write_random(root / "part" / f"f-{index}.bin", 4096, random.Random(index))
    return root


def test_hash_cache_reuses_a_hash_until_a_file_is_replaced(workdir):
    tree = _small_tree(workdir / "tree")
    hashes = LocalDataHashes()
    first = hashes.content(tree)
    edited = tree / "part" / "f-0.bin"
    kept = edited.stat()
    # Other bytes at the same size, inode and mtime: only hashing the file again sees them.
    with edited.open("r+b") as handle:
        handle.write(bytes(4096))
    os.utime(edited, ns=(kept.st_atime_ns, kept.st_mtime_ns))

    reused = hashes.content(tree)
    _write_random(workdir / "new.bin", 4096, random.Random(99)).replace(tree / "part" / "f-3.bin")
    after_replacing = hashes.content(tree)

    assert reused.sha256 == first.sha256
    assert after_replacing.sha256 == hash_local(tree).sha256 != first.sha256


def _cached_object(gcs, relative: str) -> object:
    (name,) = [n for n in gcs.names("data-cache/") if n.endswith(f"/{relative}")]
    return gcs.client.bucket(gcs.name).blob(name)


def _submit_once(runner: KineticTaskRunner, data: Data) -> dict[str, str]:
    @flow(task_runner=runner)
    def run() -> dict[str, str]:
        return digest_in_pod.submit(data).result()

    return run()


def test_tampered_data_cache_object_is_refused_in_the_pod_naming_the_file(gcs, workdir):
    tree = _small_tree(workdir / "tree")
    runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "data-tamper"))
    _submit_once(runner, Data(tree))
    _cached_object(gcs, "part/f-2.bin").upload_from_string(bytes(4096))

    with pytest.raises(PodPhaseError) as info:
        _submit_once(runner, Data(tree))

    assert info.value.phase == "data"
    assert "Failed during data: part/f-2.bin of " in str(info.value)
    assert "data-markers/" in str(info.value)


@pytest.mark.slow
def test_cached_objects_missing_or_resized_are_uploaded_again_before_reuse(gcs, workdir):
    tree = _small_tree(workdir / "tree")
    runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "data-resized"))
    _submit_once(runner, Data(tree))
    uploaded_first = _data_uploads(gcs)
    # As an administrator, straight to GCS: the IAM proxy sees none of this.
    _cached_object(gcs, "part/f-1.bin").delete()
    _cached_object(gcs, "part/f-2.bin").upload_from_string(b"short")
    before = len(gcs.iam.uploaded)

    seen = _submit_once(runner, Data(tree))
    uploaded_again = _data_uploads(gcs, since=before)

    assert [name.rpartition("/")[2] for name in uploaded_first] == [f"f-{i}.bin" for i in range(4)]
    assert [name.rpartition("/")[2] for name in uploaded_again] == ["f-1.bin", "f-2.bin"]
    assert seen == tree_digest(str(tree))
