"""The test kubelet's containers against Kubernetes' documented rules (tests/support/containers.py).

A container's env (values, the downward API's fieldRefs, Secrets, an Indexed Job's
index) and the cluster DNS a slice's hosts find each other through. Written from
Kubernetes' documentation (docs/testing.md, "The test kubelet's containers"), never
from the product's manifests: these rows are the emulated cluster's own.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.containers import (
    container_env,
    dns_names,
    field_value,
    hosts_file,
    selects,
)


def _pod(
    name: str = "train-0-abcde",
    hostname: str | None = None,
    subdomain: str | None = None,
    labels: dict[str, str] | None = None,
    index: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": "node-1", "containers": [{"name": "task"}]}
    if hostname:
        spec["hostname"] = hostname
    if subdomain:
        spec["subdomain"] = subdomain
    annotations = {"batch.kubernetes.io/job-completion-index": index} if index else {}
    return {
        "metadata": {
            "name": name,
            "namespace": "ml",
            "uid": "u-1",
            "labels": labels or {"job-name": "train"},
            "annotations": annotations,
        },
        "spec": spec,
        "status": {"podIP": "127.9.1.2"},
    }


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("metadata.name", "train-0-abcde"),
        ("metadata.namespace", "ml"),
        ("metadata.uid", "u-1"),
        ("metadata.labels['job-name']", "train"),
        ("metadata.annotations['batch.kubernetes.io/job-completion-index']", "3"),
        ("metadata.annotations['absent']", ""),
        ("spec.nodeName", "node-1"),
        ("spec.serviceAccountName", "default"),
        ("status.podIP", "127.9.1.2"),
    ],
)
def test_a_field_ref_reads_the_downward_api_field(path, expected):
    assert field_value(_pod(index="3"), path) == expected


def test_a_field_the_downward_api_does_not_offer_is_refused():
    with pytest.raises(KeyError, match="spec.containers"):
        field_value(_pod(), "spec.containers")


def test_a_containers_env_is_the_images_then_its_own_in_order():
    container = {
        "env": [
            {"name": "PATH", "value": "/opt/bin"},
            {"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {"name": "EMPTY"},
        ]
    }
    env = container_env(container, _pod(), {"s": {"k": "v"}}, {"PATH": "/usr/bin", "LANG": "C"})

    assert env == {
        "PATH": "/opt/bin",
        "LANG": "C",
        "HOST": "train-0-abcde",
        "KEY": "v",
        "EMPTY": "",
    }


def test_an_indexed_jobs_pod_gets_its_completion_index_as_job_completion_index():
    assert container_env({}, _pod(index="2"), {}, {})["JOB_COMPLETION_INDEX"] == "2"
    assert "JOB_COMPLETION_INDEX" not in container_env({}, _pod(), {}, {})


@pytest.mark.parametrize(
    ("hostname", "subdomain", "names"),
    [
        (None, None, ["train-0-abcde"]),
        ("train-0", None, ["train-0"]),
        (
            "train-0",
            "train-hosts",
            [
                "train-0.train-hosts.ml.svc.cluster.local",
                "train-0.train-hosts.ml.svc",
                "train-0.train-hosts.ml",
                "train-0.train-hosts",
            ],
        ),
    ],
)
def test_a_pods_dns_names_follow_its_hostname_and_subdomain(hostname, subdomain, names):
    assert dns_names(_pod(hostname=hostname, subdomain=subdomain)) == names


def _service(name: str = "train-hosts", cluster_ip: str = "None", **selector: str) -> dict:
    spec = {"clusterIP": cluster_ip, "selector": selector or {"job-name": "train"}}
    return {"metadata": {"name": name, "namespace": "ml"}, "spec": spec}


@pytest.mark.parametrize(
    ("service", "selected"),
    [
        (_service(), True),
        (_service(name="other"), False),  # not named by the pod's subdomain
        (_service(cluster_ip="10.0.0.1"), False),  # not headless
        (_service(**{"job-name": "other"}), False),  # selects other pods
        ({**_service(), "metadata": {"name": "train-hosts", "namespace": "x"}}, False),
    ],
    ids=[
        "headless, named, selecting",
        "another name",
        "not headless",
        "other pods",
        "other namespace",
    ],
)
def test_only_a_headless_service_named_by_the_subdomain_that_selects_the_pod_publishes_it(
    service, selected
):
    assert selects(service, _pod(hostname="train-1", subdomain="train-hosts")) is selected


def test_a_pods_hosts_file_has_its_own_names_and_its_peers_records():
    me = _pod(hostname="train-0", subdomain="train-hosts")
    peer = _pod(name="train-1-fghij", hostname="train-1", subdomain="train-hosts")

    lines = hosts_file(me, "127.9.1.1", [("127.9.1.2", peer)]).splitlines()

    assert lines[0] == "127.0.0.1\tlocalhost"
    # Its own line as the kubelet writes it: the FQDN and the bare hostname only.
    assert lines[2].split("\t") == ["127.9.1.1", "train-0.train-hosts.ml.svc.cluster.local train-0"]
    assert lines[3].startswith("127.9.1.2\ttrain-1.train-hosts.ml.svc.cluster.local ")
    assert lines[3].endswith(" train-1.train-hosts")  # a peer's bare hostname is not in DNS


def test_a_pod_without_a_hostname_gets_no_record():
    assert selects(_service(), _pod(subdomain="train-hosts")) is False


def test_a_peer_in_another_namespace_answers_only_to_names_that_say_its_namespace():
    me = _pod(hostname="train-0", subdomain="train-hosts")
    peer = _pod(name="p", hostname="train-1", subdomain="train-hosts")
    peer["metadata"]["namespace"] = "other"

    (line,) = hosts_file(me, "127.9.1.1", [("127.9.1.3", peer)]).splitlines()[3:]

    assert line.split("\t")[1].split() == [
        "train-1.train-hosts.other.svc.cluster.local",
        "train-1.train-hosts.other.svc",
        "train-1.train-hosts.other",
    ]
