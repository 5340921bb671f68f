from typer.testing import CliRunner

from kinetic_prefect.cli import app

runner = CliRunner()


def test_accelerators_lists_tpu_shapes() -> None:
    result = runner.invoke(app, ["accelerators"])
    assert ("tpu-v5e-4" in result.output, "2x2" in result.output) == (True, True)


def test_accelerators_lists_gpu_labels() -> None:
    result = runner.invoke(app, ["accelerators"])
    assert "nvidia-l4" in result.output


def test_accelerators_exits_successfully() -> None:
    assert runner.invoke(app, ["accelerators"]).exit_code == 0


def test_accelerators_kind_filter_excludes_other_kinds() -> None:
    result = runner.invoke(app, ["accelerators", "--kind", "tpu"])
    assert ("tpu-v5e-4" in result.output, "nvidia-l4" in result.output) == (True, False)


def test_accelerators_rejects_unknown_kind() -> None:
    assert runner.invoke(app, ["accelerators", "--kind", "fpga"]).exit_code != 0


def test_accelerators_lists_cloud_tpu_names_machine_types_and_requests() -> None:
    lines = runner.invoke(app, ["accelerators", "--kind", "tpu"]).output.splitlines()
    (v5p_8,) = [line for line in lines if "tpu-v5p-8 " in line]
    (v5e_16,) = [line for line in lines if "tpu-v5e-16 " in line]

    assert ("ct5p-hightpu-4t" in v5p_8, "tpu-v5p-slice" in v5p_8, "cpu:" in v5p_8) == (
        True,
        True,
        True,
    )
    assert "v5litepod-16" in "\n".join(lines[lines.index(v5e_16) : lines.index(v5e_16) + 3])


def test_jobs_logs_finds_a_warm_pod_from_its_claim_or_an_older_releases_record(tmp_path):
    import json

    from kinetic_prefect.cli.job_logs import warm_pod_for
    from kinetic_prefect.common.handover import Claim, take_back
    from kinetic_prefect.common.layout import WARM_POD_JSON, job_file
    from kinetic_prefect.common.storage import LocalStore

    store = LocalStore(tmp_path)
    store.put_bytes(job_file("kp-a", WARM_POD_JSON), Claim(pod="kp-pod", sequence=1).encode())
    legacy = {"kind": "warm-acceptance", "version": 1, "pod": "kp-old", "sequence": 2}
    store.put_bytes(job_file("kp-b", WARM_POD_JSON), json.dumps(legacy).encode())
    assert take_back(store, job_file("kp-c", WARM_POD_JSON), "", 0) is None
    store.put_bytes(job_file("kp-e", WARM_POD_JSON), Claim(pod="kp-e", sequence=0).encode())

    assert warm_pod_for(store, "kp-a") == "kp-pod"
    assert warm_pod_for(store, "kp-b") == "kp-old"
    assert warm_pod_for(store, "kp-c") is None  # cancelled before any pod took it
    assert warm_pod_for(store, "kp-d") is None
    assert warm_pod_for(store, "kp-e") is None  # its own pod's first task: follow that pod
    assert warm_pod_for(None, "kp-a") is None
