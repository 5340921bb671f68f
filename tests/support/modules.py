"""Import a test's own module from a folder, and forget it when the test ends.

Tests in one xdist worker share `sys.modules`: a module a test writes under a common name
(`project_tasks`) must not outlive that test, or the next test that writes its own file
under the same name imports the first test's copy from the first test's folder.
"""

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest


def import_fresh(directory: Path, module: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """`module` as written in `directory` now, removed from `sys.modules` after the test."""
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.delitem(sys.modules, module, raising=False)
    imported = importlib.import_module(module)
    # Undoing a set of an absent key deletes it: the module is forgotten at teardown.
    monkeypatch.setitem(sys.modules, module, imported)
    return imported
