"""`python -m kinetic_prefect.cli`: the `kinetic-prefect` command."""

from kinetic_prefect.cli import app

app()
