"""Local pods forked from a preloaded template process instead of started cold.

A pod's process spends most of its start importing Prefect (`docs/local-pods.md`).
The local backend keeps one template process per startup environment
(`kinetic_prefect.pod.template`), which has imported what every pod imports,
and forks each pod from it. A forked pod gets exactly the environment a fresh
one would; what a template was started with only has to match the pod in the
variables that are read while Python and the preloaded modules start
(`startup_env`); the rest (Kinetic and Prefect settings, cloud settings, the
pod's own paths) may differ, since nothing read them yet, and Prefect's
settings are read again in the pod.

Templates are shared by every backend of this process. One that stops
answering is replaced; a pod whose command is not the pod runtime, or when the
template is off (`KINETIC_LOCAL_TEMPLATE=0`), starts as a fresh process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import site
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from kinetic_prefect.common.intervals import Intervals

TEMPLATE_ENV = "KINETIC_LOCAL_TEMPLATE"
POD_MODULE = "kinetic_prefect.pod"
_MAX_TEMPLATES = 4
_UNKNOWN_EXIT = 255

# Read while Python, the C library and the preloaded modules start (the test
# `test_the_preloaded_modules_read_only_startup_variables_at_import` keeps this true).
_STARTUP_PREFIXES = (
    "PYTHON",
    "_PYTHON",
    "LC_",
    "LD_",
    "MALLOC",
    "SSL",
    "OPENSSL",
    "OTEL_",
    "WEBSOCKETS_",
    "PROMETHEUS_",
    "prometheus_",
    "PYDANTIC",
    "COOLNAME_",
    "FSSPEC_",
    "PENDULUM_",
    "GRIFFE_",
    # The libraries of prefect-gcp and prefect-kubernetes (kinetic_prefect.blocks.*).
    "AIOHTTP_",
    "FROZENLIST_",
    "MULTIDICT_",
    "PROPCACHE_",
    "YARL_",
    "TORNADO_",
    "CLOUDSDK_",
    "GOOGLE_API_",
    "GRPC_",
    "HTTPLIB2_",
    "PROTOCOL_BUFFERS_",
    "PYPARSING",
    "TTY_",
)
_STARTUP_NAMES = frozenset(
    {"PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "DO_NOT_TRACK"}
    # Continuous-integration markers Prefect's analytics looks at on import.
    | {"CI", "APPVEYOR", "BITBUCKET_COMMIT", "BUDDY", "BUILDKITE", "CIRCLECI", "CI_NAME"}
    | {"CODEBUILD_BUILD_ID", "DRONE", "GITHUB_ACTIONS", "GITLAB_CI", "JENKINS_URL"}
    | {"SEMAPHORE", "TEAMCITY_VERSION", "TF_BUILD", "TRAVIS"}
    # Terminal size and colour (rich), Google API endpoints.
    | {"COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR"}
    | {"API_ENDPOINT_OVERRIDE", "API_VERSION_OVERRIDE", "ENABLE_GCS_PYTHON_CLIENT_OTEL_TRACES"}
    | {"TEMPORARILY_DISABLE_PROTOBUF_VERSION_CHECK"}
)
# Prefect settings Prefect reads on import and does not read again with the rest.
_STARTUP_PREFECT = ("TEST_MODE", "PREFECT_PLUGINS_")


def is_startup_variable(name: str) -> bool:
    if name == "HOME":
        # Python reads it on start only for the user's site-packages (off in a virtualenv);
        # Prefect's home, derived from it, is read again in the pod.
        return site.ENABLE_USER_SITE is True
    if name.startswith("PREFECT_"):
        return any(part in name for part in _STARTUP_PREFECT)
    return name in _STARTUP_NAMES or name.startswith(_STARTUP_PREFIXES)


def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a pod's environment its template must have been started with."""
    return {k: v for k, v in env.items() if is_startup_variable(k)}


def forkable(command: list[str]) -> bool:
    """Whether a pod with this command can fork from a template (`python -m` the pod runtime)."""
    if os.environ.get(TEMPLATE_ENV, "1").strip().lower() in {"0", "false", "no", "off"}:
        return False
    return command[1:3] == ["-m", POD_MODULE] and hasattr(os, "pidfd_open")


