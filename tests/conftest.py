"""Shared fixtures: a real Prefect API, an isolated working directory, manifest checks."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.3")
# One master record key for every worker of the run, as one deployment has (each worker's
# Prefect home would otherwise make its own): the node cache's markers are signed with a key
# derived from it, and pods of one worker would refuse, and unpack again, what another's
# unpacked on the shared test node.
os.environ.setdefault("KINETIC_RECORD_KEY", "kinetic-prefect test suite master record key")
# Prefect clients of this process and the processes it starts (tests/support/prefect_ca.py).
from tests.support.prefect_ca import one_certificate_ca_file  # noqa: E402

os.environ.setdefault("PREFECT_API_SSL_CERT_FILE", one_certificate_ca_file())
# The session's Prefect servers (`prefect_api`) start from this process's environment:
# without the parts no test uses, nor the scheduler, since no case here waits on a
# deployment's schedule there (the worker tests' server keeps it). Idle, a server used
# 1.7 CPU-s a minute with them and 1.3 without (measured here, Prefect 3.9).
from tests.support.prefect_server import UNUSED_SERVER_PARTS  # noqa: E402

os.environ.update(
    {
        name: os.environ.get(name, value)
        for name, value in {
            **UNUSED_SERVER_PARTS,
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
        }.items()
    }
)
# The suite's intervals (docs/intervals.md's last column): this process, the flow processes
# and workers it starts, and through their manifests every pod, wait this long.
os.environ["KINETIC_INTERVALS"] = json.dumps(
    {
        "settle_margin_seconds": 10,
        "pod_gone_settle_seconds": 2,
        "events_probe_seconds": 3,
        "events_probe_interval_seconds": 5,
        "queue_poll_seconds": 2,
        "missing_queue_grace_seconds": 4,
        "flow_run_look_seconds": 3,
        "watchdog_look_seconds": 3,
    }
)

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import kubernetes_validate.utils
import pytest

from kinetic_prefect.backends.local.backend import LocalBackend
from tests.support.gcs_iam import IamProxy
from tests.support.kube import KubeCluster, running_cluster
from tests.support.prefect_server import migrated_database
from tests.support.scheduling import SuiteScheduling, is_xdist_worker, slow_first
from tests.support.scratch import end_scratch, use_scratch

# kubernetes-validate reads and decodes its JSON schemas (_definitions.json alone is several
# MB) on every call; the schemas never change, so each is decoded once per process.
_schemas = kubernetes_validate.utils
_schemas.schema_contents = functools.cache(_schemas.schema_contents)


SUITE_INTERVALS: dict[str, float] = json.loads(os.environ["KINETIC_INTERVALS"])


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Scratch in RAM where there is room (tests/support/scratch.py): before pytest's own
    temporary-directory plugin reads `--basetemp`, and before any worker starts."""
    if not is_xdist_worker(config):
        use_scratch(config)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not is_xdist_worker(session.config):
        end_scratch(session.config, exitstatus)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the item, so a fixture's teardown knows the case failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def failed(request: pytest.FixtureRequest) -> bool:
    """Whether the case failed in its setup or its call (read in a fixture's teardown)."""
    return any(
        getattr(getattr(request.node, f"report_{when}", None), "failed", False)
        for when in ("setup", "call")
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    if not is_xdist_worker(session.config):  # once a run, before any worker starts
        from tests.support.cache_prune import prune_environment_caches

        prune_environment_caches()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist, the longest cases first (tests/support/scheduling.py).

    The workers collect and the controller hands out their order; a worker runs with
    `dist` set to "no" (xdist's remote.py), so it is known by its `workerinput`.
    """
    if is_xdist_worker(config):
        slow_first(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N` or `--dist loadgroup` (as `make test` runs): see tests/support/scheduling.py."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    return SuiteScheduling(config, log)


@pytest.fixture(scope="session")
def prefect_database(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A migrated, empty Prefect database that every test server starts from a copy of.

    Kept in pytest's cache directory per Prefect version, so a run (and its xdist
    workers) migrates one database at most; without the cache (`-p no:cacheprovider`),
    in the run's temporary directory.
    """
    import prefect

    name = f"prefect-database-{prefect.__version__}"
    cache = getattr(pytestconfig, "cache", None)
    if cache is None:
        return migrated_database(tmp_path_factory.getbasetemp() / name)
    return migrated_database(cache.mkdir(name))


@pytest.fixture(scope="session")
def prefect_api(prefect_database: Path) -> Iterator[str]:
    """A real Prefect API server (SQLite) for the whole session: Prefect's test harness."""
    import shutil
    import tempfile

    from prefect.settings import (
        PREFECT_CLIENT_MAX_RETRIES,
        get_current_settings,
        temporary_settings,
    )
    from prefect.testing import utilities

    def seeded_directory() -> str:
        # The harness puts its database in a new `mkdtemp()` directory; this one already
        # holds a migrated copy, so the server skips the migrations at start-up.
        directory = tempfile.mkdtemp()
        shutil.copyfile(prefect_database, Path(directory, "prefect-test.db"))
        return directory

    # The server answers 503 while SQLite is busy, and Prefect's clients retry that five
    # times: twenty flows starting at once beside the rest of the suite on 2 cores used
    # them all. The harness makes the settings it starts in the process's own.
    retries = temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 10})
    retries.__enter__()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(utilities, "mkdtemp", seeded_directory)
        harness = utilities.prefect_test_harness(server_startup_timeout=120)
        harness.__enter__()
    try:
        yield str(get_current_settings().api.url)
    finally:
        harness.__exit__(None, None, None)
        retries.__exit__(None, None, None)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a fresh directory so `.kinetic/` artifacts and outputs stay per test."""
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.startswith("KINETIC_") and name != "KINETIC_INTERVALS":
            monkeypatch.delenv(name)
    return tmp_path


@pytest.fixture
def launched_manifests(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Every manifest the local backend launches in the test, validated afterwards."""
    seen: list[dict[str, Any]] = []
    original = LocalBackend.launch

    def recording_launch(
        self: LocalBackend, manifest: dict[str, Any], *args: Any, **kw: Any
    ) -> None:
        seen.append(manifest)
        original(self, manifest, *args, **kw)

    monkeypatch.setattr(LocalBackend, "launch", recording_launch)
    yield seen
    for manifest in seen:
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[str]:
    """One fake-gcs-server for the session (buckets are per test)."""
    from tests.support.gcs import fake_gcs_server

    with fake_gcs_server() as url:
        yield url


