"""Prefect blocks: `KineticCluster` and the GCS credentials that work with the emulator.

Each block type is a module of its own, imported on first use: a pod whose results go
to a GCS bucket with a service-account key in `KineticGcpCredentials` imports
`blocks.credentials` only, not prefect-kubernetes, which `KineticCluster`
(`blocks.cluster`) needs. The
`prefect.collections` entry point (`kinetic_prefect.plugin`) names both types, so every
Prefect process knows them without any import in user code.
"""

from typing import TYPE_CHECKING

from kinetic_prefect.common.lazy import lazy_names

if TYPE_CHECKING:
    from kinetic_prefect.blocks.cluster import KineticCluster, cluster_settings, load_cluster
    from kinetic_prefect.blocks.credentials import KineticGcpCredentials

__all__ = ["KineticCluster", "KineticGcpCredentials", "cluster_settings", "load_cluster"]

_LAZY = {
    "KineticCluster": "kinetic_prefect.blocks.cluster",
    "cluster_settings": "kinetic_prefect.blocks.cluster",
    "load_cluster": "kinetic_prefect.blocks.cluster",
    "KineticGcpCredentials": "kinetic_prefect.blocks.credentials",
}


__dir__, __getattr__ = lazy_names(__name__, _LAZY)
