"""The gke backend's decisions as tables: how a pod ended, whether Kubernetes took it, why it waits.

Every row is a Job, pod or event in the shape Kubernetes and GKE write it; the comment
above each group of rows names the page the shape comes from, never the product's code.
"""

from __future__ import annotations

from typing import Any

import pytest

from kinetic_prefect.backends.gke.status import (
    Pending,
    failed_create_reason,
    infrastructure_took,
    lasting_failed_create,
    pending,
    pending_reason,
    pod_outcome,
    pod_started,
)
from kinetic_prefect.launch.manifest import build_job_manifest
from tests.unit.test_manifest import _spec

NAMESPACE = "ml"
JOB_NAME = "kp-train-model-1a2b3c4d"
POD_NAME = f"{JOB_NAME}-x7k2p"
NODE = "gke-ml-l4-spot-5f3e1a2b-9xkz"
IMAGE = "us-docker.pkg.dev/acme-ml/trainers/trainer:v7"
STARTED = "2026-03-02T09:14:05Z"
ENDED = "2026-03-02T10:02:41Z"
CONTAINER_ID = "containerd://4f1c2a9be0d35c7e8a6b1f2d3c4e5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f"

MANIFEST = build_job_manifest(_spec("l4", image=IMAGE))


def _pod(status: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    """The Job's pod as the API server returns it, its status as the kubelet wrote it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": POD_NAME,
            "namespace": NAMESPACE,
            "labels": {"batch.kubernetes.io/job-name": JOB_NAME, "job-name": JOB_NAME},
            **metadata,
        },
        "spec": {
            "nodeName": NODE,
            "restartPolicy": "Never",
            "containers": [{"name": "task", "image": IMAGE}],
        },
        "status": status,
    }


def _task(state: dict[str, Any]) -> list[dict[str, Any]]:
    """`containerStatuses` of the pod's one container, `task`, in `state`."""
    return [
        {
            "name": "task",
            "image": IMAGE,
            "imageID": "",
            "ready": False,
            "restartCount": 0,
            "started": "running" in state,
            "state": state,
            "lastState": {},
        }
    ]


def _terminated(exit_code: int, reason: str) -> dict[str, Any]:
    return {
        "terminated": {
            "exitCode": exit_code,
            "reason": reason,
            "startedAt": STARTED,
            "finishedAt": ENDED,
            "containerID": CONTAINER_ID,
        }
    }


def _ended(*disruption: dict[str, Any], how: str = "PodFailed") -> list[dict[str, Any]]:
    """The conditions the kubelet leaves on a pod that ended `how` (and a disruption's)."""
    return [
        *disruption,
        {"type": "PodReadyToStartContainers", "status": "False"},
        {"type": "Initialized", "status": "True"},
        {"type": "Ready", "status": "False", "reason": how},
        {"type": "ContainersReady", "status": "False", "reason": how},
        {"type": "PodScheduled", "status": "True"},
    ]


def _disruption(reason: str, message: str) -> dict[str, Any]:
    return {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": ENDED,
    }


def _job(*conditions: tuple[str, str, str]) -> dict[str, Any]:
    """The Job with its `(type, reason, message)` conditions, each True."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": JOB_NAME, "namespace": NAMESPACE},
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": 3600},
        "status": {
            "startTime": STARTED,
            "conditions": [
                {
                    "type": kind,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": ENDED,
                }
                for kind, reason, message in conditions
            ],
        },
    }


# -- how a pod ended ----------------------------------------------------------------------------

# The task's own endings. Container states and exit codes:
# https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#container-state-terminated
# OOMKilled, exit code 137 (SIGKILL), in `containerStatuses[].state.terminated`:
# https://kubernetes.io/docs/tasks/configure-pod-container/assign-memory-resource/#exceed-a-container-s-memory-limit,
# https://docs.openshift.com/container-platform/3.9/dev_guide/application_memory_sizing.html
# The Job's conditions once its pod ended (SuccessCriteriaMet/Complete, FailureTarget/Failed
# with BackoffLimitExceeded): https://kubernetes.io/docs/concepts/workloads/controllers/job/#termination-of-job-pods
SUCCEEDED = _pod(
    {
        "phase": "Succeeded",
        "conditions": _ended(how="PodCompleted"),
        "containerStatuses": _task(_terminated(0, "Completed")),
    }
)
COMPLETE = _job(
    ("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
    ("Complete", "CompletionsReached", "Reached expected number of succeeded pods"),
)
BACKOFF_LIMIT = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
FAILED = _job(("FailureTarget", *BACKOFF_LIMIT), ("Failed", *BACKOFF_LIMIT))
TASK_FAILED = _pod(
    {"phase": "Failed", "conditions": _ended(), "containerStatuses": _task(_terminated(1, "Error"))}
)
OOM_KILLED = _pod(
    {
        "phase": "Failed",
        "conditions": _ended(),
        "containerStatuses": _task(_terminated(137, "OOMKilled")),
    }
)
SIGKILLED = _pod(
    {
        "phase": "Failed",
        "conditions": _ended(),
        "containerStatuses": _task(_terminated(137, "Error")),
    }
)

# A spot VM reclaimed: GKE's graceful node shutdown gives the pod "a Failed phase and a
# Terminated reason" (https://cloud.google.com/kubernetes-engine/docs/concepts/spot-vms,
# https://cloud.google.com/kubernetes-engine/docs/how-to/preemptible-vms), with the message
# https://kubernetes.io/docs/concepts/cluster-administration/node-shutdown/#graceful-node-shutdown
# quotes, and a DisruptionTarget condition of reason TerminationByKubelet
# (https://kubernetes.io/docs/concepts/workloads/pods/pod-condition/#disruption-target). A
# pod bound to the node while it shuts down is rejected at admission with reason
# NodeShutdown: the other kind of pod the preemptible-vms page has you delete
# (`kubectl get pods --all-namespaces | grep -i NodeShutdown`).
SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
SPOT_RECLAIMED = _pod(
    {
        "phase": "Failed",
        "reason": "Terminated",
        "message": SHUTDOWN_MESSAGE,
        "conditions": _ended(_disruption("TerminationByKubelet", SHUTDOWN_MESSAGE)),
        "containerStatuses": _task(_terminated(143, "Error")),
    }
)
REJECTED_BY_SHUTDOWN = _pod(
    {
        "phase": "Failed",
        "reason": "NodeShutdown",
        "message": "Pod was rejected: Pod was rejected as the node is shutting down.",
        "startTime": ENDED,
    }
)

# Evictions. Node-pressure eviction fails the pod with reason Evicted and the kubelet's
# message (https://kubernetes.io/docs/concepts/scheduling-eviction/node-pressure-eviction/)
# and adds DisruptionTarget/TerminationByKubelet; an eviction for the pod's own
# ephemeral-storage limit gets no DisruptionTarget, "because the disruptions were probably
# caused by the Pod and would reoccur on retry"
# (https://kubernetes.io/docs/concepts/workloads/pods/pod-condition/#disruption-target;
# GKE Autopilot sets a default ephemeral-storage limit,
# https://cloud.google.com/kubernetes-engine/docs/concepts/autopilot-resource-requests#defaults).
LOW_MEMORY = (
    "The node was low on resource: memory. Threshold quantity: 100Mi, available: 84Mi. "
    "Container task was using 3Gi, request is 1Gi, has larger consumption of memory. "
)
NODE_PRESSURE_EVICTED = _pod(
    {
        "phase": "Failed",
        "reason": "Evicted",
        "message": LOW_MEMORY,
        "conditions": _ended(_disruption("TerminationByKubelet", LOW_MEMORY)),
        "containerStatuses": _task(_terminated(137, "Error")),
    }
)
OWN_STORAGE = "Pod ephemeral local storage usage exceeds the total limit of containers 1Gi. "
STORAGE_LIMIT_EVICTED = _pod(
    {
        "phase": "Failed",
        "reason": "Evicted",
        "message": OWN_STORAGE,
        "conditions": _ended(),
        "containerStatuses": _task(_terminated(137, "Error")),
    }
)

# The control plane's disruptions, each with its DisruptionTarget reason
# (https://kubernetes.io/docs/concepts/workloads/pods/pod-condition/#disruption-target):
# a node drained for a GKE upgrade through the Eviction API
# (https://kubernetes.io/docs/concepts/scheduling-eviction/api-eviction/), a higher-priority
# pod (https://kubernetes.io/docs/concepts/scheduling-eviction/pod-priority-preemption/), a
# deleted node's pods marked Failed by the pod garbage collector
# (https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-garbage-collection),
# an unreachable node's pods deleted for its NoExecute taint
# (https://kubernetes.io/docs/concepts/scheduling-eviction/taint-and-toleration/#taint-based-evictions).
DRAINED = _pod(
    {
        "phase": "Failed",
        "conditions": _ended(_disruption("EvictionByEvictionAPI", "Eviction API: evicting")),
        "containerStatuses": _task(_terminated(143, "Error")),
    }
)
PREEMPTED_BY_SCHEDULER = _pod(
    {
        "phase": "Failed",
        "conditions": _ended(
            _disruption(
                "PreemptionByScheduler",
                "default-scheduler: preempting to accommodate a higher priority pod",
            )
        ),
        "containerStatuses": _task(_terminated(143, "Error")),
    }
)
NODE_DELETED = _pod(
    {
        "phase": "Failed",
        "conditions": _ended(_disruption("DeletionByPodGC", "PodGC: node no longer exists")),
        "containerStatuses": _task({"running": {"startedAt": STARTED}}),
    }
)
NODE_UNREACHABLE = _pod(
    {
        "phase": "Running",
        "conditions": [
            _disruption("DeletionByTaintManager", "Taint manager: deleting due to NoExecute taint"),
            {"type": "Ready", "status": "False"},
            {"type": "PodScheduled", "status": "True"},
        ],
        "containerStatuses": _task({"running": {"startedAt": STARTED}}),
    },
    deletionTimestamp=ENDED,
)

# activeDeadlineSeconds: the Job fails with reason DeadlineExceeded and its pods are
# terminated (https://kubernetes.io/docs/concepts/workloads/controllers/job/#job-termination-and-cleanup);
# the pod may be gone before its last status is seen, or end killed by SIGTERM.
DEADLINE = ("DeadlineExceeded", "Job was active longer than specified deadline")
PAST_DEADLINE_REASON = (
    "DeadlineExceeded: Job was active longer than specified deadline (activeDeadlineSeconds="
    "3600, from timeout_seconds; Kubernetes counts it from the Job's start, time the pod "
    "waited for a node included)"
)
PAST_DEADLINE = _job(("FailureTarget", *DEADLINE), ("Failed", *DEADLINE))
KILLED_AT_DEADLINE = _pod(
    {
        "phase": "Failed",
        "conditions": _ended(),
        "containerStatuses": _task(_terminated(143, "Error")),
    }
)

# A pod deleted (kubectl delete --force) before the kubelet wrote any status.
DELETED_WITHOUT_STATUS = _pod({}, deletionTimestamp=ENDED)

PREEMPTED_ON_SHUTDOWN = (
    "preempted: the node is shutting down (spot or maintenance) "
    f"(TerminationByKubelet: {SHUTDOWN_MESSAGE})"
)


@pytest.mark.parametrize(
    ("pod", "job", "outcome"),
    [
        pytest.param(SUCCEEDED, COMPLETE, (0, None, ""), id="exit 0: the task succeeded"),
        pytest.param(TASK_FAILED, FAILED, (1, None, ""), id="exit 1: the task failed"),
        pytest.param(
            OOM_KILLED,
            FAILED,
            (137, None, "OOMKilled: the container exceeded its memory limit"),
            id="exit 137 OOMKilled: over its memory limit",
        ),
        pytest.param(SIGKILLED, FAILED, (137, 9, ""), id="exit 137 without a reason: SIGKILL"),
        pytest.param(
            SPOT_RECLAIMED,
            FAILED,
            (143, None, PREEMPTED_ON_SHUTDOWN),
            id="spot VM reclaimed: graceful node shutdown",
        ),
        pytest.param(
            REJECTED_BY_SHUTDOWN,
            FAILED,
            (
                None,
                None,
                "NodeShutdown: Pod was rejected: Pod was rejected as the node is shutting down.",
            ),
            id="rejected by a node shutting down",
        ),
        pytest.param(
            NODE_PRESSURE_EVICTED,
            FAILED,
            (137, None, f"Evicted: {LOW_MEMORY}"),
            id="node-pressure eviction",
        ),
        pytest.param(
            STORAGE_LIMIT_EVICTED,
            FAILED,
            (137, None, f"Evicted: {OWN_STORAGE}"),
            id="evicted for its own ephemeral-storage limit",
        ),
        pytest.param(
            DRAINED,
            FAILED,
            (
                143,
                None,
                "evicted through the Eviction API (node drain or upgrade) "
                "(EvictionByEvictionAPI: Eviction API: evicting)",
            ),
            id="drained through the Eviction API",
        ),
        pytest.param(
            PREEMPTED_BY_SCHEDULER,
            FAILED,
            (
                143,
                None,
                "preempted by the scheduler for a higher-priority pod (PreemptionByScheduler: "
                "default-scheduler: preempting to accommodate a higher priority pod)",
            ),
            id="preempted by the scheduler",
        ),
        pytest.param(
            NODE_DELETED,
            FAILED,
            (
                None,
                None,
                "preempted: the node disappeared (DeletionByPodGC: PodGC: node no longer exists)",
            ),
            id="node deleted: garbage-collected",
        ),
        pytest.param(
            NODE_UNREACHABLE,
            None,
            (
                None,
                None,
                "preempted: the node was tainted (spot reclaim or node problem) "
                "(DeletionByTaintManager: Taint manager: deleting due to NoExecute taint)",
            ),
            id="node unreachable: NoExecute taint",
        ),
        pytest.param(
            None,
            PAST_DEADLINE,
            (None, None, PAST_DEADLINE_REASON),
            id="past activeDeadlineSeconds, the pod gone",
        ),
        pytest.param(
            KILLED_AT_DEADLINE,
            PAST_DEADLINE,
            (143, None, PAST_DEADLINE_REASON),
            id="past activeDeadlineSeconds, the pod killed",
        ),
        pytest.param(
            DELETED_WITHOUT_STATUS, None, (None, None, ""), id="deleted before any status"
        ),
    ],
)
def test_pod_outcome_is_exit_code_signal_and_what_kubernetes_did(pod, job, outcome):
    assert pod_outcome(pod, job) == outcome


@pytest.mark.parametrize(
    ("pod", "took"),
    [
        pytest.param(SUCCEEDED, False, id="exit 0: the task succeeded"),
        pytest.param(TASK_FAILED, False, id="exit 1: the task failed"),
        pytest.param(OOM_KILLED, False, id="exit 137 OOMKilled: over its memory limit"),
        pytest.param(SIGKILLED, False, id="exit 137 without a reason: SIGKILL"),
        pytest.param(SPOT_RECLAIMED, True, id="spot VM reclaimed: graceful node shutdown"),
        pytest.param(
            REJECTED_BY_SHUTDOWN,
            True,
            id="rejected by a node shutting down",
        ),
        pytest.param(NODE_PRESSURE_EVICTED, True, id="node-pressure eviction"),
        pytest.param(
            STORAGE_LIMIT_EVICTED,
            False,
            id="evicted for its own ephemeral-storage limit",
        ),
        pytest.param(DRAINED, True, id="drained through the Eviction API"),
        pytest.param(PREEMPTED_BY_SCHEDULER, True, id="preempted by the scheduler"),
        pytest.param(NODE_DELETED, True, id="node deleted: garbage-collected"),
        pytest.param(NODE_UNREACHABLE, True, id="node unreachable: NoExecute taint"),
        pytest.param(None, False, id="past activeDeadlineSeconds, the pod gone"),
        pytest.param(KILLED_AT_DEADLINE, False, id="past activeDeadlineSeconds, the pod killed"),
        pytest.param(DELETED_WITHOUT_STATUS, False, id="deleted before any status"),
    ],
)
def test_the_infrastructure_took_the_pod_only_when_kubernetes_disrupted_it(pod, took):
    assert infrastructure_took(pod) is took


# -- whether the container ran ------------------------------------------------------------------

# Pod phases: https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-phase
CREATING = _pod(
    {
        "phase": "Pending",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": _task({"waiting": {"reason": "ContainerCreating"}}),
    }
)
RUNNING = _pod(
    {
        "phase": "Running",
        "conditions": [{"type": "PodScheduled", "status": "True"}],
        "containerStatuses": _task({"running": {"startedAt": STARTED}}),
    }
)


@pytest.mark.parametrize(
    ("pod", "started"),
    [
        pytest.param(None, False, id="no pod yet"),
        pytest.param(CREATING, False, id="ContainerCreating"),
        pytest.param(RUNNING, True, id="running"),
        pytest.param(TASK_FAILED, True, id="exited"),
        pytest.param(DELETED_WITHOUT_STATUS, False, id="deleted before any status"),
    ],
)
def test_a_pod_started_once_its_container_ran(pod, started):
    assert pod_started(pod) is started


# -- why a pending pod waits --------------------------------------------------------------------


def _waiting(reason: str, message: str) -> dict[str, Any]:
    """A scheduled pod whose container waits for `reason`."""
    return _pod(
        {
            "phase": "Pending",
            "conditions": [
                {"type": "PodReadyToStartContainers", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
                {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"},
                {"type": "PodScheduled", "status": "True"},
            ],
            "containerStatuses": _task({"waiting": {"reason": reason, "message": message}}),
        }
    )


# Image pulls: the container waits with reason ErrImagePull, then ImagePullBackOff whose
# message is the kubelet's `Back-off pulling image "<image>"`
# (https://kubernetes.io/docs/concepts/containers/images/#imagepullbackoff,
# https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#container-state-waiting).
# ErrImagePull's message is containerd's, for a tag Artifact Registry does not have and for
# a node service account it refuses, as GKE users quote it
# (https://oneuptime.com/blog/post/2026-02-17-how-to-fix-imagepullbackoff-errors-in-google-kubernetes-engine-deployments/view,
# https://devopsaitoolkit.com/blog/gcp-error-imagepullbackoff-artifact-registry-forbidden/).
NOT_FOUND = (
    f'rpc error: code = NotFound desc = failed to pull and unpack image "{IMAGE}": '
    f'failed to resolve reference "{IMAGE}": {IMAGE}: not found'
)
FORBIDDEN = (
    f'rpc error: code = Unknown desc = failed to pull and unpack image "{IMAGE}": '
    "failed to resolve reference: pulling from host us-docker.pkg.dev failed with "
    "status code [manifests v7]: 403 Forbidden"
)
BACK_OFF = f'Back-off pulling image "{IMAGE}"'
# A secretKeyRef or configMapKeyRef the kubelet cannot resolve keeps the container from
# starting (https://kubernetes.io/docs/concepts/configuration/secret/#using-secrets-as-environment-variables,
# https://kubernetes.io/docs/concepts/configuration/configmap/#configmaps-and-pods): it waits
# with reason CreateContainerConfigError and the kubelet's lookup error as message.
NO_SECRET = 'secret "kinetic-prefect-api" not found'
NO_KEY = f"couldn't find key api-key in Secret {NAMESPACE}/kinetic-prefect-api"
NO_CONFIGMAP = 'configmap "trainer-config" not found'
# kube-scheduler's verdict on a pod whose nodeSelector no node matches: PodScheduled False,
# reason Unschedulable, the filter's per-node counts and the preemption verdict as message
# (https://kubernetes.io/docs/concepts/scheduling-eviction/assign-pod-node/#nodeselector,
# https://kubernetes.io/docs/concepts/workloads/pods/pod-condition/#lifecycle-pod-conditions;
# a whole status as a user posted it: https://gist.github.com/josephrodriguez/44e11cebfdc40f2a999895ce87d20d23).
NO_NODE_MATCHES = (
    "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. "
    "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
)
UNSCHEDULABLE = _pod(
    {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": NO_NODE_MATCHES,
                "lastProbeTime": None,
                "lastTransitionTime": STARTED,
            }
        ],
    }
)
L4_HINT = (
    "accelerator l4 needs a node with cloud.google.com/gke-accelerator=nvidia-l4 and "
    "nvidia.com/gpu: 1 free; check that a node pool offers it "
    "(kinetic-prefect doctor --accelerator l4)"
)


@pytest.mark.parametrize(
    ("pod", "waits"),
    [
        pytest.param(CREATING, None, id="ContainerCreating: just starting"),
        pytest.param(
            _waiting("ErrImagePull", NOT_FOUND),
            Pending(f"cannot pull image {IMAGE} (ErrImagePull: {NOT_FOUND})"),
            id="ErrImagePull: no such tag",
        ),
        pytest.param(
            _waiting("ErrImagePull", FORBIDDEN),
            Pending(f"cannot pull image {IMAGE} (ErrImagePull: {FORBIDDEN})"),
            id="ErrImagePull: registry refuses the node",
        ),
        pytest.param(
            _waiting("ImagePullBackOff", BACK_OFF),
            Pending(f"cannot pull image {IMAGE} (ImagePullBackOff: {BACK_OFF})"),
            id="ImagePullBackOff",
        ),
        pytest.param(
            _waiting("CreateContainerConfigError", NO_SECRET),
            Pending(f"cannot create the container (CreateContainerConfigError: {NO_SECRET})"),
            id="CreateContainerConfigError: no such Secret",
        ),
        pytest.param(
            _waiting("CreateContainerConfigError", NO_KEY),
            Pending(f"cannot create the container (CreateContainerConfigError: {NO_KEY})"),
            id="CreateContainerConfigError: no such key in the Secret",
        ),
        pytest.param(
            _waiting("CreateContainerConfigError", NO_CONFIGMAP),
            Pending(f"cannot create the container (CreateContainerConfigError: {NO_CONFIGMAP})"),
            id="CreateContainerConfigError: no such ConfigMap",
        ),
        pytest.param(
            UNSCHEDULABLE,
            Pending(f"unschedulable: {NO_NODE_MATCHES} — {L4_HINT}", unschedulable=True),
            id="Unschedulable: no node matches the selector",
        ),
    ],
)
def test_a_pending_pod_says_why_it_waits_and_whether_waiting_helps(pod, waits):
    assert pending(pod, MANIFEST) == waits


@pytest.mark.parametrize(
    ("pod", "reason"),
    [
        pytest.param(CREATING, None, id="ContainerCreating: just starting"),
        pytest.param(
            _waiting("ImagePullBackOff", BACK_OFF),
            f"cannot pull image {IMAGE} (ImagePullBackOff: {BACK_OFF})",
            id="ImagePullBackOff",
        ),
        pytest.param(
            UNSCHEDULABLE,
            f"unschedulable: {NO_NODE_MATCHES} — {L4_HINT}",
            id="Unschedulable: no node matches the selector",
        ),
    ],
)
def test_pending_reason_is_the_reason_alone(pod, reason):
    assert pending_reason(pod, MANIFEST) == reason


# -- why the Job controller cannot create the pod -----------------------------------------------


def _failed_create(message: str, at: str) -> dict[str, Any]:
    """The Job controller's FailedCreate event on the Job: "Error creating: <the refusal>"."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{JOB_NAME}.17f8a2b3c4d5e6f7", "namespace": NAMESPACE},
        "involvedObject": {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": JOB_NAME,
            "namespace": NAMESPACE,
        },
        "reason": "FailedCreate",
        "message": f"Error creating: {message}",
        "source": {"component": "job-controller"},
        "type": "Warning",
        "count": 1,
        "firstTimestamp": at,
        "lastTimestamp": at,
    }


