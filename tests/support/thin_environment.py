"""The suite's shipped environment, stood for by a thin one under the key the product plans.

The environment the product plans for the suite's tasks (its own pins, kinetic-prefect's
wheel, tests/support/shipped-requirements.txt) is this suite's virtual environment plus
the packages of that file the suite lacks. Built for real it is 393 MB packed: building it
(uv, compileall, tar, gzip) and unpacking it on each fresh test node cost about 10 s of
CPU per unpack and a minute per build, and most gke cases test something else.

So the suite publishes, under the plan's key and in the store's layout, a directory that
holds those missing packages, the build's spec, a link to each entry of the suite's
site-packages, and the bytecode of its top-level modules. The product then finds it,
downloads it, checks its digest, unpacks it, verifies and prunes node copies, and plans a
flow pod's task environments from its spec, as it does the real one. What the real
archive holds is tested where it is built: the builder Job case of
tests/environments/test_gke_ship.py and tests/environments/test_local_ship.py.
"""

from __future__ import annotations

import compileall
import json
import os
import py_compile
import random
import subprocess
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

import kinetic_prefect
from kinetic_prefect.common.environment_records import EnvironmentManifest
from kinetic_prefect.common.storage import JobsStore
from kinetic_prefect.launch.environment import (
    ARCHIVE_FILE,
    ENV_SPEC_FILE,
    EnvironmentPlan,
    ShippedEnvironment,
    publish_archive,
    upload_spec,
)
from kinetic_prefect.pod import bootstrap

BUILT_BY = "the test suite: a thin environment over its own site-packages"
# Every entry gets this mtime, so every worker packs the same bytes for one plan: they
# share a node cache (`~/.cache/kinetic-prefect/test-node`), where a copy of other bytes
# under the same key would be refused and unpacked again.
_MTIME = 1_700_000_000


def missing_pins(pins: tuple[str, ...] | list[str]) -> list[str]:
    """The `name==version` pins this interpreter's environment does not have at that version."""
    missing = []
    for pin in pins:
        name, _, version = pin.split(";")[0].strip().partition("==")
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version.strip():
            missing.append(pin)
    return missing


def _install(pins: list[str], plan: EnvironmentPlan, target: Path) -> None:
    from uv import find_uv_bin

    if not pins:
        target.mkdir(parents=True)
        return
    command = [find_uv_bin(), "pip", "install", "--quiet", "--no-deps", "--no-compile"]
    command += ["--target", str(target), "--link-mode", "copy"]
    command += ["--python-platform", plan.platform, "--python-version", plan.python, *pins]
    env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"uv could not install {pins}: {result.stderr.strip()}")


def _link_suite_packages(target: Path) -> None:
    """A link in `target` to each entry of the suite's site-packages it does not have.

    Links, not a `.pth` file: a task container finds its environment on `PYTHONPATH`,
    which reads no `.pth` file. kinetic-prefect is installed editable (a `.pth` line to
    the project), so its package is linked from the project.
    """
    site_packages = Path(sysconfig.get_paths()["purelib"])
    for entry in sorted(site_packages.iterdir()):
        link = target / entry.name
        if entry.suffix == ".pth" or entry.name == "__pycache__" or link.exists():
            continue
        link.symlink_to(entry)
        if entry.suffix == ".py":
            # A top-level module's bytecode goes beside the link (a pod writing it would
            # change the node's copy), made from the source alone: the suite's own
            # `__pycache__` gains files as processes run, and every worker must pack the
            # same bytes.
            py_compile.compile(
                str(entry),
                cfile=str(
                    target / "__pycache__" / f"{entry.stem}.{sys.implementation.cache_tag}.pyc"
                ),
                dfile=f"/environment/{entry.name}",
                doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
    (project_package,) = kinetic_prefect.__path__
    (target / "kinetic_prefect").symlink_to(project_package)


def publish_thin_environment(
    plan: EnvironmentPlan, store: JobsStore, ballast: int = 0
) -> ShippedEnvironment:
    """Put the thin stand-in for `plan` in `store`, where `Environments.ensure` finds it.

    `ballast`: that many more bytes in the archive (random, so they stay that many packed),
    for a case that needs a download longer than a few reads.
    """
    upload_spec(plan, store)
    with tempfile.TemporaryDirectory(prefix="kinetic-thin-env-") as scratch:
        target = Path(scratch) / "env"
        _install(missing_pins(plan.pins), plan, target)
        # Compiled as a real build is (nothing written beside the sources when a pod imports
        # them), with hashes instead of mtimes and no scratch path, so every worker packs the
        # same bytes.
        compileall.compile_dir(
            target,
            quiet=1,
            stripdir=str(target),
            prependdir="/environment",
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        if ballast:
            (target / "ballast.bin").write_bytes(random.Random(ballast).randbytes(ballast))
        _link_suite_packages(target)
        (target / ENV_SPEC_FILE).write_text(json.dumps(plan.spec(), indent=1))
        for path in [target, *target.rglob("*")]:
            os.utime(path, (_MTIME, _MTIME), follow_symlinks=False)
        archive = Path(scratch) / ARCHIVE_FILE
        sha256, files = bootstrap.pack(target, archive)
        manifest = EnvironmentManifest(
            key=plan.key,
            sha256=sha256,
            size=archive.stat().st_size,
            files=files,
            python=plan.python,
            platform=plan.platform,
            pins=list(plan.pins),
            wheels=plan.spec()["wheels"],
            install_seconds=0.0,
            pack_seconds=0.0,
            built_by=BUILT_BY,
        )
        return publish_archive(plan.key, store, archive, manifest.encode())
