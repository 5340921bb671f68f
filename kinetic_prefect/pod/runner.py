"""The pod entrypoint: download → verify → extract → unpickle → data → environment → run → report.

On a multi-host slice the hosts connect (`distributed`) right after extract,
before anything can touch JAX: unpickling the arguments may build `jax.Array`s
and import the task's module, and JAX cannot join a slice after that.

Every failure before the task runs leaves `final-state.json` naming the phase
and exits non-zero, so the orchestrator can say exactly what went wrong.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinetic_prefect.common import layout, prefect_cache, prefect_results, storage, versions
from kinetic_prefect.common.env import (
    CLIENT_VERSIONS_ENV,
    OUTPUT_DIR_ENV,
    SCRATCH_DIR_ENV,
    SECRET_SETTING_PATHS_ENV,
    SIGNING_KEY_ENV,
)
from kinetic_prefect.common.intervals import Intervals
from kinetic_prefect.common.records import (
    FINAL_STATE_JSON,
    STATUS_ALREADY_FINAL,
    STATUS_FINISHED,
    STATUS_PHASE_FAILED,
    FinalRecord,
)
from kinetic_prefect.pod import prefect_process
from kinetic_prefect.pod import slice as slice_host

EXIT_COMPLETED = 0
EXIT_TASK_NOT_COMPLETED = 1
EXIT_PHASE_FAILED = 2


class TaskRunAlreadyFinal(Exception):
    """The task run is already final (cancelled as its pod started): run and record nothing."""

    def __init__(self, state: Any) -> None:
        super().__init__(f"the task run is already {state.name}")
        self.state = state


class PhaseFailure(Exception):
    """A pod phase failed; `hint` tells the user what to do about it."""

    def __init__(self, phase: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.phase = phase
        self.hint = hint


@dataclass
class PodRun:
    job_dir: str
    payload_uri: str
    payload_sha256: str
    context_uri: str
    context_sha256: str
    timings: dict[str, float] = field(default_factory=dict)
    payload_bytes: bytes | None = None  # set beforehand when it came inline
    context_bytes: bytes = b""
    workdir: Path | None = None
    contents: dict[str, Any] = field(default_factory=dict)
    # A warm pod's code stays extracted between its tasks (same archive by construction).
    extracted_sha256: str = ""
    code_root: str | None = None
    # A warm pod sends its task's logs and events before it reports the task's end.
    send_telemetry_before_report: bool = False
    # A slice host: what imported JAX before the slice was connected, if anything did.
    jax_imports: slice_host.JaxImportWatch | None = None
    # A warm pod: takes its next assignment if it is there, returning its job id.
    take_next: Callable[[], str | None] | None = None

    @contextmanager
    def phase(self, name: str, hint: str = "") -> Iterator[None]:
        started = time.perf_counter()
        if self.jax_imports is not None:
            self.jax_imports.phase = name
        try:
            yield
        except (PhaseFailure, TaskRunAlreadyFinal):
            raise
        except Exception as exc:
            raise PhaseFailure(name, f"{type(exc).__name__}: {exc}", hint) from exc
        finally:
            self.timings[name] = round(time.perf_counter() - started, 4)

    @property
    def reuses_code(self) -> bool:
        return bool(self.extracted_sha256) and self.extracted_sha256 == self.context_sha256

    def write_record(self, record: FinalRecord) -> None:
        record.timings = dict(self.timings)
        record.versions = versions.fingerprint()
        key = os.environ.get(SIGNING_KEY_ENV)
        if key:
            record.sign(key)
        storage.write_uri(f"{self.job_dir}/{FINAL_STATE_JSON}", record.encode())

    def write_result_seal(self, reference: Any, sha256: str) -> None:
        """The signed digest of a persisted result record, for later cache hits on it
        (a record the pod wrote itself carries it in its metadata instead)."""
        from kinetic_prefect.common.prefect_pod_storage import result_seal

        seal = result_seal(
            self.contents["task_run"],
            str(reference.storage_block_id),
            str(reference.storage_key),
            sha256,
        )
        where = layout.result_seal_key(seal.storage_block_id, seal.storage_key)
        storage.write_uri(f"{layout.store_root_of(self.job_dir)}/{where}", seal.encode())


def parse_args(argv: list[str] | None) -> PodRun:
    parser = argparse.ArgumentParser(prog="python -m kinetic_prefect.pod")
    parser.add_argument("--job-dir", required=True)
    parser.add_argument("--payload", required=True)
    parser.add_argument("--payload-sha256", required=True)
    parser.add_argument("--context", required=True)
    parser.add_argument("--context-sha256", required=True)
    args = parser.parse_args(argv)
    return PodRun(
        job_dir=args.job_dir.rstrip("/"),
        payload_uri=args.payload,
        payload_sha256=args.payload_sha256,
        context_uri=args.context,
        context_sha256=args.context_sha256,
    )


def download(run: PodRun) -> None:
    with run.phase(
        "download",
        "check that the pod can read the jobs bucket: its service account needs Workload "
        'Identity and roles/storage.objectAdmin there (docs/kubernetes.md "Permissions")',
    ):
        if run.payload_bytes is None:
            run.payload_bytes = storage.read_uri(run.payload_uri)
        if not run.reuses_code:
            run.context_bytes = storage.read_uri(run.context_uri)


def verify(run: PodRun) -> None:
    with run.phase("verify"):
        checks = [("payload.pkl", run.payload_bytes or b"", run.payload_sha256)]
        if not run.reuses_code:
            checks.append(("context.zip", run.context_bytes, run.context_sha256))
        for label, data, expected in checks:
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected:
                raise PhaseFailure(
                    "verify",
                    f"sha256 mismatch for {label}: expected {expected}, got {actual}",
                    "the upload was interrupted or the file was changed after submission; "
                    "resubmit the task",
                )


def safe_extract(archive: zipfile.ZipFile, target: Path) -> None:
    """Extract, refusing any entry that would land outside `target`."""
    root = target.resolve()
    for member in archive.infolist():
        destination = (root / member.filename).resolve()
        if not destination.is_relative_to(root):
            raise PhaseFailure(
                "extract",
                f"archive entry {member.filename!r} escapes the extraction directory",
                "the archive was not made by kinetic-prefect; resubmit from a clean checkout",
            )
    archive.extractall(root)


def extract(run: PodRun) -> None:
    if run.reuses_code:
        assert run.workdir is not None
        os.chdir(run.workdir)
        return
    with run.phase("extract", "the pod's scratch disk may be full; raise ephemeral storage"):
        scratch = run.code_root or os.environ.get(SCRATCH_DIR_ENV) or tempfile.gettempdir()
        run.workdir = Path(tempfile.mkdtemp(prefix="kinetic-context-", dir=scratch))
        import io

        with zipfile.ZipFile(io.BytesIO(run.context_bytes)) as archive:
            safe_extract(archive, run.workdir)
        sys.path.insert(0, str(run.workdir))
        os.chdir(run.workdir)
        run.extracted_sha256 = run.context_sha256
        run.context_bytes = b""


def unpickle(run: PodRun) -> None:
    with run.phase("unpickle"):
        client = json.loads(os.environ.get(CLIENT_VERSIONS_ENV, "{}"))
        differences = versions.skew(client) if client else []
        if differences:
            raise PhaseFailure(
                "unpickle",
                "version skew between the submitting client and the pod: " + "; ".join(differences),
                "use a container image with the same Python minor version, cloudpickle, prefect "
                "and kinetic-prefect versions as the environment that submits the flow",
            )
        import cloudpickle

        run.contents = cloudpickle.loads(run.payload_bytes or b"")
        run.payload_bytes = None
        _add_import_paths(run)


def _add_import_paths(run: PodRun) -> None:
    """The archive's folders the submitting process imported from go on the import path,
    in its order, ahead of the archive's root (a notebook's folder below its project)."""
    if run.workdir is None:
        return
    for relative in reversed(run.contents.get("import_paths", [])):
        folder = str(run.workdir / relative)
        if Path(folder).is_dir() and folder not in sys.path:
            sys.path.insert(0, folder)


def resolve_data(run: PodRun) -> None:
    with run.phase("data", "check that the pod's service account can read the data bucket"):
        from kinetic_prefect.data.data import DataIntegrityError, resolve_parameters

        scratch = Path(os.environ.get(SCRATCH_DIR_ENV) or tempfile.gettempdir())
        # The cache key is the shipped parameters' (`common.prefect_cache`), not the paths'.
        run.contents["shipped_parameters"] = run.contents["parameters"]
        try:
            run.contents["parameters"] = resolve_parameters(run.contents["parameters"], scratch)
        except DataIntegrityError as exc:
            raise PhaseFailure("data", str(exc), exc.hint) from exc


def _fill_secret_settings(context: dict[str, Any]) -> None:
    """Put the separately delivered secrets back into the serialized settings."""
    settings = context.get("settings_context", {}).get("settings")
    if not isinstance(settings, dict):
        return
    paths: dict[str, list[str]] = json.loads(os.environ.get(SECRET_SETTING_PATHS_ENV) or "{}")
    for env_name, path in paths.items():
        value = os.environ.get(env_name)
        if not value or not path:
            continue
        section = settings
        for part in path[:-1]:
            section = section.setdefault(part, {})
        section[path[-1]] = value


def environment(run: PodRun) -> None:
    with run.phase("environment"):
        _fill_secret_settings(run.contents["context"])
        output_dir = os.environ.get(OUTPUT_DIR_ENV, "")
        if output_dir and "://" not in output_dir:
            Path(output_dir).mkdir(parents=True, exist_ok=True)


def execute(run: PodRun, hosts: int = 1) -> Any:
    """Run the task through Prefect's own engine and return its final state.

    On a slice the engine runs one attempt: a retry it decides on ends the pod
    with the retry state, and the runner relaunches every host together.
    """
    with run.phase("run", "the Prefect API may be unreachable from the pod; check PREFECT_API_URL"):
        from prefect.context import hydrated_context
        from prefect.engine import handle_engine_signals
        from prefect.task_engine import run_task_async, run_task_sync

        from kinetic_prefect.pod.blocks import build_known_blocks

        contents = run.contents
        contents["context"] = build_known_blocks(contents["context"])
        task = contents["task"]
        prefect_process.direct_result_writes(task)
        kwargs = dict(
            task=task,
            task_run=contents["task_run"],
            parameters=contents["parameters"],
            wait_for=contents.get("wait_for"),
            dependencies=contents.get("dependencies"),
            return_type="state",
            # The settings are entered once, below: the engine hydrates the context it is
            # given again, and building Prefect's settings costs about 0.1 s of CPU.
            context={k: v for k, v in contents["context"].items() if k != "settings_context"},
        )
        hydrate_started = time.perf_counter()
        with hydrated_context(contents["context"]):
            run.timings["hydrate"] = round(time.perf_counter() - hydrate_started, 4)
            shipped = contents.get("shipped_parameters")
            if shipped is not None and shipped is not contents["parameters"]:
                key = prefect_cache.cache_key(task, contents["task_run"], shipped)
                if key is not None:
                    prefect_cache.pin_cache_key(task, key)
            recorded = _recorded_state(contents["task_run"].id)
            if recorded is not None and recorded.is_final():
                raise TaskRunAlreadyFinal(recorded)
            with (
                handle_engine_signals(contents["task_run"].id),
                prefect_process.logged_task_run_errors() as logged,
            ):
                if hosts > 1:
                    state = prefect_process.run_one_attempt(**kwargs)
                elif task.isasync:
                    import asyncio

                    state = asyncio.run(run_task_async(**kwargs))
                else:
                    state = run_task_sync(**kwargs)
            failed = prefect_process.unstored_result(state, task, logged)
            if failed is None:
                return state
            _record_state(contents["task_run"].id, failed)
            return failed


def _record_state(task_run_id: Any, state: Any) -> None:
    """Replace the task run's state in the API (a Completed run whose result was not stored)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.set_task_run_state(task_run_id, state.model_copy(update={"data": None}), force=True)