class TemplateChild:
    """A pod process a template forked: the part of `subprocess.Popen` the backend uses."""

    def __init__(self, pid: int, template: PodTemplate) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._template = template

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._template.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired([POD_MODULE], timeout or 0)
        return self.returncode


class PodTemplate:
    """One template process and its control socket."""

    def __init__(self, env: Mapping[str, str], interpreter: str = sys.executable) -> None:
        self.env = dict(env)
        # How long the template may take to answer a fork request.
        self._reply_seconds = Intervals.from_environ(os.environ).template_reply_seconds
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._control = ours
        with theirs:
            self._process = subprocess.Popen(
                [interpreter, "-m", "kinetic_prefect.pod.template", str(theirs.fileno())],
                env=self.env,
                cwd="/",
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._send_lock = threading.Lock()
        self._replies: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        self._ended = threading.Condition()
        self.closed = False
        threading.Thread(target=self._read, name="kinetic-pod-template", daemon=True).start()

    @property
    def idle(self) -> bool:
        with self._ended:
            return not self._live

    def spawn(
        self, argv: list[str], env: Mapping[str, str], cwd: Path, log: Path
    ) -> tuple[TemplateChild, int]:
        """Fork a pod running `python -m kinetic_prefect.pod *argv`; its handle and pidfd."""
        request = {"argv": argv, "env": dict(env), "cwd": str(cwd), "log": str(log)}
        with self._send_lock:
            if self.closed:
                raise OSError("the pod template has ended")
            self._control.send(json.dumps(request).encode())
            try:
                reply = self._replies.get(timeout=self._reply_seconds)
            except queue.Empty:
                reply = None
            if reply is None:
                self.close()
                raise OSError("the pod template did not answer")
        pid, pidfd = reply
        with self._ended:
            self._live.add(pid)
        return TemplateChild(pid, self), pidfd

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self._ended:
            self._ended.wait_for(lambda: pid in self._exits, timeout)
            return self._exits.pop(pid, None)

    def _read(self) -> None:
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self._control, 4096, 1)
            except OSError:
                message, fds = b"", []
            if not message:
                break
            reply = json.loads(message)
            if "pid" in reply:
                self._replies.put((reply["pid"], fds[0]))
                continue
            with self._ended:
                self._exits[reply["exit"]] = reply["code"]
                self._live.discard(reply["exit"])
                self._ended.notify_all()
        # The template is gone: no exit status will come for the pods it forked.
        self.closed = True
        self._replies.put(None)
        with self._ended:
            for pid in self._live:
                self._exits.setdefault(pid, _UNKNOWN_EXIT)
            self._live.clear()
            self._ended.notify_all()

    def close(self) -> None:
        """Close the control socket: the template exits; pods it forked run on."""
        self.closed = True
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_RDWR)


class PodTemplates:
    """This process's templates, by interpreter and startup environment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._templates: dict[tuple[str, frozenset[tuple[str, str]]], PodTemplate] = {}
        atexit.register(self.close)

    def spawn(
        self, command: list[str], env: Mapping[str, str], cwd: Path, log: Path
    ) -> tuple[TemplateChild, int]:
        startup = frozenset(startup_env(env).items())
        key = (command[0], startup)
        with self._lock:
            template = self._templates.get(key)
            if template is None or template.closed:
                self._make_room()
                template = self._templates[key] = PodTemplate(dict(startup), command[0])
        return template.spawn(command[3:], env, cwd, log)

    def _make_room(self) -> None:
        for key, template in list(self._templates.items()):
            if template.closed:
                del self._templates[key]
        for key, template in list(self._templates.items()):
            if len(self._templates) < _MAX_TEMPLATES:
                return
            if template.idle:
                del self._templates[key]
                template.close()

    def close(self) -> None:
        with self._lock:
            templates = list(self._templates.values())
            self._templates.clear()
        for template in templates:
            template.close()


templates = PodTemplates()
