"""Shipped environments on the emulated cluster: built by a builder Job, verified in the pod."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from prefect import flow, task

from kinetic_prefect import KineticTaskRunner
from kinetic_prefect.backends import environments
from kinetic_prefect.errors import EnvironmentBuildError
from kinetic_prefect.launch.accelerators import parse_accelerator
from kinetic_prefect.launch.environment import (
    ENV_SPEC_FILE,
    Environments,
    plan_environment,
)
from kinetic_prefect.launch.manifest import (
    ENV_CACHE_VOLUME,
    UNPACK_CONTAINER_NAME,
    node_cache_path,
)
from kinetic_prefect.pod import bootstrap
from tests.support.clusters import SHIPPED_REQUIREMENTS
from tests.support.gcs import FaultInjectingProxy
from tests.support.kube import NAMESPACE
from tests.support.kube_admission import AUTOPILOT
from tests.support.metadata_server import MetadataServer
from tests.support.thin_environment import publish_thin_environment

REPO = Path(__file__).resolve().parents[2]

if TYPE_CHECKING:
    from tests.support.kube import KubeCluster

pytestmark = pytest.mark.usefixtures("prefect_api", "workdir")


@task
def shipped_versions(x: int) -> tuple[int, str, str]:
    import inflection
    import jax.numpy as jnp

    return int(jnp.square(x)), inflection.__version__, jnp.__name__


def _runner(gke: str, **options: object) -> KineticTaskRunner:
    return KineticTaskRunner(cluster=gke, allow_loopback_api=True, **options)


def _manifest(gcs: object, prefix: str) -> dict[str, object]:
    blobs = [b for b in gcs.names("env-cache/") if b.endswith("/manifest.json")]  # type: ignore[attr-defined]
    assert len(blobs) == 1, blobs
    blob = gcs.client.bucket(gcs.name).blob(blobs[0])  # type: ignore[attr-defined]
    return json.loads(blob.download_as_bytes())


def test_a_sweep_importing_jax_and_a_shipped_package_completes_on_the_default_image(
    gke: str, cluster: KubeCluster
) -> None:
    @flow(task_runner=_runner(gke))
    def sweep() -> list[tuple[int, str, str]]:
        return [f.result() for f in shipped_versions.map([1, 2, 3])]

    assert sweep() == [
        (1, "0.5.1", "jax.numpy"),
        (4, "0.5.1", "jax.numpy"),
        (9, "0.5.1", "jax.numpy"),
    ]
    for job in cluster.created_jobs():
        container = job["spec"]["template"]["spec"]["containers"][0]
        assert container["image"].startswith("python:3.") and container["image"].endswith("-slim")
        assert container["command"][:2] == ["python", "-c"]


def test_a_sweep_completes_when_the_metadata_server_is_slow_to_answer_new_pods(
    gke: str, cluster: KubeCluster
) -> None:
    @flow(task_runner=_runner(gke))
    def sweep() -> list[tuple[int, str, str]]:
        return [f.result() for f in shipped_versions.map([1, 2])]

    with MetadataServer("emulator-project", new_pod_seconds=2.0) as metadata:
        cluster.kubelet.metadata = metadata
        assert sweep() == [(1, "0.5.1", "jax.numpy"), (4, "0.5.1", "jax.numpy")]

    pods = {pod for pod, _, _ in metadata.requests}
    assert len(pods) == len(cluster.created_jobs()) == 2
    for pod in pods:
        statuses = metadata.token_requests(pod)
        assert statuses[0] == "refused" and 200 in statuses, (pod, statuses)


# The builder Job installs a whole environment in a bare interpreter: 4 to 5 minutes on 2
# cores with the rest of the suite running (the suite's 900 s backstop applies).
@pytest.mark.slow
def test_a_new_environment_is_built_by_a_builder_job_under_its_plans_key_with_every_pin_packed(
    gke: str,
    cluster: KubeCluster,
    gcs: object,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The builder Job installs from the package index with uv, as on a cluster.

    The node's uv cache is this machine's (`UV_CACHE_DIR` in the pods' env), so the
    wheels are not downloaded again; what it installs and packs is the builder's own work.
    """
    monkeypatch.setattr(environments, "ENVIRONMENTS", Environments())
    # A node of its own: the shared test node holds the suite's thin environment under the
    # same key, which pods of other cases may be running on.
    cluster.kubelet.node_root = tmp_path / "node"
    uv_cache = os.environ.get("UV_CACHE_DIR") or str(Path.home() / ".cache" / "uv")
    # This machine reaches the package index through a proxy whose CA only its own
    # trust store has: the builder pod is told to trust it, as an image would be.
    trust = {k: os.environ[k] for k in ("SSL_CERT_FILE", "PIP_CERT") if k in os.environ}

    @flow(
        task_runner=_runner(
            gke,
            environment_builder="cluster",
            environment_store=gcs.uri,  # type: ignore[attr-defined]
            env={**gcs.pod_env, **trust, "UV_CACHE_DIR": uv_cache},  # type: ignore[attr-defined]
        )
    )
    def built_on_the_cluster() -> tuple[int, str, str]:
        return shipped_versions.submit(3).result()

    assert built_on_the_cluster() == (9, "0.5.1", "jax.numpy")
    builders = [j for j in cluster.created_jobs() if j["metadata"]["name"].startswith("kp-env-")]
    assert len(builders) == 1
    on_cluster = _manifest(gcs, "env-cache/")
    assert on_cluster["built_by"] == "builder Job"

    plan = plan_environment(REPO, parse_accelerator("cpu"), str(SHIPPED_REQUIREMENTS))
    assert (on_cluster["key"], on_cluster["pins"]) == (plan.key, list(plan.pins))
    # What the Job packed, read from the archive it uploaded rather than from its manifest:
    # the digest, the entry count, and exactly the dist-infos of the plan's pins and wheels.
    key = on_cluster["key"]
    archive = tmp_path / "built-by-the-job.tar.gz"
    bucket = gcs.client.bucket(gcs.name)  # type: ignore[attr-defined]
    bucket.blob(f"env-cache/{key}/environment.tar.gz").download_to_filename(archive)
    assert hashlib.sha256(archive.read_bytes()).hexdigest() == on_cluster["sha256"]
    with tarfile.open(archive) as packed:
        entries = [m.name.removeprefix("./") for m in packed.getmembers()]
    entries = [name for name in entries if name not in ("", ".")]
    assert len(entries) == on_cluster["files"]
    installed = {
        _normalized(name.removesuffix(".dist-info"))
        for name in entries
        if "/" not in name and name.endswith(".dist-info")
    }
    wheels = {_normalized("-".join(w.name.split("-")[:2])) for w in plan.wheels}
    assert installed == {_normalized(pin.replace("==", "-")) for pin in plan.pins} | wheels
    # The builder pod shares this machine's temporary directory: its 1-2 GB of scratch
    # space must be gone once it uploaded the archive.
    scratch = Path(tempfile.gettempdir()).glob(f"kinetic-env-*/env/{ENV_SPEC_FILE}")
    assert [p for p in scratch if json.loads(p.read_text())["key"] == key] == []