def _recorded_state(task_run_id: Any) -> Any:
    """The task run's state as the API has it (None if it cannot tell)."""
    # Not `from prefect import get_client`: where nothing imported `prefect.main` yet (a
    # forked local pod, a task pickled by value), that would, and it sets up Prefect's
    # logging again (about 0.06 s of CPU).
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            return client.read_task_run(task_run_id).state
    except Exception:
        return None  # the engine's own first call will say what is wrong with the API


def distributed(run: PodRun, index: int, hosts: int) -> None:
    """On a multi-host slice: connect the hosts through jax.distributed before anything uses JAX."""
    if hosts <= 1:
        return
    with run.phase("distributed"):
        early = run.jax_imports.stop() if run.jax_imports is not None else None
        run.jax_imports = None
        address = slice_host.coordinator_address()
        where = f"host {index} of {hosts} could not join the slice (coordinator {address})"
        if early is not None:
            raise PhaseFailure(
                "distributed",
                f"{where}: JAX was imported before jax.distributed.initialize, {early}",
                "nothing may import JAX before the pod connects the slice's hosts; if the image "
                "imports it at interpreter start-up (sitecustomize, a .pth file), remove that",
            )
        try:
            slice_host.initialize_distributed(index, hosts)
        except Exception as exc:
            raise PhaseFailure(
                "distributed",
                f"{where}: {type(exc).__name__}: {exc}",
                "the image needs jax, and every host of the slice must be up and reach host 0 "
                "at the coordinator's address (see each host's log: "
                "`kinetic-prefect jobs logs JOB --host K`)",
            ) from exc


