"""Accelerator registry: every CPU/GPU/TPU shape kinetic-prefect can schedule on GKE.

An accelerator spec is a short, case-insensitive string such as ``"cpu"``, ``"l4x2"``,
``"a100-80gbx4"``, ``"tpu-v5e-4"`` or ``"v6e-16:spot"``. :func:`parse_accelerator`
turns it into an :class:`Accelerator` carrying the node selectors, resource limits,
tolerations and machine type (whence its default cpu and memory requests) a pod needs to
land on matching GKE nodes.

TPU names are Cloud TPU's accelerator types (``tpu-v5p-8`` is Cloud TPU's ``v5p-8``: 8
TensorCores, 4 chips, one host); a topology (``tpu-v5p-2x2x1``) names the same slice.
docs/kubernetes.md has the table and its sources.

Example:
    >>> acc = parse_accelerator("tpu-v5e-4")
    >>> acc.node_selector["cloud.google.com/gke-tpu-topology"]
    '2x2'
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass

__all__ = [
    "CPU_REQUESTS",
    "Accelerator",
    "MachineType",
    "UnknownAcceleratorError",
    "catalogue",
    "machine_type",
    "parse_accelerator",
    "parse_quantity",
    "tpu_aliases",
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
    # The machine type of the node the pod lands on (its smallest, for GPUs); None for cpu.
    machine_type: str | None = None

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
        machine_type: str | None = None,
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
        object.__setattr__(self, "machine_type", machine_type)

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
    def default_requests(self) -> dict[str, str]:
        """The pod's cpu and memory requests unless `cpu=`/`memory=` say otherwise.

        A GPU or TPU pod asks for most of its machine (see :class:`MachineType`); a cpu
        pod for :data:`CPU_REQUESTS`.
        """
        if self.machine_type is None:
            return dict(CPU_REQUESTS)
        return _MACHINES[self.machine_type].default_requests()

    @property
    def chips(self) -> int:
        """Chips (TPU) or GPUs of the whole slice: per host times hosts."""
        return self.count * self.hosts

    @property
    def spec(self) -> str:
        """Spec string that parses back to this accelerator, e.g. ``"l4x2:spot"``."""
        return f"{self.name}:spot" if self.spot else self.name

    def __repr__(self) -> str:
        return (
            f"Accelerator(name={self.name!r}, kind={self.kind!r}, count={self.count}, "
            f"hosts={self.hosts}, spot={self.spot}, topology={self.topology!r}, "
            f"machine_type={self.machine_type!r}, "
            f"node_selector={self.node_selector!r}, resource_limits={self.resource_limits!r})"
        )


@dataclass(frozen=True)
class MachineType:
    """A Compute Engine machine type: what one node of a GKE node pool has.

    ``memory_gib`` is the machine's memory as Compute Engine lists it ("GB" in its
    tables are GiB). :meth:`default_requests` is what one pod asks for when it has the
    node to itself: GKE's allocatable capacity (the machine minus GKE's own reservation,
    https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes) minus room
    for GKE's system DaemonSets (logging, metrics, device plugins, the GCS FUSE driver).
    """

    name: str
    vcpus: int
    memory_gib: float

    def allocatable(self) -> tuple[int, int]:
        """(millicores, MiB) GKE leaves to pods on this machine."""
        return self.vcpus * 1000 - _cpu_reserved_millicores(self.vcpus), int(
            self.memory_gib * 1024 - _memory_reserved_mib(self.memory_gib)
        )

    def refuse_larger_requests(self, requests: dict[str, str], accelerator: str) -> None:
        """Raise if `requests` ask for more cpu or memory than this machine gives pods."""
        cpu, memory = self.allocatable()
        for key, most in (("cpu", cpu / 1000), ("memory", memory * 2**20)):
            if key in requests and parse_quantity(requests[key]) > most:
                shown = f"{cpu}m" if key == "cpu" else f"{memory}Mi"
                raise ValueError(
                    f"{key}={requests[key]} is more than a {self.name} node of {accelerator} "
                    f"gives its pods ({shown}): the pod would never be scheduled. Ask for "
                    f"at most {shown}, or leave {key} unset for the default "
                    f"({self.default_requests()[key]})."
                )

    def default_requests(self) -> dict[str, str]:
        """``{"cpu": ..., "memory": ...}`` for a pod that owns the node."""
        cpu, memory = self.allocatable()
        cpu_left = cpu - max(_DAEMON_CPU_MILLICORES, cpu * _DAEMON_SHARE)
        memory_left = memory - max(_DAEMON_MEMORY_MIB, memory * _DAEMON_SHARE)
        return {"cpu": f"{int(cpu_left) // 10 * 10}m", "memory": f"{int(memory_left)}Mi"}


# GKE's reservation for the kubelet and the OS, by slices of the machine
# (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-node-sizes#memory_cpu):
# CPU 6% of the first core, 1% of the next, 0.5% of the next 2, 0.25% above 4;
# memory 25% of the first 4 GiB, 20% of the next 4, 10% of the next 8, 6% of the next
# 112, 2% above 128 GiB, plus a 100 MiB eviction threshold.
_CPU_RESERVATION = ((1, 0.06), (1, 0.01), (2, 0.005), (float("inf"), 0.0025))
_MEMORY_RESERVATION = ((4, 0.25), (4, 0.20), (8, 0.10), (112, 0.06), (float("inf"), 0.02))
_EVICTION_THRESHOLD_MIB = 100
# What GKE's system DaemonSets take on top (a share of the node, at least this much).
# On a GKE 1.36 GPU node with Workload Identity they request about 0.5 CPU (kube-proxy,
# fluentbit-gke, gke-metrics-agent, pdcsi-node, netd, ip-masq-agent, gke-metadata-server,
# the GPU device plugin); the rest leaves room for optional ones (NodeLocal DNSCache).
_DAEMON_SHARE = 0.05
_DAEMON_CPU_MILLICORES = 700
_DAEMON_MEMORY_MIB = 1024


def _tiered(amount: float, tiers: tuple[tuple[float, float], ...]) -> float:
    reserved, left = 0.0, amount
    for size, share in tiers:
        part = min(left, size)
        reserved += part * share
        left -= part
    return reserved


def _cpu_reserved_millicores(vcpus: int) -> int:
    return int(round(_tiered(vcpus, _CPU_RESERVATION) * 1000))


def _memory_reserved_mib(memory_gib: float) -> float:
    return _tiered(memory_gib, _MEMORY_RESERVATION) * 1024 + _EVICTION_THRESHOLD_MIB


# Every machine type the catalogue schedules on: vCPUs and memory (GiB) from Compute
# Engine's machine-type tables (https://cloud.google.com/compute/docs/accelerator-optimized-machines,
# https://cloud.google.com/compute/docs/general-purpose-machines#n1_machines) and Cloud TPU's
# per-version pages (https://cloud.google.com/tpu/docs/v5e, .../v5p, .../v6e, .../tpu7x).
_MACHINES: dict[str, MachineType] = {
    m.name: m
    for m in (
        # cpu-only pods and builder Jobs: no machine of their own, a small request.
        MachineType("n1-standard-4", 4, 15),
        MachineType("n1-standard-8", 8, 30),
        MachineType("n1-standard-16", 16, 60),
        MachineType("n1-standard-32", 32, 120),
        MachineType("g2-standard-4", 4, 16),
        MachineType("g2-standard-24", 24, 96),
        MachineType("g2-standard-48", 48, 192),
        MachineType("g2-standard-96", 96, 384),
        MachineType("a2-highgpu-1g", 12, 85),
        MachineType("a2-highgpu-2g", 24, 170),
        MachineType("a2-highgpu-4g", 48, 340),
        MachineType("a2-highgpu-8g", 96, 680),
        MachineType("a2-megagpu-16g", 96, 1360),
        MachineType("a2-ultragpu-1g", 12, 170),
        MachineType("a2-ultragpu-2g", 24, 340),
        MachineType("a2-ultragpu-4g", 48, 680),
        MachineType("a2-ultragpu-8g", 96, 1360),
        MachineType("a3-highgpu-1g", 26, 234),
        MachineType("a3-highgpu-2g", 52, 468),
        MachineType("a3-highgpu-4g", 104, 936),
        MachineType("a3-highgpu-8g", 208, 1872),
        MachineType("ct3-hightpu-4t", 96, 340),
        MachineType("ct3p-hightpu-4t", 48, 340),
        MachineType("ct4p-hightpu-4t", 240, 407),
        MachineType("ct5l-hightpu-1t", 24, 48),
        MachineType("ct5l-hightpu-4t", 112, 192),
        MachineType("ct5l-hightpu-8t", 224, 384),
        MachineType("ct5lp-hightpu-1t", 24, 48),
        MachineType("ct5lp-hightpu-4t", 112, 192),
        MachineType("ct5lp-hightpu-8t", 224, 384),
        MachineType("ct5p-hightpu-4t", 208, 448),
        MachineType("ct6e-standard-1t", 44, 176),
        MachineType("ct6e-standard-4t", 180, 720),
        MachineType("ct6e-standard-8t", 180, 1440),
        MachineType("tpu7x-standard-4t", 224, 960),
    )
}

# A Kubernetes quantity: a decimal number, then an SI or binary suffix or an exponent
# (https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/).
_QUANTITY = re.compile(
    r"(?P<number>\d+(?:\.\d*)?|\.\d+)(?P<suffix>[eE][-+]?\d+|[mkMGTPE]|[KMGTPE]i)?"
)
_SUFFIXES = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_SUFFIXES.update({f"{p}i": 2.0 ** (10 * (i + 1)) for i, p in enumerate("KMGTPE")})


def parse_quantity(value: str) -> float:
    """A Kubernetes quantity as a number (cores, bytes): ``"500m"`` -> 0.5, ``"1Ki"`` -> 1024.

    Raises:
        ValueError: `value` is not a quantity.
    """
    match = _QUANTITY.fullmatch(str(value).strip())
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    suffix = match["suffix"] or ""
    if suffix not in _SUFFIXES and suffix:  # an exponent: "1e3", "5E-2"
        return float(match["number"] + suffix)
    return float(match["number"]) * _SUFFIXES.get(suffix, 1.0)


# A pod without an accelerator (tasks on cpu, builder Jobs, flow-run pods).
CPU_REQUESTS = {"cpu": "1", "memory": "2Gi"}


def machine_type(name: str) -> MachineType:
    """The catalogue's machine type `name` (e.g. ``"ct5lp-hightpu-4t"``)."""
    return _MACHINES[name]


