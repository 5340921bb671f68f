"""What a pod on a stock `python` image runs before kinetic-prefect exists in it.

Standard library only: the orchestrator sends this file's source as the
container's program (`python -c`), so it must run on a bare interpreter. Two
commands:

`run` makes the task's shipped environment ready and starts a module on it:
it downloads the environment's archive from the jobs store (the GCS JSON API
with the Workload Identity token of the metadata server, or the emulator named
by `STORAGE_EMULATOR_HOST`, or a local path), verifies its sha256, unpacks it
into the node's environment cache (`KINETIC_ENV_CACHE`) and runs the module
(`kinetic_prefect.pod`, or Prefect's CLI for a flow pod) with that
environment first on `sys.path`. An environment already unpacked on the node
is used as it is. A failure is the pod's "environment" phase failure: it
leaves a signed `final-state.json` in the job directory, as the pod runtime's
own phases do, and exits with the phase-failure code.

`unpack` is the pod's init container: it readies the environment in the cache
as `run` does, but trusts a copy already there only once every file's size,
mtime and ctime match the table in its marker and the marker's signature (the
record key) holds; otherwise it unpacks the archive again. The task container then mounts the cache
read-only and `run` finds the environment ready. See docs/environments.md.

`build` turns a build spec (the resolved pins, the platform and Python, the
local wheels) into the environment's archive: it installs the pins with uv
for the pod's platform into a directory and packs it, then writes the
archive, its manifest and, last, its marker. The builder Job runs it on the
cluster; `environment_builder="local"` runs the same command on the
orchestrator's machine. See docs/environments.md.

`test-iam` asks Cloud Storage (`testIamPermissions`) which of the given
permissions this pod's identity holds on each bucket, and prints the answer
as one JSON line after `IAM_ANSWER_PREFIX`: `kinetic-prefect doctor` runs it
in a short pod as the task pods' service account and reads it from the log.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import hmac
import http.client
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

# Written as in `kinetic_prefect.common` (a unit test keeps them equal): this file
# cannot import it, since the pod has no kinetic-prefect until the archive is unpacked.
ENV_CACHE_ENV = "KINETIC_ENV_CACHE"
SHIPPED_ENV_ENV = "KINETIC_SHIPPED_ENVIRONMENT"
SIGNING_KEY_ENV = "KINETIC_RECORD_KEY"
NODE_CACHE_KEY_ENV = "KINETIC_NODE_CACHE_KEY"
NODE_CACHE_KEY_MESSAGE = b"kinetic-prefect node cache key"
FINAL_STATE_JSON = "final-state.json"
STATUS_PHASE_FAILED = "phase-failed"
PHASE = "environment"
EXIT_PHASE_FAILED = 2
ARCHIVE_FILE = "environment.tar.gz"
MANIFEST_FILE = "manifest.json"
MARKER_FILE = "ready.json"
SPEC_FILE = "spec.json"
DEFAULT_CACHE = "/tmp/kinetic-env"
# Inside the unpacked directory, written once the whole archive is there.
UNPACKED_MARKER = ".kinetic-env-ready"
# Inside the environment: the spec it was built from (a flow pod plans its tasks' from it).
ENV_SPEC_FILE = "kinetic-environment.json"
# The records this file writes and reads, as the models of `kinetic_prefect.common.records`
# and `kinetic_prefect.common.environment_records` define them (kind, version, fields).
FINAL_STATE_KIND = "final-state"
FINAL_STATE_VERSION = 2
FINAL_STATE_FIELDS = (
    "status", "phase", "error_type", "message", "traceback", "state_type", "state_name",
    "versions", "timings", "state_pickle", "state_sha256", "result_storage_key",
    "result_sha256", "result_record", "next_job", "signature",
)  # fmt: skip
SPEC_KIND = "environment-spec"
SPEC_VERSION = 3
SPEC_FIELDS_READ = ("key", "python", "platform", "pins", "wheels", "index_url")
WHEEL_FIELDS = ("name", "sha256")
MANIFEST_KIND = "environment-manifest"
MANIFEST_VERSION = 1
MANIFEST_FIELDS = (
    "key", "sha256", "size", "files", "python", "platform", "pins", "wheels",
    "install_seconds", "pack_seconds", "built_by",
)  # fmt: skip
MARKER_KIND = "environment-marker"
MARKER_VERSION = 1
MARKER_FIELDS = ("sha256", "size", "files")


def new_record(kind: str, version: int, fields: tuple[str, ...], **values: object) -> dict:
    """A record as the models define it: its kind, its version and exactly its fields."""
    if set(values) != set(fields):
        raise ValueError(f"a {kind} record has fields {sorted(fields)}, not {sorted(values)}")
    return {"kind": kind, "version": version, **values}


# The metadata server, named as google-auth names it: `GCE_METADATA_HOST`, then its older
# name `GCE_METADATA_ROOT`, else the host every GKE and Compute Engine pod resolves.
METADATA_HOST_ENVS = ("GCE_METADATA_HOST", "GCE_METADATA_ROOT")
_METADATA_DEFAULT_HOST = "metadata.google.internal"
_METADATA_ACCOUNT_PATH = "/computeMetadata/v1/instance/service-accounts/default"
INTERVALS_ENV = "KINETIC_INTERVALS"
# The node cache's size cap, in GB (10^9 bytes); the launch setting `node_cache_max_gb`.
NODE_CACHE_MAX_GB_ENV = "KINETIC_NODE_CACHE_MAX_GB"
DEFAULT_NODE_CACHE_MAX_GB = 20.0
# What starts the line `test-iam` prints (read back by `kinetic_prefect.cli.doctor`).
IAM_ANSWER_PREFIX = "kinetic-prefect-iam: "
_GCS_HOST = "https://storage.googleapis.com"
_RETRY_STATUSES = (408, 429, 500, 502, 503, 504)
_ATTEMPTS = 6
_CHUNK = 1 << 20


class EnvironmentFailure(Exception):
    """The environment could not be made ready; the message says why and what to do."""


# -- storage: gs:// through the JSON API, or a local path ------------------------------------


def _metadata_host() -> str | None:
    """The metadata server to ask for a token; None in emulator mode without one."""
    for name in METADATA_HOST_ENVS:
        if os.environ.get(name):
            return os.environ[name]
    return None if os.environ.get("STORAGE_EMULATOR_HOST") else _METADATA_DEFAULT_HOST


def metadata_wait() -> float:
    """How long a pod keeps asking a metadata server that does not answer yet.

    `Intervals.metadata_wait_seconds`, from the manifest's `KINETIC_INTERVALS`: this file
    cannot import `kinetic_prefect.common.intervals`, so it reads the JSON itself, and
    the default is written again here (a unit test keeps the two equal).
    """
    try:
        changed = json.loads(os.environ.get(INTERVALS_ENV) or "{}")
        return float(changed.get("metadata_wait_seconds", 60.0))
    except (ValueError, TypeError, AttributeError):
        return 60.0


def _metadata_get(path: str) -> bytes:
    """GET a metadata path, retrying refusals and 5xx answers for `metadata_wait()`.

    Under Workload Identity GKE's metadata server does not answer a new pod for its
    first seconds (docs/kubernetes.md "Workload Identity at pod start").
    """
    url = f"http://{_metadata_host()}{_METADATA_ACCOUNT_PATH}{path}"
    deadline = time.monotonic() + metadata_wait()
    delay = 0.25
    while True:
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or time.monotonic() + delay > deadline:
                raise
        except OSError:
            if time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 4.0)


def _token() -> str | None:
    if _metadata_host() is None:
        return None
    try:
        return json.loads(_metadata_get("/token"))["access_token"]
    except (OSError, ValueError, KeyError) as exc:
        raise EnvironmentFailure(
            f"no credentials for GCS: the metadata server at {_metadata_host()} did not give "
            f"a token within {metadata_wait():g}s ({exc}); the pod's service account needs "
            "Workload Identity"
        ) from exc


def _gcs_host() -> str:
    return (os.environ.get("STORAGE_EMULATOR_HOST") or _GCS_HOST).rstrip("/")


def _split_gs(uri: str) -> tuple[str, str]:
    bucket, _, name = uri[len("gs://") :].partition("/")
    return bucket, name


def _gcs_message(exc: urllib.error.HTTPError) -> str:
    """The message of GCS's JSON error (a 403 names the caller and the permission)."""
    try:
        return str(json.loads(exc.read())["error"]["message"])
    except (OSError, ValueError, KeyError, TypeError):
        return str(exc.msg)