def run_other_host(run: PodRun, index: int) -> int:
    """A host other than 0 runs the function without the engine; host 0 reports the task run."""
    try:
        slice_host.run_function(run.contents)
    except BaseException as exc:
        log(f"host {index}: the task raised:\n{format_traceback(exc, run)}")
        return EXIT_TASK_NOT_COMPLETED
    log(f"host {index}: finished ({run.timings})")
    return EXIT_COMPLETED


def process_age() -> float | None:
    """Seconds since this process was started (Linux), to time interpreter start-up."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 4)


def _exception_of(state: Any) -> BaseException | None:
    if not (state.is_failed() or state.is_crashed()):
        return None
    try:
        value = state.result(raise_on_failure=False)
    except Exception as exc:
        return exc
    return value if isinstance(value, BaseException) else None


def report(run: PodRun, state: Any) -> int:
    with run.phase("report", "the task's return value must be picklable"):
        import cloudpickle

        exc = _exception_of(state)
        tb = format_traceback(exc, run) if exc is not None else None
        shipped = prefect_process.shippable_state(state, run.contents["task"])
        final = cloudpickle.dumps(
            {"state": shipped, "traceback": tb, "task_run": run.contents["task_run"]}
        )
        record = FinalRecord(
            status=STATUS_FINISHED,
            state_type=state.type.value,
            state_name=state.name,
            message=state.message,
            traceback=tb,
        )
        if not record.carry_state(final):
            beside = f"{run.job_dir}/{layout.FINAL_STATE_PICKLE}"
            with run.phase("report", f"the pod could not write {beside}: check its access"):
                storage.write_uri(beside, final)
        del final  # a large state: its bytes are up, no copy of it needs to stay
        reference = prefect_results.result_reference(shipped)
        if reference is not None:
            # The orchestrator deserialises the result record only if it is what the pod wrote.
            written = prefect_process.written_record(run.contents["task"], reference)
            if written is None:
                stored = prefect_results.read_stored(reference)
                written = (stored.sha256, stored.data)
                run.write_result_seal(reference, written[0])
            record.carry_result(str(reference.storage_key), *written)
        if run.take_next is not None and not state.is_crashed():
            record.next_job = run.take_next()
        run.write_record(record)
    return EXIT_COMPLETED if state.is_completed() else EXIT_TASK_NOT_COMPLETED


def format_traceback(exc: BaseException, run: PodRun) -> str:
    """The exception's traceback, with the source lines of shipped code.

    Code pickled by value keeps the file names it had where the flow runs; in the
    pod those files exist only in the extracted code archive. Their lines are read
    from there, so a remote traceback shows the task's own source.
    """
    root = run.contents.get("source_root") if run.contents else None
    if root and run.workdir is not None:
        for filename in _traceback_files(exc):
            _cache_shipped_source(filename, Path(root), run.workdir)
    return "".join(traceback.format_exception(exc))


def _traceback_files(exc: BaseException) -> set[str]:
    files: set[str] = set()
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            files.add(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        pending += [current.__cause__, current.__context__]
    return files


def _cache_shipped_source(filename: str, root: Path, workdir: Path) -> None:
    import linecache

    path = Path(filename)
    if filename in linecache.cache or not path.is_absolute() or path.exists():
        return
    if not path.is_relative_to(root):
        return
    shipped = workdir / path.relative_to(root)
    if shipped.is_file():
        text = shipped.read_text(errors="replace")
        # mtime None: linecache.checkcache leaves the entry alone.
        linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)


def log(message: str) -> None:
    # The pod's stderr is its log: the local backend's log file, or `kubectl logs`.
    sys.stderr.write(f"kinetic-prefect pod: {message}\n")
    sys.stderr.flush()


def start_collecting() -> None:
    """Turn the garbage collector on, once per process, as the task's inputs are in hand.

    The pod starts with it off (`kinetic_prefect.pod.__main__`; the local template too):
    importing Prefect builds about 140 thousand objects, and the collector's passes while
    they are built cost about a tenth of that. They are frozen (`gc.freeze`) before it
    starts, so its passes skip them for the rest of the process; turned on without that,
    its first pass walks all of them, and a pod came out slower than with the collector
    on throughout. Objects freed by their reference count still are; cyclic garbage made
    while it was off (a few thousand objects) stays.
    """
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def run_task(run: PodRun, index: int, hosts: int) -> tuple[int, Any]:
    """One task run through every phase: the exit code, and the engine's state if it ran."""
    if hosts > 1:
        run.jax_imports = slice_host.JaxImportWatch.start()
    try:
        download(run)
        verify(run)
        extract(run)
        distributed(run, index, hosts)
        unpickle(run)
        start_collecting()
        resolve_data(run)
        environment(run)
        if index > 0:
            return run_other_host(run, index), None
        state = execute(run, hosts)
        telemetry_seconds = Intervals.from_environ(os.environ).telemetry_seconds
        if run.send_telemetry_before_report and not prefect_process.send_telemetry(
            telemetry_seconds
        ):
            log(f"some logs or events did not reach the API in {telemetry_seconds:g}s")
        code = report(run, state)
        log(f"finished: {state.type.value} ({run.timings})")
        return code, state
    except TaskRunAlreadyFinal as final:
        log(f"{final}; it was left as it is")
        record = FinalRecord(
            status=STATUS_ALREADY_FINAL,
            state_type=final.state.type.value,
            state_name=final.state.name,
            message=final.state.message,
        )
        try:
            run.write_record(record)
        except Exception as exc:  # the runner then sees a pod that ended without a word
            log(f"could not write {FINAL_STATE_JSON}: {exc}")
        return EXIT_TASK_NOT_COMPLETED, None
    except PhaseFailure as failure:
        message = f"Failed during {failure.phase}: {failure}"
        if failure.hint:
            message += f" — {failure.hint}"
        log(message)
        if index > 0:
            return EXIT_PHASE_FAILED, None  # host 0 alone writes the record
        cause = failure.__cause__ or failure
        record = FinalRecord(
            status=STATUS_PHASE_FAILED,
            phase=failure.phase,
            error_type=type(cause).__name__,
            message=message,
            traceback=format_traceback(cause, run),
        )
        try:
            run.write_record(record)
        except Exception as exc:  # the store itself is unreachable: the log is all we have
            log(f"could not write {FINAL_STATE_JSON}: {exc}")
        return EXIT_PHASE_FAILED, None
