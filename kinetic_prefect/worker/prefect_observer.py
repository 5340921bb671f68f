"""Prefect's observer of flow runs entering Cancelling: the worker's watch on unstarted pods.

Prefect's own workers use it from `prefect._internal`; it has no public home.
`test_prefects_cancelling_observer_calls_back_for_an_in_flight_run_that_enters_cancelling`
uses it as the worker does, and
`test_cancelling_a_flow_run_whose_pod_has_not_started_the_flow_stops_the_pod` through
the worker; they fail if it changes.
"""

from __future__ import annotations

from typing import Any

from prefect._internal.observers import FlowRunCancellingObserver
from prefect.events.filters import EventAnyResourceFilter, EventFilter, EventNameFilter


def cancelling_observer(
    on_cancelling: Any,
    poll_seconds: float,
    work_pool: EventAnyResourceFilter | None,
) -> Any:
    """An async context manager: `on_cancelling(flow_run_id: UUID)` for each run of `work_pool`."""
    return FlowRunCancellingObserver(
        on_cancelling=on_cancelling,
        polling_interval=poll_seconds,
        event_filter=EventFilter(
            event=EventNameFilter(name=["prefect.flow-run.Cancelling"]),
            any_resource=work_pool,
        ),
    )