def _request(url: str, method: str = "GET", body: object = None, headers: dict | None = None):
    """Open `url` with retries on transient answers; the caller reads and closes the response."""
    headers = dict(headers or {})
    token = _token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    delay = 0.5
    for attempt in range(_ATTEMPTS):
        if hasattr(body, "seek"):
            body.seek(0)  # type: ignore[attr-defined]
        request = urllib.request.Request(url, data=body, method=method, headers=headers)  # type: ignore[arg-type]
        try:
            return urllib.request.urlopen(request, timeout=120)
        except urllib.error.HTTPError as exc:
            if exc.code not in _RETRY_STATUSES or attempt == _ATTEMPTS - 1:
                exc.msg = _gcs_message(exc)
                raise
        except (urllib.error.URLError, OSError):
            if attempt == _ATTEMPTS - 1:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 8.0)
    raise AssertionError("unreachable")


def download(uri: str, destination: Path) -> str:
    """Copy `uri` to `destination`; the sha256 of what arrived.

    A connection lost mid-body resumes where it stopped (an HTTP Range request), as
    long as each attempt brings more bytes; the caller verifies the sha256 of the whole.
    """
    if not uri.startswith("gs://"):
        shutil.copyfile(uri.removeprefix("file://"), destination)
        return _sha256(destination)
    bucket, name = _split_gs(uri)
    url = f"{_gcs_host()}/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media"
    received = 0
    total: int | None = None
    stalls = 0
    digest = hashlib.sha256()
    with open(destination, "wb") as out:
        while total is None or received < total:
            before = received
            # Every attempt after the first asks for the rest, even from byte 0.
            ranged = {"Range": f"bytes={received}-"} if total is not None else {}
            with _request(url, headers=ranged) as source:
                if ranged and source.status != 206:  # the Range was ignored: start over
                    out.seek(0)
                    out.truncate()
                    received = 0
                    digest = hashlib.sha256()
                total = _body_length(source, received)
                try:
                    while chunk := source.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        received += len(chunk)
                except (OSError, http.client.HTTPException):
                    pass  # resumed below
            if total is None:  # no length given: what arrived is all there is
                break
            stalls = 0 if received > before else stalls + 1
            if received < total and stalls >= _ATTEMPTS:
                raise EnvironmentFailure(
                    f"{uri}: the connection kept breaking at byte {received} of {total}"
                )
    return digest.hexdigest()


