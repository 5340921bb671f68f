"""The lowest-Prefect test environment: the lock's pins, with Prefect at its lower bound.

`make test` runs the conformance tests in a second, small environment built from
these (`.venv-lowest`), so the lowest Prefect that `pyproject.toml` allows is tested
as well as the locked one. Reads the exported lock on stdin, writes requirements
on stdout:

    uv export --frozen --no-hashes --no-emit-project | python tests/support/lowest_prefect.py
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def lowest_prefect(pyproject: Path = PYPROJECT) -> str:
    """The version in the `prefect>=X` requirement of `[project.dependencies]`."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for requirement in dependencies:
        match = re.fullmatch(r"prefect\s*>=\s*([0-9][^,;\s]*)(,.*)?", requirement.strip())
        if match:
            return match.group(1)
    raise SystemExit(f"{pyproject} has no 'prefect>=X' requirement to take the lower bound from")


def with_lowest_prefect(exported: str, version: str) -> str:
    lines = exported.splitlines()
    pinned = [f"prefect=={version}" if re.match(r"prefect==", line) else line for line in lines]
    if pinned == lines:
        raise SystemExit("the exported lock has no 'prefect==' line to replace")
    return "\n".join(pinned) + "\n"


if __name__ == "__main__":
    sys.stdout.write(with_lowest_prefect(sys.stdin.read(), lowest_prefect()))
