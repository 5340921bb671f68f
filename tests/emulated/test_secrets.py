"""No secret or server state leaves the orchestrator; nothing from the bucket is trusted blindly."""

from __future__ import annotations

import hashlib
import json
import secrets
from pathlib import Path

import cloudpickle
import pytest
from prefect import flow, task
from prefect.blocks.system import Secret
from prefect.settings import (
    PREFECT_API_KEY,
    PREFECT_LOGGING_LEVEL,
    temporary_settings,
)

from kinetic_prefect.backends.base import PodExit
from kinetic_prefect.common.layout import FINAL_STATE_PICKLE
from kinetic_prefect.common.records import FINAL_STATE_JSON, FinalRecord
from kinetic_prefect.common.storage import JobsStore, open_store
from kinetic_prefect.errors import TamperedRecordError
from kinetic_prefect.launch.pod_secrets import PodSecrets
from kinetic_prefect.launch.pod_settings import pod_settings_env, secret_setting_paths
from kinetic_prefect.runner.attempt_end import read_attempt_end
from tests.emulated.test_kubernetes_backend import _runner
from tests.support.leaks import canary_settings, leaks, scanned_artifacts

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")

KNOWN = canary_settings()
USER_SECRET = secrets.token_hex(12)


@task
def secret_digests() -> dict[str, str | None]:
    import os

    def digest(name: str) -> str | None:
        value = os.environ.get(name)
        return hashlib.sha256(value.encode()).hexdigest() if value else None

    return {
        "user": digest("TRAINING_TOKEN"),
        "api_key": digest("PREFECT_API_KEY"),
        "server_auth": digest("PREFECT_SERVER_API_AUTH_STRING"),
        "db_password": digest("PREFECT_SERVER_DATABASE_PASSWORD"),
    }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_pods_get_only_the_allowlisted_prefect_settings():
    with temporary_settings({**KNOWN, PREFECT_LOGGING_LEVEL: "DEBUG"}):
        env = pod_settings_env("http://prefect.example:4200/api")

    assert sorted(env) == [
        "KINETIC_SECRET_SETTING_PATHS",
        "PREFECT_API_SSL_CERT_FILE",  # set by tests/conftest.py
        "PREFECT_API_URL",
        "PREFECT_CLIENT_MAX_RETRIES",  # set by tests/conftest.py
        "PREFECT_LOGGING_LEVEL",
        "PREFECT_LOGGING_TO_API_BATCH_INTERVAL",  # set by tests/conftest.py
    ]
    assert json.loads(env["KINETIC_SECRET_SETTING_PATHS"]) == {
        "PREFECT_API_AUTH_STRING": ["api", "auth_string"],
        "PREFECT_API_KEY": ["api", "key"],
    }


def test_every_secret_setting_of_prefects_model_is_known_as_secret():
    assert {
        "PREFECT_API_KEY",
        "PREFECT_API_AUTH_STRING",
        "PREFECT_SERVER_API_AUTH_STRING",
        "PREFECT_SERVER_DATABASE_PASSWORD",
    } <= set(secret_setting_paths())


def test_secrets_with_different_values_live_in_differently_named_kubernetes_secrets():
    first = PodSecrets({"PREFECT_API_KEY": "key-one"})
    second = PodSecrets({"PREFECT_API_KEY": "key-two"})

    assert first.secret_name != second.secret_name
    assert first.secret_name == PodSecrets({"PREFECT_API_KEY": "key-one"}).secret_name
    assert [ref.secret_name for ref in first.refs()] == [first.secret_name]


def test_no_secret_reaches_a_manifest_payload_handle_or_archive_yet_pods_get_theirs(
    gke, cluster, gcs
):
    Secret(value=USER_SECRET).save("training-token", overwrite=True)
    runner = _runner(gke, env={"TRAINING_TOKEN": Secret.load("training-token")})

    @flow(task_runner=runner)
    def run() -> dict[str, str | None]:
        return secret_digests.submit().result()

    with temporary_settings(KNOWN):
        seen = run()

    assert seen == {
        "user": _sha(USER_SECRET),
        "api_key": _sha(KNOWN[PREFECT_API_KEY]),
        "server_auth": None,
        "db_password": None,
    }
    artifacts = scanned_artifacts(cluster, gcs)
    assert any(name.endswith("payload.pkl") for name in artifacts)
    assert leaks([*KNOWN.values(), USER_SECRET], artifacts) == []


VICTIM = "kp-victim-0001"


def _signed_attempt(store: JobsStore, key: str, state_bytes: bytes) -> None:
    """As a pod leaves it: the record, and a large state beside it."""
    record = FinalRecord(status="finished", state_type="COMPLETED")
    if not record.carry_state(state_bytes):
        store.put_bytes(f"kinetic/{VICTIM}/{FINAL_STATE_PICKLE}", state_bytes)
    record.sign(key)
    store.put_bytes(f"kinetic/{VICTIM}/{FINAL_STATE_JSON}", record.encode())


class _WritesMarkerWhenUnpickled:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path(self.marker).write_text, ("unpickled",))


@pytest.fixture(params=["local", "gcs"])
def jobs_store(request: pytest.FixtureRequest, workdir: Path) -> JobsStore:
    """The jobs store a pod wrote its record to: a local directory or a GCS bucket."""
    if request.param == "local":
        return open_store(str(workdir / "jobs"))
    return open_store(request.getfixturevalue("gcs").uri)


def _assert_refused_unread(store: JobsStore, marker: Path) -> None:
    end = read_attempt_end(store, VICTIM, PodExit(VICTIM, 0), "runner-key")

    assert end.state.is_failed()
    assert "was altered after the pod wrote it" in (end.state.message or "")
    assert isinstance(end.state.data, TamperedRecordError)
    assert not marker.exists()


