"""Everything that runs inside a Kinetic pod.

`python -m kinetic_prefect.pod` takes a task run from its payload to a final
state through named phases; see `kinetic_prefect.pod.runner`. Nothing here
imports the orchestrator side (no Kubernetes client, no CLI).
"""
