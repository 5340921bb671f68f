"""Multi-host TPU slices on the local backend: N host processes wired by jax.distributed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from prefect import flow, task

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.outputs.checkpoint import checkpoint_manager, output_dir
from tests.support.waiting import recorded_history

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

CPU_JAX = {"JAX_PLATFORMS": "cpu"}
DEADLINE = 120
# The smallest multi-host slice, two hosts of 4 chips (Cloud TPU v5p, topology 2x2x2): what
# a property of host 0 and another host needs. The four-host case shows that N hosts join.
TWO_HOSTS = "tpu-v5p-16"


@task
def gather_host_indices_and_pids() -> dict[str, object]:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    # One device per host process here: psum over the global device axis sums the hosts.
    summed = jax.pmap(lambda x: jax.lax.psum(x, "hosts"), axis_name="hosts")(
        jnp.asarray([jax.process_index()] * jax.local_device_count())
    )
    pids = multihost_utils.process_allgather(jnp.asarray(os.getpid()))
    return {
        "total": int(summed[0]),
        "processes": jax.process_count(),
        "pids": sorted(int(p) for p in pids),
        "reporter": jax.process_index(),
    }


@task(retries=1)
def count_to_ten_losing_host_1_at_step_6() -> tuple[int, str]:
    """Checkpoints every step on every host; host 1 of the first attempt dies at step 6."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    attempt = os.environ["KINETIC_ATTEMPT"]
    pid_dir = Path(output_dir()) / "pids"
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / f"attempt-{attempt}-host-{jax.process_index()}").write_text(str(os.getpid()))
    manager = checkpoint_manager(save_interval_steps=1)
    latest = manager.latest_step()
    start = 0 if latest is None else latest + 1
    for step in range(start, 10):
        manager.save(step, args=ocp.args.StandardSave({"step": np.asarray(step)}))
        manager.wait_until_finished()
        if step == 6 and attempt == "1" and jax.process_index() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    return start, output_dir()


@task
async def allgather_an_array_argument(values: object) -> dict[str, object]:
    """Async, so that host 0's one-attempt engine is the async one."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    # Each host scales the argument by its own rank: the sum proves every host took part.
    gathered = multihost_utils.process_allgather(jnp.asarray(values) * (jax.process_index() + 1))
    return {"shape": list(gathered.shape), "sum": int(gathered.sum())}


@task(retries=1)
def a_host_fails_the_first_attempt(marks: str, failing_host: int) -> int:
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from prefect.runtime import task_run

    host = jax.process_index()
    attempt = os.environ["KINETIC_ATTEMPT"]
    Path(marks, f"host {host} attempt {attempt} run {task_run.run_count}").touch()
    # Every host has written its mark before one raises.
    multihost_utils.sync_global_devices("marked")
    if host == failing_host and attempt == "1":
        raise RuntimeError(f"host {host} fails its first attempt")
    return int(multihost_utils.process_allgather(jnp.asarray(host + 1)).sum())


def _states(task_run_id: object) -> list[object]:
    return recorded_history(task_run_id)


def _state_types(task_run_id: object) -> list[str]:
    return [s.type.value for s in _states(task_run_id)]  # type: ignore[attr-defined]


def test_a_four_host_slice_sums_every_hosts_index_and_host_0_reports_once():
    @flow(task_runner=KineticTaskRunner(accelerator="tpu-v5e-16", env=CPU_JAX))
    def run() -> tuple[dict[str, object], object]:
        future = gather_host_indices_and_pids.submit()
        return future.result(), future.task_run_id

    result, task_run_id = run()

    assert (result["total"], result["processes"], result["reporter"]) == (0 + 1 + 2 + 3, 4, 0)
    assert len(set(result["pids"])) == 4  # type: ignore[arg-type]
    assert _state_types(task_run_id).count("COMPLETED") == 1


def test_a_jax_array_argument_reaches_every_host_of_a_two_host_slice():
    import jax.numpy as jnp

    @flow(task_runner=KineticTaskRunner(accelerator=TWO_HOSTS, env=CPU_JAX))
    def run() -> dict[str, object]:
        return allgather_an_array_argument.submit(jnp.arange(8)).result()

    result = run()

    assert result == {"shape": [2, 8], "sum": 28 * (1 + 2)}


def run_a_host_failing_once(
    runner: KineticTaskRunner, workdir: Path, failing_host: int = 0, retry_delay_seconds: float = 0
) -> dict[str, object]:
    """What a flow running `a_host_fails_the_first_attempt` on the runner's slice shows."""
    marks = workdir / "marks"
    marks.mkdir()
    failing = a_host_fails_the_first_attempt.with_options(retry_delay_seconds=retry_delay_seconds)

    @flow(task_runner=runner)
    def run() -> tuple[int, object, int]:
        future = failing.submit(str(marks), failing_host)
        return future.result(), future.task_run_id, len(future.job_ids)

    total, task_run_id, pods = run()
    states = _states(task_run_id)
    names = [s.name for s in states]  # type: ignore[attr-defined]
    return {
        # A host stuck until the deadline would end its attempt as DeadlineExceeded.
        "states naming the deadline": [
            s.name  # type: ignore[attr-defined]
            for s in states
            if "deadline" in (s.message or "").lower()  # type: ignore[attr-defined]
        ],
        "total": total,
        "pods": pods,
        "marks": {p.name for p in marks.iterdir()},
        "retry states": [n for n in names if n in ("Retrying", "AwaitingRetry")],
        "completed, failed": (names.count("Completed"), names.count("Failed")),
    }