def test_a_final_state_pickle_rewritten_after_the_pod_signed_it_is_never_unpickled(
    jobs_store: JobsStore, workdir: Path
):
    from prefect.states import Completed

    _signed_attempt(jobs_store, "runner-key", cloudpickle.dumps({"state": Completed(data=1)}))
    marker = workdir / "unpickled"
    key = f"kinetic/{VICTIM}/{FINAL_STATE_JSON}"
    record = FinalRecord.decode(jobs_store.get_bytes(key), key)
    record.carry_state(cloudpickle.dumps({"state": _WritesMarkerWhenUnpickled(str(marker))}))
    jobs_store.put_bytes(key, record.encode())

    _assert_refused_unread(jobs_store, marker)


def test_a_large_final_state_is_read_from_beside_its_record_and_refused_once_replaced(
    jobs_store: JobsStore, workdir: Path
):
    from prefect.states import Completed

    from kinetic_prefect.common.records import INLINE_STATE_BYTES

    large = b"x" * (INLINE_STATE_BYTES + 1)
    _signed_attempt(jobs_store, "runner-key", cloudpickle.dumps({"state": Completed(data=large)}))
    end = read_attempt_end(jobs_store, VICTIM, PodExit(VICTIM, 0), "runner-key")
    assert end.state.is_completed() and end.state.data == large
    record = FinalRecord.decode(jobs_store.get_bytes(f"kinetic/{VICTIM}/{FINAL_STATE_JSON}"), "")
    assert record.state_pickle is None and record.state_sha256 is not None

    # Gone (a cleanup, a lifecycle rule): said so, not taken for tampering.
    jobs_store.delete_prefix(f"kinetic/{VICTIM}/{FINAL_STATE_PICKLE}")
    gone = read_attempt_end(jobs_store, VICTIM, PodExit(VICTIM, 0), "runner-key").state
    assert gone.is_failed() and "is gone" in (gone.message or "")
    assert "altered" not in (gone.message or "")

    marker = workdir / "unpickled"
    evil = cloudpickle.dumps({"state": _WritesMarkerWhenUnpickled(str(marker)), "pad": large})
    jobs_store.put_bytes(f"kinetic/{VICTIM}/{FINAL_STATE_PICKLE}", evil)

    _assert_refused_unread(jobs_store, marker)


def test_a_final_state_signed_with_another_key_is_never_unpickled(
    jobs_store: JobsStore, workdir: Path
):
    marker = workdir / "unpickled"
    evil = cloudpickle.dumps({"state": _WritesMarkerWhenUnpickled(str(marker))})
    _signed_attempt(jobs_store, "someone-elses-key", evil)

    _assert_refused_unread(jobs_store, marker)


@task
def api_key_digest() -> str:
    import os

    return hashlib.sha256(os.environ["PREFECT_API_KEY"].encode()).hexdigest()


def _run_with_key(gke: str, key: str, results: dict[str, str]) -> None:
    @flow(task_runner=_runner(gke))
    def run() -> str:
        return api_key_digest.submit().result()

    with temporary_settings({PREFECT_API_KEY: key}):
        results[key] = run()


def test_two_runners_with_different_api_keys_in_one_namespace_each_give_pods_their_own(
    gke, cluster
):
    import threading

    keys = [f"pnu_{secrets.token_hex(12)}" for _ in range(2)]
    results: dict[str, str] = {}
    threads = [threading.Thread(target=_run_with_key, args=(gke, k, results)) for k in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)

    assert results == {key: _sha(key) for key in keys}
    secret_requests = [r for r in cluster.client_requests() if r.resource.plural == "secrets"]
    # Never read; patched only to add the Jobs that own it.
    assert sorted({r.method for r in secret_requests}) == ["DELETE", "PATCH", "POST"]
    patches = [json.loads(r.body) for r in secret_requests if r.method == "PATCH"]
    assert all(
        list(p) == ["metadata"] and list(p["metadata"]) == ["ownerReferences"] for p in patches
    )
    created = {
        json.loads(r.body)["metadata"]["name"] for r in secret_requests if r.method == "POST"
    }
    assert len(created) == 2
    assert [cluster.secret("default", name) for name in created] == [None, None]


def test_a_pod_whose_secret_is_not_there_yet_waits_and_runs_once_it_is(cluster):
    """As a kubelet retries a pod whose Secret it could not fetch (the test kubelet's rule,
    docs/testing.md): the gke backend relies on it when a Secret collected with the last
    Job that owned it is created again for the next one."""
    import base64

    from tests.support.waiting import wait_until

    name = "waits-for-its-secret"
    cluster.kubelet.faults_by_job[name] = "hang"
    env = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "comes-later", "key": "t"}}}]
    pod_spec = {
        "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "busybox", "env": env}],
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"template": {"metadata": {"labels": {"app": "waits"}}, "spec": pod_spec}},
    }
    cluster.create("/apis/batch/v1/namespaces/default/jobs", job)

    def state() -> tuple[str | None, str | None]:
        (pod,) = cluster.pods() or [{}]
        status = pod.get("status") or {}
        waiting = ((status.get("containerStatuses") or [{}])[0].get("state") or {}).get("waiting")
        return status.get("phase"), (waiting or {}).get("reason")

    wait_until(
        lambda: state()[1] == "CreateContainerConfigError", 30, "the pod to wait for its Secret"
    )
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "comes-later"},
        "data": {"t": base64.b64encode(b"token").decode()},
    }
    cluster.create("/api/v1/namespaces/default/secrets", secret)
    wait_until(lambda: state()[0] == "Running", 30, "the pod to run once its Secret exists")
