"""kinetic-prefect's `prefect.collections` entry point.

Prefect imports this module in every process that loads collections (the CLI,
workers, the server, each pod), which registers the `kinetic-cluster` and
`kinetic-gcp-credentials` block types and the `kinetic` worker type.
"""

from kinetic_prefect.blocks import KineticCluster, KineticGcpCredentials
from kinetic_prefect.worker import KineticWorker

__all__ = ["KineticCluster", "KineticGcpCredentials", "KineticWorker"]
