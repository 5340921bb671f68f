"""How `make test` shares the suite among pytest-xdist workers (`-n N`, `--dist loadgroup`).

One work unit per test, handed out in collection order, except that each module of a
folder in `ONE_WORKER_FOLDERS` is one unit (handed out first, being the largest): its
tests share a costly module-scoped fixture that then starts once per run. The tests
marked `slow` come next (`slow_first`), the two longest (`LONGEST`, about 150 and 180 s
each, a third of a worker's share) ahead of them, so the longest cases do not start
last and leave three workers idle while one finishes them. (xdist's own
`xdist_group` marks do not group under pytest 9: xdist renames items through an
attribute pytest no longer reads.)

No test asserts a wall-clock bound, so none needs the machine to itself: timing
figures live in tests/benchmarks/.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

ONE_WORKER_FOLDERS = ("tests/worker/",)
# Cases that take a worker for minutes: started first, beside the worker folder.
LONGEST = (
    "tests/examples/test_gke_walkthrough.py::test_the_gke_guides_run_as_written_on_a_new_strict_cluster",
    "tests/environments/test_gke_ship.py::"
    "test_a_new_environment_is_built_by_a_builder_job_under_its_plans_key_with_every_pin_packed",
)


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class SuiteScheduling(LoadScopeScheduling):  # type: ignore[misc]
    """See the module docstring."""

    def _split_scope(self, nodeid: str) -> str:
        module = module_of(nodeid)
        return module if module.startswith(ONE_WORKER_FOLDERS) else nodeid


def is_xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker: the workers collect, and the
    controller hands tests out in the order they collected them."""
    return hasattr(config, "workerinput")


def slow_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: `ONE_WORKER_FOLDERS` and `LONGEST`, then `slow`, then the
    rest.

    A stable sort, the same in every worker (xdist needs one collection order).
    """

    def rank(item: pytest.Item) -> int:
        if module_of(item.nodeid).startswith(ONE_WORKER_FOLDERS) or item.nodeid in LONGEST:
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)
