"""mypy checks pipeline/stages/build.py against the TensorRT type stubs (tensorrt-stubs).

tensorrt-stubs 10.13 installs a bare ``tensorrt/__init__.pyi`` without a
``py.typed`` marker, which mypy skips (PEP 561: "missing library stubs or
py.typed marker"; pyproject's ``ignore_missing_imports`` hides even that), so
every ``trt.*`` would silently be ``Any``. Its ``tensorrt_bindings/tensorrt.pyi``
also has syntax errors that stop mypy (parameters named ``in``; a parameter
without default after defaulted ones). This test lays the stub files out as
PEP 561 stub-only packages (``tensorrt-stubs/``, ``tensorrt_bindings-stubs/``)
in a temp folder on PYTHONPATH, with those two syntax errors patched, and
first proves that mypy resolves them (a wrong call must fail).
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUBS = "tensorrt-stubs"


def _stub_files() -> list[Path]:
    try:
        files = md.distribution(STUBS).files or []
    except md.PackageNotFoundError:
        pytest.skip(f"{STUBS} is not installed (pip install {STUBS}==10.13.*); cannot type-check TensorRT calls")
    pyi = [Path(str(f.locate())) for f in files if str(f).endswith(".pyi")]
    if not pyi:
        pytest.skip(f"{STUBS} is installed but ships no .pyi files")
    return pyi


def _repair(text: str) -> str:
    """Fix the syntax errors of tensorrt-stubs 10.13 (invalid Python in a .pyi)."""
    text = re.sub(r"(?<=[(, ])in: ", "in_: ", text)
    return text.replace(", channel_axis: int)", ", channel_axis: int = ...)")


@pytest.fixture(scope="module")
def mypy_env(tmp_path_factory) -> dict[str, str]:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (dev extra)")
    root = tmp_path_factory.mktemp("trt_stub_path")
    for src in _stub_files():
        package = src.parent.name  # tensorrt / tensorrt_bindings
        dst = root / f"{package}-stubs" / src.name
        dst.parent.mkdir(exist_ok=True)
        text = _repair(src.read_text())
        try:
            ast.parse(text)
        except SyntaxError as e:
            pytest.fail(f"{src} still has a syntax error after repair ({e}); update _repair for this stubs version")
        dst.write_text(text)
    env = dict(os.environ, PYTHONPATH=str(root), MYPY_CACHE_DIR=str(root / ".mypy_cache"))
    return env


def _mypy(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args, "--follow-imports=silent"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_mypy_resolves_the_tensorrt_stubs(mypy_env, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import tensorrt as trt\n"
        "reveal_type(trt.Builder.create_network)\n"
        "trt.Builder.no_such_method\n"
        "trt.IBuilderConfig.set_memory_pool_limit(None, trt.MemoryPoolType.WORKSPACE, 'many')\n"
    )
    out = _mypy(mypy_env, str(probe))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "INetworkDefinition" in out.stdout  # revealed type comes from the stubs, not Any
    assert '"type[Builder]" has no attribute "no_such_method"' in out.stdout
    assert 'incompatible type "str"; expected "int"' in out.stdout


def test_build_stage_typechecks_against_tensorrt_stubs(mypy_env):
    out = _mypy(mypy_env, "pipeline/stages/build.py", "pipeline/serving.py", "pipeline/stages/triton.py",
                "pipeline/runners.py")
    assert out.returncode == 0, out.stdout + out.stderr


def test_gpu_check_helper_typechecks(mypy_env):
    out = _mypy(mypy_env, "benchmarks/gpu_check.py")
    assert out.returncode == 0, out.stdout + out.stderr
