"""A task run's stable identity within its flow run: the key of its `KINETIC_OUTPUT_DIR`.

`{task name}-{digest of its inputs}`, with `-{n}` added only for the n-th
(n ≥ 1) submission of identical inputs. An upstream future among the inputs
counts by its own identity, so the key is the same on every attempt of the task
run and on every retry of the flow run, whatever order the flow submits in:
a retried sweep resumes each configuration from its own checkpoint.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from prefect.futures import PrefectFuture
from prefect.utilities.collections import visit_collection
from prefect.utilities.hashing import hash_objects

_PATH_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
DIGEST_CHARS = 12


def safe_path_part(name: str) -> str:
    return _PATH_UNSAFE.sub("-", name).strip("-") or "task"


def inputs_digest(parameters: dict[str, Any]) -> str:
    """A digest of a task's inputs that does not depend on run ids or submission order."""

    def stable(item: Any) -> Any:
        if isinstance(item, PrefectFuture):
            upstream = getattr(item, "task_key", None)
            return {"upstream": upstream or str(item.task_run_id)}
        return item

    replaced = visit_collection(parameters, visit_fn=stable, return_data=True)
    digest = hash_objects(replaced, hash_algo=hashlib.sha256)
    if digest is None:
        # Inputs that neither JSON nor cloudpickle can hash: their names still separate them.
        digest = hashlib.sha256(repr(sorted(parameters)).encode()).hexdigest()
    return digest[:DIGEST_CHARS]


def base_key(task_name: str, parameters: dict[str, Any]) -> str:
    """The task key before the occurrence index: task name and inputs digest."""
    return f"{safe_path_part(task_name)}-{inputs_digest(parameters)}"


def with_occurrence(key: str, index: int) -> str:
    """The key of the `index`-th submission (from 0) of identical inputs."""
    return key if index == 0 else f"{key}-{index}"


def task_identity(flow_run_id: str, task_key: str) -> str:
    """The task run's identity across processes, short enough for a label value (≤ 63)."""
    return hashlib.sha256(f"{flow_run_id}/{task_key}".encode()).hexdigest()[:40]
