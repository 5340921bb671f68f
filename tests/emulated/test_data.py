"""`Data` parameters: local and gs:// data arrive in the pod as plain paths with the same bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import uuid
from pathlib import Path

import pytest
from prefect import flow, task
from prefect.cache_policies import INPUTS

from kinetic_prefect import Data, KineticTaskRunner
from kinetic_prefect.common.storage import JobsStore, LocalStore, open_store
from kinetic_prefect.data.data import DataError
from kinetic_prefect.data.upload import hash_local, upload_local
from kinetic_prefect.launch.manifest import GCSFUSE_ANNOTATION, GCSFUSE_DRIVER
from tests.support.clusters import gcs_cluster

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


def tree_digest(root: str) -> dict[str, str]:
    base = Path(root)
    files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    return {
        (p.name if base.is_file() else p.relative_to(base).as_posix()): hashlib.sha256(
            p.read_bytes()
        ).hexdigest()
        for p in files
    }


@task
def digest_in_pod(path: str) -> dict[str, str]:
    assert isinstance(path, str)
    return tree_digest(path)


@task
def digests_of_nested(bundle: dict[str, list[object]]) -> list[dict[str, str]]:
    return [tree_digest(p if isinstance(p, str) else p.path) for p in bundle["inputs"]]


@dataclasses.dataclass
class Inputs:
    path: object


def _dataset(root: Path, files: int = 3, size: int = 1000) -> Path:
    for index in range(files):
        target = root / f"part-{index}" / f"shard-{index}.bin"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(os.urandom(size))
    return root


def _run_digest(runner: KineticTaskRunner, data: Data) -> dict[str, str]:
    @flow(task_runner=runner)
    def run() -> dict[str, str]:
        return digest_in_pod.submit(data).result()

    return run()


@pytest.mark.parametrize("storage", ["local", "gcs"])
def test_local_directory_arrives_in_the_pod_with_the_same_bytes(storage, workdir, request):
    dataset = _dataset(workdir / "dataset")
    if storage == "local":
        runner = KineticTaskRunner()
    else:
        runner = KineticTaskRunner(cluster=gcs_cluster(request.getfixturevalue("gcs"), "data-gcs"))

    assert _run_digest(runner, Data(dataset)) == tree_digest(str(dataset))


def _stored_files(store: Path) -> dict[str, tuple[int, int, int, int]]:
    """Every file of the local jobs store's data cache and markers: (size, inode, mtime, ctime).

    The local store writes a file whole and renames it into place, so writing one again
    gives it another inode and ctime whatever its bytes.
    """
    stored = {}
    for prefix in ("data-cache", "data-markers"):
        for path in (store / prefix).rglob("*"):
            if path.is_file():
                info = path.stat()
                key = path.relative_to(store).as_posix()
                stored[key] = (info.st_size, info.st_ino, info.st_mtime_ns, info.st_ctime_ns)
    return stored


def test_same_200_mb_directory_submitted_twice_is_uploaded_once(workdir):
    dataset = _dataset(workdir / "big", files=50, size=4 * 1024 * 1024)
    store = workdir / ".kinetic"

    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[list[dict[str, str]], dict[str, tuple[int, int, int, int]]]:
        first = digest_in_pod.submit(Data(dataset)).result()
        stored_first = _stored_files(store)
        return [first, digest_in_pod.submit(Data(dataset)).result()], stored_first

    seen, stored_first = run()
    cached = {name: size for name, (size, *_) in stored_first.items() if "data-cache/" in name}

    assert seen == [tree_digest(str(dataset))] * 2
    assert (len(cached), sum(cached.values())) == (50, 200 * 1024 * 1024)
    assert _stored_files(store) == stored_first


def _upload_to_bucket(gcs, local: Path, prefix: str) -> None:
    bucket = gcs.client.bucket(gcs.name)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        bucket.blob(f"{prefix}/{path.relative_to(local).as_posix()}").upload_from_filename(
            str(path)
        )


@pytest.mark.parametrize("fuse", [False, True])
def test_gcs_prefix_and_object_resolve_to_paths_with_their_content(
    gcs, workdir, fuse, launched_manifests
):
    dataset = _dataset(workdir / "remote")
    _upload_to_bucket(gcs, dataset, "datasets/remote")
    runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "data-remote"))
    one_object = f"{gcs.uri}/datasets/remote/part-1/shard-1.bin"

    prefix_digest = _run_digest(runner, Data(f"{gcs.uri}/datasets/remote/", fuse=fuse))
    object_digest = _run_digest(runner, Data(one_object, fuse=fuse))

    assert prefix_digest == tree_digest(str(dataset))
    assert object_digest == tree_digest(str(dataset / "part-1" / "shard-1.bin"))


def test_fuse_data_puts_a_read_only_gcsfuse_volume_and_annotation_in_the_manifest(
    gcs, workdir, launched_manifests
):
    _upload_to_bucket(gcs, _dataset(workdir / "remote"), "datasets/remote")

    _run_digest(
        KineticTaskRunner(cluster=gcs_cluster(gcs, "data-fuse")),
        Data(f"{gcs.uri}/datasets/remote/", fuse=True),
    )
    pod = launched_manifests[-1]["spec"]["template"]

    assert pod["metadata"]["annotations"][GCSFUSE_ANNOTATION] == "true"
    assert pod["spec"]["volumes"][0]["csi"]["driver"] == GCSFUSE_DRIVER
    assert pod["spec"]["volumes"][0]["csi"]["readOnly"] is True
    assert (
        "only-dir=datasets/remote"
        in pod["spec"]["volumes"][0]["csi"]["volumeAttributes"]["mountOptions"]
    )
    assert pod["spec"]["containers"][0]["volumeMounts"][0]["readOnly"] is True


def test_data_nested_in_a_dict_of_lists_and_a_dataclass_resolves(workdir):
    first, second = _dataset(workdir / "a"), _dataset(workdir / "b")

    @flow(task_runner=KineticTaskRunner())
    def run() -> list[dict[str, str]]:
        bundle = {"inputs": [Data(first), Inputs(path=Data(second))]}
        return digests_of_nested.submit(bundle).result()

    assert run() == [tree_digest(str(first)), tree_digest(str(second))]


def test_missing_local_path_fails_at_construction(workdir):
    with pytest.raises(DataError, match="does not exist"):
        Data(workdir / "nowhere")


def test_gs_uri_without_a_bucket_fails_at_construction():
    with pytest.raises(DataError, match="has no bucket"):
        Data("gs:///datasets/x")


CHANGES = {"rewritten": lambda old: bytes(len(old)), "truncated": lambda old: old[:7]}


def _store(storage: str, workdir: Path, request: pytest.FixtureRequest) -> JobsStore:
    if storage == "local":
        return LocalStore(workdir / "store")
    return open_store(f"{request.getfixturevalue('gcs').uri}/jobs")


@pytest.mark.parametrize("storage", ["local", "gcs"])
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_file_changed_between_hashing_and_upload_is_refused_and_not_stored(
    storage, change, workdir, request
):
    dataset = _dataset(workdir / "changing", files=2, size=9 * 1024 * 1024)
    content = hash_local(dataset)
    victim = dataset / "part-0" / "shard-0.bin"
    victim.write_bytes(CHANGES[change](victim.read_bytes()))
    store = _store(storage, workdir, request)

    with pytest.raises(DataError, match="changed while it was being uploaded"):
        upload_local(store, content)
    assert not store.exists(f"data-markers/{content.sha256}")
    assert not store.exists(f"data-cache/{content.sha256}/part-0/shard-0.bin")


def test_task_run_artifacts_show_its_output_dir_and_the_data_it_used(workdir):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId

    dataset = _dataset(workdir / "tracked")

    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[object, str]:
        future = digest_in_pod.submit(Data(dataset))
        future.wait()
        return future.task_run_id, future.output_dir

    task_run_id, outputs = run()

    async def read() -> list[object]:
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    task_run_id=ArtifactFilterTaskRunId(any_=[task_run_id])
                )
            )

    artifacts = asyncio.run(read())
    by_type = {a.type: str(a.data) for a in artifacts}

    assert outputs in by_type["markdown"]
    assert hash_local(dataset).sha256 in by_type["table"]


@task(cache_policy=INPUTS, persist_result=True)
def count_lines_once(path: str, runs: str, nonce: str) -> int:
    with open(runs, "a") as ran:
        ran.write("ran\n")
    return len(Path(path).read_text().splitlines())


@pytest.mark.lowest_prefect
@pytest.mark.parametrize("storage", ["local", "gcs"])
def test_a_task_taking_data_is_cached_under_the_key_of_its_shipped_parameters(
    storage: str, workdir: Path, request: pytest.FixtureRequest
):
    # The pod sees a local path where the orchestrator shipped a `DataRef`: the result
    # must be stored under the key the orchestrator looks up, so the second flow run
    # finds it before launching any pod. With results in a GCS bucket the pod does not
    # look the key up itself, as on GKE: it only writes.
    lines = workdir / "lines.txt"
    lines.write_text("a\nb\nc\n")
    runs = workdir / "runs.txt"
    nonce = uuid.uuid4().hex  # no record of an earlier run of this test can be a hit

    if storage == "local":
        runner = KineticTaskRunner()
    else:
        runner = KineticTaskRunner(cluster=gcs_cluster(request.getfixturevalue("gcs"), "cache"))

    @flow(task_runner=runner)
    def count() -> tuple[int, str | None]:
        future = count_lines_once.submit(Data(str(lines)), str(runs), nonce)
        return future.result(), future.state.name

    first, second = count(), count()

    assert first == (3, "Completed")
    assert second == (3, "Cached")
    assert runs.read_text().splitlines() == ["ran"]
    assert len(list((workdir / ".kinetic" / "pods").glob("*.json"))) == 1  # no second pod
