import pytest

from kinetic_prefect.launch.accelerators import (
    Accelerator,
    UnknownAcceleratorError,
    catalogue,
    machine_type,
    parse_accelerator,
    parse_quantity,
    tpu_aliases,
)

SPOT_SELECTOR = {"cloud.google.com/gke-spot": "true"}
SPOT_TOLERATION = {
    "key": "cloud.google.com/gke-spot",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}


def test_gpu_selects_gke_accelerator_label() -> None:
    assert parse_accelerator("l4").node_selector == {
        "cloud.google.com/gke-accelerator": "nvidia-l4"
    }


def test_gpu_limits_nvidia_gpus_to_the_count() -> None:
    assert parse_accelerator("a100-80gbx4").resource_limits == {"nvidia.com/gpu": "4"}


def test_gpu_tolerates_the_nvidia_taint() -> None:
    assert parse_accelerator("h100").tolerations == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_gpu_count_suffix_sets_count() -> None:
    assert parse_accelerator("l4x2").count == 2


def test_cpu_has_no_scheduling_constraints() -> None:
    cpu = parse_accelerator("cpu")
    assert (cpu.kind, cpu.node_selector, cpu.resource_limits, cpu.tolerations) == (
        "cpu",
        {},
        {},
        [],
    )


def test_tpu_v5e_1_is_a_single_chip_lite_podslice() -> None:
    tpu = parse_accelerator("tpu-v5e-1")
    assert (tpu.node_selector, tpu.resource_limits) == (
        {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
            "cloud.google.com/gke-tpu-topology": "1x1",
        },
        {"google.com/tpu": "1"},
    )


def test_tpu_v5e_8_uses_2x4_topology() -> None:
    assert parse_accelerator("tpu-v5e-8").topology == "2x4"


