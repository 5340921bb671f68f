import pytest

from kinetic_prefect.launch.accelerators import (
    Accelerator,
    UnknownAcceleratorError,
    catalogue,
    parse_accelerator,
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


def test_invalid_tpu_chip_count_lists_valid_counts() -> None:
    with pytest.raises(UnknownAcceleratorError, match="4, 8, 16, 32"):
        parse_accelerator("tpu-v4-64")


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
