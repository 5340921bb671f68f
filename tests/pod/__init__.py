"""The pod entrypoint run as `python -m kinetic_prefect.pod` in real processes."""
