"""The private Prefect calls of the `prefect_*.py` adapters, each against a real Prefect API.

Every adapter leans on something Prefect does not promise to keep: these tests are
the ones a Prefect upgrade breaks first. `make test-lowest` runs them (and every other
test marked `lowest_prefect`) on the lowest Prefect pyproject.toml allows.
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from pathlib import Path
from typing import Any

import prefect.context
import pytest
from prefect import flow, get_client, tags, task
from prefect.context import serialize_context
from prefect.filesystems import LocalFileSystem
from prefect.states import Cancelling

from kinetic_prefect.common import prefect_results
from kinetic_prefect.launch import prefect_context
from kinetic_prefect.runner import prefect_engine
from kinetic_prefect.worker.prefect_observer import cancelling_observer
from tests.support.waiting import recorded_task_run, wait_until

pytestmark = [pytest.mark.lowest_prefect, pytest.mark.usefixtures("prefect_api", "workdir")]


@flow
def idle() -> None:
    pass


def test_prefects_cancelling_observer_calls_back_for_an_in_flight_run_that_enters_cancelling():
    # As the worker uses it: a plain callback, and the run registered while it is in flight.
    async def observe() -> tuple[uuid.UUID, list[uuid.UUID]]:
        seen: list[uuid.UUID] = []
        async with get_client() as client:
            flow_run = await client.create_flow_run(idle)
            async with cancelling_observer(seen.append, 0.5, None) as observer:
                observer.add_in_flight_flow_run_id(flow_run.id)
                await client.set_flow_run_state(flow_run.id, Cancelling(), force=True)
                deadline = asyncio.get_running_loop().time() + 60
                while not seen and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.1)
        return flow_run.id, seen

    flow_run_id, seen = asyncio.run(observe())

    assert seen == [flow_run_id]


def test_a_persisted_result_is_read_back_as_its_stored_bytes_then_deserialised(tmp_path: Path):
    storage = LocalFileSystem(basepath=str(tmp_path / "results"))
    storage.save(f"results-{uuid.uuid4().hex[:8]}")

    @task(persist_result=True, result_storage=storage)
    def answer() -> dict[str, int]:
        return {"answer": 42}

    @flow
    def one() -> uuid.UUID:
        return answer.submit().task_run_id  # type: ignore[return-value]

    task_run_id = one()
    state = recorded_task_run(task_run_id).state
    metadata = prefect_results.result_reference(state)

    stored = prefect_results.read_stored(metadata)
    on_disk = next((tmp_path / "results").iterdir())
    assert stored.data == on_disk.read_bytes()
    assert stored.location == str(on_disk)
    assert prefect_results.load_record(stored.data, metadata).result == {"answer": 42}


def test_the_engine_adapter_records_states_the_api_then_reports_as_ended():
    from prefect.states import Completed

    @task(retries=2, retry_delay_seconds=[7, 9])
    def later() -> None:
        pass

    @flow
    def outer() -> tuple[uuid.UUID, float]:
        task_run = prefect_engine.new_task_run(later, uuid.uuid4(), {}, None, None)
        wait_until(lambda: _state_name(task_run.id) is not None, 60, "the task run")
        prefect_engine.report_state(task_run, prefect_engine.awaiting_retry(0.0, "again"))
        wait_until(
            lambda: _state_name(task_run.id) == "AwaitingRetry", 60, "the AwaitingRetry state"
        )
        assert prefect_engine.ended_task_runs([task_run.id]) == set()
        prefect_engine.report_state(task_run, Completed())
        wait_until(
            lambda: prefect_engine.ended_task_runs([task_run.id]) == {task_run.id},
            60,
            "the Completed state",
        )
        return task_run.id, prefect_engine.retry_delay(later, 2)

    task_run_id, delay = outer()

    assert delay == 9.0
    assert prefect_engine.recorded_run_count(task_run_id) == 0  # no pod ever ran it


def _state_name(task_run_id: uuid.UUID) -> str | None:
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            state = client.read_task_run(task_run_id).state
        except ObjectNotFound:  # its creation is an event the API has not recorded yet
            return None
    return state.name if state else None


def test_the_pod_context_has_every_part_of_prefects_serialized_context_but_its_settings():
    # The deployment's context variables are set as a deployment's flow run has them.
    @task
    def noted(x: int) -> int:
        return x

    def both(task_run_id: uuid.UUID) -> tuple[dict[str, Any], dict[str, Any]]:
        kwargs = {
            "task": noted,
            "task_run_id": task_run_id,
            "task_inputs": {"x": set()},
            "copy_to_child_ctx": True,
        }
        prefect.context._deployment_id.set(uuid.uuid4())
        prefect.context._deployment_parameters.set({"lr": 0.1})
        with tags("sweep"):
            return (
                prefect_context.serialized_context_but_settings(kwargs),
                serialize_context(kwargs),
            )

    @flow
    def in_a_flow_run() -> tuple[dict[str, Any], dict[str, Any]]:
        task_run = prefect_engine.new_task_run(noted, uuid.uuid4(), {"x": 1}, None, {})
        return contextvars.copy_context().run(both, task_run.id)

    ours, prefects = in_a_flow_run()

    assert prefects.pop("settings_context")["settings"]
    assert ours.pop("settings_context") == {}
    assert ours.keys() == prefects.keys()
    for key, value in prefects.items():
        assert ours[key] == value, key
    assert ours["tags_context"]["current_tags"] == {"sweep"}
    assert ours["deployment_parameters"] == {"lr": 0.1}


def test_a_pinned_cache_policy_stores_the_result_under_its_key(tmp_path: Path):
    from prefect.cache_policies import INPUTS

    from kinetic_prefect.common import prefect_cache

    def storage(name: str) -> LocalFileSystem:
        block = LocalFileSystem(basepath=str(tmp_path / name))
        block.save(f"{name}-{uuid.uuid4().hex[:8]}")
        return block

    @task(cache_policy=INPUTS, persist_result=True, result_storage=storage("by-inputs"))
    def by_inputs(x: int) -> int:
        return x + 1

    pinned = by_inputs.with_options(result_storage=storage("pinned"))
    prefect_cache.pin_cache_key(pinned, "kp-pinned-key")

    @flow
    def both() -> str | None:
        by_inputs(1)
        pinned(1)
        task_run = prefect_engine.new_task_run(by_inputs, uuid.uuid4(), {"x": 1}, None, None)
        return prefect_cache.cache_key(by_inputs, task_run, {"x": 1})

    computed = both()

    # The key computed here is the one Prefect's engine stored the result under.
    assert [p.name for p in (tmp_path / "by-inputs").iterdir()] == [computed]
    assert [p.name for p in (tmp_path / "pinned").iterdir()] == ["kp-pinned-key"]
    assert isinstance(pinned.cache_policy, prefect_cache.PinnedKey)
    assert pinned.cache_policy.isolation_level == by_inputs.cache_policy.isolation_level
