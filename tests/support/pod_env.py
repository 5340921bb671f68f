"""What the test kubelet gives a pod's container besides its manifest.

API access from inside a pod (a flow-run pod launching its task pods): a real
kubelet mounts the service account's token, and the client inside uses the
in-cluster config. The emulator serves plain HTTP, which the in-cluster config
cannot speak, so as a test-only stand-in a pod whose spec mounts its token
(`automountServiceAccountToken`, true when unset, as in Kubernetes) gets
`KUBECONFIG` pointing at a kubeconfig for the emulator whose bearer token is
`service_account_token(namespace, account)`: the emulator's request log then
says which service account made each request. Any other pod gets a `KUBECONFIG`
that does not exist, so it cannot reach the cluster through the test's own.

The container's environment otherwise starts from `image_env()` (see the
kubelet's module docstring), and its secretKeyRefs are filled from the Secrets
stored in the emulator (`secret_values`), as a kubelet fills them.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NO_TOKEN_KUBECONFIG = "no-service-account-token/kubeconfig"
# A python image's PATH past its interpreter's directory.
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_env(home: Path) -> dict[str, str]:
    """The environment a python image gives every container: PATH, HOME and LANG.

    And `PYTHONPATH` to a directory holding only the kinetic_prefect under test: an
    image has the checkout it was built from installed, while this interpreter's
    editable install may point at another checkout (a git worktree's tests).
    """
    return {
        "PATH": f"{Path(sys.executable).parent}:{_SYSTEM_PATH}",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONPATH": str(_image_site(home.parent / "image-site")),
    }


def _image_site(site: Path) -> Path:
    import kinetic_prefect

    package = site / "kinetic_prefect"
    if not package.exists():
        site.mkdir(parents=True, exist_ok=True)
        package.symlink_to(Path(kinetic_prefect.__file__).parent, target_is_directory=True)
    return site


def service_account_token(namespace: str, account: str) -> str:
    """The bearer token the kubelet gives pods that run as `account` in `namespace`."""
    return f"serviceaccount:{namespace}:{account}"


def pod_kubeconfig(workspace: Path, api_url: str, namespace: str, pod_spec: dict[str, Any]) -> str:
    """The stand-in for a mounted service-account token (see the module docstring)."""
    if not pod_spec.get("automountServiceAccountToken", True):
        return str(workspace / _NO_TOKEN_KUBECONFIG)
    account = pod_spec.get("serviceAccountName") or "default"
    path = workspace / "serviceaccounts" / f"{namespace}.{account}.json"
    token = service_account_token(namespace, account)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "kmock", "cluster": {"server": api_url}}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "pod", "context": {"cluster": "kmock", "user": account}}],
        "current-context": "pod",
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return str(path)


def secret_values(
    find_secret: Callable[[str], dict[str, Any] | None], namespace: str, pod_spec: dict[str, Any]
) -> dict[str, dict[str, str]]:
    """The values of the container's secretKeyRefs, by Secret name and key.

    A missing Secret or key is a `KeyError` worded as the kubelet's
    CreateContainerConfigError.
    """
    values: dict[str, dict[str, str]] = {}
    for item in pod_spec["containers"][0].get("env") or []:
        ref = (item.get("valueFrom") or {}).get("secretKeyRef")
        if ref is None:
            continue
        secret = find_secret(ref["name"])
        if secret is None or ref["key"] not in (secret.get("data") or {}):
            raise KeyError(f"couldn't find key {ref['key']} in Secret {namespace}/{ref['name']}")
        values.setdefault(ref["name"], {})[ref["key"]] = base64.b64decode(
            secret["data"][ref["key"]]
        ).decode()
    return values