@dataclass(frozen=True)
class _GpuModel:
    label: str
    # GPUs per pod -> the smallest machine type with that many (its capacity is the
    # pod's default request, so the pod fits any machine of the series with that count).
    machines: dict[int, str]

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(self.machines)


@dataclass(frozen=True)
class _TpuGeneration:
    """One TPU version as GKE and Cloud TPU name it.

    ``cores_per_chip``: what the number in a Cloud TPU accelerator type counts per chip
    (TensorCores for v3, v4, v5p and TPU7x, chips for v5e and v6e).
    ``single_host``: topology -> machine type of a one-node slice;
    ``multi_host``: the topologies of multi-host slices, on ``slice_machine`` nodes.
    """

    label: str
    cloud_name: str | None
    cores_per_chip: int
    single_host: dict[str, str]
    multi_host: tuple[str, ...] = ()
    slice_machine: str = ""
    # GKE labels single-host v3 nodes tpu-v3-device, multi-host ones tpu-v3-slice.
    single_host_label: str | None = None


@dataclass(frozen=True)
class _TpuShape:
    generation: str
    topology: str
    chips: int
    hosts: int
    machine: str
    label: str

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def number(self) -> int:
        """The number in the Cloud TPU accelerator type: TensorCores or chips."""
        return self.chips * _TPUS[self.generation].cores_per_chip

    @property
    def name(self) -> str:
        prefix = self.generation if self.generation.startswith("tpu") else f"tpu-{self.generation}"
        return f"{prefix}-{self.number}"


