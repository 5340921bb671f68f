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