@pytest.fixture
def gcs_endpoint(gcs_server: str) -> str:
    """The endpoint GCS clients use in a test (a fault proxy overrides this)."""
    return gcs_server


# One bucket per GCS server for shipped environments: the suite's one environment is
# uploaded once per server, not once per test bucket (`environment_store`).
ENVIRONMENTS_BUCKET = "kp-environments"


@pytest.fixture(scope="session")
def suite_environment(gcs_server: str, shipped_requirements: Path) -> str:
    """The suite's one shipped environment, in this GCS server's environments bucket.

    The thin stand-in for the environment the suite's tasks plan
    (tests/support/thin_environment.py), uploaded before the first gke test; the
    tests still go through the same lookup, and every pod still downloads, checks
    and unpacks it, or finds and verifies it on its node.
    """
    with pytest.MonkeyPatch.context() as patch:
        return upload_suite_environment(gcs_server, shipped_requirements, patch.setenv)


def upload_suite_environment(
    gcs_server: str, requirements: Path, setenv: Callable[[str, str], None]
) -> str:
    """Upload the thin environment of `requirements`' plan, as an administrator."""
    from google.api_core.exceptions import Conflict

    from kinetic_prefect.backends.environments import ENVIRONMENTS
    from kinetic_prefect.common import gcs as kgcs
    from kinetic_prefect.launch.accelerators import parse_accelerator
    from tests.support.thin_environment import publish_thin_environment

    setenv("STORAGE_EMULATOR_HOST", gcs_server)
    kgcs._clients.clear()
    with contextlib.suppress(Conflict):
        kgcs.storage_client().create_bucket(ENVIRONMENTS_BUCKET)
    plan = ENVIRONMENTS.plan(
        Path(__file__).resolve().parents[1],
        parse_accelerator("cpu"),
        requirements=str(requirements),
        extras=(),
    )
    publish_thin_environment(plan, kgcs.GcsStore(f"gs://{ENVIRONMENTS_BUCKET}"))
    kgcs._clients.clear()
    return f"gs://{ENVIRONMENTS_BUCKET}"


@pytest.fixture
def gcs_iam(gcs_server: str, gcs_endpoint: str) -> Iterator[IamProxy]:
    """GCS as strict as Cloud IAM for this test (tests/support/gcs_iam.py).

    Every client of the test reaches `gcs_endpoint` through it, with the grants
    docs/kubernetes.md tells users to make (added per bucket by `gcs`).
    """
    from tests.support.gcs_iam import strict_gcs

    with strict_gcs(gcs_endpoint, lookup=gcs_server) as proxy:
        yield proxy


@pytest.fixture
def gcs(
    gcs_server: str, gcs_iam: IamProxy, monkeypatch: pytest.MonkeyPatch
) -> Iterator[GcsTestBucket]:
    """Emulator mode for this process and its pods, with a fresh bucket (`documented_bucket`)."""
    from kinetic_prefect.common import gcs as kgcs

    yield documented_bucket(gcs_server, gcs_iam, monkeypatch.setenv)
    kgcs._clients.clear()