# Dict order is the catalogue order.
_GPUS: dict[str, _GpuModel] = {
    "l4": _GpuModel(
        "nvidia-l4",
        {1: "g2-standard-4", 2: "g2-standard-24", 4: "g2-standard-48", 8: "g2-standard-96"},
    ),
    # T4 and V100 attach to N1 machines of the user's choosing: requests assume 4 vCPUs
    # per GPU (override with cpu= and memory=).
    "t4": _GpuModel(
        "nvidia-tesla-t4", {1: "n1-standard-4", 2: "n1-standard-8", 4: "n1-standard-16"}
    ),
    "v100": _GpuModel(
        "nvidia-tesla-v100",
        {1: "n1-standard-4", 2: "n1-standard-8", 4: "n1-standard-16", 8: "n1-standard-32"},
    ),
    "a100": _GpuModel(
        "nvidia-tesla-a100",
        {
            1: "a2-highgpu-1g",
            2: "a2-highgpu-2g",
            4: "a2-highgpu-4g",
            8: "a2-highgpu-8g",
            16: "a2-megagpu-16g",
        },
    ),
    "a100-80gb": _GpuModel(
        "nvidia-a100-80gb",
        {1: "a2-ultragpu-1g", 2: "a2-ultragpu-2g", 4: "a2-ultragpu-4g", 8: "a2-ultragpu-8g"},
    ),
    "h100": _GpuModel(
        "nvidia-h100-80gb",
        {1: "a3-highgpu-1g", 2: "a3-highgpu-2g", 4: "a3-highgpu-4g", 8: "a3-highgpu-8g"},
    ),
}

