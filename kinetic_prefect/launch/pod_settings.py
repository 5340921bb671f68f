"""Which of this process's Prefect settings a pod receives: an allowlist, decided here only.

A pod runs one task through Prefect's engine: it needs the API (URL, TLS,
client retries), logging, results and task settings, and nothing of the
server, its database, workers or this machine's paths. Secret settings
(every `SecretStr` field in Prefect's settings model, found by walking the
model so that a Prefect upgrade cannot add one unnoticed) never travel as
values: those in allowed sections go through the pod's Secret
(`kinetic_prefect.launch.pod_secrets`), the rest not at all.
"""

from __future__ import annotations

import functools
import json
import typing
from typing import Any

from pydantic import BaseModel, SecretBytes, SecretStr

from kinetic_prefect.common.env import SECRET_SETTING_PATHS_ENV

# Top-level sections of Prefect's settings that a pod needs to run a task.
POD_SETTING_SECTIONS = (
    "api",
    "client",
    "cloud",
    "debug_mode",
    "experiments",
    "flows",
    "logging",
    "results",
    "tasks",
    "ui_url",
)


def _is_secret_type(annotation: Any) -> bool:
    candidates = typing.get_args(annotation) or (annotation,)
    return any(isinstance(a, type) and issubclass(a, (SecretStr, SecretBytes)) for a in candidates)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in typing.get_args(annotation) or (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


@functools.cache
def secret_setting_paths() -> dict[str, tuple[str, ...]]:
    """Every secret setting of Prefect's settings model: env var name → path in the model."""
    from prefect.settings.models.root import Settings

    found: dict[str, tuple[str, ...]] = {}

    def walk(model: type[BaseModel], path: tuple[str, ...]) -> None:
        prefix = str(model.model_config.get("env_prefix", "PREFECT_"))
        for name, info in model.model_fields.items():
            nested = _model_of(info.annotation)
            if nested is not None:
                walk(nested, (*path, name))
            elif _is_secret_type(info.annotation):
                found[f"{prefix}{name}".upper()] = (*path, name)

    walk(Settings, ())
    return found


def _allowed_env(name: str) -> bool:
    return any(
        name == f"PREFECT_{section.upper()}" or name.startswith(f"PREFECT_{section.upper()}_")
        for section in POD_SETTING_SECTIONS
    )


def pod_secret_settings() -> dict[str, str]:
    """Secret settings a pod needs, with their values, by env var name."""
    from prefect.settings import get_current_settings

    settings: Any = get_current_settings()
    found: dict[str, str] = {}
    for env_name, path in secret_setting_paths().items():
        if path[0] not in POD_SETTING_SECTIONS:
            continue
        value: Any = settings
        for part in path:
            value = getattr(value, part, None)
        if value is None:
            continue
        plain = value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
        if plain:
            found[env_name] = plain if isinstance(plain, str) else plain.decode()
    return found


# The last settings object's env: each attempt asks, and serializing Prefect's whole
# settings model is the costliest part of launching one.
_LAST_SETTINGS: list[tuple[Any, frozenset[str], dict[str, str]]] = []


def _allowed_settings_env(settings: Any, secrets: frozenset[str]) -> dict[str, str]:
    last = _LAST_SETTINGS[0] if _LAST_SETTINGS else None
    if last is not None and last[0] is settings and last[1] == secrets:
        return last[2]
    env = settings.to_environment_variables(exclude_unset=True)
    allowed = {k: str(v) for k, v in env.items() if _allowed_env(k) and k not in secrets}
    _LAST_SETTINGS[:] = [(settings, secrets, allowed)]
    return allowed


def pod_settings_env(api_url: str | None) -> dict[str, str]:
    """This process's explicitly set Prefect settings a pod needs, as env vars; no secrets."""
    from prefect.settings import get_current_settings

    secrets = secret_setting_paths()
    allowed = dict(_allowed_settings_env(get_current_settings(), frozenset(secrets)))
    if api_url:
        allowed["PREFECT_API_URL"] = api_url
    paths = {k: list(v) for k, v in secrets.items() if v[0] in POD_SETTING_SECTIONS}
    allowed[SECRET_SETTING_PATHS_ENV] = json.dumps(paths, sort_keys=True)
    return allowed


def pod_serialized_settings(serialized: dict[str, Any], api_url: str | None) -> dict[str, Any]:
    """A serialized `SettingsContext` cut down to the allowed sections, secrets dropped."""
    settings = {
        section: _drop_secrets(value)
        for section, value in serialized.get("settings", {}).items()
        if section in POD_SETTING_SECTIONS
    }
    if api_url:
        settings.setdefault("api", {})["url"] = api_url
    profile = dict(serialized.get("profile") or {})
    secrets = secret_setting_paths()
    profile["settings"] = {
        k: v
        for k, v in (profile.get("settings") or {}).items()
        if _allowed_env(str(k)) and str(k) not in secrets
    }
    return {**serialized, "settings": settings, "profile": profile}


def _drop_secrets(value: Any) -> Any:
    # serialize(include_secrets=False) leaves some secrets as SecretStr objects (which
    # pickle with their real value) and masks others as "********".
    if isinstance(value, dict):
        return {k: _drop_secrets(v) for k, v in value.items() if not _is_secret_value(v)}
    return value


def _is_secret_value(value: Any) -> bool:
    if isinstance(value, (SecretStr, SecretBytes)):
        return True
    return isinstance(value, str) and bool(value) and set(value) == {"*"}
