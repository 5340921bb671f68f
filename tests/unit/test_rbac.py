"""deployments/k8s/rbac.yaml grants the runner exactly what the code asks for (`RUNNER_ACCESS`)."""

from __future__ import annotations

from pathlib import Path

import yaml

from kinetic_prefect.backends.gke.permissions import (
    PODS_SERVICE_ACCOUNT,
    RBAC_FILE,
    RUNNER_ACCESS,
    RUNNER_ROLE,
    RUNNER_SERVICE_ACCOUNT,
)

ROOT = Path(__file__).resolve().parents[2]


def _documents() -> list[dict]:
    return [doc for doc in yaml.safe_load_all((ROOT / RBAC_FILE).read_text()) if doc]


def test_the_runner_role_grants_exactly_what_the_runner_uses() -> None:
    (role,) = [
        d for d in _documents() if d["kind"] == "Role" and d["metadata"]["name"] == RUNNER_ROLE
    ]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    used = {(a.group, a.resource, a.verb) for a in RUNNER_ACCESS}
    assert granted - used == set(), "the Role grants verbs nothing uses"
    assert used - granted == set(), "the code uses verbs the Role does not grant"


def test_rbac_yaml_creates_the_service_accounts_the_defaults_name() -> None:
    accounts = {d["metadata"]["name"] for d in _documents() if d["kind"] == "ServiceAccount"}
    assert {RUNNER_SERVICE_ACCOUNT, PODS_SERVICE_ACCOUNT} <= accounts
