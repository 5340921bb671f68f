"""Admission of the node's environment cache: the emulated profiles' rules, the product's
verdict on a dry-run's answer, and the manifest each profile admits."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kinetic_prefect.backends.gke.admission import dry_run_pod, node_cache_verdict
from kinetic_prefect.launch.environment import ShippedEnvironment
from kinetic_prefect.launch.manifest import (
    CONTAINER_NAME,
    ENV_CACHE_VOLUME,
    UNPACK_CONTAINER_NAME,
    build_job_manifest,
    node_cache_path,
    uses_node_cache,
    without_node_cache,
)
from kinetic_prefect.pod import bootstrap
from kinetic_prefect.runner import record_key
from tests.support.kube_admission import pod_security_refusal, warden_refusal
from tests.unit.test_manifest import _spec

ENVIRONMENT = ShippedEnvironment(key="k" * 64, archive_uri="gs://env/a.tar.gz", sha256="c" * 64)
BASELINE = {"pod-security.kubernetes.io/enforce": "baseline"}


def _pod(volume: dict, read_only: bool) -> dict:
    mount = {"name": "v", "mountPath": "/mnt/v", "readOnly": read_only}
    return {
        "metadata": {"name": "p"},
        "spec": {"volumes": [{"name": "v", **volume}], "containers": [
            {"name": "c", "volumeMounts": [mount]}]},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("volume", "read_only", "refused"),
    [
        ({"hostPath": {"path": "/var/log/app"}}, True, False),
        ({"hostPath": {"path": "/var/log/app"}}, False, True),
        ({"hostPath": {"path": "/var/cache/x"}}, True, True),
        ({"emptyDir": {}}, False, False),
    ],
)
def test_autopilot_admits_only_read_only_hostpaths_under_var_log(
    volume: dict, read_only: bool, refused: bool
) -> None:
    assert (warden_refusal(_pod(volume, read_only)) is not None) == refused


def test_warden_refusal_has_gkes_shape() -> None:
    refusal = warden_refusal(_pod({"hostPath": {"path": "/data"}}, False))

    assert refusal is not None and refusal["code"] == 403
    assert refusal["message"].startswith(
        'admission webhook "warden-validating.common-webhooks.networking.gke.io" denied the '
        "request: GKE Warden rejected the request because it violates one or more constraints. "
        'Violations details: {"[denied by autogke-no-write-mode-hostpath]":['
    )
    assert "hostPath volume v in container c is accessed in write mode" in refusal["message"]


def test_pod_security_baseline_refuses_any_hostpath_in_an_enforcing_namespace() -> None:
    pod = _pod({"hostPath": {"path": "/var/log/app"}}, True)

    refusal = pod_security_refusal(pod, BASELINE)

    assert refusal is not None
    assert refusal["message"] == (
        'pods "p" is forbidden: violates PodSecurity "baseline:latest": hostPath volumes '
        '(volume "v")'
    )
    assert pod_security_refusal(pod, {}) is None
    assert pod_security_refusal(_pod({"emptyDir": {}}, False), BASELINE) is None


@pytest.mark.parametrize(
    ("status", "message", "keep"),
    [
        (None, "", True),
        (403, 'admission webhook "warden..." denied the request: ... hostPath volume ...', False),
        (403, 'pods "p" is forbidden: violates PodSecurity "baseline:latest": hostPath', False),
        (403, 'User "u" cannot create resource "pods" in API group ""', False),
        (403, "error looking up service account ml/x", True),
        (500, "etcd timeout", True),
    ],
)
def test_a_dry_run_refusal_naming_hostpath_or_the_dry_run_itself_drops_the_node_cache(
    status: int | None, message: str, keep: bool
) -> None:
    assert node_cache_verdict(status, message) is keep


def _shipped_manifest(namespace: str = "ml", account: str | None = "kinetic-prefect-pods"):
    spec = _spec(environment=ENVIRONMENT, namespace=namespace, service_account=account)
    return build_job_manifest(spec)


def test_the_task_container_mounts_the_node_cache_read_only_and_only_the_init_container_writes():
    pod_spec = _shipped_manifest()["spec"]["template"]["spec"]
    (task,) = [c for c in pod_spec["containers"] if c["name"] == CONTAINER_NAME]
    (init,) = pod_spec["initContainers"]

    assert init["name"] == UNPACK_CONTAINER_NAME and init["args"][0] == "unpack"
    assert [m.get("readOnly") for m in task["volumeMounts"] if m["name"] == ENV_CACHE_VOLUME] == [
        True
    ]
    assert [m.get("readOnly") for m in init["volumeMounts"]] == [None]


def test_each_namespace_and_service_account_has_its_own_node_cache_directory() -> None:
    paths = {
        node_cache_path("team-a", "kinetic-prefect-pods"),
        node_cache_path("team-b", "kinetic-prefect-pods"),
        node_cache_path("team-a", "other"),
    }
    volumes = _shipped_manifest("team-a")["spec"]["template"]["spec"]["volumes"]

    assert len(paths) == 3
    assert volumes[-1]["hostPath"]["path"] == node_cache_path("team-a", "kinetic-prefect-pods")


def test_without_the_node_cache_the_pod_passes_both_admission_profiles() -> None:
    manifest = _shipped_manifest()
    fallback = without_node_cache(manifest)
    pod = dry_run_pod(fallback)

    assert warden_refusal(dry_run_pod(manifest)) is not None
    assert pod_security_refusal(dry_run_pod(manifest), BASELINE) is not None
    assert uses_node_cache(manifest) and not uses_node_cache(fallback)
    assert warden_refusal(pod) is None and pod_security_refusal(pod, BASELINE) is None


# -- re-verifying the node's copy -------------------------------------------------------------


@pytest.fixture
def archive(tmp_path: Path) -> tuple[Path, str]:
    source = tmp_path / "source"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "__init__.py").write_text("VALUE = 'built'\n")
    packed = tmp_path / "environment.tar.gz"
    sha256, _ = bootstrap.pack(source, packed)
    return packed, sha256


@pytest.fixture
def signing_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bootstrap.SIGNING_KEY_ENV, "record-key")


@pytest.fixture
def node_copy(
    archive: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signing_key: None
) -> Path:
    """The archive unpacked, signed and verified in a node cache, as an init container leaves it."""
    path, sha256 = archive
    monkeypatch.setenv(bootstrap.ENV_CACHE_ENV, str(tmp_path / "node"))
    return bootstrap.verified_environment(str(path), sha256, "key")


def _marker(target: Path) -> dict:
    return json.loads((target / bootstrap.UNPACKED_MARKER).read_text())


def _past_the_recorded_ctimes(target: Path) -> None:
    """Wait until a write on the cache's file system gets a ctime after every recorded one.

    The kernel stamps ctimes from a clock that ticks in steps of a few milliseconds: a
    change within the unpack's own tick would carry the same ctime as the table.
    """
    latest = max(stat[2] for stat in _marker(target)["files"].values())
    probe = target.parent / "ctime-probe"
    deadline = time.monotonic() + 10
    probe.touch()
    while probe.stat().st_ctime_ns <= latest:
        assert time.monotonic() < deadline, "the file system's ctime clock did not advance"
        probe.touch()


def _tamper_keeping_size_and_mtime(path: Path, content: str) -> None:
    before = path.stat()
    path.write_text(content)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_a_file_rewritten_with_its_size_and_mtime_restored_is_caught_by_its_ctime(
    archive: tuple[Path, str], node_copy: Path
) -> None:
    _, sha256 = archive
    planted = node_copy / "pkg" / "__init__.py"
    _past_the_recorded_ctimes(node_copy)
    _tamper_keeping_size_and_mtime(planted, "VALUE = 'plant'\n")

    assert len(planted.read_text()) == len("VALUE = 'built'\n")
    assert bootstrap.cached_copy_problem(node_copy, sha256) == (
        "entries changed since it was unpacked: 1 (first pkg/__init__.py)"
    )


def test_a_refused_copy_is_logged_and_unpacked_again(
    archive: tuple[Path, str], node_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, sha256 = archive
    planted = node_copy / "pkg" / "__init__.py"
    _past_the_recorded_ctimes(node_copy)
    _tamper_keeping_size_and_mtime(planted, "VALUE = 'plant'\n")

    bootstrap.verified_environment(str(path), sha256, "key")

    assert planted.read_text() == "VALUE = 'built'\n"
    assert bootstrap.cached_copy_problem(node_copy, sha256) is None
    assert "is refused (entries changed since it was unpacked: 1" in capsys.readouterr().err


def test_another_archive_of_the_same_environment_leaves_the_copy_pods_run_on_alone(
    node_copy: Path, tmp_path: Path
) -> None:
    # The same environment key built again (another environment store, or a rebuild): its
    # archive differs, and a pod already running on the first copy must keep its files.
    source = tmp_path / "rebuilt"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "__init__.py").write_text("VALUE = 'rebuilt'\n")
    packed = tmp_path / "rebuilt.tar.gz"
    sha256, _ = bootstrap.pack(source, packed)
    first = (node_copy / "pkg" / "__init__.py").stat().st_ino

    second = bootstrap.verified_environment(str(packed), sha256, "key")

    assert second != node_copy
    assert (second / "pkg" / "__init__.py").read_text() == "VALUE = 'rebuilt'\n"
    assert (node_copy / "pkg" / "__init__.py").stat().st_ino == first
    assert (node_copy / "pkg" / "__init__.py").read_text() == "VALUE = 'built'\n"


def test_a_file_added_to_the_node_copy_is_caught(
    archive: tuple[Path, str], node_copy: Path
) -> None:
    _, sha256 = archive
    (node_copy / "pkg" / "sitecustomize.py").write_text("import os\n")

    assert bootstrap.cached_copy_problem(node_copy, sha256) == (
        "entries added since it was unpacked: 1 (first pkg/sitecustomize.py)"
    )


def test_a_file_removed_from_the_node_copy_is_caught(
    archive: tuple[Path, str], node_copy: Path
) -> None:
    _, sha256 = archive
    (node_copy / "pkg" / "__init__.py").unlink()

    assert bootstrap.cached_copy_problem(node_copy, sha256) == (
        "entries removed since it was unpacked: 1 (first pkg/__init__.py)"
    )


def test_a_marker_rewritten_without_the_record_key_is_refused(
    archive: tuple[Path, str], node_copy: Path
) -> None:
    _, sha256 = archive
    (node_copy / "pkg" / "__init__.py").write_text("VALUE = 'planted'\n")
    forged = {"sha256": sha256, "files": bootstrap.stat_table(node_copy), "signature": "0" * 64}
    (node_copy / bootstrap.UNPACKED_MARKER).write_text(json.dumps(forged))

    assert bootstrap.cached_copy_problem(node_copy, sha256) == (
        "its marker is not signed with this runner's node-cache key"
    )


def test_a_copy_unpacked_in_one_flow_run_is_trusted_in_the_next_and_refused_under_another_master(
    archive: tuple[Path, str], node_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # node_copy was unpacked by a flow pod, which holds the master key "record-key".
    _, sha256 = archive
    monkeypatch.setenv(bootstrap.SIGNING_KEY_ENV, record_key.flow_run_key("record-key", "run-2"))
    monkeypatch.setenv(bootstrap.NODE_CACHE_KEY_ENV, record_key.node_cache_key("record-key"))
    assert bootstrap.cached_copy_problem(node_copy, sha256) is None

    monkeypatch.setenv(bootstrap.NODE_CACHE_KEY_ENV, record_key.node_cache_key("another"))
    assert bootstrap.cached_copy_problem(node_copy, sha256) == (
        "its marker is not signed with this runner's node-cache key"
    )


@pytest.mark.usefixtures("signing_key")
def test_what_a_pod_of_namespace_a_plants_in_its_cache_never_reaches_namespace_b(
    archive: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sha256 = archive
    node = tmp_path / "node"
    caches = {ns: node / node_cache_path(ns, "kinetic-prefect-pods").lstrip("/") for ns in "ab"}
    monkeypatch.setenv(bootstrap.ENV_CACHE_ENV, str(caches["a"]))
    in_a = bootstrap.verified_environment(str(path), sha256, "key")
    (in_a / "pkg" / "__init__.py").write_text("VALUE = 'planted'\n")

    monkeypatch.setenv(bootstrap.ENV_CACHE_ENV, str(caches["b"]))
    in_b = bootstrap.verified_environment(str(path), sha256, "key")

    assert (in_b / "pkg" / "__init__.py").read_text() == "VALUE = 'built'\n"
