"""The task's Python environment, shipped with it: requirements, resolution, key, store.

With `environment="ship"` a pod starts from a stock `python` image and unpacks
a ready environment that was resolved once, installed once for the pod's
platform and stored content-addressed in the jobs store::

    env-cache/{key}/spec.json            what to build: the pins, platform, Python, wheels
    env-cache/{key}/wheels/*.whl         local distributions (an editable kinetic-prefect)
    env-cache/{key}/environment.tar.gz   the installed environment
    env-cache/{key}/manifest.json        its sha256, size, file count and pins
    env-cache/{key}/ready.json           the marker, written last

This module decides the environment (`plan_environment`) and makes sure it is
in the store (`ensure_environment`); `pod/bootstrap.py` builds and unpacks it.
docs/environments.md has the whole story.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from kinetic_prefect.common import layout
from kinetic_prefect.common.env import SHIPPED_ENV_ENV
from kinetic_prefect.common.environment_records import (
    SPEC_VERSION,
    EnvironmentManifest,
    EnvironmentMarker,
    EnvironmentSpec,
    WheelEntry,
)
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.errors import ConfigurationError, EnvironmentBuildError
from kinetic_prefect.launch.accelerators import Accelerator

MODES = ("auto", "ship", "image")
BUILDERS = ("cluster", "local")
# The default image is `python:{minor}-slim`: Debian 12, glibc 2.36, x86_64.
POD_PLATFORM = "x86_64-manylinux_2_36"
FORMAT_VERSION = SPEC_VERSION
SELF = "kinetic-prefect"
# Where the bootstrap's source lives, read as text: the pod runs it before kinetic-prefect exists.
BOOTSTRAP_SOURCE = Path(__file__).resolve().parent.parent / "pod" / "bootstrap.py"
ARCHIVE_FILE = "environment.tar.gz"
MANIFEST_FILE = "manifest.json"
MARKER_FILE = "ready.json"
SPEC_FILE = "spec.json"
# In the environment itself: the spec it was built from.
ENV_SPEC_FILE = "kinetic-environment.json"
# In an unpacked environment on a node, written once all of it is there.
UNPACKED_MARKER = ".kinetic-env-ready"


def node_cache_entry(key: str, sha256: str) -> str:
    """The directory a node unpacks environment `key`'s archive `sha256` into.

    One per archive, not per key: an environment built again (another environment store,
    or a rebuild) has another archive, and unpacking it in place of the first would pull
    the files from under the pods running on it. `pod/bootstrap.py` keeps a copy.
    """
    return f"{key}-{sha256[:16]}"


_DETECTED = ("uv.lock", "pylock.toml", "requirements.txt", "pyproject.toml")


def pod_python(minor: str | None = None) -> str:
    """The pod's Python, `3.X`: the orchestrator's unless given."""
    return minor or f"{sys.version_info.major}.{sys.version_info.minor}"


def stock_image(python: str | None = None) -> str:
    return f"python:{pod_python(python)}-slim"


def cache_dir() -> Path:
    """This machine's cache for resolutions, wheels and archives built here."""
    configured = os.environ.get("KINETIC_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kinetic-prefect"


def uv_command() -> list[str]:
    from uv import find_uv_bin

    return [find_uv_bin()]


# -- what the environment asks for ------------------------------------------------------------


@dataclass(frozen=True)
class Requirements:
    """The user's requirements: where they came from and the uv inputs that carry them."""

    source: str
    lines: tuple[str, ...] = ()
    files: tuple[Path, ...] = ()

    def digest_parts(self) -> list[str]:
        return [*self.lines, *(f.read_text() for f in self.files)]


def detect_requirements(root: Path, given: Sequence[str] | str | None = None) -> Requirements:
    """The requirements of the project at `root`, or the ones given.

    Given: a list of requirement strings, or the path of a requirements file.
    Detected, first found wins: `uv.lock` (its export without dev groups and
    without the project), `pylock.toml`, `requirements.txt`,
    `[project.dependencies]` of `pyproject.toml`; else this interpreter's
    distributions at their exact versions.
    """
    if isinstance(given, str):
        path = Path(given).expanduser()
        if not path.is_absolute():
            path = (root / path) if (root / path).exists() else path.resolve()
        if not path.is_file():
            raise ConfigurationError(
                f"requirements={given!r}: no such file. Give a requirements file's path, or a "
                "list of requirement strings."
            )
        return Requirements(str(path), files=(path,))
    if given is not None:
        return Requirements("requirements=[...]", tuple(str(line) for line in given))
    if (root / "uv.lock").is_file():
        return Requirements(str(root / "uv.lock"), tuple(_uv_export(root)))
    if (root / "pylock.toml").is_file():
        return Requirements(str(root / "pylock.toml"), tuple(_pylock(root / "pylock.toml")))
    if (root / "requirements.txt").is_file():
        return Requirements(str(root / "requirements.txt"), files=(root / "requirements.txt",))
    if (root / "pyproject.toml").is_file():
        project = tomllib.loads((root / "pyproject.toml").read_text()).get("project", {})
        if "dependencies" in project:
            return Requirements(
                f"{root / 'pyproject.toml'} [project.dependencies]",
                tuple(project["dependencies"]),
            )
    return Requirements("this interpreter's distributions", tuple(_installed_pins()))


def _uv_export(root: Path) -> list[str]:
    command = [*uv_command(), "export", "--frozen", "--no-dev", "--no-emit-project"]
    command += ["--no-hashes", "--no-header", "--no-annotate", "--quiet", "--project", str(root)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise ConfigurationError(
            f"`uv export` of {root / 'uv.lock'} failed: {result.stderr.strip()}. Run `uv lock` "
            "there, or give requirements= explicitly."
        )
    lines = [line.strip() for line in result.stdout.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _pylock(path: Path) -> list[str]:
    lock = tomllib.loads(path.read_text())
    pins = []
    for package in lock.get("packages", []):
        line = f"{package['name']}=={package['version']}" if "version" in package else None
        if line is None:
            raise ConfigurationError(
                f"{path}: package {package.get('name')!r} has no version; ship it from an index "
                "or give requirements= explicitly."
            )
        if package.get("marker"):
            line += f" ; {package['marker']}"
        pins.append(line)
    return pins


def _installed_pins() -> list[str]:
    pins = []
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name and _normal(name) not in {_normal(SELF), "pip", "setuptools", "wheel"}:
            pins.append(f"{name}=={dist.version}")
    return sorted(set(pins))


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# -- kinetic-prefect itself, at the orchestrator's versions ----------------------------------


@dataclass(frozen=True)
class LocalWheel:
    """A distribution built here from a local directory and shipped as a wheel."""

    name: str
    path: Path
    sha256: str


def _pod_markers(python: str) -> dict[str, str]:
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def self_pins(python: str) -> tuple[list[str], list[Path]]:
    """kinetic-prefect and everything it needs, at exactly the versions installed here.

    Returns the pins, and the source directories of the ones installed from a
    local path (kinetic-prefect itself when it is an editable install), to be
    built into wheels.
    """
    from packaging.requirements import Requirement

    environment = _pod_markers(python)
    pins: dict[str, str] = {}
    local: list[Path] = []
    todo: list[tuple[str, frozenset[str]]] = [(SELF, frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional part this interpreter does not have
        source = _local_source(dist)
        if source is not None:
            if source not in local:
                local.append(source)
        else:
            pins[_normal(name)] = f"{_normal(name)}=={dist.version}"
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not any(
                requirement.marker.evaluate({**environment, "extra": extra})
                for extra in (extras or {""})
            ):
                continue
            todo.append((requirement.name, frozenset(requirement.extras)))
    return sorted(pins.values()), local


def _local_source(dist: metadata.Distribution) -> Path | None:
    """The directory a distribution was installed from, when it was a local path."""
    text = dist.read_text("direct_url.json")
    if not text:
        return None
    url = json.loads(text).get("url", "")
    if not url.startswith("file://"):
        return None
    return Path(url[len("file://") :])


def _tree_digest(directory: Path) -> str:
    """A digest of the files a wheel of `directory` is built from."""
    digest = hashlib.sha256()
    skip = {".git", ".venv", "__pycache__", "node_modules", ".kinetic", "tests", "docs"}
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith(".venv"))
        for name in sorted(files):
            if name.endswith((".py", ".toml", ".cfg", ".txt", ".md", ".json", ".typed")):
                path = Path(root, name)
                digest.update(str(path.relative_to(directory)).encode() + b"\0")
                digest.update(path.read_bytes())
    return digest.hexdigest()


def build_wheel(source: Path) -> LocalWheel:
    """A wheel of the project at `source`, built once per content and kept in the cache."""
    cached = cache_dir() / "wheels" / _tree_digest(source)
    wheels = sorted(cached.glob("*.whl")) if cached.is_dir() else []
    if not wheels:
        cached.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cached.parent) as out:
            command = [*uv_command(), "build", "--wheel", "--quiet", "--out-dir", out, str(source)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise EnvironmentBuildError(
                    f"Could not build a wheel of {source}: {result.stderr.strip()}"
                )
            for wheel in Path(out).glob("*.whl"):
                os.replace(wheel, cached / wheel.name)
        wheels = sorted(cached.glob("*.whl"))
    wheel = wheels[-1]
    return LocalWheel(wheel.name, wheel, hashlib.sha256(wheel.read_bytes()).hexdigest())


# -- accelerator extras ---------------------------------------------------------------------


def accelerator_extras(
    accelerator: Accelerator, pins: Iterable[str], override: Sequence[str] | None = None
) -> list[str]:
    """What an accelerator adds to the environment: jax's TPU or CUDA parts at jax's version.

    `override` (the `accelerator_extras` setting) replaces the default, `[]` adds nothing.
    """
    if override is not None:
        return list(override)
    jax = next((p.split("==", 1)[1] for p in pins if p.startswith("jax==")), None)
    if jax is None:
        return []
    if accelerator.kind == "tpu":
        return [f"jax[tpu]=={jax}"]
    if accelerator.kind == "gpu":
        return [f"jax[cuda12]=={jax}"]
    return []


# -- resolution ------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvironmentPlan:
    """One environment, decided: its key and everything a builder needs."""

    key: str
    python: str
    platform: str
    pins: tuple[str, ...]
    wheels: tuple[LocalWheel, ...]
    index_url: str | None
    requirements_source: str
    extras: tuple[str, ...] = ()

    def spec(self) -> dict[str, Any]:
        """The builder's `spec.json` (an `EnvironmentSpec` record) as JSON fields."""
        return EnvironmentSpec(
            key=self.key,
            python=self.python,
            platform=self.platform,
            pins=list(self.pins),
            wheels=[WheelEntry(name=w.name, sha256=w.sha256) for w in self.wheels],
            index_url=self.index_url,
            extras=list(self.extras),
            requirements=self.requirements_source,
        ).fields()


def _key(python: str, platform: str, pins: Sequence[str], wheels: Sequence[LocalWheel]) -> str:
    content = {
        "format": FORMAT_VERSION,
        "python": python,
        "platform": platform,
        "pins": sorted(pins),
        "wheels": sorted(w.sha256 for w in wheels),
    }
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:32]


def resolve(
    inputs: Sequence[str],
    files: Sequence[Path],
    python: str,
    platform: str,
    index_url: str | None,
) -> list[str]:
    """The exact pins uv resolves for the pod's platform and Python (cached by input)."""
    request = {
        "inputs": list(inputs),
        "files": [f.read_text() for f in files],
        "python": python,
        "platform": platform,
        "index": index_url,
    }
    digest = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
    cached = cache_dir() / "resolutions" / f"{digest}.txt"
    if cached.is_file():
        return cached.read_text().splitlines()
    with tempfile.TemporaryDirectory() as scratch:
        requested = Path(scratch) / "requirements.in"
        requested.write_text("\n".join(inputs) + "\n")
        command = [*uv_command(), "pip", "compile", "--quiet", "--no-header", "--no-annotate"]
        command += ["--python-platform", platform, "--python-version", python]
        command += ["--index-url", index_url] if index_url else []
        command += [str(requested), *map(str, files)]
        env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=scratch)
    if result.returncode != 0:
        raise EnvironmentBuildError(
            "The task's environment cannot be resolved for the pod "
            f"(Python {python}, {platform}): {result.stderr.strip()}"
        )
    pins = [line.strip() for line in result.stdout.splitlines()]
    pins = [line for line in pins if line and not line.startswith(("#", "--"))]
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.partial")
    partial.write_text("\n".join(pins))
    os.replace(partial, cached)
    return pins


def _check_local_paths(pins: Sequence[str], root: Path) -> tuple[list[str], list[Path]]:
    """Pins from an index, and local directories inside the project to build as wheels."""
    from_index, local = [], []
    for pin in pins:
        name, at, location = pin.partition(" @ ")
        if not at and not pin.startswith(("-e", "file:", "/", ".")):
            from_index.append(pin)
            continue
        location = (location or pin.removeprefix("-e")).strip().split(" ;")[0]
        path = Path(location.removeprefix("file://")).resolve()
        if not path.exists() or not path.is_relative_to(root):
            raise EnvironmentBuildError(
                f"{name.strip() or pin} comes from the local path {location}, outside the "
                f"project {root}: a pod cannot reach it. Publish it to your package index, or "
                "move it into the project, or build a wheel and list the wheel in requirements."
            )
        local.append(path)
    return from_index, local


def plan_environment(
    root: Path,
    accelerator: Accelerator,
    requirements: Sequence[str] | str | None = None,
    index_url: str | None = None,
    extras: Sequence[str] | None = None,
    python: str | None = None,
) -> EnvironmentPlan:
    """The environment a task from the project at `root` ships with on `accelerator`.

    In a pod that runs on a shipped environment (a worker's flow pod), the task's
    environment is that one, with `accelerator`'s extras added.
    """
    python = pod_python(python)
    inherited = os.environ.get(SHIPPED_ENV_ENV)
    if inherited:
        return _plan_from_own_environment(json.loads(inherited), accelerator, index_url, extras)
    user = detect_requirements(root, requirements)
    own_pins, own_sources = self_pins(python)
    added = accelerator_extras(accelerator, own_pins, extras)
    inputs = [*user.lines, *own_pins, *added]
    pins = resolve(inputs, user.files, python, POD_PLATFORM, index_url)
    from_index, local = _check_local_paths(pins, root)
    wheels = tuple(build_wheel(source) for source in [*own_sources, *local])
    return EnvironmentPlan(
        key=_key(python, POD_PLATFORM, from_index, wheels),
        python=python,
        platform=POD_PLATFORM,
        pins=tuple(from_index),
        wheels=wheels,
        index_url=index_url,
        requirements_source=user.source,
        extras=tuple(added),
    )


def _plan_from_own_environment(
    shipped: dict[str, str],
    accelerator: Accelerator,
    index_url: str | None,
    extras: Sequence[str] | None,
) -> EnvironmentPlan:
    """The plan for a task launched from a pod: the pod's own environment plus the extras."""
    from kinetic_prefect.common.storage import read_uri

    spec_path = Path(shipped["directory"]) / ENV_SPEC_FILE
    spec = EnvironmentSpec.decode(spec_path.read_bytes(), str(spec_path))
    added = accelerator_extras(accelerator, spec.pins, extras)
    pins = spec.pins
    if added:
        pins = resolve([*spec.pins, *added], [], spec.python, spec.platform, index_url)
    prefix = shipped["archive"].rpartition("/")[0]
    wheels = []
    for wheel in spec.wheels:
        path = cache_dir() / "wheels" / wheel.sha256 / wheel.name
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(read_uri(f"{prefix}/wheels/{wheel.name}"))
        wheels.append(LocalWheel(wheel.name, path, wheel.sha256))
    return EnvironmentPlan(
        key=_key(spec.python, spec.platform, pins, wheels),
        python=spec.python,
        platform=spec.platform,
        pins=tuple(pins),
        wheels=tuple(wheels),
        index_url=index_url or spec.index_url,
        requirements_source=f"this pod's environment {shipped['key']}",
        extras=tuple(added),
    )


# -- the store ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShippedEnvironment:
    """An environment in the jobs store, as a pod needs it: where, and its digest."""

    key: str
    archive_uri: str
    sha256: str
    size: int = 0
    files: int = 0


def env_key(key: str, name: str) -> str:
    return f"{layout.ENV_CACHE_PREFIX}/{key}/{name}"


def stored_environment(store: JobsStore, key: str) -> ShippedEnvironment | None:
    """The environment `key` if its marker is in the store (one read)."""
    marker_key = env_key(key, MARKER_FILE)
    try:
        data = store.get_bytes(marker_key)
    except FileNotFoundError:
        return None
    marker = EnvironmentMarker.decode(data, store.uri(marker_key))
    return ShippedEnvironment(
        key, store.uri(env_key(key, ARCHIVE_FILE)), marker.sha256, marker.size, marker.files
    )


def upload_spec(plan: EnvironmentPlan, store: JobsStore) -> str:
    """Put the build spec and its wheels in the store; the spec's URI."""
    for wheel in plan.wheels:
        with open(wheel.path, "rb") as stream:
            store.put_stream(
                env_key(plan.key, f"wheels/{wheel.name}"), stream, wheel.path.stat().st_size
            )
    return store.put_bytes(env_key(plan.key, SPEC_FILE), json.dumps(plan.spec(), indent=1).encode())


def _build_here(plan: EnvironmentPlan, built: Path) -> None:
    """Run the builder (`pod/bootstrap.py build`) on this machine; its output goes to `built`."""
    with tempfile.TemporaryDirectory(dir=built.parent) as scratch:
        spec_dir = Path(scratch) / "spec"
        (spec_dir / "wheels").mkdir(parents=True)
        for wheel in plan.wheels:
            (spec_dir / "wheels" / wheel.name).write_bytes(wheel.path.read_bytes())
        (spec_dir / SPEC_FILE).write_text(json.dumps(plan.spec()))
        out = Path(scratch) / "out"
        command = [sys.executable, str(BOOTSTRAP_SOURCE), "build"]
        command += ["--spec", str(spec_dir / SPEC_FILE), "--out", str(out)]
        command += ["--built-by", "this machine"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise EnvironmentBuildError(
                f"Building environment {plan.key} here failed: {result.stderr.strip()}"
            )
        built.mkdir(parents=True, exist_ok=True)
        os.replace(out / ARCHIVE_FILE, built / ARCHIVE_FILE)
        os.replace(out / MANIFEST_FILE, built / MANIFEST_FILE)


def build_locally(plan: EnvironmentPlan, store: JobsStore) -> ShippedEnvironment:
    """Build the environment on this machine (kept in the cache) and upload it."""
    built = cache_dir() / "environments" / plan.key
    manifest_path = built / MANIFEST_FILE
    built.parent.mkdir(parents=True, exist_ok=True)
    # One build per environment on this machine, however many processes want it at once.
    with open(built.parent / f".{plan.key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not manifest_path.is_file():
            _build_here(plan, built)
    upload_spec(plan, store)  # its wheels: a flow pod plans its tasks' environments from them
    return publish_archive(plan.key, store, built / ARCHIVE_FILE, manifest_path.read_bytes())


def publish_archive(
    key: str, store: JobsStore, archive: Path, manifest_bytes: bytes
) -> ShippedEnvironment:
    """Upload a built environment's archive and manifest, then its marker (it is ready)."""
    manifest = EnvironmentManifest.decode(manifest_bytes, str(archive.with_name(MANIFEST_FILE)))
    with open(archive, "rb") as stream:
        archive_uri = store.put_stream(env_key(key, ARCHIVE_FILE), stream, archive.stat().st_size)
    store.put_bytes(env_key(key, MANIFEST_FILE), manifest_bytes)
    marker = EnvironmentMarker(sha256=manifest.sha256, size=manifest.size, files=manifest.files)
    store.put_bytes(env_key(key, MARKER_FILE), marker.encode())
    return ShippedEnvironment(key, archive_uri, manifest.sha256, manifest.size, manifest.files)


ClusterBuilder = Callable[[EnvironmentPlan, str, str], None]
"""Runs the builder on the cluster: (plan, spec URI, destination prefix URI); raises on failure."""


@dataclass
class Environments:
    """The environments one process has made sure of, so a sweep decides once per spec."""

    _known: dict[tuple[str, str], ShippedEnvironment] = field(default_factory=dict)
    _plans: dict[tuple[Any, ...], EnvironmentPlan] = field(default_factory=dict)
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(
        self,
        root: Path,
        accelerator: Accelerator,
        requirements: Sequence[str] | str | None = None,
        index_url: str | None = None,
        extras: Sequence[str] | None = None,
    ) -> EnvironmentPlan:
        """`plan_environment`, decided once per process for the same inputs."""
        requested = tuple(requirements) if isinstance(requirements, list | tuple) else requirements
        inputs = (root, accelerator.kind, requested, index_url, None if extras is None
                  else tuple(extras))  # fmt: skip
        with self._lock:
            lock = self._locks.setdefault(repr(inputs), threading.Lock())
        with lock:
            planned = self._plans.get(inputs)
            if planned is None:
                planned = plan_environment(root, accelerator, requirements, index_url, extras)
                self._plans[inputs] = planned
            return planned

    def ensure(
        self,
        plan: EnvironmentPlan,
        store: JobsStore,
        builder: ClusterBuilder | None,
    ) -> ShippedEnvironment:
        """The environment in `store`: found there, else built (on the cluster or here)."""
        scope = (store.uri(""), plan.key)
        with self._lock:
            lock = self._locks.setdefault(plan.key, threading.Lock())
        with lock:
            known = self._known.get(scope)
            if known is not None:
                return known
            found = stored_environment(store, plan.key)
            if found is None:
                if builder is None:
                    found = build_locally(plan, store)
                else:
                    spec_uri = upload_spec(plan, store)
                    builder(plan, spec_uri, store.uri(env_key(plan.key, "")).rstrip("/"))
                    found = stored_environment(store, plan.key)
                    if found is None:
                        raise EnvironmentBuildError(
                            f"The builder Job ended without writing environment {plan.key}."
                        )
            self._known[scope] = found
            return found


def bootstrap_command(
    environment: ShippedEnvironment, module: str, args: Sequence[str], job_dir: str = ""
) -> list[str]:
    """The container command that readies `environment` and runs `python -m module args`."""
    command = ["python", "-c", BOOTSTRAP_SOURCE.read_text(), "run"]
    command += ["--archive", environment.archive_uri, "--sha256", environment.sha256]
    command += ["--key", environment.key]
    if job_dir:
        command += ["--job-dir", job_dir]
    return [*command, "--module", module, "--", *args]


def unpack_command(environment: ShippedEnvironment, job_dir: str = "") -> list[str]:
    """The init container's command: unpack `environment` into the cache, or re-verify it."""
    command = ["python", "-c", BOOTSTRAP_SOURCE.read_text(), "unpack"]
    command += ["--archive", environment.archive_uri, "--sha256", environment.sha256]
    command += ["--key", environment.key]
    return [*command, "--job-dir", job_dir] if job_dir else command


def builder_command(spec_uri: str, destination: str) -> list[str]:
    return ["python", "-c", BOOTSTRAP_SOURCE.read_text(), "build", "--spec", spec_uri,
            "--upload", destination]  # fmt: skip


def test_iam_command(wanted: dict[str, list[str]]) -> list[str]:
    """A stock-image pod's command: which of `wanted` (bucket -> permissions) it holds."""
    return ["python", "-c", BOOTSTRAP_SOURCE.read_text(), "test-iam", "--wanted",
            json.dumps(wanted, sort_keys=True)]  # fmt: skip
