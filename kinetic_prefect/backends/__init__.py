"""Where pods run. Every backend takes the same Job manifest."""

from kinetic_prefect.backends.base import Backend, PodExit

__all__ = ["Backend", "PodExit"]
