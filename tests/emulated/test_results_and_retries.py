"""Results in GCS result storage, checkpointed retries that resume, cache hits without pods.

Pods import this module to run its tasks: the block classes (prefect-gcp,
prefect-kubernetes, seconds of imports) are imported only in the tests that use them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, get_client, task
from prefect.cache_policies import INPUTS
from prefect.filesystems import LocalFileSystem
from prefect.runtime import task_run

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.cli.jobs_store import cleanup_jobs
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.outputs.checkpoint import checkpoint_manager, output_dir
from tests.support.clusters import gcs_cluster
from tests.support.waiting import recorded_task_run, wait_for_task_run_state

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


@task
def cube(x: int) -> int:
    return x**3


@task
def big_block(x: int) -> bytes:
    """A result too large to travel in the final-state record: it is read from storage."""
    from kinetic_prefect.common.records import INLINE_RESULT_BYTES

    return bytes([x]) * (INLINE_RESULT_BYTES + 1)


@task(retries=1)
def train_to_ten(interrupt: str) -> dict[str, object]:
    """Counts to 10 with a checkpoint per step; the first attempt is interrupted at step 6."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    manager = checkpoint_manager(max_to_keep=2)
    latest = manager.latest_step()
    template = {"count": jnp.zeros(())}
    state = (
        template
        if latest is None
        else manager.restore(latest, args=ocp.args.StandardRestore(template))
    )
    start = 0 if latest is None else latest + 1
    for step in range(start, 10):
        state = {"count": state["count"] + 1}
        manager.save(step, args=ocp.args.StandardSave(state))
        manager.wait_until_finished()
        if step == 6 and task_run.run_count == 1:
            if interrupt == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("interrupted at step 6")
    return {"start": start, "count": float(state["count"]), "output_dir": output_dir()}


@task(retries=1)
def note_attempt_then_fail_once() -> str:
    Path(output_dir(), f"attempt-{task_run.run_count}").write_text(output_dir())
    if task_run.run_count == 1:
        raise RuntimeError("first attempt fails")
    return output_dir()


@task(cache_policy=INPUTS, persist_result=True)
def cached_square(x: int) -> int:
    return x * x


def _runner(storage: str, request: pytest.FixtureRequest, **options: object) -> KineticTaskRunner:
    if storage == "local":
        return KineticTaskRunner(**options)
    gcs = request.getfixturevalue("gcs")
    return KineticTaskRunner(cluster=gcs_cluster(gcs, f"c-{os.urandom(4).hex()}"), **options)


def _state_history(task_run_id: object) -> list[tuple[str, str]]:
    """(type, name) of every state the API recorded for the task run, oldest first."""
    with get_client(sync_client=True) as client:
        states = client.read_task_run_states(task_run_id)  # type: ignore[arg-type]
    return [(s.type.value, s.name or "") for s in sorted(states, key=lambda s: s.timestamp)]


READER = """
import json, sys
from prefect import get_client
with get_client(sync_client=True) as client:
    values = [client.read_task_run(run_id).state.result() for run_id in sys.argv[1:]]
print(json.dumps(values))
"""


@task(retries=1)
def killed_then_raising() -> None:
    if task_run.run_count == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("the retry fails too")


@pytest.mark.slow
def test_a_killed_pod_and_a_failing_relaunch_run_the_task_once_per_retry():
    @flow(task_runner=KineticTaskRunner())
    def run() -> tuple[str, object]:
        future = killed_then_raising.submit()
        future.wait()
        return future.state.type.value, future.task_run_id

    state, task_run_id = run()

    assert (state, recorded_task_run(task_run_id).run_count) == ("FAILED", 2)


