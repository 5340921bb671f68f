"""``kinetic-prefect`` command-line interface.

Top-level commands live on :data:`app`; command groups (for example a future ``jobs``
group) are separate ``typer.Typer`` instances attached with ``app.add_typer``. Heavy
modules are imported inside the commands so ``kinetic-prefect --help`` stays fast.

Example:
    $ kinetic-prefect accelerators --kind tpu
"""

from __future__ import annotations

import enum
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="kinetic-prefect",
    help="Run Prefect tasks on GKE TPU/GPU pods.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _main() -> None:
    """Run Prefect tasks on GKE TPU/GPU pods."""
    # An explicit callback keeps Typer in multi-command mode; with a single command it
    # would otherwise run that command directly instead of expecting its name.


class Kind(enum.StrEnum):
    """Accelerator kinds accepted by ``--kind``."""

    cpu = "cpu"
    gpu = "gpu"
    tpu = "tpu"


def _console() -> Console:
    # Piped output (grep, files, tests) should keep one accelerator per line rather than
    # wrapping the long node-selector keys at 80 columns.
    return Console(width=None if sys.stdout.isatty() else 1000)


_GKE_PREFIX = "cloud.google.com/"


def _pairs(mapping: dict[str, str]) -> str:
    # The shared GKE label prefix is named once in the caption so the values that tell
    # accelerators apart fit in a normal terminal.
    lines = (f"{key.removeprefix(_GKE_PREFIX)}: {value}" for key, value in mapping.items())
    return "\n".join(lines) or "-"


@app.command("accelerators")
def accelerators(
    kind: Annotated[Kind | None, typer.Option("--kind", help="Only list this kind.")] = None,
) -> None:
    """List every accelerator spec and the GKE node selectors and limits it maps to.

    Example: kinetic-prefect accelerators --kind gpu
    """
    from kinetic_prefect.accelerators import catalogue

    table = Table(
        title="Accelerators",
        caption=f"Node selector keys without a domain are under {_GKE_PREFIX}",
    )
    table.add_column("name", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("chips/GPUs\nper host", justify="right", no_wrap=True)
    table.add_column("hosts", justify="right", no_wrap=True)
    # Fold rather than truncate so no value is hidden in narrow terminals.
    table.add_column("node selector(s)", overflow="fold")
    table.add_column("resource limit", no_wrap=True)
    for acc in catalogue():
        if kind is not None and acc.kind != kind.value:
            continue
        table.add_row(
            acc.name,
            acc.kind,
            str(acc.count) if acc.count else "-",
            str(acc.hosts),
            _pairs(acc.node_selector),
            _pairs(acc.resource_limits),
        )
    _console().print(table)
    typer.echo("Append ':spot' to any name (e.g. 'l4x2:spot') to run on Spot VMs.")


if __name__ == "__main__":
    app()
