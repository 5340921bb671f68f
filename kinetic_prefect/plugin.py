"""kinetic-prefect's `prefect.collections` entry point.

Prefect imports this module in every process that loads collections (the CLI,
workers, the server, a pod that looks up a block), so it only names the
`kinetic-cluster` and `kinetic-gcp-credentials` block types and the `kinetic`
worker type: each class is imported (with prefect-gcp, prefect-kubernetes or
the worker machinery) the first time Prefect looks it up or lists its types.
"""

from prefect.blocks.core import Block
from prefect.workers.base import BaseWorker

from kinetic_prefect.common.prefect_registry import register_deferred

BLOCK_TYPES = {
    "kinetic-cluster": "kinetic_prefect.blocks.cluster",
    "kinetic-gcp-credentials": "kinetic_prefect.blocks.credentials",
}
WORKER_TYPES = {"kinetic": "kinetic_prefect.worker.worker"}

register_deferred(Block, BLOCK_TYPES)
register_deferred(BaseWorker, WORKER_TYPES)