def _normalized(dist: str) -> str:
    """A distribution's `name-version`, compared as wheel names are (case, `-`, `_`, `.`)."""
    name, _, version = dist.rpartition("-")
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}"


def test_an_archive_changed_after_upload_is_refused_in_the_pod(
    gke: str, cluster: KubeCluster, gcs: object, tmp_path: Path
) -> None:
    from kinetic_prefect.common.gcs import GcsStore

    # A store of its own holding the suite's environment, whose archive is then replaced.
    plan = plan_environment(REPO, parse_accelerator("cpu"), str(SHIPPED_REQUIREMENTS), extras=())
    shipped = publish_thin_environment(plan, GcsStore(gcs.uri))  # type: ignore[attr-defined]
    archive = shipped.archive_uri.removeprefix(f"gs://{gcs.name}/")  # type: ignore[attr-defined]
    bucket = gcs.client.bucket(gcs.name)  # type: ignore[attr-defined]
    bucket.blob(archive).upload_from_string(b"not the environment that was built")
    # A node that has not unpacked the environment yet must download and check it.
    cluster.kubelet.node_root = tmp_path / "fresh-node"

    @flow(task_runner=_runner(gke, environment_store=gcs.uri))  # type: ignore[attr-defined]
    def once() -> tuple[int, str, str]:
        return shipped_versions.submit(2).result()

    with pytest.raises(
        Exception, match="Failed during environment: .* changed after it was uploaded"
    ):
        once()
    assert not list((tmp_path / "fresh-node").rglob("*.py")), "nothing of it may be unpacked"