def the_whole_slice_retried(hosts: int) -> dict[str, object]:
    """Both attempts on every host (each host's KINETIC_ATTEMPT and Prefect run count, as
    the hosts saw them), the retry recorded once, no Failed, the hosts' sum."""
    return {
        "states naming the deadline": [],
        "total": sum(range(1, hosts + 1)),
        "pods": 2,
        "marks": {f"host {h} attempt {a} run {a}" for h in range(hosts) for a in (1, 2)},
        "retry states": ["Retrying"],
        "completed, failed": (1, 0),
    }


THE_WHOLE_SLICE_RETRIED = the_whole_slice_retried(2)


def _slice_with_a_deadline(accelerator: str = TWO_HOSTS) -> KineticTaskRunner:
    # A deadline, so that hosts stuck in mismatched collectives or in JAX's shutdown fail the
    # test instead of hanging it.
    return KineticTaskRunner(accelerator=accelerator, env=CPU_JAX, timeout_seconds=DEADLINE)


@pytest.mark.lowest_prefect
def test_an_exception_on_host_0_retries_the_whole_slice_with_one_attempt_number(workdir):
    seen = run_a_host_failing_once(_slice_with_a_deadline(), workdir)

    assert seen == THE_WHOLE_SLICE_RETRIED


@pytest.mark.slow
def test_a_slice_retry_with_a_delay_waits_as_awaiting_retry_then_relaunches_every_host(workdir):
    seen = run_a_host_failing_once(_slice_with_a_deadline(), workdir, retry_delay_seconds=1)

    assert seen == {**THE_WHOLE_SLICE_RETRIED, "retry states": ["AwaitingRetry"]}


def test_an_exception_on_another_host_ends_the_attempt_at_once_and_retries_the_slice(workdir):
    # Four hosts: on two, host 0 sometimes saw its only peer's failure in the collective
    # and reported its own exception (Retrying) before the runner ended the attempt.
    seen = run_a_host_failing_once(_slice_with_a_deadline("tpu-v5e-16"), workdir, failing_host=2)

    # Host 0 reported nothing: the runner records the retry of the lost attempt.
    assert seen == {**the_whole_slice_retried(4), "retry states": ["AwaitingRetry"]}


@pytest.mark.slow
def test_a_host_killed_mid_training_relaunches_the_whole_slice_from_the_checkpoint():
    @flow(task_runner=KineticTaskRunner(accelerator=TWO_HOSTS, env=CPU_JAX))
    def run() -> tuple[tuple[int, str], int]:
        future = count_to_ten_losing_host_1_at_step_6.submit()
        return future.result(), len(future.job_ids)

    (start, outputs), pods = run()

    first_attempt = [int(p.read_text()) for p in Path(outputs, "pids").glob("attempt-1-host-*")]
    assert (pods, len(first_attempt)) == (2, 2)
    assert start >= 5
    assert not [pid for pid in first_attempt if Path(f"/proc/{pid}").exists()]


def test_kinetic_local_hosts_caps_the_local_processes_of_a_slice(monkeypatch):
    monkeypatch.setenv("KINETIC_LOCAL_HOSTS", "2")

    @flow(task_runner=KineticTaskRunner(accelerator="tpu-v6e-32", env=CPU_JAX))
    def run() -> dict[str, object]:
        return gather_host_indices_and_pids.submit().result()

    result = run()

    assert (result["total"], result["processes"]) == (1, 2)
