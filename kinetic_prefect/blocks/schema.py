"""Block JSON schemas built once per class: Prefect asks for them again and again."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

_SCHEMAS: dict[Any, str] = {}


def built_once(
    cls: Any, build: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any
) -> dict[str, Any]:
    """`build(*args, **kwargs)`, `cls`'s schema, built once per class and arguments.

    Each caller gets a new copy (Prefect edits them), decoded from the JSON kept here:
    faster than `copy.deepcopy` of the dict.
    """
    key = (cls, args, tuple(sorted(kwargs.items())))
    if key not in _SCHEMAS:
        _SCHEMAS[key] = json.dumps(build(*args, **kwargs))
    return json.loads(_SCHEMAS[key])  # type: ignore[no-any-return]


class SchemaOnce:
    """A block whose `model_json_schema` is built once per class and arguments.

    Prefect builds a block's schema again for each field it serializes (to find its secret
    fields) and for each checksum, so one `save` of a `KineticCluster` asked for its schema
    about 120 times. The schema depends on the class alone (every field has one concrete
    type).
    """

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return built_once(cls, super().model_json_schema, *args, **kwargs)  # type: ignore[misc]