def test_results_are_prefect_records_in_the_bucket_readable_by_a_plain_prefect_process(
    gcs, prefect_api
):
    runner = KineticTaskRunner(cluster=gcs_cluster(gcs, "results-e2e"))

    @flow(task_runner=runner)
    def cubes() -> list[str]:
        futures = cube.map([1, 2, 3])
        futures.wait()
        return [str(f.task_run_id) for f in futures]

    task_run_ids = cubes()
    for task_run_id in task_run_ids:
        wait_for_task_run_state(task_run_id, "COMPLETED")
    reader = subprocess.run(
        [sys.executable, "-c", READER, *task_run_ids],
        env={**os.environ, "PREFECT_API_URL": prefect_api},
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert reader.returncode == 0, reader.stderr
    assert json.loads(reader.stdout.splitlines()[-1]) == [1, 8, 27]
    assert len(gcs.names("results/")) >= 3


@pytest.mark.parametrize("storage", ["local", "gcs"])
@pytest.mark.parametrize(
    ("interrupt", "retry_state"), [("kill", "AwaitingRetry"), ("raise", "Retrying")]
)
@pytest.mark.slow
def test_interrupted_training_resumes_from_its_last_checkpoint_with_no_terminal_state_before(
    storage, interrupt, retry_state, request
):
    @flow(task_runner=_runner(storage, request))
    def train() -> tuple[dict[str, object], object]:
        future = train_to_ten.submit(interrupt)
        return future.result(), future.task_run_id

    result, task_run_id = train()

    assert result["start"] >= 5
    assert result["count"] == 10.0
    wait_for_task_run_state(task_run_id, "COMPLETED")
    history = _state_history(task_run_id)
    assert retry_state in [name for _, name in history]
    assert [kind for kind, _ in history if kind in ("FAILED", "CRASHED")] == []
    assert history[-1][0] == "COMPLETED"
    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).run_count == 2


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["local", "gcs"])
def test_killed_pod_without_retries_ends_crashed_with_the_reason_and_keeps_its_checkpoint(
    storage, request
):
    @flow(task_runner=_runner(storage, request))
    def train() -> tuple[str, str, str, Any]:
        future = train_to_ten.with_options(retries=0).submit("kill")
        future.wait()
        state = future.state
        return state.type.value, state.message or "", future.output_dir, future.task_run_id

    state_type, message, outputs, task_run_id = train()

    assert state_type == "CRASHED"
    assert "killed by signal 9" in message
    # The runner recorded the Crashed state: the API still counts the one run the pod made.
    wait_for_task_run_state(task_run_id, "CRASHED")
    with get_client(sync_client=True) as client:
        assert client.read_task_run(task_run_id).run_count == 1
    os.environ["KINETIC_OUTPUT_DIR"] = outputs
    try:
        assert checkpoint_manager().latest_step() == 6
    finally:
        del os.environ["KINETIC_OUTPUT_DIR"]


def test_output_dir_is_shared_by_attempts_distinct_for_siblings_and_survives_cleanup(workdir: Path):
    @flow(task_runner=KineticTaskRunner())
    def run() -> list[tuple[str, list[str]]]:
        futures = [note_attempt_then_fail_once.submit() for _ in range(2)]
        return [(f.result(), f.job_ids) for f in futures]

    (first_dir, first_jobs), (second_dir, second_jobs) = run()
    cleanup_jobs(str(workdir / ".kinetic"), [*first_jobs, *second_jobs])

    assert first_dir != second_dir
    assert (
        Path(first_dir, "attempt-1").read_text()
        == Path(first_dir, "attempt-2").read_text()
        == first_dir
    )
    assert not any((workdir / ".kinetic" / "kinetic" / job).exists() for job in first_jobs)


@task
def swap_config_marker(config: str) -> str:
    """Leaves `config` in the output dir; returns what an earlier run of this identity left.

    The first run in an output dir fails after leaving its marker, so a retry of the
    flow runs the task again (a Completed one would be taken over, not rerun).
    """
    marker = Path(output_dir(), "config")
    previous = marker.read_text() if marker.exists() else ""
    marker.write_text(config)
    if not previous:
        raise RuntimeError(f"no earlier run of {config} left a marker")
    return previous


@flow(retries=1, task_runner=KineticTaskRunner())
def sweep_in_reverse_on_retry(configs: list[str]) -> list[str]:
    from prefect.runtime import flow_run

    first_run = flow_run.run_count == 1
    order = configs if first_run else configs[::-1]
    futures = {config: swap_config_marker.submit(config) for config in order}
    found = {config: future.result(raise_on_failure=False) for config, future in futures.items()}
    if first_run:
        raise RuntimeError("the first run of the flow fails after its sweep")
    return [found[config] for config in configs]


def test_a_retried_flow_that_submits_in_reverse_finds_each_configs_own_output_dir():
    assert sweep_in_reverse_on_retry(["lr=0.1", "lr=0.01", "lr=0.001"]) == [
        "lr=0.1",
        "lr=0.01",
        "lr=0.001",
    ]


def test_second_run_of_a_cached_task_launches_no_pod(launched_manifests):
    # Inputs unique to this run: Prefect's default result storage outlives the session.
    base = int.from_bytes(os.urandom(4), "big")

    @flow(task_runner=KineticTaskRunner())
    def squares() -> tuple[list[int], list[str | None]]:
        futures = cached_square.map([base, base + 1])
        return [f.result() for f in futures], [f.state.name for f in futures]

    first = squares()
    launched_after_first = len(launched_manifests)
    second = squares()

    assert first[0] == second[0] == [base * base, (base + 1) * (base + 1)]
    assert second[1] == ["Cached", "Cached"]
    assert len(launched_manifests) == launched_after_first == 2


