"""What of Prefect's context and settings travels with a task run to its pod.

Prefect's serialized context (with every secret removed), the settings a pod
receives as env vars, and the API URL pods must use. Kept in one `prefect_*`
module because it leans on private parts of Prefect: finding this process's
ephemeral server reads a private table
(`test_runner_with_no_settings_runs_pods_in_prefect_ephemeral_mode` fails if that
changes), and the context is serialized as Prefect's `serialize_context` does but for its
settings, reading the deployment's context variables
(`test_the_pod_context_has_every_part_of_prefects_serialized_context_but_its_settings`).
"""

from __future__ import annotations

from typing import Any

from prefect import context as prefect_context
from prefect.client.schemas.objects import TaskRun
from prefect.context import (
    AssetContext,
    EngineContext,
    SettingsContext,
    TagsContext,
    TaskRunContext,
)
from prefect.settings import get_current_settings

from kinetic_prefect.launch import pod_settings


def api_url() -> str | None:
    """The API URL pods must use: the configured one, or this process's ephemeral server."""
    configured = get_current_settings().api.url
    if configured:
        return configured
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer._instances.get(None)
    return server.api_url if server is not None and server.server_process else None


def pod_context(task: Any, task_run: TaskRun) -> dict[str, Any]:
    """Prefect's serialized context for a pod, with every secret removed.

    Only the settings sections a pod needs travel (`kinetic_prefect.launch.pod_settings`).
    It carries the task run's asset context (upstream assets, what it
    materializes) as prefect-dask and prefect-ray ship it, so asset lineage
    events come from the pod. Secrets (API key, auth string) travel separately
    as Kubernetes Secret refs and are put back by the pod.
    """
    task_inputs = {name: set(inputs) for name, inputs in (task_run.task_inputs or {}).items()}
    context = serialized_context_but_settings(
        {
            "task": task,
            "task_run_id": task_run.id,
            "task_inputs": task_inputs,
            "copy_to_child_ctx": True,
        }
    )
    settings_ctx = SettingsContext.get()
    if settings_ctx is not None:
        context["settings_context"] = pod_settings.pod_serialized_settings(
            settings_ctx.serialize(include_secrets=False), api_url()
        )
    return context


def serialized_context_but_settings(asset_ctx_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What `prefect.context.serialize_context(asset_ctx_kwargs)` returns, less its settings
    (`asset_ctx_kwargs` given, as `pod_context` always does).

    Prefect serializes the settings with their secrets, about 20 ms of CPU for each task
    run submitted (measured here), and `pod_context` replaces them with the pod's own
    serialization, without secrets, which costs under 1 ms.
    """
    engine = EngineContext.get()
    task_run = TaskRunContext.get()
    tags = TagsContext.get()
    deployment_id = prefect_context._deployment_id.get()
    return {
        "flow_run_context": engine.serialize() if engine else {},
        "task_run_context": task_run.serialize() if task_run else {},
        "tags_context": tags.serialize() if tags else {},
        "settings_context": {},
        "asset_context": AssetContext.from_task_and_inputs(**asset_ctx_kwargs).serialize(),
        "deployment_id": str(deployment_id) if deployment_id else None,
        "deployment_parameters": prefect_context._deployment_parameters.get(),
    }


def secret_values() -> dict[str, str]:
    """Secret Prefect settings a pod needs, by the env var that delivers them."""
    return pod_settings.pod_secret_settings()


def pod_settings_env() -> dict[str, str]:
    """The Prefect settings a pod receives as env vars (an allowlist), secrets excluded."""
    return pod_settings.pod_settings_env(api_url())
