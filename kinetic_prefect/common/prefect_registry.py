"""Prefect's type registries, with kinetic-prefect's entries imported on first use.

Prefect registers a block or worker class when its module is imported; the
`prefect.collections` entry point (`kinetic_prefect.plugin`) names the classes
without importing them (and prefect-gcp, prefect-kubernetes) in every process
that loads collections. The registries are Prefect's own dicts:
`test_deferred_registration_reaches_prefects_registry` fails if that changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class _DeferredRegistry(dict[str, Any]):
    """A Prefect type registry whose kinetic-prefect entries import on first use.

    Prefect reads its registries with `get`, `keys`, `values` and `items`; a
    deferred key is imported when it is asked for by name, and every deferred
    key when the registry is listed, so lookups see the same classes as with
    eager imports.
    """

    def __init__(self, entries: Mapping[str, Any]) -> None:
        super().__init__(entries)
        self.deferred: dict[str, str] = {}

    def _load(self, key: object) -> None:
        module = self.deferred.pop(key, None) if isinstance(key, str) else None
        if module is not None:
            import importlib

            importlib.import_module(module)

    def _load_all(self) -> None:
        for key in list(self.deferred):
            self._load(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._load(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self._load(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._load(key)
        return super().__contains__(key)

    def __iter__(self) -> Any:
        self._load_all()
        return super().__iter__()

    def __len__(self) -> int:
        self._load_all()
        return super().__len__()

    def keys(self) -> Any:
        self._load_all()
        return super().keys()

    def values(self) -> Any:
        self._load_all()
        return super().values()

    def items(self) -> Any:
        self._load_all()
        return super().items()


def register_deferred(base: type, entries: Mapping[str, str]) -> None:
    """Register dispatch keys of `base` (a block slug, a worker type) by module, imported on use.

    Prefect registers a block or worker class when its module is imported;
    this lets the `prefect.collections` entry point name the classes without
    importing them (and prefect-gcp, prefect-kubernetes) in every process that
    loads collections. Prefect keeps its registries in a private table; the
    test `test_deferred_registration_reaches_prefects_registry` fails if that changes.
    """
    from prefect.utilities import dispatch

    registry = dispatch.get_registry_for_type(base)
    if registry is None:
        raise TypeError(f"{base.__name__} is not a Prefect dispatch base type")
    owner = next(cls for cls in base.mro() if dispatch._TYPE_REGISTRIES.get(cls) is registry)
    if not isinstance(registry, _DeferredRegistry):
        registry = _DeferredRegistry(registry)
        dispatch._TYPE_REGISTRIES[owner] = registry
    for key, module in entries.items():
        if not dict.__contains__(registry, key):
            registry.deferred[key] = module
