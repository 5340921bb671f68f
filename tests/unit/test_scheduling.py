"""The order `make test` hands the suite to its workers (tests/support/scheduling.py)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.scheduling import LONGEST, module_of, slow_first

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _Item:
    nodeid: str
    slow: bool = False

    def get_closest_marker(self, name: str) -> object:
        return object() if name == "slow" and self.slow else None


def test_the_worker_folder_and_the_longest_cases_go_first_then_slow_ones_in_their_order():
    items = [
        _Item("tests/unit/test_a.py::test_quick"),
        _Item("tests/emulated/test_b.py::test_slow_one", slow=True),
        _Item(LONGEST[0], slow=True),
        _Item("tests/worker/test_worker.py::test_w"),
        _Item("tests/emulated/test_b.py::test_slow_two", slow=True),
        _Item(LONGEST[1], slow=True),
    ]

    slow_first(items)  # type: ignore[arg-type]

    assert [item.nodeid for item in items] == [
        LONGEST[0],
        "tests/worker/test_worker.py::test_w",
        LONGEST[1],
        "tests/emulated/test_b.py::test_slow_one",
        "tests/emulated/test_b.py::test_slow_two",
        "tests/unit/test_a.py::test_quick",
    ]


@pytest.mark.parametrize("nodeid", LONGEST)
def test_each_longest_case_named_exists(nodeid: str):
    source = ROOT / module_of(nodeid)
    tree = ast.parse(source.read_text())
    tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}

    assert nodeid.split("::")[1] in tests


class _WorkerConfig:
    """What a pytest-xdist worker's config shows: `workerinput`, and `dist` set to "no"."""

    workerinput: dict[str, object] = {"workerid": "gw0"}

    def getvalue(self, name: str) -> object:
        return "no" if name == "dist" else None


def test_an_xdist_worker_reorders_what_it_collected():
    from tests.conftest import pytest_collection_modifyitems

    items = [_Item("tests/unit/test_a.py::test_quick"), _Item(LONGEST[1], slow=True)]

    pytest_collection_modifyitems(_WorkerConfig(), items)  # type: ignore[arg-type]

    assert [item.nodeid for item in items] == [LONGEST[1], "tests/unit/test_a.py::test_quick"]