def _submit_one(runner: KineticTaskRunner, storage: object = None) -> None:
    @flow(task_runner=runner)
    def run() -> None:
        cube.with_options(result_storage=storage).submit(2)

    run()


def test_unsaved_result_storage_with_a_gcs_cluster_fails_before_any_pod(gcs, launched_manifests):
    from prefect_gcp.cloud_storage import GcsBucket

    from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials

    cluster = KineticCluster(
        backend="local",
        jobs_bucket=gcs.uri,
        result_storage=GcsBucket(bucket=gcs.name, gcp_credentials=KineticGcpCredentials()),
    )

    with pytest.raises(ConfigurationError, match="is not saved"):
        _submit_one(KineticTaskRunner(cluster=cluster))
    assert launched_manifests == []


def test_non_gcs_result_storage_with_a_gcs_cluster_fails_before_any_pod(
    gcs, launched_manifests, tmp_path
):
    from kinetic_prefect.blocks import KineticCluster

    LocalFileSystem(basepath=str(tmp_path)).save("local-results", overwrite=True)
    cluster = KineticCluster(backend="local", jobs_bucket=gcs.uri)

    with pytest.raises(ConfigurationError, match="use a GCS bucket"):
        _submit_one(KineticTaskRunner(cluster=cluster), LocalFileSystem.load("local-results"))
    assert launched_manifests == []


def test_missing_jobs_bucket_fails_before_any_pod_naming_the_bucket(gcs, launched_manifests):
    from kinetic_prefect.blocks import KineticCluster

    cluster = KineticCluster(backend="local", jobs_bucket="gs://no-such-bucket-kp")

    with pytest.raises(ConfigurationError, match="gs://no-such-bucket-kp does not exist"):
        _submit_one(KineticTaskRunner(cluster=cluster))
    assert launched_manifests == []


def test_credentials_block_without_credentials_outside_emulator_mode_fails_before_any_pod(
    monkeypatch, launched_manifests, tmp_path
):
    from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    cluster = KineticCluster(
        backend="local", jobs_bucket="gs://some-bucket", gcp_credentials=KineticGcpCredentials()
    )

    with pytest.raises(ConfigurationError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        _submit_one(KineticTaskRunner(cluster=cluster))
    assert launched_manifests == []


class _WritesMarkerWhenUnpickled:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path(self.marker).write_text, ("unpickled",))


def _replace_result(metadata: Any, marker: Path, keep_seal: bool = False) -> None:
    """Rewrite the result record in its storage: the same record, its value a booby trap.

    A new object has no custom metadata; `keep_seal` copies the old one's (the pod's
    seal) onto it, as anyone who may write the bucket can.
    """
    from prefect.results import ResultRecord, resolve_result_storage

    results: Any = resolve_result_storage(metadata.storage_block_id, _sync=True)  # type: ignore[call-arg]
    if keep_seal:
        bucket = results.gcp_credentials.get_cloud_storage_client().bucket(results.bucket)
        old = bucket.get_blob(results._resolve_path(metadata.storage_key))
    stored = ResultRecord.deserialize(results.read_path(metadata.storage_key, _sync=True))
    stored.result = _WritesMarkerWhenUnpickled(str(marker))
    results.write_path(metadata.storage_key, stored.serialize(), _sync=True)
    if keep_seal:
        new = bucket.get_blob(old.name)
        assert old.metadata and not new.metadata
        new.metadata = old.metadata
        new.patch()


def _rewrite_without_seal(metadata: Any) -> None:
    """Write the result record's bytes again, unread, as a new object without metadata."""
    from prefect.results import resolve_result_storage

    results: Any = resolve_result_storage(metadata.storage_block_id, _sync=True)  # type: ignore[call-arg]
    data = results.read_path(metadata.storage_key, _sync=True)
    results.write_path(metadata.storage_key, data, _sync=True)


def _results_runner(
    backend: str, request: pytest.FixtureRequest, workdir: Path, task: Any = cube
) -> tuple:
    """A runner whose `task` results go to saved result storage, and its jobs store."""
    from kinetic_prefect.common.storage import open_store

    if backend == "local":
        name = f"results-{os.urandom(4).hex()}"
        LocalFileSystem(basepath=str(workdir / "results")).save(name)
        task = task.with_options(result_storage=LocalFileSystem.load(name), persist_result=True)
        return KineticTaskRunner(), task, open_store(str(workdir / ".kinetic"))
    gcs = request.getfixturevalue("gcs")
    runner = KineticTaskRunner(cluster=request.getfixturevalue("gke"), allow_loopback_api=True)
    return runner, task, open_store(gcs.uri)


