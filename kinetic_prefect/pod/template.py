"""A preloaded Python that local pods fork from (`python -m kinetic_prefect.pod.template FD`).

Every pod process starts by importing Prefect, its task engine, cloudpickle and
the pod runtime: about a second and a half of CPU before the pod does anything.
The local backend starts this process once per pod environment instead; it
imports all of that and then forks one child per pod it is asked for over the
control socket `FD` (a SOCK_SEQPACKET socket, one JSON message per request).

A child becomes what `python -m kinetic_prefect.pod ARGS` would have been: a
session of its own, the pod's working directory, its log file as stdout and
stderr, exactly the environment it was given, and Prefect's settings and
logging read again from that environment. For each child the template sends
back its pidfd (SCM_RIGHTS) and, once the child has ended, its exit status.
When the backend's end of the socket closes, the template exits; running pods
go on, as pods do when the process that launched them goes away.
"""

from __future__ import annotations

import gc
import json
import os
import select
import socket
import sys
from typing import Any

from kinetic_prefect.pod.exit import FastExit

# Registered before anything else, as in `kinetic_prefect.pod.__main__`: a pod's
# own exit handlers run first, this one last.
fast_exit = FastExit()

# What every pod imports before its task runs, and the block a task whose results go
# to a saved GCS bucket carries (`common.prefect_pod_storage`).
PRELOADED = (
    "cloudpickle",
    "prefect",
    "prefect.task_engine",
    "kinetic_prefect.pod.entrypoint",
    "kinetic_prefect.common.prefect_pod_storage",
)
_MAX_MESSAGE = 1 << 20


def preload() -> None:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)


def serve(control: socket.socket) -> None:
    """Fork a pod per request until the backend closes its end; report each pod's exit."""
    children: dict[int, int] = {}  # pidfd → pid
    control_fd = control.fileno()
    while True:
        readable, _, _ = select.select([control_fd, *children], [], [])
        for fd in readable:
            if fd == control_fd:
                message = control.recv(_MAX_MESSAGE)
                if not message:
                    return
                pid = os.fork()
                if pid == 0:
                    become_pod(json.loads(message), control, list(children))
                pidfd = os.pidfd_open(pid)
                children[pidfd] = pid
                socket.send_fds(control, [json.dumps({"pid": pid}).encode()], [pidfd])
            else:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                code = os.waitstatus_to_exitcode(status)
                control.send(json.dumps({"exit": pid, "code": code}).encode())


def become_pod(request: dict[str, Any], control: socket.socket, fds: list[int]) -> None:
    """In the forked child: turn into the pod `request` describes, run it and exit."""
    try:
        control.close()
        for fd in fds:
            os.close(fd)
        os.setsid()
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        _as_fresh_process(request["argv"])
    except BaseException as exc:  # noqa: BLE001 - nothing of the template may run on in a pod
        os.write(2, f"kinetic-prefect: could not start the pod process: {exc!r}\n".encode())
        os._exit(127)
    from kinetic_prefect.pod.entrypoint import main

    fast_exit.code = main()
    # Ends as `python -m` does: non-daemon threads joined, exit handlers run.
    raise SystemExit(fast_exit.code)


def _as_fresh_process(argv: list[str]) -> None:
    """What a new interpreter would have read from the environment it started in."""
    import random
    import tempfile

    import kinetic_prefect.pod
    from kinetic_prefect.pod.prefect_process import reload_prefect_settings

    sys.argv = [os.path.join(os.path.dirname(kinetic_prefect.pod.__file__), "__main__.py"), *argv]
    sys.path[0] = os.getcwd()
    tempfile.tempdir = None
    random.seed()
    reload_prefect_settings()
    _reread_kubeconfig_location()


def _reread_kubeconfig_location() -> None:
    """kubernetes-asyncio's default kubeconfig, which it reads from `KUBECONFIG` (else
    `~/.kube/config`) on import: the pod's, not the template's (a pod's own code may call
    `load_kube_config()` without a path). The test
    `test_a_forked_pod_sees_exactly_the_environment_a_fresh_pod_would` fails if
    kubernetes-asyncio stops keeping it there."""
    kube_config = sys.modules.get("kubernetes_asyncio.config.kube_config")
    if kube_config is not None:
        default = os.path.join(os.path.expanduser("~"), ".kube", "config")
        kube_config.__dict__["KUBE_CONFIG_DEFAULT_LOCATION"] = os.environ.get("KUBECONFIG", default)


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    # As in `python -m kinetic_prefect.pod`: no collector while the pods' modules load
    # (each forked pod starts it: `runner.start_collecting`). Frozen before the first fork,
    # so that no pod's collector walks the preloaded objects, writing to pages the pods
    # would otherwise share with the template.
    gc.disable()
    preload()
    gc.freeze()
    serve(control)


if __name__ == "__main__":
    main()