# A namespace's ResourceQuota refusing the pod
# (https://kubernetes.io/docs/concepts/policy/resource-quotas/), and the ServiceAccount
# admission plugin refusing a pod whose service account does not exist, before the pod's
# generateName got its suffix
# (https://kubernetes.io/docs/reference/access-authn-authz/admission-controllers/#serviceaccount).
OVER_QUOTA = (
    f'pods "{POD_NAME}" is forbidden: exceeded quota: gpu-quota, '
    "requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=4, "
    "limited: requests.nvidia.com/gpu=4"
)
NO_ACCOUNT = (
    f'pods "{JOB_NAME}-" is forbidden: error looking up service account '
    f'{NAMESPACE}/kinetic-prefect-pods: serviceaccount "kinetic-prefect-pods" not found'
)
QUOTA_EVENT = _failed_create(OVER_QUOTA, "2026-03-02T09:14:20Z")
ACCOUNT_EVENT = _failed_create(NO_ACCOUNT, "2026-03-02T09:14:10Z")


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        pytest.param([], None, id="no FailedCreate"),
        pytest.param(
            [QUOTA_EVENT],
            f"cannot create the pod: Error creating: {OVER_QUOTA}",
            id="over quota",
        ),
        pytest.param(
            [QUOTA_EVENT, ACCOUNT_EVENT],
            f"cannot create the pod: Error creating: {OVER_QUOTA}",
            id="the latest of two",
        ),
    ],
)
def test_a_failed_create_says_why_the_pod_was_refused(events, reason):
    assert failed_create_reason(events) == reason


@pytest.mark.parametrize(
    ("events", "lasting"),
    [
        pytest.param([QUOTA_EVENT], None, id="over quota: frees as pods end"),
        pytest.param(
            [ACCOUNT_EVENT],
            "cannot create the pod: its service account kinetic-prefect-pods does not exist in "
            f"namespace {NAMESPACE} (Error creating: {NO_ACCOUNT}). Apply "
            "deployments/k8s/rbac.yaml to the namespace (kubectl apply -n ml -f "
            "deployments/k8s/rbac.yaml creates the accounts kinetic-prefect-runner and "
            "kinetic-prefect-pods), or set KineticCluster.service_account to an account that "
            "exists (kubectl get serviceaccounts -n ml)",
            id="no such service account: waiting will not fix it",
        ),
        pytest.param(
            [ACCOUNT_EVENT, QUOTA_EVENT], None, id="the account created since: over quota now"
        ),
    ],
)
def test_only_a_missing_service_account_is_a_failed_create_waiting_will_not_fix(events, lasting):
    assert lasting_failed_create(events) == lasting