def _submitted_once(runner: Any, task: Any, store: Any) -> tuple[str, object, Any, Any]:
    """Run `task(2)` once: its job id, task run id, result metadata, and a re-reader of its end."""
    from kinetic_prefect.backends.base import PodExit
    from kinetic_prefect.runner import record_key
    from kinetic_prefect.runner.attempt_end import read_attempt_end

    @flow(task_runner=runner)
    def once() -> tuple[str, object, object]:
        future = task.submit(2)
        future.wait()
        data = future.state.data  # the verified record (its metadata, were it not read)
        return future.job_id, future.task_run_id, getattr(data, "metadata", data)

    job_id, task_run_id, metadata = once()
    flow_run_id = recorded_task_run(task_run_id).flow_run_id
    key = record_key.flow_run_key(record_key.master_key(), str(flow_run_id))

    def attempt_end() -> Any:
        return read_attempt_end(store, job_id, PodExit(job_id, exit_code=0), key).state

    return job_id, task_run_id, metadata, attempt_end


@pytest.mark.slow
# The private calls are the same on either backend: the lowest Prefect runs the local one.
@pytest.mark.parametrize(
    "backend", [pytest.param("local", marks=pytest.mark.lowest_prefect), "gke"]
)
def test_a_result_record_replaced_after_the_pod_wrote_it_is_refused_naming_it_never_unpickled(
    backend: str, request: pytest.FixtureRequest, workdir: Path
):
    from kinetic_prefect.common.records import FINAL_STATE_JSON, FinalRecord
    from kinetic_prefect.errors import TamperedResultError

    runner, task, store = _results_runner(backend, request, workdir, big_block)
    job_id, task_run_id, metadata, attempt_end = _submitted_once(runner, task, store)

    assert attempt_end().result() == bytes([2]) * len(attempt_end().result())
    record = FinalRecord.decode(store.get_bytes(f"kinetic/{job_id}/{FINAL_STATE_JSON}"), job_id)
    assert record.result_storage_key == metadata.storage_key
    assert record.result_record is None  # too large to travel in the record: read from storage

    marker = workdir / "unpickled"
    _replace_result(metadata, marker)

    refused = attempt_end()

    assert refused.is_failed()
    error = refused.result(raise_on_failure=False)
    assert isinstance(error, TamperedResultError)
    assert record.result_storage_key in str(error)
    assert str(task_run_id) in str(error)
    assert "was changed after pod" in str(error)
    assert not marker.exists()


@pytest.mark.slow
def test_a_small_result_travels_signed_in_the_final_state_record_and_its_stored_copy_is_not_read(
    gke: str, request: pytest.FixtureRequest, workdir: Path
):
    runner, task, store = _results_runner("gke", request, workdir)
    _, _, metadata, attempt_end = _submitted_once(runner, task, store)
    marker = workdir / "unpickled"
    _replace_result(metadata, marker)

    assert attempt_end().result() == 8
    assert not marker.exists()


@pytest.mark.slow
def test_a_cached_result_record_replaced_in_the_bucket_is_refused_naming_it_never_unpickled(
    gke: str, workdir: Path
):
    from kinetic_prefect.errors import TamperedResultError

    base = int.from_bytes(os.urandom(4), "big")

    @flow(task_runner=KineticTaskRunner(cluster=gke, allow_loopback_api=True))
    def square() -> tuple[str, object, object]:
        future = cached_square.submit(base)
        future.wait()
        state = future.state
        return state.type.value, state.result(raise_on_failure=False), state.data

    first_type, first_value, first_record = square()
    marker = workdir / "unpickled"
    _replace_result(first_record.metadata, marker, keep_seal=True)  # type: ignore[attr-defined]

    second_type, error, _ = square()

    assert (first_type, first_value) == ("COMPLETED", base * base)
    assert second_type == "FAILED"
    assert isinstance(error, TamperedResultError)
    assert first_record.metadata.storage_key in str(error)  # type: ignore[attr-defined]
    assert not marker.exists()

    # Written again without the seal, it is no kinetic pod's record: the task runs again.
    _rewrite_without_seal(first_record.metadata)  # type: ignore[attr-defined]
    assert square()[:2] == ("COMPLETED", base * base)
    assert not marker.exists()