# The TPU catalogue, as GKE's "Plan TPUs in GKE" page
# (https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus) and Cloud TPU's
# per-version pages (https://cloud.google.com/tpu/docs/v3, .../v4, .../v5e, .../v5p,
# .../v6e, .../tpu7x) list them; docs/kubernetes.md has the table and its sources.
_V2D_SLICES = ("4x4", "4x8", "8x8", "8x16", "16x16")
_V3D_SLICES = ("2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16")
_TPUS: dict[str, _TpuGeneration] = {
    "v3": _TpuGeneration(
        "tpu-v3-slice",
        "v3",
        2,
        {"2x2": "ct3-hightpu-4t"},
        _V2D_SLICES,
        "ct3p-hightpu-4t",
        single_host_label="tpu-v3-device",
    ),
    "v4": _TpuGeneration(
        "tpu-v4-podslice", "v4", 2, {"2x2x1": "ct4p-hightpu-4t"}, _V3D_SLICES, "ct4p-hightpu-4t"
    ),
    "v5e": _TpuGeneration(
        "tpu-v5-lite-podslice",
        "v5litepod",
        1,
        {"1x1": "ct5lp-hightpu-1t", "2x2": "ct5lp-hightpu-4t", "2x4": "ct5lp-hightpu-8t"},
        _V2D_SLICES,
        "ct5lp-hightpu-4t",
    ),
    # v5e for serving: ct5l machines, single-host only.
    "v5e-device": _TpuGeneration(
        "tpu-v5-lite-device",
        None,
        1,
        {"1x1": "ct5l-hightpu-1t", "2x2": "ct5l-hightpu-4t", "2x4": "ct5l-hightpu-8t"},
    ),
    "v5p": _TpuGeneration(
        "tpu-v5p-slice", "v5p", 2, {"2x2x1": "ct5p-hightpu-4t"}, _V3D_SLICES, "ct5p-hightpu-4t"
    ),
    "v6e": _TpuGeneration(
        "tpu-v6e-slice",
        "v6e",
        1,
        {"1x1": "ct6e-standard-1t", "2x2": "ct6e-standard-4t", "2x4": "ct6e-standard-8t"},
        _V2D_SLICES,
        "ct6e-standard-4t",
    ),
    # Ironwood.
    "tpu7x": _TpuGeneration(
        "tpu7x",
        "tpu7x",
        2,
        {"2x2x1": "tpu7x-standard-4t"},
        _V3D_SLICES,
        "tpu7x-standard-4t",
    ),
}


def _chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def _machine_chips(machine: str) -> int:
    # TPU machine types end in their chip count: ct5lp-hightpu-4t, ct6e-standard-8t.
    match = re.search(r"-(\d+)t$", machine)
    if match is None:
        raise ValueError(f"{machine} names no TPU chip count")
    return int(match[1])


def _tpu_shapes() -> dict[str, dict[str, _TpuShape]]:
    """generation -> topology -> shape, single-host shapes first."""
    shapes: dict[str, dict[str, _TpuShape]] = {}
    for name, gen in _TPUS.items():
        found = shapes.setdefault(name, {})
        for topology, machine in gen.single_host.items():
            label = gen.single_host_label or gen.label
            found[topology] = _TpuShape(name, topology, _chips(topology), 1, machine, label)
        for topology in gen.multi_host:
            per_host = _machine_chips(gen.slice_machine)
            chips = _chips(topology)
            found[topology] = _TpuShape(
                name, topology, chips, chips // per_host, gen.slice_machine, gen.label
            )
    return shapes


_TPU_SHAPES = _tpu_shapes()


def _tpu_spellings() -> dict[str, _TpuShape]:
    """Every accepted TPU spelling (lower case, no `tpu-` prefix) -> its shape.

    Our name (`v5p-8`), the Cloud TPU accelerator type (`v5litepod-16`: the same number,
    a different version name) and the topology (`v5p-2x2x1`).
    """
    spellings: dict[str, _TpuShape] = {}
    for generation, shapes in _TPU_SHAPES.items():
        cloud = _TPUS[generation].cloud_name
        for shape in shapes.values():
            spellings[shape.name.removeprefix("tpu-")] = shape
            if cloud:
                spellings[f"{cloud}-{shape.number}"] = shape
            spellings[f"{generation}-{shape.topology}"] = shape
    return spellings