def documented_bucket(
    gcs_server: str, iam: IamProxy, setenv: Callable[[str, str], None]
) -> GcsTestBucket:
    """A fresh bucket with the documented grants; this process acts as the user.

    The bucket is made by an administrator (straight to the emulator); the test
    process then acts as the user (`setenv` points its clients at the user's port),
    and its pods as their service accounts, with the documented grants on it (jobs
    and results bucket at once) and on the environments bucket.
    """
    import uuid

    from google.api_core.exceptions import Conflict

    from kinetic_prefect.common import gcs as kgcs
    from tests.support.gcs_iam import USER_MEMBER, documented_grants

    setenv("STORAGE_EMULATOR_HOST", gcs_server)
    kgcs._clients.clear()
    admin = kgcs.storage_client()
    bucket = admin.create_bucket(f"kp-{uuid.uuid4().hex[:12]}")
    with contextlib.suppress(Conflict):
        admin.create_bucket(ENVIRONMENTS_BUCKET)
    iam.grant(
        documented_grants(
            {
                "JOBS_BUCKET": bucket.name,
                "RESULTS_BUCKET": bucket.name,
                "ENVIRONMENT_STORE": ENVIRONMENTS_BUCKET,
                "PROJECT": kgcs.EMULATOR_PROJECT,
            }
        )
    )
    user_endpoint = iam.endpoint(USER_MEMBER)
    emulator_env = {
        "STORAGE_EMULATOR_HOST": user_endpoint,
        "TENSORSTORE_GCS_HTTP_URL": user_endpoint,
    }
    for name, value in emulator_env.items():
        setenv(name, value)
    kgcs._clients.clear()
    return GcsTestBucket(
        name=bucket.name,
        client=admin,
        # The kubelet gives each pod its own identity's port in place of this address.
        pod_env=emulator_env,
        environment_store=f"gs://{ENVIRONMENTS_BUCKET}",
        iam=iam,
    )


@dataclasses.dataclass
class GcsTestBucket:
    name: str
    client: Any
    # What pods need to reach the emulator: on a cluster, only a manifest's env carries it.
    pod_env: dict[str, str]
    # Where gke test clusters keep shipped environments: shared by the tests of a GCS server.
    environment_store: str = ""
    # The IAM proxy every client of the test goes through.
    iam: Any = None

    @property
    def uri(self) -> str:
        return f"gs://{self.name}"

    def names(self, prefix: str = "") -> list[str]:
        return sorted(b.name for b in self.client.list_blobs(self.name, prefix=prefix))


@pytest.fixture
def cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[KubeCluster]:
    """An emulated cluster the kubeconfig points at; every Job created must validate strictly.

    It enforces RBAC from deployments/k8s/rbac.yaml (tests/support/kube_auth.py): a request
    it refuses fails the test unless the test set `cluster.refusals_expected`, so a
    permission the product lacks cannot hide behind a swallowed error. A case that failed
    prints the end of each pod's log, which goes with the cluster, and its Jobs, pods and
    Kueue Workloads.
    """
    with running_cluster(tmp_path / "cluster") as emulated:
        monkeypatch.setenv("KUBECONFIG", str(emulated.kubeconfig))
        yield emulated
        if failed(request):
            emulated.kubelet.print_log_tails()
            emulated.print_state()
        created = emulated.created_jobs()
        refusals = [] if emulated.refusals_expected else emulated.refusals()
    assert refusals == [], f"The cluster refused requests: {refusals}"
    for manifest in created:
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


@pytest.fixture
def gke(gcs: object, cluster: KubeCluster, suite_environment: str) -> Iterator[str]:
    """A saved gke KineticCluster with jobs and results in the fake GCS bucket.

    Every GKE-backend case runs with known values for Prefect's secret settings, and
    none of them may appear in what the case produced: Job manifests, payloads,
    final states or code archives.
    """
    from prefect.settings import temporary_settings

    from tests.support.clusters import gcs_cluster
    from tests.support.leaks import canary_settings, leaks, scanned_artifacts

    canaries = canary_settings()
    with temporary_settings(canaries):
        yield gcs_cluster(gcs, f"gke-{os.urandom(4).hex()}", backend="gke")
    assert leaks(canaries.values(), scanned_artifacts(cluster, gcs)) == []


@pytest.fixture(scope="session")
def shipped_requirements() -> Path:
    """The requirements file every shipped-environment test uses: one environment per suite.

    It names a package this environment does not have, so a pod that imports it
    proves the environment it ran on was shipped.
    """
    from tests.support.clusters import SHIPPED_REQUIREMENTS

    return SHIPPED_REQUIREMENTS
