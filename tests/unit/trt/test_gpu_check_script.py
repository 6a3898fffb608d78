"""benchmarks/gpu_check.sh says what is missing and exits 4 where TensorRT / a GPU are absent;
its python helper imports here (it is also type-checked in test_build_typecheck)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess

from conftest import ROOT


def test_script_lists_what_is_missing(tmp_path):
    bin_dir = tmp_path / "bin"  # only basic tools: no trtexec, no nvidia-smi
    bin_dir.mkdir()
    for tool in ("dirname", "head", "sed", "timeout"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    python = tmp_path / "python"  # an interpreter without tensorrt
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    out = subprocess.run(["/bin/sh", str(ROOT / "benchmarks" / "gpu_check.sh"), "no-such-recipe"],
                         env={"PATH": str(bin_dir), "PYTHON": str(python)}, capture_output=True, text=True)
    assert out.returncode == 4
    lines = out.stderr.splitlines()
    assert lines[0] == "gpu_check: cannot run; missing:"
    assert lines[1].startswith("  - the tensorrt Python package")
    assert lines[2].startswith("  - trtexec")
    assert lines[3].startswith("  - a CUDA GPU")
    assert lines[4].startswith("  - artifacts/no-such-recipe/build/trtexec.sh")


def test_helper_imports():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert callable(module.main) and callable(module.compare)
