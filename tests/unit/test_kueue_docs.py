"""docs/kueue.md's manifests use Kueue's v1beta2 API as its reference defines it.

The fields per kind are those of Kueue's v1beta2 API reference
(https://kueue.sigs.k8s.io/docs/reference/kueue.v1beta2/): v1beta2 removed a ClusterQueue's
`admissionChecks` and `cohort` (now `admissionChecksStrategy`, `cohortName`) and an
AdmissionCheck's `retryDelayMinutes`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

DOC = Path(__file__).resolve().parents[2] / "docs" / "kueue.md"

# kind -> (spec fields, required spec fields)
V1BETA2_SPEC = {
    "ResourceFlavor": ({"nodeLabels", "nodeTaints", "tolerations", "topologyName"}, set()),
    "ClusterQueue": (
        {
            "admissionChecksStrategy",
            "admissionScope",
            "cohortName",
            "concurrentAdmissionPolicy",
            "fairSharing",
            "flavorFungibility",
            "namespaceSelector",
            "preemption",
            "queueingStrategy",
            "resourceGroups",
            "stopPolicy",
        },
        set(),
    ),
    "LocalQueue": ({"clusterQueue", "fairSharing", "stopPolicy"}, set()),
    "AdmissionCheck": ({"controllerName", "parameters"}, {"controllerName"}),
    "ProvisioningRequestConfig": (
        {
            "managedResources",
            "parameters",
            "podSetMergePolicy",
            "podSetUpdates",
            "provisioningClassName",
            "retryStrategy",
        },
        {"provisioningClassName"},
    ),
}
RESOURCE_GROUP = {"coveredResources", "flavors"}
FLAVOR_QUOTAS = {"name", "resources"}
RESOURCE = ({"name", "nominalQuota", "borrowingLimit", "lendingLimit"}, {"name", "nominalQuota"})


def _kueue_objects() -> list[dict[str, Any]]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    found = [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]
    return [o for o in found if str(o.get("apiVersion", "")).startswith("kueue.x-k8s.io/")]


def _check_cluster_queue(spec: dict[str, Any]) -> None:
    for group in spec.get("resourceGroups", []):
        assert set(group) == RESOURCE_GROUP, group
        for flavor in group["flavors"]:
            assert set(flavor) == FLAVOR_QUOTAS, flavor
            for resource in flavor["resources"]:
                allowed, required = RESOURCE
                assert required <= set(resource) <= allowed, resource
    for check in (spec.get("admissionChecksStrategy") or {}).get("admissionChecks", []):
        assert set(check) <= {"name", "onFlavors"} and "name" in check, check


def test_every_kueue_manifest_in_the_docs_is_v1beta2_with_its_fields() -> None:
    objects = _kueue_objects()
    assert {o["kind"] for o in objects} == set(V1BETA2_SPEC)  # the page shows each kind
    for obj in objects:
        assert obj["apiVersion"] == "kueue.x-k8s.io/v1beta2", obj["metadata"]
        allowed, required = V1BETA2_SPEC[obj["kind"]]
        spec = obj.get("spec") or {}
        assert required <= set(spec) <= allowed, (obj["kind"], sorted(spec))
        if obj["kind"] == "ClusterQueue":
            _check_cluster_queue(spec)
