"""Secrets for pods: delivered by reference, never as literals in a manifest or payload.

A pod's secrets are the secret Prefect settings it needs (API key, auth
string), the runner's result-signing key, and the user's own secrets from
`env=` given as Prefect `Secret` blocks. They reach the pod as `secretKeyRef`s
to one Kubernetes Secret named by the digest of its contents, so runners with
different credentials never overwrite each other's Secret; on the local backend
the same refs are filled straight into the process environment.

Example:
    ```python
    from prefect.blocks.system import Secret

    Secret(value="wandb-key").save("wandb")
    KineticTaskRunner(env={"WANDB_API_KEY": Secret.load("wandb")})
    # or, as in Prefect job variables: env={"WANDB_API_KEY": "{{ prefect.blocks.secret.wandb }}"}
    ```
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kinetic_prefect.errors import ConfigurationError

SECRET_NAME_PREFIX = "kinetic-prefect-secrets-"
_TEMPLATE = re.compile(r"^\{\{\s*prefect\.blocks\.secret\.([A-Za-z0-9_-]+)\s*\}\}$")


@dataclass(frozen=True)
class SecretValue:
    """An env value taken from a saved Prefect `Secret` block when a pod is launched.

    Only the block's name travels (in settings, payloads, pickled runners); the
    value is read from the Prefect API by the process that launches the pod.
    """

    block_name: str

    def reveal(self) -> str:
        from prefect.blocks.system import Secret

        value = Secret.load(self.block_name, _sync=True).get()  # type: ignore[call-arg,union-attr]
        return value if isinstance(value, str) else json.dumps(value)

    def __repr__(self) -> str:
        return f"SecretValue({self.block_name!r})"


def env_value(name: str, value: Any) -> str | SecretValue:
    """One `env=` value as a plain string or a reference to a Prefect `Secret` block."""
    if isinstance(value, SecretValue):
        return value
    from prefect.blocks.system import Secret

    if isinstance(value, Secret):
        block_name = getattr(value, "_block_document_name", None)
        if not block_name or getattr(value, "_is_anonymous", False):
            raise ConfigurationError(
                f"env={name!r} is an unsaved Secret block: save it first "
                f"(Secret(value=...).save('NAME')) and pass Secret.load('NAME'), so that its "
                "value never travels inside a payload."
            )
        return SecretValue(block_name)
    text = str(value)
    match = _TEMPLATE.match(text.strip())
    return SecretValue(match.group(1)) if match else text


@dataclass(frozen=True)
class PodSecrets:
    """Secret env vars for one pod: the Secret that holds them and the refs to it."""

    values: Mapping[str, str]

    @property
    def secret_name(self) -> str:
        canonical = json.dumps(dict(sorted(self.values.items())), sort_keys=True).encode()
        return SECRET_NAME_PREFIX + hashlib.sha256(canonical).hexdigest()[:16]

    def refs(self) -> tuple[Any, ...]:
        """`SecretRef`s (env var → key of this Secret) for the manifest."""
        from kinetic_prefect.launch.manifest import SecretRef

        name = self.secret_name
        return tuple(SecretRef(env, name, _key(env)) for env in sorted(self.values))

    def contents(self) -> dict[str, dict[str, str]]:
        """The Secret as a backend creates it (name → key → value); empty when there is none."""
        if not self.values:
            return {}
        return {self.secret_name: {_key(env): value for env, value in self.values.items()}}


def _key(env_name: str) -> str:
    # Secret keys allow [-._a-zA-Z0-9]; env var names already fit.
    return env_name.lower().replace("_", "-")


def split_env(env: Mapping[str, str | SecretValue]) -> tuple[dict[str, str], dict[str, str]]:
    """Plain env vars, and the revealed values of those that come from `Secret` blocks."""
    plain = {k: v for k, v in env.items() if not isinstance(v, SecretValue)}
    secret = {k: v.reveal() for k, v in env.items() if isinstance(v, SecretValue)}
    return plain, secret
