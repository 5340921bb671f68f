"""A shipped environment: build cold and warm, its size, and a pod's bootstrap against baselines.

Run: `.venv/bin/python tests/benchmarks/bench_environment.py [REQUIREMENTS_FILE]`.

Everything happens in one run on this machine, so read the ratios: a cold build
(nothing of kinetic-prefect's cached: resolution, wheel, archive; uv's own wheel
cache is as this machine has it) against a warm one (the store has it); the
pod's bootstrap on a fresh node (download, verify, unpack, with a bare Python)
against `tar -xzf` of the same archive and against `import prefect` with this
interpreter. The store is a local directory, so "download" is a local copy.

It also starts pods on a node that has the environment with the bootstrap of
the commit named by `KINETIC_BENCH_BEFORE` (default `main`) and with this tree's,
alternating, and prints the two medians side by side: what holding the
environment in use and touching its last use (the node cache's pruning) adds.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def timed(work):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def main() -> None:
    requirements = (
        sys.argv[1]
        if len(sys.argv) > 1
        else str(REPO / "tests" / "support" / "shipped-requirements.txt")
    )
    scratch = Path(tempfile.mkdtemp(prefix="kp-bench-env-"))
    os.environ["KINETIC_CACHE_DIR"] = str(scratch / "cache")

    from kinetic_prefect.backends.local.interpreter import bare_python
    from kinetic_prefect.common.storage import LocalStore
    from kinetic_prefect.launch import environment
    from kinetic_prefect.launch.accelerators import parse_accelerator

    store = LocalStore(scratch / "store")
    cpu = parse_accelerator("cpu")
    plan_cold, plan = timed(lambda: environment.plan_environment(REPO, cpu, requirements))
    build_cold, shipped = timed(lambda: environment.Environments().ensure(plan, store, None))
    plan_warm, _ = timed(lambda: environment.plan_environment(REPO, cpu, requirements))
    build_warm, _ = timed(lambda: environment.Environments().ensure(plan, store, None))

    bare = bare_python()
    node = scratch / "node"
    command = [bare, str(environment.BOOTSTRAP_SOURCE), "run", "--archive", shipped.archive_uri]
    command += ["--sha256", shipped.sha256, "--key", shipped.key, "--module", "platform"]
    env = {"PATH": os.environ["PATH"], "KINETIC_ENV_CACHE": str(node), "HOME": str(scratch)}
    fresh, _ = timed(lambda: subprocess.run(command, env=env, check=True, capture_output=True))
    cached, _ = timed(lambda: subprocess.run(command, env=env, check=True, capture_output=True))
    before_source = scratch / "bootstrap_before.py"
    revision = os.environ.get("KINETIC_BENCH_BEFORE", "main")
    before_source.write_bytes(
        subprocess.run(
            ["git", "-C", str(REPO), "show", f"{revision}:kinetic_prefect/pod/bootstrap.py"],
            check=True,
            capture_output=True,
        ).stdout
    )
    before_command = [bare, str(before_source), *command[2:]]
    starts: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(7):
        for name, run in (("before", before_command), ("after", command)):
            seconds, _ = timed(
                lambda run=run: subprocess.run(run, env=env, check=True, capture_output=True)
            )
            starts[name].append(seconds)
    start_before = statistics.median(starts["before"])
    start_after = statistics.median(starts["after"])
    (scratch / "tar").mkdir()
    tar = ["tar", "-xzf", shipped.archive_uri, "-C", str(scratch / "tar")]
    untar, _ = timed(lambda: subprocess.run(tar, check=True))
    importing, _ = timed(
        lambda: subprocess.run([sys.executable, "-c", "import prefect"], check=True)
    )

    rows = [
        ("plan, cold (uv resolves, wheel built)", plan_cold, ""),
        ("plan, warm (cached resolution)", plan_warm, f"{plan_warm / plan_cold:.2f}x cold"),
        ("build + upload, cold", build_cold, ""),
        ("ensure, warm (store has it)", build_warm, f"{build_warm / build_cold:.4f}x cold"),
        ("pod bootstrap, fresh node", fresh, f"{fresh / untar:.2f}x tar -x"),
        ("pod bootstrap, node has it", cached, f"{cached / importing:.2f}x import prefect"),
        (f"node has it: bootstrap of {revision} (median)", start_before, "1.00x"),
        ("node has it: this bootstrap (median)", start_after, f"{start_after / start_before:.2f}x"),
        ("baseline: tar -xzf of the archive", untar, "1.00x"),
        ("baseline: import prefect", importing, ""),
    ]
    print(f"environment {shipped.key}: {len(plan.pins)} pins, {len(plan.wheels)} local wheel(s)")
    print(f"archive: {shipped.size / 1e6:.1f} MB, {shipped.files} files")
    print(f"{'step':<42} {'seconds':>9}  ratio")
    for name, seconds, ratio in rows:
        print(f"{name:<42} {seconds:>9.2f}  {ratio}")
    subprocess.run(["rm", "-rf", str(scratch)], check=False)


if __name__ == "__main__":
    main()