_TPU_SPELLINGS = _tpu_spellings()
_TPU_ALIASES = {gen.cloud_name: name for name, gen in _TPUS.items() if gen.cloud_name}

# GKE node labels are accepted as GPU names so specs can be copied from node pools.
_GPU_ALIASES = {model.label: name for name, model in _GPUS.items()}

_GPU_SPEC = re.compile(r"(?P<model>.+?)(?:x(?P<count>\d+))?")
_TPU_SPEC = re.compile(r"(?P<gen>v\d+[a-z]*(?:-device)?|tpu\d+[a-z]*)(?:-(?P<size>[0-9x]+))?")


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
        name,
        "gpu",
        count,
        selector,
        {_GPU_RESOURCE: str(count)},
        tolerations,
        spot=spot,
        machine_type=_GPUS[model].machines[count],
    )


def _tpu(shape: _TpuShape, spot: bool) -> Accelerator:
    selector, tolerations = _with_spot(
        {_GKE_TPU_ACCELERATOR: shape.label, _GKE_TPU_TOPOLOGY: shape.topology},
        [_TPU_TOLERATION],
        spot,
    )
    return Accelerator(
        shape.name,
        "tpu",
        shape.chips_per_host,
        selector,
        {_TPU_RESOURCE: str(shape.chips_per_host)},
        tolerations,
        hosts=shape.hosts,
        spot=spot,
        topology=shape.topology,
        machine_type=shape.machine,
    )


def catalogue() -> list[Accelerator]:
    """Return every canonical (non-spot) accelerator: cpu first, then GPUs, then TPUs.

    Example:
        >>> [a.name for a in catalogue()][:3]
        ['cpu', 'l4', 'l4x2']
    """
    accelerators = [_cpu(spot=False)]
    accelerators += [_gpu(m, n, spot=False) for m, model in _GPUS.items() for n in model.counts]
    accelerators += [
        _tpu(s, spot=False) for shapes in _TPU_SHAPES.values() for s in shapes.values()
    ]
    return accelerators


def tpu_aliases(accelerator: Accelerator) -> list[str]:
    """The other spellings of a TPU: its Cloud TPU accelerator type and its topology."""
    return sorted(
        {
            spelling
            for spelling, shape in _TPU_SPELLINGS.items()
            if shape.name == accelerator.name and spelling != accelerator.name.removeprefix("tpu-")
        }
    )


def _unknown(spec: str, reason: str) -> UnknownAcceleratorError:
    return UnknownAcceleratorError(f"Unknown accelerator {spec!r}: {reason}. {_LIST_HINT}")


def _suggestions(body: str) -> str:
    # Match against bare and aliased forms too, so "v9z-1" still finds "tpu-v5e-1".
    candidates: dict[str, str] = {}
    for acc in catalogue():
        candidates[acc.name] = acc.name
    for spelling, shape in _TPU_SPELLINGS.items():
        candidates[spelling] = shape.name
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
    shape = _TPU_SPELLINGS.get(f"{generation}-{match['size']}")
    if shape is not None:
        return _tpu(shape, spot)
    shapes = list(_TPU_SHAPES[generation].values())
    gen = _TPUS[generation]
    valid = ", ".join(str(s.number) for s in shapes)
    counts = (
        f"TPU {generation} names count TensorCores as Cloud TPU does ({gen.cores_per_chip} "
        f"per chip: {shapes[0].name} is {shapes[0].chips} chips, topology {shapes[0].topology})"
        if gen.cores_per_chip > 1
        else f"TPU {generation} names count chips"
    )
    if match["size"] is None:
        raise _unknown(spec, f"{counts}; give a size, one of {valid}")
    raise _unknown(
        spec, f"{counts}; valid sizes are {valid}, or a topology such as {shapes[-1].topology}"
    )


def parse_accelerator(spec: str, *, spot: bool | None = None) -> Accelerator:
    """Parse an accelerator spec such as ``"l4x2"``, ``"tpu-v5e-4"`` or ``"v6e-8:spot"``.

    Parsing ignores case and surrounding whitespace; the ``tpu-``/``gpu-`` prefixes are
    optional, Cloud TPU's names (``v5litepod-16``, ``v5p-8``) and topologies
    (``v5p-2x2x1``) are accepted for TPUs and GKE GPU labels (``nvidia-l4``) for the short
    GPU names. A ``:spot`` suffix requests Spot VMs; ``spot=True`` or
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