@task
def never_runs() -> None:
    raise AssertionError("no pod may start")


def test_an_unresolvable_requirement_fails_before_any_pod_starts_naming_it(
    gke: str, cluster: KubeCluster
) -> None:
    @flow(task_runner=_runner(gke, requirements=["kinetic-prefect-no-such-package==9.9.9"]))
    def unresolvable() -> None:
        never_runs.submit().result()

    with pytest.raises(EnvironmentBuildError, match="kinetic-prefect-no-such-package"):
        unresolvable()
    assert cluster.created_jobs() == []


def test_a_dependency_from_a_local_path_outside_the_project_says_how_to_ship_it(
    gke: str, cluster: KubeCluster, tmp_path: Path
) -> None:
    outside = tmp_path / "outside" / "mylib"
    outside.mkdir(parents=True)
    (outside / "pyproject.toml").write_text(
        '[project]\nname = "mylib"\nversion = "0.1"\n[build-system]\n'
        'requires = ["hatchling"]\nbuild-backend = "hatchling.build"\n'
    )
    (outside / "mylib").mkdir()
    (outside / "mylib" / "__init__.py").write_text("")

    @flow(task_runner=_runner(gke, requirements=[f"mylib @ file://{outside}"]))
    def from_a_path() -> None:
        never_runs.submit().result()

    with pytest.raises(EnvironmentBuildError, match="outside the project.*Publish it"):
        from_a_path()
    assert cluster.created_jobs() == []


@task
def squared(x: int) -> int:
    return x * x


def _env_cache_volumes(cluster: KubeCluster) -> list[dict[str, object]]:
    return [
        v
        for job in cluster.created_jobs()
        if not job["metadata"]["name"].startswith("kp-env-")
        for v in job["spec"]["template"]["spec"].get("volumes", [])
        if v["name"] == ENV_CACHE_VOLUME
    ]


def test_a_default_sweep_completes_under_autopilots_warden_admission(
    gke: str, cluster: KubeCluster
) -> None:
    cluster.call(lambda: setattr(cluster.emulator, "admission", AUTOPILOT))

    @flow(task_runner=_runner(gke))
    def sweep() -> list[int]:
        return [f.result() for f in squared.map([2, 3])]

    assert sweep() == [4, 9]
    assert [v.get("emptyDir") for v in _env_cache_volumes(cluster)] == [{}, {}]


def test_a_default_sweep_completes_in_a_namespace_enforcing_pod_security_baseline(
    gke: str, cluster: KubeCluster
) -> None:
    labels = {NAMESPACE: {"pod-security.kubernetes.io/enforce": "baseline"}}
    cluster.call(lambda: cluster.emulator.namespace_labels.update(labels))

    @flow(task_runner=_runner(gke))
    def sweep() -> list[int]:
        return [f.result() for f in squared.map([2, 3])]

    assert sweep() == [4, 9]
    assert [v.get("emptyDir") for v in _env_cache_volumes(cluster)] == [{}, {}]


