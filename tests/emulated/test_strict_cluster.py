"""The emulated cluster is as strict as GKE's: authentication, RBAC from deployments/k8s/rbac.yaml,
ServiceAccount admission, SelfSubjectAccessReview; and what the gke backend says when it is refused.

Pods import this module to run its tasks: the emulator's helpers (kmock) are imported
only by the fixtures, never here at the top.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prefect import flow, task

from kinetic_prefect import KineticTaskRunner
from tests.support.pod_env import service_account_token
from tests.support.waiting import wait_until

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

RUNNER = service_account_token("default", "kinetic-prefect-runner")
RUNNER_USER = "system:serviceaccount:default:kinetic-prefect-runner"
# The account blocks/save_gke.py once defaulted to, where rbac.yaml creates kinetic-prefect-pods.
MISSPELT_ACCOUNT = "kinetic-prefect-pod"
# Past pytest-timeout's 900 s backstop: a run that waited for it could not pass, so a
# failure in time can only come from the events.
PENDING_TIMEOUT = 3600.0


@task
def trivial(x: int) -> int:
    return x


def _failed_run(gke: str, **options: Any) -> tuple[str, str]:
    runner = KineticTaskRunner(cluster=gke, allow_loopback_api=True, **options)

    @flow(task_runner=runner)
    def run() -> tuple[str, str]:
        future = trivial.submit(1)
        future.wait()
        return future.state.type.value, future.state.message or ""

    return run()


def _job_manifest(name: str, service_account: str) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": service_account,
                    "containers": [{"name": "task", "image": "python:3.11-slim"}],
                },
            },
        },
    }


def _failed_creates(cluster: Any, job: str) -> list[str]:
    return [
        e["message"]
        for e in cluster.call(lambda: cluster.emulator.live("events", "default"))
        if e["involvedObject"]["name"] == job and e["reason"] == "FailedCreate"
    ]


def _review(cluster: Any, token: str, **attributes: str) -> tuple[int, dict[str, Any]]:
    body = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"namespace": "default", **attributes}},
    }
    path = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
    return cluster.request_as(token, "POST", path, body)  # type: ignore[no-any-return]


# -- service accounts ----------------------------------------------------------------------


def test_a_pod_whose_service_account_does_not_exist_fails_fast_naming_the_account_and_the_fix(
    gke, cluster
):
    state, message = _failed_run(
        gke, service_account=MISSPELT_ACCOUNT, pending_timeout_seconds=PENDING_TIMEOUT
    )

    assert state == "FAILED"
    assert (
        'pods "kp-' in message
        and f"is forbidden: error looking up service account default/{MISSPELT_ACCOUNT}: "
        f'serviceaccount "{MISSPELT_ACCOUNT}" not found'
        in message
    )
    assert "kubectl apply -n default -f deployments/k8s/rbac.yaml" in message
    assert "KineticCluster.service_account" in message
    wait_until(lambda: cluster.jobs() == [], 30, "the Job to be deleted")


def test_the_job_controller_retries_a_pod_refused_for_its_account_until_the_account_exists(
    cluster,
):
    cluster.kubelet.run_containers = False
    cluster.create("/apis/batch/v1/namespaces/default/jobs", _job_manifest("late", "trainer"))

    refusals = wait_until(lambda: _failed_creates(cluster, "late"), 30, "a FailedCreate event")
    assert refusals[0] == (
        'Error creating: pods "late-" is forbidden: error looking up service account '
        'default/trainer: serviceaccount "trainer" not found'
    )
    assert cluster.pods() == []
    wait_until(lambda: len(_failed_creates(cluster, "late")) >= 2, 30, "a retry")
    cluster.create(
        "/api/v1/namespaces/default/serviceaccounts",
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "trainer"}},
    )

    wait_until(lambda: cluster.pods(), 30, "the pod, once its account exists")


# -- authentication and RBAC --------------------------------------------------------------


def test_a_request_without_a_known_token_is_unauthorized(cluster):
    cluster.refusals_expected = True
    pods = "/api/v1/namespaces/default/pods"
    for token in ("", "no-such-token", service_account_token("default", "nobody")):
        status, answer = cluster.request_as(token, "GET", pods)

        assert (status, answer) == (
            401,
            {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": "Unauthorized",
                "reason": "Unauthorized",
                "code": 401,
            },
        )
    assert cluster.refusals() == [(401, "GET", pods, "Unauthorized")] * 3


def test_the_runner_identity_may_not_delete_pods(cluster):
    cluster.refusals_expected = True
    status, answer = cluster.request_as(RUNNER, "DELETE", "/api/v1/namespaces/default/pods/x")

    assert status == 403
    assert answer["reason"] == "Forbidden"
    assert answer["message"] == (
        f'pods "x" is forbidden: User "{RUNNER_USER}" cannot delete resource "pods" in API '
        'group "" in the namespace "default"'
    )
    assert answer["details"] == {"name": "x", "kind": "pods"}
    assert cluster.refusals() == [
        (403, "DELETE", "/api/v1/namespaces/default/pods/x", answer["message"])
    ]


def test_the_runner_identity_may_do_what_its_role_grants_and_nothing_in_another_namespace(
    cluster,
):
    cluster.refusals_expected = True
    jobs = "/apis/batch/v1/namespaces/{}/jobs"

    assert cluster.request_as(RUNNER, "GET", jobs.format("default"))[0] == 200
    watch = jobs.format("default") + "?watch=true&timeoutSeconds=1"
    assert cluster.request_as(RUNNER, "GET", watch)[0] == 200
    status, answer = cluster.request_as(RUNNER, "GET", jobs.format("ml"))
    assert status == 403
    assert answer["message"] == (
        f'jobs.batch is forbidden: User "{RUNNER_USER}" cannot list resource "jobs" in API '
        'group "batch" in the namespace "ml"'
    )
    assert cluster.refusals() == [(403, "GET", jobs.format("ml"), answer["message"])]


def test_a_refusal_stays_logged_apart_from_injected_errors_and_later_requests_are_served(
    cluster,
):
    cluster.refusals_expected = True
    secrets = "/api/v1/namespaces/default/secrets"
    refused, answer = cluster.request_as(RUNNER, "DELETE", "/api/v1/namespaces/default/pods/x")
    cluster.refuse(429, "TooManyRequests", "injected", plural="secrets")

    served = cluster.request_as(RUNNER, "GET", "/apis/batch/v1/namespaces/default/jobs")[0]
    injected = cluster.request_as(cluster.admin.token, "GET", secrets)[0]
    cluster.stop_refusing()
    lifted = cluster.request_as(cluster.admin.token, "GET", secrets)[0]

    assert (refused, served, injected, lifted) == (403, 200, 429, 200)
    assert cluster.refusals() == [
        (403, "DELETE", "/api/v1/namespaces/default/pods/x", answer["message"])
    ]


def test_without_its_binding_the_users_requests_are_forbidden_and_the_error_says_what_to_do(
    gke, cluster
):
    cluster.refusals_expected = True
    cluster.unbind_user()

    state, message = _failed_run(gke)

    assert state == "FAILED"
    # The runner's first request (it lists the flow run's Jobs to take over earlier pods).
    assert 'User "tester" cannot list resource "jobs" in API group "batch"' in message
    assert 'tester lacks "list" on jobs (API group batch) in namespace default' in message
    assert "sed s/USER/tester/ deployments/k8s/user-binding.yaml | kubectl apply -n default" in (
        message
    )
    assert cluster.jobs() == []
    # That first request, and nothing after it.
    ((code, method, path, refused),) = cluster.refusals()
    assert (code, method, path.partition("?")[0]) == (
        403,
        "GET",
        "/apis/batch/v1/namespaces/default/jobs",
    )
    assert refused == (
        'jobs.batch is forbidden: User "tester" cannot list resource "jobs" in API group "batch" '
        'in the namespace "default"'
    )


# -- SelfSubjectAccessReview ---------------------------------------------------------------


def test_a_self_subject_access_review_says_allowed_and_by_which_binding(cluster):
    status, answer = _review(cluster, RUNNER, verb="create", group="batch", resource="jobs")

    assert status == 201
    assert answer["kind"] == "SelfSubjectAccessReview"
    assert answer["status"] == {
        "allowed": True,
        "reason": 'RBAC: allowed by RoleBinding "kinetic-prefect-runner/default" of Role '
        '"kinetic-prefect-runner" to ServiceAccount "kinetic-prefect-runner/default"',
    }


def test_a_self_subject_access_review_says_denied_for_what_the_role_lacks(cluster):
    status, answer = _review(cluster, RUNNER, verb="delete", resource="pods")

    assert status == 201
    assert answer["status"] == {"allowed": False}


def test_a_self_subject_access_review_answers_kubernetes_client_for_the_kubeconfig_user(cluster):
    from kubernetes_asyncio import client, config

    async def review(resource: str, subresource: str = "") -> Any:
        api = await config.new_client_from_config(str(cluster.kubeconfig))
        async with api:
            spec = client.V1SelfSubjectAccessReviewSpec(
                resource_attributes=client.V1ResourceAttributes(
                    namespace="default", verb="get", resource=resource, subresource=subresource
                )
            )
            body = client.V1SelfSubjectAccessReview(spec=spec)
            return await client.AuthorizationV1Api(api).create_self_subject_access_review(body)

    logs = asyncio.run(review("pods", "log"))
    secrets = asyncio.run(review("secrets"))

    assert logs.status.allowed is True
    assert 'to User "tester"' in logs.status.reason
    assert secrets.status.allowed is False
