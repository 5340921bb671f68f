"""The pod's last step: flushing the files nobody closed must not import anything."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

from kinetic_prefect.pod.exit import buffered_files


def test_the_scan_for_open_files_finds_them_and_leaves_lazy_modules_unloaded(tmp_path: Path):
    source = tmp_path / "lazily_loaded.py"
    source.write_text("import sys\nsys.modules[__name__].loaded = True\nLOADED = True\n")
    spec = importlib.util.spec_from_file_location("lazily_loaded", source)
    assert spec is not None and spec.loader is not None
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lazily_loaded"] = module
    spec.loader.exec_module(module)
    left_open = (tmp_path / "left-open.txt").open("w")
    try:
        found = buffered_files()

        assert any(f is left_open for f in found)
        assert all(isinstance(f, io.IOBase) for f in found)
        # Loading it would run its code, which sets `loaded`; reading __dict__ does not.
        assert "LOADED" not in object.__getattribute__(module, "__dict__")
    finally:
        left_open.close()
        sys.modules.pop("lazily_loaded", None)