def test_where_hostpath_is_admitted_the_task_reads_the_node_cache_read_only(
    gke: str, cluster: KubeCluster
) -> None:
    @flow(task_runner=_runner(gke))
    def once() -> int:
        return squared.submit(4).result()

    assert once() == 16
    (job,) = [j for j in cluster.created_jobs() if not j["metadata"]["name"].startswith("kp-env-")]
    pod_spec = job["spec"]["template"]["spec"]
    mounts = [m for m in pod_spec["containers"][0]["volumeMounts"] if m["name"] == ENV_CACHE_VOLUME]
    assert [m.get("readOnly") for m in mounts] == [True]
    assert [c["name"] for c in pod_spec["initContainers"]] == [UNPACK_CONTAINER_NAME]
    assert [v["hostPath"]["path"] for v in _env_cache_volumes(cluster)] == [
        node_cache_path(NAMESPACE, pod_spec.get("serviceAccountName"))
    ]


def test_the_next_flow_run_reuses_the_environment_an_earlier_one_unpacked_and_stale_ones_go(
    gke: str, cluster: KubeCluster, tmp_path: Path
) -> None:
    # A node of this test's own, so no other case's pods touch its cache meanwhile.
    cluster.kubelet.node_root = tmp_path / "node"
    # An environment an earlier pod left there: 100 GB (a sparse file), past the 20 GB cap.
    cache = tmp_path / "node" / node_cache_path(NAMESPACE, "kinetic-prefect-pods").lstrip("/")
    stale = cache / ("0" * 64)
    stale.mkdir(parents=True)
    with open(stale / "weights.bin", "wb") as weights:
        weights.truncate(100 * 10**9)
    (stale / bootstrap.UNPACKED_MARKER).write_text("{}")

    @flow(task_runner=_runner(gke))
    def once(x: int) -> int:
        return squared.submit(x).result()

    def unpacked() -> dict[Path, tuple[int, int]]:
        markers = (tmp_path / "node").rglob(bootstrap.UNPACKED_MARKER)
        return {m.parent: (m.parent.stat().st_ino, m.stat().st_ino) for m in markers}

    assert once(3) == 9
    first = unpacked()
    assert once(5) == 25  # another flow run: its pods hold another record key

    assert len(first) == 1 and stale not in first
    assert unpacked() == first  # neither unpacked again nor its marker rewritten
    assert not stale.exists()  # pruned by the first pod's init container


def test_an_environment_download_reset_mid_body_resumes_and_the_task_runs(
    gke: str, cluster: KubeCluster, gcs: object, tmp_path: Path
) -> None:
    from kinetic_prefect.common.gcs import GcsStore

    # An archive of a few reads (4 MiB), in a store of this test's own; a node of its own,
    # so the pod downloads it; a proxy in front of GCS resets the first object download
    # (the archive) after 1.5 MiB of its body.
    reset_after = 3 << 19
    plan = plan_environment(REPO, parse_accelerator("cpu"), str(SHIPPED_REQUIREMENTS), extras=())
    shipped = publish_thin_environment(plan, GcsStore(gcs.uri), ballast=4 << 20)  # type: ignore[attr-defined]
    assert shipped.size > 2 * reset_after
    cluster.kubelet.node_root = tmp_path / "node"
    fronts: dict[str, FaultInjectingProxy] = {}

    def front(address: str) -> str:
        if address not in fronts:
            fronts[address] = FaultInjectingProxy(address, every=None, reset_after=reset_after)
            fronts[address].__enter__()
        return fronts[address].url

    cluster.kubelet.gcs_front = front

    @flow(task_runner=_runner(gke, environment_store=gcs.uri))  # type: ignore[attr-defined]
    def once() -> int:
        return squared.submit(6).result()

    try:
        assert once() == 36
    finally:
        for proxy in fronts.values():
            proxy.__exit__(None, None, None)

    (proxy,) = fronts.values()
    assert proxy.resets == 1
    resumed = [r for r in proxy.ranges if r]
    assert resumed and 0 < int(resumed[0].removeprefix("bytes=").partition("-")[0]) <= reset_after
