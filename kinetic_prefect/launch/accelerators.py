"""Accelerator registry: every CPU/GPU/TPU shape kinetic-prefect can schedule on GKE.

An accelerator spec is a short, case-insensitive string such as ``"cpu"``, ``"l4x2"``,
``"a100-80gbx4"``, ``"tpu-v5e-4"`` or ``"v6e-16:spot"``. :func:`parse_accelerator`
turns it into an :class:`Accelerator` carrying the node selectors, resource limits and
tolerations a pod needs to land on matching GKE nodes.

Example:
    >>> acc = parse_accelerator("tpu-v5e-4")
    >>> acc.node_selector["cloud.google.com/gke-tpu-topology"]
    '2x2'
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

__all__ = [
    "Accelerator",
    "UnknownAcceleratorError",
    "catalogue",
    "parse_accelerator",
]

_LIST_HINT = "Run `kinetic-prefect accelerators` to list every supported accelerator."

_GKE_ACCELERATOR = "cloud.google.com/gke-accelerator"
_GKE_TPU_ACCELERATOR = "cloud.google.com/gke-tpu-accelerator"
_GKE_TPU_TOPOLOGY = "cloud.google.com/gke-tpu-topology"
_GKE_SPOT = "cloud.google.com/gke-spot"
_GPU_RESOURCE = "nvidia.com/gpu"
_TPU_RESOURCE = "google.com/tpu"

_GPU_TOLERATION = {"key": _GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
_TPU_TOLERATION = {"key": _TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
_SPOT_TOLERATION = {"key": _GKE_SPOT, "operator": "Equal", "value": "true", "effect": "NoSchedule"}


class UnknownAcceleratorError(ValueError):
    """Raised when a spec does not name an accelerator in :func:`catalogue`."""


_Pairs = tuple[tuple[str, str], ...]


def _freeze(mapping: dict[str, str]) -> _Pairs:
    # Sorted so that equality and hashing ignore insertion order, like dict equality.
    return tuple(sorted(mapping.items()))


@dataclass(frozen=True, init=False, repr=False)
class Accelerator:
    """One schedulable accelerator shape.

    ``node_selector``, ``resource_limits`` and ``tolerations`` are stored as sorted
    tuples so instances stay hashable and immutable; the properties hand out fresh
    ``dict``/``list`` copies that callers may mutate freely.

    ``name`` never carries the ``:spot`` suffix because it is also used where ``:`` is
    not allowed (Kubernetes label values); :attr:`spec` is the round-trippable form.

    Example:
        >>> acc = Accelerator("l4x2", "gpu", 2, {"cloud.google.com/gke-accelerator": "nvidia-l4"},
        ...                   {"nvidia.com/gpu": "2"}, [])
        >>> acc.resource_limits
        {'nvidia.com/gpu': '2'}
    """

    name: str
    kind: str
    count: int
    _node_selector: _Pairs
    _resource_limits: _Pairs
    _tolerations: tuple[_Pairs, ...]
    hosts: int = 1
    spot: bool = False
    topology: str | None = None

    def __init__(
        self,
        name: str,
        kind: str,
        count: int,
        node_selector: dict[str, str],
        resource_limits: dict[str, str],
        tolerations: list[dict[str, str]],
        hosts: int = 1,
        spot: bool = False,
        topology: str | None = None,
    ) -> None:
        if kind not in ("cpu", "gpu", "tpu"):
            raise ValueError(f"kind must be 'cpu', 'gpu' or 'tpu', got {kind!r}")
        # Frozen dataclasses block normal assignment, so set through object.
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "_node_selector", _freeze(node_selector))
        object.__setattr__(self, "_resource_limits", _freeze(resource_limits))
        object.__setattr__(self, "_tolerations", tuple(_freeze(t) for t in tolerations))
        object.__setattr__(self, "hosts", hosts)
        object.__setattr__(self, "spot", spot)
        object.__setattr__(self, "topology", topology)

    @property
    def node_selector(self) -> dict[str, str]:
        """Pod ``nodeSelector`` entries (a fresh copy)."""
        return dict(self._node_selector)

    @property
    def resource_limits(self) -> dict[str, str]:
        """Container resource limits, e.g. ``{"google.com/tpu": "4"}`` (a fresh copy)."""
        return dict(self._resource_limits)

    @property
    def tolerations(self) -> list[dict[str, str]]:
        """Pod tolerations as Kubernetes toleration dicts (fresh copies)."""
        return [dict(t) for t in self._tolerations]

    @property
    def spec(self) -> str:
        """Spec string that parses back to this accelerator, e.g. ``"l4x2:spot"``."""
        return f"{self.name}:spot" if self.spot else self.name

    def __repr__(self) -> str:
        return (
            f"Accelerator(name={self.name!r}, kind={self.kind!r}, count={self.count}, "
            f"hosts={self.hosts}, spot={self.spot}, topology={self.topology!r}, "
            f"node_selector={self.node_selector!r}, resource_limits={self.resource_limits!r})"
        )


@dataclass(frozen=True)
class _GpuModel:
    label: str
    counts: tuple[int, ...]


@dataclass(frozen=True)
class _TpuShape:
    topology: str
    chips_per_host: int
    hosts: int


@dataclass(frozen=True)
class _TpuGeneration:
    label: str
    shapes: dict[int, _TpuShape]  # total chips -> shape


# Dict order is the catalogue order.
_GPUS: dict[str, _GpuModel] = {
    "l4": _GpuModel("nvidia-l4", (1, 2, 4, 8)),
    "t4": _GpuModel("nvidia-tesla-t4", (1, 2, 4)),
    "v100": _GpuModel("nvidia-tesla-v100", (1, 2, 4, 8)),
    "a100": _GpuModel("nvidia-tesla-a100", (1, 2, 4, 8, 16)),
    "a100-80gb": _GpuModel("nvidia-a100-80gb", (1, 2, 4, 8, 16)),
    "h100": _GpuModel("nvidia-h100-80gb", (1, 2, 4, 8)),
}

# v5e and v6e share slice shapes on GKE: up to 8 chips fit one host, larger slices use
# 4-chip hosts.
_V5E_V6E_SHAPES = {
    1: _TpuShape("1x1", 1, 1),
    4: _TpuShape("2x2", 4, 1),
    8: _TpuShape("2x4", 8, 1),
    16: _TpuShape("4x4", 4, 4),
    32: _TpuShape("4x8", 4, 8),
    64: _TpuShape("8x8", 4, 16),
    128: _TpuShape("8x16", 4, 32),
    256: _TpuShape("16x16", 4, 64),
}
# v4 and v5p use 3-D topologies with 4 chips per host.
_V4_V5P_SHAPES = {
    4: _TpuShape("2x2x1", 4, 1),
    8: _TpuShape("2x2x2", 4, 2),
    16: _TpuShape("2x2x4", 4, 4),
    32: _TpuShape("2x4x4", 4, 8),
}
_TPUS: dict[str, _TpuGeneration] = {
    "v3": _TpuGeneration(
        "tpu-v3-podslice",
        {4: _TpuShape("2x2", 4, 1), 16: _TpuShape("4x4", 4, 4), 32: _TpuShape("4x8", 4, 8)},
    ),
    "v4": _TpuGeneration("tpu-v4-podslice", _V4_V5P_SHAPES),
    "v5e": _TpuGeneration("tpu-v5-lite-podslice", _V5E_V6E_SHAPES),
    "v5p": _TpuGeneration("tpu-v5p-slice", _V4_V5P_SHAPES),
    "v6e": _TpuGeneration("tpu-v6e-slice", _V5E_V6E_SHAPES),
}
_TPU_ALIASES = {"v5litepod": "v5e"}

# GKE node labels are accepted as GPU names so specs can be copied from node pools.
_GPU_ALIASES = {model.label: name for name, model in _GPUS.items()}

_GPU_SPEC = re.compile(r"(?P<model>.+?)(?:x(?P<count>\d+))?")
_TPU_SPEC = re.compile(r"(?P<gen>v\d+[a-z]*)(?:-(?P<chips>\d+))?")


def _with_spot(
    selector: dict[str, str], tolerations: list[dict[str, str]], spot: bool
) -> tuple[dict[str, str], list[dict[str, str]]]:
    if spot:
        selector = {**selector, _GKE_SPOT: "true"}
        tolerations = [*tolerations, _SPOT_TOLERATION]
    return selector, tolerations


def _cpu(spot: bool) -> Accelerator:
    selector, tolerations = _with_spot({}, [], spot)
    return Accelerator("cpu", "cpu", 0, selector, {}, tolerations, spot=spot)


def _gpu(model: str, count: int, spot: bool) -> Accelerator:
    selector, tolerations = _with_spot(
        {_GKE_ACCELERATOR: _GPUS[model].label}, [_GPU_TOLERATION], spot
    )
    name = model if count == 1 else f"{model}x{count}"
    return Accelerator(
        name, "gpu", count, selector, {_GPU_RESOURCE: str(count)}, tolerations, spot=spot
    )


def _tpu(generation: str, chips: int, spot: bool) -> Accelerator:
    gen = _TPUS[generation]
    shape = gen.shapes[chips]
    selector, tolerations = _with_spot(
        {_GKE_TPU_ACCELERATOR: gen.label, _GKE_TPU_TOPOLOGY: shape.topology},
        [_TPU_TOLERATION],
        spot,
    )
    return Accelerator(
        f"tpu-{generation}-{chips}",
        "tpu",
        shape.chips_per_host,
        selector,
        {_TPU_RESOURCE: str(shape.chips_per_host)},
        tolerations,
        hosts=shape.hosts,
        spot=spot,
        topology=shape.topology,
    )


def catalogue() -> list[Accelerator]:
    """Return every canonical (non-spot) accelerator: cpu first, then GPUs, then TPUs.

    Example:
        >>> [a.name for a in catalogue()][:3]
        ['cpu', 'l4', 'l4x2']
    """
    accelerators = [_cpu(spot=False)]
    accelerators += [_gpu(m, n, spot=False) for m, model in _GPUS.items() for n in model.counts]
    accelerators += [_tpu(g, n, spot=False) for g, gen in _TPUS.items() for n in gen.shapes]
    return accelerators


def _unknown(spec: str, reason: str) -> UnknownAcceleratorError:
    return UnknownAcceleratorError(f"Unknown accelerator {spec!r}: {reason}. {_LIST_HINT}")


def _suggestions(body: str) -> str:
    # Match against bare and aliased forms too, so "v9z-1" still finds "tpu-v5e-1".
    candidates: dict[str, str] = {}
    for acc in catalogue():
        candidates[acc.name] = acc.name
        candidates[acc.name.removeprefix("tpu-")] = acc.name
    for label, model in _GPU_ALIASES.items():
        candidates[label] = model
    close = difflib.get_close_matches(body, list(candidates), n=8, cutoff=0.5)
    names = list(dict.fromkeys(candidates[c] for c in close))[:5]
    if names:
        return "close matches: " + ", ".join(names)
    return "examples of valid specs: cpu, l4, a100x8, tpu-v5e-4, tpu-v6e-8:spot"


def _parse_gpu(spec: str, body: str, spot: bool) -> Accelerator | None:
    match = _GPU_SPEC.fullmatch(body)
    if match is None:
        return None
    model = _GPU_ALIASES.get(match["model"], match["model"])
    if model not in _GPUS:
        return None
    count = int(match["count"] or 1)
    counts = _GPUS[model].counts
    if count not in counts:
        valid = ", ".join(map(str, counts))
        raise _unknown(spec, f"{model} supports {valid} GPUs per pod, not {count}")
    return _gpu(model, count, spot)


def _parse_tpu(spec: str, body: str, spot: bool) -> Accelerator | None:
    match = _TPU_SPEC.fullmatch(body)
    if match is None:
        return None
    generation = _TPU_ALIASES.get(match["gen"], match["gen"])
    if generation not in _TPUS:
        return None
    shapes = _TPUS[generation].shapes
    valid = ", ".join(map(str, shapes))
    if match["chips"] is None:
        example = f"tpu-{generation}-{next(iter(shapes))}"
        raise _unknown(
            spec, f"TPU {generation} needs a chip count, e.g. {example!r}; valid counts: {valid}"
        )
    chips = int(match["chips"])
    if chips not in shapes:
        raise _unknown(spec, f"TPU {generation} comes in {valid} chips, not {chips}")
    return _tpu(generation, chips, spot)


def parse_accelerator(spec: str, *, spot: bool | None = None) -> Accelerator:
    """Parse an accelerator spec such as ``"l4x2"``, ``"tpu-v5e-4"`` or ``"v6e-8:spot"``.

    Parsing ignores case and surrounding whitespace; the ``tpu-``/``gpu-`` prefixes are
    optional, ``v5litepod`` is accepted for ``v5e`` and GKE GPU labels (``nvidia-l4``)
    for the short GPU names. A ``:spot`` suffix requests Spot VMs; ``spot=True`` or
    ``spot=False`` overrides the suffix, ``spot=None`` keeps it.

    Raises:
        UnknownAcceleratorError: the spec names no accelerator in :func:`catalogue`;
            the message suggests close matches or lists the valid counts.

    Example:
        >>> parse_accelerator("L4x2:spot").node_selector
        {'cloud.google.com/gke-accelerator': 'nvidia-l4', 'cloud.google.com/gke-spot': 'true'}
        >>> parse_accelerator("v5litepod-16").hosts
        4
    """
    normalized = spec.strip().lower()
    if not normalized:
        raise UnknownAcceleratorError(f"Accelerator spec is empty. {_LIST_HINT}")

    body, sep, suffix = normalized.partition(":")
    if sep and suffix.strip() != "spot":
        raise _unknown(spec, f"unsupported suffix {':' + suffix!r}, only ':spot' is allowed")
    body = body.strip()
    use_spot = bool(sep) if spot is None else spot

    prefix, _, rest = body.partition("-")
    if prefix in ("tpu", "gpu") and rest:
        parsers = [_parse_tpu] if prefix == "tpu" else [_parse_gpu]
        body = rest
    else:
        parsers = [_parse_gpu, _parse_tpu]

    if body == "cpu" and len(parsers) == 2:
        return _cpu(use_spot)
    for parser in parsers:
        accelerator = parser(spec, body, use_spot)
        if accelerator is not None:
            return accelerator
    raise _unknown(spec, _suggestions(normalized))
