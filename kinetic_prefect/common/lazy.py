"""A package's public names, each imported from its module on first use (PEP 562).

`kinetic_prefect` and `kinetic_prefect.blocks` name more than a pod or the CLI needs:
importing them must not import Prefect's collections, kubernetes-asyncio or the runner.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(
    package: str, modules: Mapping[str, str]
) -> tuple[Callable[[], list[str]], Callable[[str], Any]]:
    """`(__dir__, __getattr__)` for `package`, whose names in `modules` live in those modules.

    `dir()` lists the lazy names too: `prefect block register -m` finds blocks by it.
    """

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *modules})

    def __getattr__(name: str) -> Any:
        if name in modules:
            return getattr(importlib.import_module(modules[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __dir__, __getattr__
