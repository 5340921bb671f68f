"""A task run's cache key, computed once from the parameters the orchestrator shipped.

The orchestrator looks a task's cache key up before it launches a pod
(`runner.result_check`), from the parameters it ships: a `Data` argument is a
`DataRef` there, naming its content. In the pod that argument becomes a local path
(somewhere under the pod's scratch), so Prefect's engine would compute another key
and write the result where the orchestrator never looks. The pod therefore pins the
task's cache policy to the key of the shipped parameters (`pin_cache_key`), keeping
the policy's storage, isolation and locking.

Uses `CachePolicy.compute_key` as Prefect's engine calls it, with a `TaskRunContext`
built by `model_construct`.
`test_a_task_taking_data_is_cached_under_the_key_of_its_shipped_parameters` and
`test_a_pinned_cache_policy_stores_the_result_under_its_key` fail if either changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from prefect.cache_policies import NO_CACHE, CachePolicy


def caches(task: Any) -> bool:
    """Whether the task has a cache policy that gives keys (not none, not `NO_CACHE`)."""
    policy = task.cache_policy
    return isinstance(policy, CachePolicy) and not isinstance(policy, type(NO_CACHE))


def refreshes(task: Any) -> bool:
    """Whether the task always runs again (`refresh_cache`, else `PREFECT_TASKS_REFRESH_CACHE`)."""
    from prefect.settings import get_current_settings

    if task.refresh_cache is not None:
        return bool(task.refresh_cache)
    return bool(get_current_settings().tasks.refresh_cache)


def cache_key(
    task: Any, task_run: Any, parameters: Mapping[str, Any], result_store: Any = None
) -> str | None:
    """The task's cache key for `parameters` as Prefect's engine computes it; None when
    its policy gives none (no policy, `NO_CACHE`, or a key function that fails)."""
    from prefect.context import FlowRunContext, TaskRunContext

    if not caches(task):
        return None
    policy = task.cache_policy
    flow_context = FlowRunContext.get()
    context = TaskRunContext.model_construct(
        task=task, task_run=task_run, parameters=dict(parameters), result_store=result_store
    )
    try:
        key = policy.compute_key(
            task_ctx=context,
            inputs=dict(parameters),
            flow_parameters=(flow_context.parameters if flow_context else None) or {},
        )
    except Exception:
        return None
    return key or None


@dataclass
class PinnedKey(CachePolicy):
    """A cache policy whose key was computed elsewhere."""

    key: str = ""

    def compute_key(
        self,
        task_ctx: Any,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        return self.key


def pin_cache_key(task: Any, key: str) -> None:
    """Make Prefect's engine use `key` for `task`, with its policy's other settings."""
    policy = task.cache_policy
    task.cache_policy = PinnedKey(
        key=key,
        key_storage=policy.key_storage,
        isolation_level=policy.isolation_level,
        lock_manager=policy.lock_manager,
    )
