"""How `make test` shares the suite among pytest-xdist workers (`-n N`, `--dist loadgroup`).

- One work unit per test, handed out in collection order, except that each module of a
  folder in `ONE_WORKER_FOLDERS` is one unit (handed out first, being the largest): its
  tests share a costly module-scoped fixture that then starts once per run. (xdist's own
  `xdist_group` marks do not group under pytest 9: xdist renames items through an
  attribute pytest no longer reads.)
- A module in a folder of `ALONE_FOLDERS` (its tests assert timing bounds) runs last,
  by itself: one worker takes it when nothing else is left to hand out, and starts it
  only once every other worker has finished and exited.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

ONE_WORKER_FOLDERS = ("tests/worker/",)
ALONE_FOLDERS = ("tests/emulated/scale/",)


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _in(folders: tuple[str, ...], module: str) -> bool:
    return module.startswith(folders)


def check_alone_marks(items: list[pytest.Item]) -> None:
    """A test marked `alone` must be in a folder of `ALONE_FOLDERS`, or it would not run alone."""
    strays = [
        item.nodeid
        for item in items
        if item.get_closest_marker("alone") and not _in(ALONE_FOLDERS, module_of(item.nodeid))
    ]
    if strays:
        raise pytest.UsageError(
            f"Tests marked `alone` outside {list(ALONE_FOLDERS)} would share the machine: "
            f"{strays}. Move them there."
        )


class SuiteScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """See the module docstring."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        self.alone_host: Any = None

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        return module if _in(ONE_WORKER_FOLDERS + ALONE_FOLDERS, module) else nodeid

    def _only_alone_left(self) -> bool:
        return all(_in(ALONE_FOLDERS, scope) for scope in self.workqueue)

    def _assign_work_unit(self, node: Any) -> None:
        if not self._only_alone_left():
            for scope in [s for s in self.workqueue if _in(ALONE_FOLDERS, s)]:
                self.workqueue.move_to_end(scope)
            super()._assign_work_unit(node)
            return
        # The rest is handed out: this worker queues the alone units after its own tests.
        # An xdist worker runs its last queued test only once told to shut down, which
        # happens when every other worker is gone.
        self.alone_host = node
        while self.workqueue:
            super()._assign_work_unit(node)
        self._release_alone_host()

    def _release_alone_host(self) -> None:
        host = self.alone_host
        if host is not None and not host.shutting_down and self.nodes == [host]:
            host.shutdown()

    def _reschedule(self, node: Any) -> None:
        if node is self.alone_host:
            self._release_alone_host()
            return
        super()._reschedule(node)

    def remove_node(self, node: Any) -> str | None:
        crashed: str | None = super().remove_node(node)
        self._release_alone_host()
        return crashed

    @property
    def tests_finished(self) -> bool:
        host = self.alone_host
        if host is not None and host in self.nodes and len(self.nodes) > 1:
            return False  # the alone tests wait for the other workers to exit
        return bool(super().tests_finished)
