"""The real fp8-llm repository on a real tritonserver (minutes; uses the session's fp8-llm run):
streamed greedy tokens against the validate stage's, and ``python -m pipeline serve`` until Ctrl-C."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, llm_overrides
from test_repository import snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.server]


def processes_with(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (our server and its python-backend stubs
    carry the server's unique shared-memory prefix in their arguments)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_served_fp8_llm_streams_the_validate_greedy_tokens(fp8_llm_run, llm_workspace, record_property):
    pytest.importorskip("pytriton")
    from pipeline.recipe.load import load_recipe
    from pipeline.serve.check import check_greedy
    from pipeline.serve.run import launch, prepare_for_server
    from pipeline.triton.server import find_server

    assert fp8_llm_run.passed
    recipe = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", llm_overrides(llm_workspace))
    published = snapshot(Path(recipe.output_dir))
    served = prepare_for_server(recipe, fp8_llm_run.artifacts)
    if "onnxruntime" not in find_server().backends:
        assert served.target == "python-onnxruntime" and "needs tritonserver's 'onnxruntime' backend" in served.note
    server = launch(served)
    try:
        assert processes_with(server.shm_prefix)  # the server (and its stubs) while it runs
        checks = check_greedy(served, server.grpc_url)  # all 8 validate prompts, 32 tokens each
    finally:
        code = server.stop()
    verdicts = [f"prompt {c.index}: {c.verdict}" for c in checks]
    record_property("greedy_checks", verdicts)
    print("\n".join(verdicts))
    assert len(checks) == 8 and all(c.streamed == c.expected for c in checks), "\n".join(verdicts)
    assert all(c.ok for c in checks), "\n".join(verdicts)
    assert code == 0, server.logs()[-3000:]
    assert not processes_with(server.shm_prefix), "a tritonserver or python-backend stub outlived stop()"
    assert not list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))
    assert snapshot(Path(recipe.output_dir)) == published  # the served copy never touches output_dir


def test_cli_serve_runs_until_ctrl_c_and_leaves_nothing(fp8_llm_run, llm_workspace):
    pytest.importorskip("pytriton")
    from pipeline.serve.client import StreamClient

    sets = [f"--set={k}={v}" for k, v in llm_overrides(llm_workspace).items()]
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(ROOT / "recipes" / "fp8-llm.yaml"),
                             "--quiet", *sets], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, grpc_url = [], None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "serve exited early:\n" + "".join(lines)
            lines.append(line)
            grpc_url = grpc_url or (m.group(1) if (m := re.search(r"gRPC (127\.0\.0\.1:\d+)", line)) else None)
            if line.startswith("serving; Ctrl-C"):
                break
        assert grpc_url, "".join(lines)
        prompt = fp8_llm_run.artifacts["validate"].greedy_tokens["prompt_ids"][0]
        with StreamClient(grpc_url) as client:
            assert len(client.generate("smollm2_generate", input_ids=prompt, max_tokens=3).tokens) == 3
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=300)  # generous: the stop takes ~4 s idle, far longer on a loaded CI box
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, "".join(lines) + out
    assert "tritonserver stopped (exit status 0)" in out
    prefix = f"trtpipe{proc.pid}-"  # start_server's shared-memory prefix in that process
    assert not processes_with(prefix) and not list(Path("/dev/shm").glob(f"{prefix}*"))
