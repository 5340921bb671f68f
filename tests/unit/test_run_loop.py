"""A task run's fields have one writer: the run loop. Read from the source, as
`test_layering` reads imports."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from kinetic_prefect.runner.task_launch import TaskLaunch

PACKAGE = Path(__file__).resolve().parents[2] / "kinetic_prefect"
LOOP = PACKAGE / "runner" / "run_loop.py"
FIELDS = {f.name for f in dataclasses.fields(TaskLaunch)}


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [t for target in node.targets for t in _flatten(target)]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return _flatten(node.target)
    return []


def _flatten(target: ast.expr) -> list[ast.expr]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [t for item in target.elts for t in _flatten(item)]
    return [target]


def _writes_a_field(target: ast.expr) -> bool:
    """Whether `target` is a field of a launch, or anything inside one
    (`launch.job_ids[-1]`, `launch.task_run.run_count`)."""
    while isinstance(target, (ast.Subscript, ast.Attribute)):
        if isinstance(target, ast.Attribute) and target.attr in FIELDS:
            receiver = ast.unparse(target.value)
            if receiver == "launch" or receiver.endswith(".launch"):
                return True
        target = target.value
    return False


def field_writes(source: str) -> list[str]:
    """`launch.<field> = ...` (and `+=`, through `x.launch`, into a field's item or attribute)."""
    return [
        f"line {node.lineno}: {ast.unparse(target)}"
        for node in ast.walk(ast.parse(source))
        for target in _targets(node)
        if _writes_a_field(target)
    ]


def test_no_task_run_field_is_assigned_outside_the_loop() -> None:
    writes = {
        str(path.relative_to(PACKAGE)): field_writes(path.read_text())
        for path in PACKAGE.rglob("*.py")
        if path != LOOP
    }
    assert {path: lines for path, lines in writes.items() if lines} == {}
    assert field_writes(LOOP.read_text()), "the loop is where they are written"


def test_the_check_sees_each_form_of_write() -> None:
    source = """
launch.state = s
launch.backend += 1
placement.launch.manifest = {}
launch.manifest["kind"] = "Job"
a, launch.inputs = 1, 2
pod.manifest = {}
launch.not_a_field = 1
launch.task_run.run_count = 2
launch.not_a_field.task_run = 3
"""
    assert [line.split(": ")[1] for line in field_writes(source)] == [
        "launch.state",
        "launch.backend",
        "placement.launch.manifest",
        "launch.manifest['kind']",
        "launch.inputs",
        "launch.task_run.run_count",
    ]
