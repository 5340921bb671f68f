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

GCS identity from inside a pod (Workload Identity): on GKE a pod's requests to
GCS carry a token the metadata server issues for the Google service account its
Kubernetes service account is annotated with (`iam.gke.io/gcp-service-account`),
or for the Kubernetes account's own principal, which holds no roles, when it
has none. Clients in emulator mode send no token, so as a second test-only
stand-in the kubelet, as the metadata server would, replaces a GCS address in
the manifest's env that belongs to the IAM proxy (tests/support/gcs_iam.py)
with that proxy's port for the pod's identity (`workload_identity_env`). The
annotation is read from the ServiceAccount the emulator stores (the cluster's
admin runs the docs' `kubectl annotate` lines at start); the docs' grants decide
what each identity may do.

The container's environment otherwise starts from `image_env()` (see the
kubelet's module docstring), and its secretKeyRefs are filled from the Secrets
stored in the emulator (`secret_values`), as a kubelet fills them.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NO_TOKEN_KUBECONFIG = "no-service-account-token/kubeconfig"
# A python image's PATH past its interpreter's directory.
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_env(interpreter: str, home: Path) -> dict[str, str]:
    """The environment a python image gives every container: PATH, HOME and LANG.

    `PATH` starts with the directory of the image's `python` (`interpreter`), as a
    python image's starts with `/usr/local/bin`. And the suite's CA file for Prefect
    clients (tests/support/prefect_ca.py), as an image may set one.
    """
    from tests.support.prefect_ca import one_certificate_ca_file

    return {
        "PATH": f"{Path(interpreter).parent}:{_SYSTEM_PATH}",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PREFECT_API_SSL_CERT_FILE": one_certificate_ca_file(),
    }


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
    from tests.support.standins import kubeconfig

    config = kubeconfig(api_url, account, token)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return str(path)


# The variables through which GCS clients in emulator mode find the server.
GCS_ADDRESS_VARIABLES = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")


def workload_identity_env(
    find_service_account: Callable[[str], dict[str, Any] | None],
    namespace: str,
    pod_spec: dict[str, Any],
    gcs: Any = None,
) -> list[dict[str, str]]:
    """The container's env with the IAM proxy's address replaced by its identity's port.

    Unchanged when no GCS address in it belongs to an IAM proxy (see the module
    docstring). `gcs`, the IAM proxy that stands for GCS on this cluster's
    network, is how a pod whose manifest names no GCS address reaches it, as a
    GKE pod reaches storage.googleapis.com.
    """
    from tests.support.gcs_iam import (
        USER_MEMBER,
        WORKLOAD_IDENTITY_ANNOTATION,
        proxy_serving,
    )

    env = [dict(item) for item in pod_spec["containers"][0].get("env") or []]
    named = {item["name"] for item in env}
    if gcs is not None and not named & set(GCS_ADDRESS_VARIABLES):
        # Any of the proxy's ports: the loop below puts the pod's own identity's in its place.
        address = gcs.endpoint(USER_MEMBER)
        env += [{"name": name, "value": address} for name in GCS_ADDRESS_VARIABLES]
    account = pod_spec.get("serviceAccountName") or "default"
    for item in env:
        proxy = (
            proxy_serving(item.get("value") or "")
            if item["name"] in GCS_ADDRESS_VARIABLES
            else None
        )
        if proxy is None:
            continue
        stored = find_service_account(account) or {"metadata": {}}
        annotations = stored["metadata"].get("annotations") or {}
        annotation = annotations.get(WORKLOAD_IDENTITY_ANNOTATION)
        member = proxy.workload_identity_member(namespace, account, annotation)
        item["value"] = proxy.endpoint(member)
    return env


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