def test_tpu_tolerates_the_tpu_taint() -> None:
    assert parse_accelerator("tpu-v6e-4").tolerations == [
        {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_multi_host_tpu_limits_chips_per_host() -> None:
    tpu = parse_accelerator("tpu-v5e-16")
    assert (tpu.count, tpu.hosts, tpu.resource_limits) == (4, 4, {"google.com/tpu": "4"})


def test_v5litepod_is_an_alias_for_v5e() -> None:
    assert parse_accelerator("v5litepod-4") == parse_accelerator("tpu-v5e-4")


@pytest.mark.parametrize("spec", ["v5e-4", "TPU-V5E-4", "  tpu-v5e-4 ", "Tpu-V5litepod-4"])
def test_tpu_spec_ignores_case_whitespace_and_prefix(spec: str) -> None:
    assert parse_accelerator(spec) == parse_accelerator("tpu-v5e-4")


@pytest.mark.parametrize("spec", ["L4", "gpu-l4", " GPU-L4 ", "nvidia-l4"])
def test_gpu_spec_ignores_case_whitespace_and_prefix(spec: str) -> None:
    assert parse_accelerator(spec) == parse_accelerator("l4")


def test_spot_suffix_adds_spot_selector() -> None:
    assert parse_accelerator("l4:spot").node_selector == {
        "cloud.google.com/gke-accelerator": "nvidia-l4",
        **SPOT_SELECTOR,
    }


def test_spot_suffix_adds_spot_toleration() -> None:
    assert SPOT_TOLERATION in parse_accelerator("l4:spot").tolerations


def test_spot_argument_adds_spot_selector_and_toleration() -> None:
    tpu = parse_accelerator("tpu-v5e-4", spot=True)
    assert (
        SPOT_SELECTOR.items() <= tpu.node_selector.items(),
        SPOT_TOLERATION in tpu.tolerations,
    ) == (True, True)


def test_spot_false_overrides_spot_suffix() -> None:
    assert parse_accelerator("l4:spot", spot=False) == parse_accelerator("l4")


def test_spot_cpu_adds_only_spot_constraints() -> None:
    cpu = parse_accelerator("cpu:spot")
    assert (cpu.node_selector, cpu.tolerations) == (SPOT_SELECTOR, [SPOT_TOLERATION])


def test_spot_spec_round_trips() -> None:
    assert parse_accelerator(parse_accelerator("l4x2:spot").spec).spot is True


def test_returned_dicts_are_fresh_copies() -> None:
    acc = parse_accelerator("l4")
    acc.node_selector["mutated"] = "yes"
    acc.tolerations[0]["mutated"] = "yes"
    assert (acc.node_selector, acc.tolerations) == (
        parse_accelerator("l4").node_selector,
        parse_accelerator("l4").tolerations,
    )


def test_accelerators_are_hashable() -> None:
    assert len({parse_accelerator("l4"), parse_accelerator("L4")}) == 1


def test_unknown_tpu_suggests_close_matches_and_listing_command() -> None:
    with pytest.raises(UnknownAcceleratorError, match=r"tpu-v5e-1.*kinetic-prefect accelerators"):
        parse_accelerator("tpu-v9z-1")


def test_unknown_name_without_close_match_lists_examples() -> None:
    with pytest.raises(UnknownAcceleratorError, match="tpu-v5e-4"):
        parse_accelerator("zzzzzz")


def test_invalid_gpu_count_lists_valid_counts() -> None:
    with pytest.raises(UnknownAcceleratorError, match="1, 2, 4, 8"):
        parse_accelerator("l4x3")


def test_tpu_without_chip_count_lists_valid_counts() -> None:
    with pytest.raises(UnknownAcceleratorError, match="1, 4, 8, 16, 32, 64, 128, 256"):
        parse_accelerator("v5e")


def test_invalid_tpu_size_lists_valid_sizes() -> None:
    with pytest.raises(UnknownAcceleratorError, match="valid sizes are 8, 16, 32, 64"):
        parse_accelerator("tpu-v4-24")


def test_unsupported_suffix_is_rejected() -> None:
    with pytest.raises(UnknownAcceleratorError, match=":preemptible"):
        parse_accelerator("l4:preemptible")


def test_empty_spec_is_rejected() -> None:
    with pytest.raises(UnknownAcceleratorError, match="empty"):
        parse_accelerator("  ")


def test_unknown_accelerator_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_accelerator("nope")


@pytest.mark.parametrize("acc", catalogue(), ids=lambda acc: acc.name)
def test_catalogue_names_round_trip(acc: Accelerator) -> None:
    assert parse_accelerator(acc.name) == acc


def test_catalogue_lists_cpu_then_gpus_then_tpus() -> None:
    kinds = [acc.kind for acc in catalogue()]
    assert kinds == sorted(kinds, key=["cpu", "gpu", "tpu"].index)


# -- TPU names as GKE and Cloud TPU write them ---------------------------------------------
# https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus and Cloud TPU's
# per-version pages: v3, v4, v5p and TPU7x accelerator types count TensorCores (two per
# chip), v5e and v6e count chips.


@pytest.mark.parametrize(
    ("spec", "chips", "hosts", "topology", "machine"),
    [
        ("v5p-8", 4, 1, "2x2x1", "ct5p-hightpu-4t"),
        ("tpu-v5p-8", 4, 1, "2x2x1", "ct5p-hightpu-4t"),
        ("v5p-16", 8, 2, "2x2x2", "ct5p-hightpu-4t"),
        ("v4-8", 4, 1, "2x2x1", "ct4p-hightpu-4t"),
        ("v4-16", 8, 2, "2x2x2", "ct4p-hightpu-4t"),
        ("v3-8", 4, 1, "2x2", "ct3-hightpu-4t"),
        ("v3-32", 16, 4, "4x4", "ct3p-hightpu-4t"),
        ("v5litepod-16", 16, 4, "4x4", "ct5lp-hightpu-4t"),
        ("v5litepod-8", 8, 1, "2x4", "ct5lp-hightpu-8t"),
        ("v6e-8", 8, 1, "2x4", "ct6e-standard-8t"),
        ("v6e-16", 16, 4, "4x4", "ct6e-standard-4t"),
        ("tpu7x-8", 4, 1, "2x2x1", "tpu7x-standard-4t"),
    ],
)
def test_cloud_tpu_names_mean_what_cloud_tpu_means(
    spec: str, chips: int, hosts: int, topology: str, machine: str
) -> None:
    tpu = parse_accelerator(spec)

    assert (tpu.chips, tpu.hosts, tpu.topology, tpu.machine_type) == (
        chips,
        hosts,
        topology,
        machine,
    )
    assert tpu.resource_limits == {"google.com/tpu": str(chips // hosts)}


def test_gke_tpu_accelerator_values_are_the_ones_gke_labels_nodes_with() -> None:
    labels = {
        acc.node_selector["cloud.google.com/gke-tpu-accelerator"]
        for acc in catalogue()
        if acc.kind == "tpu"
    }

    assert labels == {
        "tpu-v3-device",
        "tpu-v3-slice",
        "tpu-v4-podslice",
        "tpu-v5-lite-podslice",
        "tpu-v5-lite-device",
        "tpu-v5p-slice",
        "tpu-v6e-slice",
        "tpu7x",
    }


def test_v3_on_one_host_is_a_device_and_across_hosts_a_slice() -> None:
    selector = "cloud.google.com/gke-tpu-accelerator"

    assert parse_accelerator("tpu-v3-8").node_selector[selector] == "tpu-v3-device"
    assert parse_accelerator("tpu-v3-32").node_selector[selector] == "tpu-v3-slice"


@pytest.mark.parametrize(
    ("topology", "name"),
    [("v5p-2x2x1", "tpu-v5p-8"), ("tpu-v5e-4x4", "tpu-v5e-16"), ("v6e-2x4", "tpu-v6e-8")],
)
def test_a_topology_names_its_slice(topology: str, name: str) -> None:
    assert parse_accelerator(topology).name == name


def test_a_v5p_size_that_counted_chips_explains_that_names_count_tensorcores() -> None:
    with pytest.raises(UnknownAcceleratorError, match=r"count TensorCores.*tpu-v5p-8 is 4 chips"):
        parse_accelerator("tpu-v5p-4")


@pytest.mark.parametrize("acc", catalogue(), ids=lambda a: a.name)
def test_every_catalogue_name_is_one_shape_whatever_its_spelling(acc: Accelerator) -> None:
    spellings = [acc.name, *tpu_aliases(acc)] if acc.kind == "tpu" else [acc.name]

    assert {parse_accelerator(s) for s in spellings} == {acc}


# -- cpu and memory requests ----------------------------------------------------------------


def _quantity(value: str) -> float:
    units = {"m": 1e-3, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value.removesuffix(suffix)) * factor
    return float(value)


@pytest.mark.parametrize("acc", catalogue(), ids=lambda a: a.name)
def test_every_accelerator_requests_cpu_and_memory_its_machine_can_give(acc: Accelerator) -> None:
    requests = acc.default_requests

    assert set(requests) == {"cpu", "memory"}
    if acc.machine_type is None:
        assert requests == {"cpu": "1", "memory": "2Gi"}
        return
    machine = machine_type(acc.machine_type)
    cpu, memory = _quantity(requests["cpu"]), _quantity(requests["memory"])
    # Below what GKE leaves to pods, yet most of the node: the pod has it to itself.
    allocatable_cpu, allocatable_mib = machine.allocatable()
    assert 0.8 * allocatable_cpu / 1000 < cpu < allocatable_cpu / 1000
    assert 0.8 * allocatable_mib * 2**20 < memory < allocatable_mib * 2**20


def test_allocatable_follows_gkes_documented_reservation() -> None:
    # plan-node-sizes: a 4 vCPU / 16 GiB node reserves 80m of CPU (6% + 1% + 2 x 0.5%) and
    # 2.6 GiB of memory (25% of 4 + 20% of 4 + 10% of 8) plus the 100 MiB eviction threshold.
    assert machine_type("g2-standard-4").allocatable() == (3920, int(16 * 1024 - 2.6 * 1024 - 100))


@pytest.mark.parametrize(
    ("quantity", "value"),
    [
        ("500m", 0.5),
        ("2", 2.0),
        ("1Ki", 1024.0),
        ("3920m", 3.92),
        ("1e3", 1000.0),
        ("2E", 2e18),
        ("1Ei", 2.0**60),
    ],
)
def test_kubernetes_quantities_read_with_their_suffixes_and_exponents(quantity, value):
    assert parse_quantity(quantity) == value
