"""Every interval the product waits on is a field of one settings object, `Intervals`."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from kinetic_prefect.common.intervals import INTERVAL_NAMES, Intervals
from kinetic_prefect.errors import ConfigurationError
from kinetic_prefect.launch.settings import resolve_settings, resources

PACKAGE = Path(__file__).resolve().parents[2] / "kinetic_prefect"
HOME = PACKAGE / "common" / "intervals.py"
INTERVAL_SUFFIXES = ("_SECONDS", "_INTERVAL", "_TIMEOUT", "_GRACE")


def _module_level_names(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names += [t.id for t in targets if isinstance(t, ast.Name)]
    return names


def test_no_module_outside_intervals_defines_an_interval_constant():
    found = [
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME
        for name in _module_level_names(path)
        if name.lstrip("_").upper() == name.lstrip("_") and name.endswith(INTERVAL_SUFFIXES)
    ]

    assert found == [], "make these fields of kinetic_prefect.common.intervals.Intervals"


def test_the_constant_check_sees_a_module_level_interval(tmp_path: Path):
    module = tmp_path / "m.py"
    module.write_text("POLL_SECONDS = 1.0\n_RETRY_SECONDS: float = 2\nname_seconds = 3\n")

    assert _module_level_names(module) == ["POLL_SECONDS", "_RETRY_SECONDS", "name_seconds"]


@pytest.mark.parametrize(
    ("environ", "block", "runner", "override", "expected"),
    [
        # (KINETIC_INTERVALS, block, runner, resources(), the changed fields resolved)
        ("", None, None, None, {}),
        ('{"settle_margin_seconds": 3}', None, None, None, {"settle_margin_seconds": 3.0}),
        (
            '{"settle_margin_seconds": 3}',
            {"settle_margin_seconds": 4, "queue_poll_seconds": 1},
            None,
            None,
            {"settle_margin_seconds": 4.0, "queue_poll_seconds": 1.0},
        ),
        (
            '{"watchdog_look_seconds": 2}',
            {"queue_poll_seconds": 1},
            Intervals(queue_poll_seconds=0.5),
            {"watchdog_look_seconds": 7},
            {"watchdog_look_seconds": 7.0, "queue_poll_seconds": 0.5},
        ),
    ],
)
def test_intervals_resolve_field_by_field_like_every_other_setting(
    environ, block, runner, override, expected
):
    layers = {"intervals": override} if override else {}
    with resources(**layers):
        settings = resolve_settings(
            runner={"intervals": runner},
            block={"intervals": block},
            overrides=layers,
            environ={"KINETIC_INTERVALS": environ},
        )

    assert settings.intervals.changed() == expected


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ('{"settle_margin": 3}', "settle_margin (did you mean settle_margin_seconds?)"),
        ('{"watchdog_look_seconds": 0}', "watchdog_look_seconds=0 is not a positive number"),
        ('{"watchdog_look_seconds": "soon"}', "watchdog_look_seconds='soon' is not a positive"),
        ("[1, 2]", "must be a JSON object of interval names to seconds"),
        ("{nope", "is not JSON"),
    ],
)
def test_a_bad_kinetic_intervals_value_is_refused_saying_what_to_write(value, says):
    with pytest.raises(ConfigurationError, match=None) as raised:
        resolve_settings(environ={"KINETIC_INTERVALS": value})

    assert says in str(raised.value)


def test_production_defaults_travel_as_nothing_and_changes_as_one_variable():
    assert Intervals().to_env() == {}
    changed = Intervals.of({"watchdog_look_seconds": 2, "settle_margin_seconds": 5})

    assert json.loads(changed.to_env()["KINETIC_INTERVALS"]) == {
        "settle_margin_seconds": 5.0,
        "watchdog_look_seconds": 2.0,
    }
    assert Intervals.from_environ(changed.to_env()) == changed


def test_every_interval_is_documented_in_the_table_of_docs_intervals_md():
    table = (PACKAGE.parent / "docs" / "intervals.md").read_text()

    assert [name for name in INTERVAL_NAMES if f"`{name}`" not in table] == []


@pytest.mark.parametrize(
    ("intervals", "env", "grace"),
    [
        (Intervals(), None, 15),
        (
            Intervals(termination_grace_seconds=4.5, emergency_window_seconds=2),
            '{"emergency_window_seconds": 2.0, "termination_grace_seconds": 4.5}',
            5,
        ),
    ],
)
def test_a_pod_gets_its_runners_intervals_through_its_manifest(intervals, env, grace):
    from kinetic_prefect.launch.manifest import build_job_manifest
    from tests.unit.test_manifest import _spec

    pod = build_job_manifest(_spec(intervals=intervals))["spec"]["template"]["spec"]
    values = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}

    assert values.get("KINETIC_INTERVALS") == env
    assert pod["terminationGracePeriodSeconds"] == grace


def test_the_suite_runs_with_the_intervals_docs_intervals_md_lists_for_it():
    from tests.conftest import SUITE_INTERVALS

    rows = [
        [cell.strip(" `") for cell in line.strip("|").split("|")]
        for line in (PACKAGE.parent / "docs" / "intervals.md").read_text().splitlines()
        if line.startswith("| `")
    ]
    documented = {name: float(suite) for name, default, _, suite in rows if suite != default}

    assert documented == SUITE_INTERVALS
    assert Intervals.from_environ(os.environ).changed() == SUITE_INTERVALS
