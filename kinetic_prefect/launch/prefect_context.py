"""What of Prefect's context and settings travels with a task run to its pod.

Prefect's serialized context (with every secret removed), the settings a pod
receives as env vars, and the API URL pods must use. Kept in one `prefect_*`
module because finding this process's ephemeral server reads a private table
of Prefect's; `test_runner_with_no_settings_runs_pods_in_prefect_ephemeral_mode` fails if that
changes.
"""

from __future__ import annotations

from typing import Any

from prefect.client.schemas.objects import TaskRun
from prefect.context import SettingsContext, serialize_context
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
    context = serialize_context(
        asset_ctx_kwargs={
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


def secret_values() -> dict[str, str]:
    """Secret Prefect settings a pod needs, by the env var that delivers them."""
    return pod_settings.pod_secret_settings()


def pod_settings_env() -> dict[str, str]:
    """The Prefect settings a pod receives as env vars (an allowlist), secrets excluded."""
    return pod_settings.pod_settings_env(api_url())