def _body_length(response, start: int) -> int | None:  # type: ignore[no-untyped-def]
    """The whole object's size from a 200's Content-Length or a 206's Content-Range."""
    ranged = response.headers.get("Content-Range", "")
    if response.status == 206 and "/" in ranged:
        size = ranged.rpartition("/")[2]
        return int(size) if size.isdigit() else None
    length = response.headers.get("Content-Length")
    return start + int(length) if length and length.isdigit() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as data:
        while chunk := data.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def upload(path_or_bytes: Path | bytes, uri: str) -> None:
    """Write a file or bytes to `uri` (an object, or a local path)."""
    if not uri.startswith("gs://"):
        target = Path(uri.removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        if isinstance(path_or_bytes, bytes):
            partial.write_bytes(path_or_bytes)
        else:
            shutil.copyfile(path_or_bytes, partial)
        os.replace(partial, target)
        return
    bucket, name = _split_gs(uri)
    url = (
        f"{_gcs_host()}/upload/storage/v1/b/{bucket}/o?uploadType=media&"
        f"name={urllib.parse.quote(name, safe='')}"
    )
    headers = {"Content-Type": "application/octet-stream"}
    if isinstance(path_or_bytes, bytes):
        headers["Content-Length"] = str(len(path_or_bytes))
        _request(url, "POST", path_or_bytes, headers).close()
        return
    headers["Content-Length"] = str(path_or_bytes.stat().st_size)
    with open(path_or_bytes, "rb") as body:
        _request(url, "POST", body, headers).close()


def read_text(uri: str) -> str:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "object"
        download(uri, path)
        return path.read_text()


# -- the archive -------------------------------------------------------------------------------


def _gnu_tar() -> str | None:
    """GNU tar, when the image has it (`python:*-slim` does): several times faster than tarfile."""
    found = shutil.which("tar")
    if not found:
        return None
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return None
    return found if "GNU tar" in version and shutil.which("gzip") else None


def pack(directory: Path, archive: Path) -> tuple[str, int]:
    """A gzip tar of `directory`'s contents, in a fixed order; its sha256 and file count."""
    files = sum(len(names) + len(dirs) for _, dirs, names in os.walk(directory))
    tar = _gnu_tar()
    if tar:
        # Sorted names, no timestamps in the gzip header, root-owned: reproducible bytes.
        command = [tar, "--sort=name", "--owner=0", "--group=0", "--numeric-owner"]
        command += ["--format=pax", "--pax-option=delete=atime,delete=ctime"]
        command += ["-C", str(directory), "-cf", "-", "."]
        with open(archive, "wb") as out:
            packer = subprocess.Popen(command, stdout=subprocess.PIPE)
            zipper = subprocess.Popen(["gzip", "-1", "-n"], stdin=packer.stdout, stdout=out)
            assert packer.stdout is not None
            packer.stdout.close()
            if zipper.wait() != 0 or packer.wait() != 0:
                raise EnvironmentFailure(f"packing {directory} failed (tar or gzip)")
    else:
        _pack_with_tarfile(directory, archive)
    return _sha256(archive), files


def _pack_with_tarfile(directory: Path, archive: Path) -> None:
    with (
        open(archive, "wb") as raw,
        gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=1, mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for root, dirs, names in os.walk(directory):
            dirs.sort()
            for name in sorted(names):
                path = Path(root, name)
                info = tar.gettarinfo(str(path), str(path.relative_to(directory)))
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if info.isreg():
                    with open(path, "rb") as content:
                        tar.addfile(info, content)
                else:
                    tar.addfile(info)


def unpack(archive: Path, directory: Path) -> None:
    """Unpack an environment archive (already verified), nothing outside `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tar = _gnu_tar()
    if tar:
        # GNU tar refuses members with `..` and strips leading `/`.
        subprocess.run(
            [tar, "-xzf", str(archive), "-C", str(directory), "--no-same-owner"],
            check=True,
            capture_output=True,
        )
        return
    with tarfile.open(archive, "r:gz") as packed:
        packed.extractall(directory, filter="data")


# -- run ---------------------------------------------------------------------------------------


def node_cache_entry(key: str, sha256: str) -> str:
    """The node cache's directory for environment `key`'s archive `sha256` (one per archive:
    a rebuilt environment never replaces the files running pods use). As
    `kinetic_prefect.launch.environment.node_cache_entry`."""
    return f"{key}-{sha256[:16]}"


def ready_environment(archive_uri: str, sha256: str, key: str) -> Path:
    """The unpacked environment on this node: unpacked now unless an earlier pod did it."""
    cache = Path(os.environ.get(ENV_CACHE_ENV) or DEFAULT_CACHE)
    key = node_cache_entry(key, sha256)
    target = cache / key
    cache.mkdir(parents=True, exist_ok=True)
    hold_in_use(cache, key)
    if (target / UNPACKED_MARKER).is_file():
        return target
    # Pods starting together on a node unpack once: the others wait for the first.
    with open(cache / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / UNPACKED_MARKER).is_file():
            return target
        _download_and_unpack(archive_uri, sha256, cache, target)
    # Pruned once the lock is released: the pods waiting for this environment start now.
    prune_cache(cache, node_cache_max_bytes(), keep=key)
    return target


def _download_and_unpack(archive_uri: str, sha256: str, cache: Path, target: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name[:12]}-", dir=cache))
    try:
        archive = scratch / ARCHIVE_FILE
        try:
            arrived = download(archive_uri, archive)
        except (OSError, urllib.error.URLError) as exc:
            raise EnvironmentFailure(
                f"could not download {archive_uri}: {exc}; check that the pod's service account "
                "can read that bucket (Workload Identity and roles/storage.objectAdmin, see "
                'docs/kubernetes.md "Permissions")'
            ) from exc
        if arrived != sha256:
            raise EnvironmentFailure(
                f"{archive_uri} has sha256 {arrived}, not {sha256}: it changed after it was "
                "uploaded, so it is refused; `kinetic-prefect env build` uploads it again"
            )
        unpacked = scratch / "env"
        unpack(archive, unpacked)
        archive.unlink()
        marker = _signed_marker(sha256, unpacked)
        (unpacked / UNPACKED_MARKER).write_text(json.dumps(marker))
        size = sum(stat[0] for stat in marker["files"].values())  # type: ignore[attr-defined]
        (cache / f".{target.name}.size").write_text(str(size))
        if target.exists():
            # A refused copy (or a partial one of an interrupted pod) leaves by a rename, not
            # by deleting it in place: pods started on it may still be importing from it,
            # and the new copy takes its name at once.
            doomed = Path(tempfile.mkdtemp(prefix=f".{target.name[:12]}{_REMOVED}", dir=cache))
            os.rename(target, doomed / target.name)
            _delete_behind([doomed])
        os.rename(unpacked, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- the node cache: least recently used environments go past the size cap --------------------
#
# Each pod holds a shared flock on its environment's `.{key}.use` for its whole life and
# touches that file when it starts: its mtime is the environment's last use. A pod that
# unpacked a new environment then prunes (one pod at a time, `.prune.lock`): it removes an
# environment only when it gets that lock exclusively without waiting, and holds it only
# while the environment is renamed away, so no environment a running pod uses goes away and
# a pod starting meanwhile waits no longer than a rename (then unpacks it again). The lock
# files stay (a few bytes each): removing a lock file another pod holds open would let two
# pods lock two different files.

_HELD_IN_USE: list[object] = []  # open for the pod's life: closing one releases its lock


def hold_in_use(cache: Path, key: str) -> None:
    """Mark `key` used now and in use until this process ends (see above)."""
    try:
        use = open(cache / f".{key}.use", "a")  # noqa: SIM115 (held until the process ends)
    except OSError:  # a read-only cache: nothing here prunes it
        return
    fcntl.flock(use, fcntl.LOCK_SH)
    os.utime(use.fileno())
    _HELD_IN_USE.append(use)


def node_cache_max_bytes() -> int:
    """The node cache's size cap (`KINETIC_NODE_CACHE_MAX_GB`, default 20 GB)."""
    try:
        return int(float(os.environ.get(NODE_CACHE_MAX_GB_ENV) or DEFAULT_NODE_CACHE_MAX_GB) * 1e9)
    except ValueError:
        return int(DEFAULT_NODE_CACHE_MAX_GB * 1e9)


def prune_plan(entries: list[tuple[str, int, float]], max_bytes: int, keep: set[str]) -> list[str]:
    """The environments to remove, least recently used first, until the rest fit `max_bytes`.

    `entries` are (key, size in bytes, last use); `keep` are never removed (in use, or
    being readied), even when the rest cannot fit without them.
    """
    total = sum(size for _, size, _ in entries)
    removed = []
    for key, size, _ in sorted(entries, key=lambda entry: entry[2]):
        if total <= max_bytes:
            break
        if key not in keep:
            removed.append(key)
            total -= size
    return removed


def _tree_size(directory: Path) -> int:
    total = 0
    for root, _, names in os.walk(directory):
        for name in names:
            with contextlib.suppress(OSError):  # removed meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _cached_size(cache: Path, key: str) -> int:
    """The unpacked size of `key`, walked once and then kept beside it."""
    record = cache / f".{key}.size"
    try:
        return int(record.read_text())
    except (OSError, ValueError):
        size = _tree_size(cache / key)
        record.write_text(str(size))
        return size


def prune_cache(cache: Path, max_bytes: int, keep: str) -> list[str]:
    """Remove least recently used environments past `max_bytes`; the keys removed."""
    removed: list[str] = []
    with open(cache / ".prune.lock", "w") as prune_lock:
        fcntl.flock(prune_lock, fcntl.LOCK_EX)
        entries, busy = [], {keep}
        # What an earlier pod moved out and did not live to delete.
        doomed = [path for path in cache.glob(f".*{_REMOVED}*") if path.is_dir()]
        for path in cache.iterdir():
            if path.name.startswith(".") or not (path / UNPACKED_MARKER).is_file():
                continue
            use = cache / f".{path.name}.use"
            with _unused(use) as unused:
                if not unused:
                    busy.add(path.name)
            entries.append((path.name, _cached_size(cache, path.name), use.stat().st_mtime))
        for key in prune_plan(entries, max_bytes, busy):
            with _unused(cache / f".{key}.use") as unused:
                if not unused:  # a pod started on it since
                    continue
                (cache / key / UNPACKED_MARKER).unlink()  # never half an environment ready
                doomed.append(Path(tempfile.mkdtemp(prefix=f".{key[:12]}{_REMOVED}", dir=cache)))
                os.rename(cache / key, doomed[-1] / key)
            (cache / f".{key}.size").unlink(missing_ok=True)
            removed.append(key)
    _delete_behind(doomed)
    if removed:
        sys.stderr.write(
            f"kinetic-prefect pod: node cache over {max_bytes / 1e9:g} GB: removed the least "
            f"recently used environment(s) {', '.join(k[:12] for k in removed)}\n"
        )
    return removed


_REMOVED = "-removed-"


def _delete_behind(directories: list[Path]) -> None:
    """Delete `directories` in a child process, so that the task starts meanwhile.

    Out of the cache already (renamed): a pod that ends first leaves them to the next
    pod that prunes.
    """
    if directories:
        subprocess.Popen(  # noqa: S603 (this interpreter, fixed code, our own paths)
            [sys.executable, "-c", "import shutil, sys\n"
             "for path in sys.argv[1:]: shutil.rmtree(path, ignore_errors=True)",
             *map(str, directories)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip


@contextlib.contextmanager
def _unused(use: Path) -> Iterator[bool]:
    """Whether `use` is locked by no pod; while True, this process holds it exclusively."""
    with open(use, "a") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True


def stat_table(directory: Path) -> dict[str, list[int]]:
    """Every entry under `directory` (but the unpacked marker): its size, mtime and ctime.

    Entries are `lstat`ed, never followed. Nobody can set a ctime: any write, chmod,
    rename or `os.utime` sets it to now, so a file changed after the table was taken
    no longer matches it, even with its size and mtime put back.
    """
    table: dict[str, list[int]] = {}
    pending = [("", str(directory))]
    while pending:
        prefix, path = pending.pop()
        with os.scandir(path) as entries:
            for entry in entries:
                relative = prefix + entry.name
                if relative == UNPACKED_MARKER:
                    continue
                info = entry.stat(follow_symlinks=False)
                table[relative] = [info.st_size, info.st_mtime_ns, info.st_ctime_ns]
                if entry.is_dir(follow_symlinks=False):
                    pending.append((relative + "/", entry.path))
    return table


def node_cache_key(master: str) -> str:
    """The node-cache key of a master record key (`kinetic_prefect.runner.record_key`)."""
    return hmac.new(master.encode(), NODE_CACHE_KEY_MESSAGE, hashlib.sha256).hexdigest()


def _node_cache_key() -> str | None:
    """The key of this pod's node-cache markers.

    A task pod is given it (`KINETIC_NODE_CACHE_KEY`); a flow pod holds the master record
    key itself and derives it, as its runner does for the task pods it launches.
    """
    given = os.environ.get(NODE_CACHE_KEY_ENV)
    if given:
        return given
    master = os.environ.get(SIGNING_KEY_ENV)
    return node_cache_key(master) if master else None


def _marker_signature(sha256: str, files: dict[str, list[int]]) -> str | None:
    key = _node_cache_key()
    if not key:
        return None
    signed = sha256.encode() + b":" + json.dumps(files, sort_keys=True).encode()
    return hmac.new(key.encode(), signed, hashlib.sha256).hexdigest()


def _signed_marker(sha256: str, directory: Path) -> dict[str, object]:
    """What an unpacked environment's marker says: the archive, every entry's stat, a signature.

    Taken once every file is written and its times set, before the rename into the cache
    (which changes the ctime of the renamed directory only, not of anything inside it).
    """
    files = stat_table(directory)
    return {"sha256": sha256, "files": files, "signature": _marker_signature(sha256, files)}


def cached_copy_problem(target: Path, sha256: str) -> str | None:
    """Why the node's copy at `target` is not the archive `sha256` unpacked; None if it is.

    The marker names the archive and the stat of every entry unpacked from it, signed with
    the record key the runner gives its pods. Every entry is `lstat`ed again and compared:
    no file is read, so reuse costs one `lstat` per file (docs/environments.md says what
    this cannot see).
    """
    try:
        marker = json.loads((target / UNPACKED_MARKER).read_text())
    except FileNotFoundError:
        return "not unpacked on this node"
    except (OSError, ValueError) as exc:
        return f"its marker is unreadable ({exc})"
    if not isinstance(marker, dict) or marker.get("sha256") != sha256:
        return "its marker names another archive"
    files = marker.get("files")
    if not isinstance(files, dict):
        return "its marker has no table of the unpacked files"
    expected = _marker_signature(sha256, files)
    if expected is not None and not hmac.compare_digest(expected, str(marker.get("signature"))):
        return "its marker is not signed with this runner's node-cache key"
    found = stat_table(target)
    added = sorted(found.keys() - files.keys())
    if added:
        return f"entries added since it was unpacked: {len(added)} (first {added[0]})"
    removed = sorted(files.keys() - found.keys())
    if removed:
        return f"entries removed since it was unpacked: {len(removed)} (first {removed[0]})"
    changed = sorted(name for name, stat in found.items() if stat != files[name])
    if changed:
        return f"entries changed since it was unpacked: {len(changed)} (first {changed[0]})"
    return None


def verified_environment(archive_uri: str, sha256: str, key: str) -> Path:
    """The environment in the node cache, unpacked again unless the copy there verifies."""
    cache = Path(os.environ.get(ENV_CACHE_ENV) or DEFAULT_CACHE)
    key = node_cache_entry(key, sha256)
    target = cache / key
    cache.mkdir(parents=True, exist_ok=True)
    hold_in_use(cache, key)  # its last use is now (the task container mounts it read-only)
    with open(cache / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        problem = cached_copy_problem(target, sha256)
        if problem is None:
            return target
        if (target / UNPACKED_MARKER).exists():
            sys.stderr.write(
                f"kinetic-prefect pod: the node's copy of environment {key[:12]} is "
                f"refused ({problem}); unpacking it again\n"
            )
        _download_and_unpack(archive_uri, sha256, cache, target)
    # Pruned once the lock is released: the pods waiting for this environment start now.
    prune_cache(cache, node_cache_max_bytes(), keep=key)
    return target


def start_module(environment: Path, module: str, args: list[str]) -> None:
    """Run `python -m module args` with the environment first on the path."""
    import runpy
    import site

    before = list(sys.path)
    site.addsitedir(str(environment))  # also runs the environment's .pth files
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before
    # Processes the task starts (`python -m ...`) see the environment too.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(environment), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def record_failure(job_dir: str, message: str, error: BaseException) -> None:
    """Leave the phase failure in the job directory, as the pod runtime's phases do."""
    fields: dict[str, object] = {
        "status": STATUS_PHASE_FAILED,
        "phase": PHASE,
        "error_type": type(error).__name__,
        "message": message,
        "traceback": "".join(traceback.format_exception(error)),
        "state_type": None,
        "state_name": None,
        "versions": {},
        "timings": {},
        "state_pickle": None,
        "state_sha256": None,
        "result_storage_key": None,
        "result_sha256": None,
        "result_record": None,
        "next_job": None,
    }
    unsigned = {"kind": FINAL_STATE_KIND, "version": FINAL_STATE_VERSION, **fields}
    key = os.environ.get(SIGNING_KEY_ENV)
    signature = None
    if key:
        signed = json.dumps(unsigned, sort_keys=True).encode()
        signature = hmac.new(key.encode(), signed, hashlib.sha256).hexdigest()
    record = new_record(
        FINAL_STATE_KIND, FINAL_STATE_VERSION, FINAL_STATE_FIELDS, **fields, signature=signature
    )
    upload(json.dumps(record, sort_keys=True).encode(), f"{job_dir.rstrip('/')}/{FINAL_STATE_JSON}")


def _fail(options: argparse.Namespace, exc: BaseException) -> int:
    """Report the environment phase's failure, in the log and in the job directory."""
    message = f"Failed during {PHASE}: {exc}"
    sys.stderr.write(f"kinetic-prefect pod: {message}\n")
    if options.job_dir:
        try:
            record_failure(options.job_dir, message, exc)
        except Exception as write_error:  # the log is all that is left
            sys.stderr.write(f"kinetic-prefect pod: could not write the record: {write_error}\n")
    return EXIT_PHASE_FAILED


def unpack_for_pod(options: argparse.Namespace) -> int:
    """The `unpack` command of a pod's init container: ready and verify, then exit."""
    started = time.monotonic()
    try:
        verified_environment(options.archive, options.sha256, options.key)
    except Exception as exc:
        return _fail(options, exc)
    sys.stderr.write(
        f"kinetic-prefect pod: environment {options.key[:12]} verified in "
        f"{time.monotonic() - started:.2f}s\n"
    )
    return 0


def run(options: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        # On a cluster (the environment in GCS), whether or not the environment is on the
        # node, wait for the metadata server here: google-auth in the pod runtime gives up
        # on it within seconds (docs/kubernetes.md "Workload Identity at pod start").
        if options.archive.startswith("gs://"):
            _token()
        environment = ready_environment(options.archive, options.sha256, options.key)
    except Exception as exc:
        return _fail(options, exc)
    sys.stderr.write(
        f"kinetic-prefect pod: environment {options.key[:12]} ready in "
        f"{time.monotonic() - started:.2f}s\n"
    )
    # What a runner in this pod (a flow pod's) starts its own task pods from.
    os.environ[SHIPPED_ENV_ENV] = json.dumps(
        {"key": options.key, "archive": options.archive, "sha256": options.sha256,
         "directory": str(environment)}
    )  # fmt: skip
    start_module(environment, options.module, options.args)
    return 0


# -- build -------------------------------------------------------------------------------------


def _uv() -> list[str]:
    """A uv to build with: this Python's, else one installed with pip for the build."""
    try:
        from uv import find_uv_bin  # type: ignore[import-not-found]

        return [find_uv_bin()]
    except ImportError:
        pass
    found = shutil.which("uv")
    if found:
        return [found]
    tools = Path(tempfile.mkdtemp(prefix="kinetic-uv-"))
    index = os.environ.get("PIP_INDEX_URL")
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tools)]
    command += ["--disable-pip-version-check", "--no-warn-script-location"]
    command += (["--index-url", index] if index else []) + [
        f"uv=={os.environ['KINETIC_UV_VERSION']}"
    ]
    subprocess.run(command, check=True)
    return [str(tools / "bin" / "uv")]


def install(spec: dict, wheels: list[Path], target: Path) -> None:
    """Install the spec's pins and wheels into `target`, for the spec's platform and Python."""
    pins = target.parent / "pins.txt"
    pins.write_text("\n".join(spec["pins"]) + "\n")
    common = ["--target", str(target), "--python-platform", spec["platform"]]
    common += ["--python-version", spec["python"], "--no-deps", "--compile-bytecode", "--quiet"]
    # Copies, not hard links into uv's cache: the archive is packed from these files, and a
    # link count another build changes meanwhile makes tar report a file changed as it read.
    common += ["--link-mode", "copy"]
    if spec.get("index_url"):
        common += ["--index-url", spec["index_url"]]
    uv = _uv()
    environ = {**os.environ, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_CONFIG": "1"}
    result = subprocess.run(
        [*uv, "pip", "install", *common, "-r", str(pins)],
        env=environ,
        capture_output=True,
        text=True,
    )
    if result.returncode == 0 and wheels:
        result = subprocess.run(
            [*uv, "pip", "install", *common, *map(str, wheels)],
            env=environ,
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        raise EnvironmentFailure(f"uv could not install the environment:\n{result.stderr.strip()}")


def build(options: argparse.Namespace) -> int:
    if options.out:
        return _build(options, Path(options.out))
    # Scratch space (1-2 GB for a TPU stack): removed once the archive is uploaded, so a
    # builder leaves nothing behind wherever it runs.
    work = Path(tempfile.mkdtemp(prefix="kinetic-env-"))
    try:
        return _build(options, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _build(options: argparse.Namespace, work: Path) -> int:
    spec_uri = options.spec
    spec = json.loads(read_text(spec_uri))
    if (spec.get("kind"), spec.get("version")) != (SPEC_KIND, SPEC_VERSION):
        raise EnvironmentFailure(
            f"{spec_uri} is a {spec.get('kind')!r} record of version {spec.get('version')!r}, "
            f"not a {SPEC_KIND!r} record of version {SPEC_VERSION}: the orchestrator's "
            "kinetic-prefect is not this builder's version"
        )
    source = spec_uri.rpartition("/")[0]
    destination = (options.upload or "").rstrip("/")
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    wheels = []
    for wheel in spec["wheels"]:
        path = work / "wheels" / wheel["name"]
        path.parent.mkdir(exist_ok=True)
        if download(f"{source}/wheels/{wheel['name']}", path) != wheel["sha256"]:
            raise EnvironmentFailure(f"wheel {wheel['name']} changed after it was uploaded")
        wheels.append(path)
    target = work / "env"
    shutil.rmtree(target, ignore_errors=True)
    install(spec, wheels, target)
    (target / ENV_SPEC_FILE).write_text(json.dumps(spec, indent=1))
    installed = time.monotonic()
    archive = work / ARCHIVE_FILE
    sha256, files = pack(target, archive)
    manifest = new_record(
        MANIFEST_KIND,
        MANIFEST_VERSION,
        MANIFEST_FIELDS,
        key=spec["key"],
        sha256=sha256,
        size=archive.stat().st_size,
        files=files,
        python=spec["python"],
        platform=spec["platform"],
        pins=spec["pins"],
        wheels=[{name: wheel[name] for name in WHEEL_FIELDS} for wheel in spec["wheels"]],
        install_seconds=round(installed - started, 2),
        pack_seconds=round(time.monotonic() - installed, 2),
        built_by=options.built_by,
    )
    (work / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    if destination:
        upload(archive, f"{destination}/{ARCHIVE_FILE}")
        upload(json.dumps(manifest, indent=1).encode(), f"{destination}/{MANIFEST_FILE}")
        marker = new_record(
            MARKER_KIND, MARKER_VERSION, MARKER_FIELDS,
            sha256=sha256, size=manifest["size"], files=files,
        )  # fmt: skip
        upload(json.dumps(marker).encode(), f"{destination}/{MARKER_FILE}")
    sys.stderr.write(
        f"kinetic-prefect builder: environment {spec['key'][:12]}: {files} files, "
        f"{manifest['size'] / 1e6:.1f} MB in {time.monotonic() - started:.1f}s\n"
    )
    return 0


def _account_email() -> str | None:
    """The Google service account this pod acts as, when a metadata server says so."""
    if _metadata_host() is None:
        return None
    try:
        return _metadata_get("/email").decode().strip() or None
    except OSError:
        return None


def test_iam(wanted: dict) -> dict:
    """Which of `wanted` (bucket -> permissions) this pod holds; an error in place of a list."""
    buckets: dict = {}
    for bucket, permissions in wanted.items():
        query = urllib.parse.urlencode([("permissions", p) for p in permissions])
        url = (
            f"{_gcs_host()}/storage/v1/b/{urllib.parse.quote(bucket, safe='')}"
            f"/iam/testPermissions?{query}"
        )
        try:
            with _request(url) as response:
                buckets[bucket] = json.load(response).get("permissions", [])
        except urllib.error.HTTPError as exc:
            buckets[bucket] = {"error": f"HTTP {exc.code}: {exc.msg}"}
        except (OSError, ValueError, EnvironmentFailure) as exc:
            buckets[bucket] = {"error": str(exc)}
    return {"account": _account_email(), "buckets": buckets}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kinetic-prefect-bootstrap")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--archive", required=True)
    run_parser.add_argument("--sha256", required=True)
    run_parser.add_argument("--key", required=True)
    run_parser.add_argument("--job-dir", default="")
    run_parser.add_argument("--module", required=True)
    run_parser.add_argument("args", nargs=argparse.REMAINDER)
    unpack_parser = commands.add_parser("unpack")
    unpack_parser.add_argument("--archive", required=True)
    unpack_parser.add_argument("--sha256", required=True)
    unpack_parser.add_argument("--key", required=True)
    unpack_parser.add_argument("--job-dir", default="")
    build_parser = commands.add_parser("build")
    build_parser.add_argument("--spec", required=True)
    build_parser.add_argument("--upload", default="")
    build_parser.add_argument("--out", default="")
    build_parser.add_argument("--built-by", default="builder Job")
    iam_parser = commands.add_parser("test-iam")
    iam_parser.add_argument("--wanted", required=True, help="JSON: bucket -> permissions")
    options = parser.parse_args(argv)
    if options.command == "test-iam":
        answer = test_iam(json.loads(options.wanted))
        print(IAM_ANSWER_PREFIX + json.dumps(answer, sort_keys=True), flush=True)
        return 0
    if options.command == "unpack":
        return unpack_for_pod(options)
    if options.command == "run":
        if options.args[:1] == ["--"]:
            options.args = options.args[1:]
        return run(options)
    try:
        return build(options)
    except EnvironmentFailure as failure:
        sys.stderr.write(f"kinetic-prefect builder: {failure}\n")
        return EXIT_PHASE_FAILED


if __name__ == "__main__":
    sys.exit(main())
