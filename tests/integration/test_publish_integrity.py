"""A failed or crashed run never changes what is published (issue: integrity, round 2).

Crashes are injected with ``PIPELINE_FAULT=<point>`` (the process SIGKILLs itself
there, see pipeline.faults), plus one real SIGKILL from outside. After each crash
the repository must hold the old set, or be reported half-published by
``verify_repository`` and hold the new complete set once the next run repaired it.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


import crash
from conftest import ROOT
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
from pipeline.triton.publish import JOURNAL_FILE, verify_repository
from tiny import seed_export, tiny_recipe

STAGES = ["export", "quantize", "build", "validate", "triton"]


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file (hidden journal included)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _run(path: Path, overrides: dict | None = None):
    return run_pipeline(load_recipe(path, overrides or {}), path, quiet=True)


def _build_cmd(path: Path, overrides: dict) -> list[str]:
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    return [sys.executable, "-m", "pipeline", "build", str(path), "--quiet", *sets]


def _crash(path: Path, point: str, overrides: dict) -> crash.Finished:
    """A build in a process of its own (a fork of :mod:`crash`'s server) that SIGKILLs itself at ``point``."""
    argv = _build_cmd(path, overrides)[3:]  # after python -m pipeline
    return crash.run_build(argv, {"PIPELINE_FAULT": point}, ROOT,
                           path.parent / "crash-logs" / f"{point.replace(':', '-')}.log")


def _hits(man: dict) -> dict[str, bool]:
    return {k: bool(v.get("cache_hit")) for k, v in man["stages"].items()}


def test_failed_gate_leaves_published_and_serve_copies_byte_identical(tmp_path, tiny_model, tiny_export):
    from pipeline.serve.prepare import prepare

    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)
    first = _run(path)
    served = prepare(load_recipe(path), first.artifacts, ["python"])  # the python-onnxruntime serve copy
    repo, serve_repo = Path(first.artifacts["triton"].repository), served.repository
    before, serve_before = snapshot(repo), snapshot(serve_repo)
    quantized = Path(first.artifacts["quantize"].onnx_path)
    assert os.stat(quantized).st_ino != os.stat(repo / "smollm2_fp8" / "1" / "model.onnx").st_ino

    failed = _run(path, {"quantize.calibration.method": "percentile",
                         "validate.gates.0.max": 1e-12})
    assert not failed.passed and failed.manifest["stages"]["quantize"]["cache_hit"] is False
    assert failed.manifest["stages"]["triton"]["status"] == "skipped"
    assert snapshot(repo) == before and snapshot(serve_repo) == serve_before
    assert verify_repository(repo) == [] and verify_repository(serve_repo) == []

    argv = _build_cmd(path, {"quantize.calibration.method": "entropy", "validate.gates.0.max": 1e-12})[3:]
    proc = crash.run_build(argv, {}, ROOT, tmp_path / "failed-gate.log")  # the CLI's exit code, in a process
    assert proc.returncode == 1, proc.stderr
    assert snapshot(repo) == before


def test_verify_repository_names_every_differing_file(tmp_path, tiny_model, tiny_export):
    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)
    repo = Path(_run(path).artifacts["triton"].repository)
    assert verify_repository(repo) == []
    model_file = repo / "smollm2_fp8" / "1" / "model.onnx"
    model_file.write_bytes(model_file.read_bytes() + b"\0")
    (repo / "smollm2_generate" / "1" / "tokenizer.json").unlink()
    (repo / "smollm2_generate" / "1" / "extra.txt").write_text("x")
    problems = verify_repository(repo)
    assert len(problems) == 3
    assert any(str(model_file) in p and "differs" in p for p in problems)
    assert any("tokenizer.json: missing" in p for p in problems)
    assert any("extra.txt: not part of the published model" in p for p in problems)

    from pipeline.cli.app import main

    assert main(["verify-repo", str(repo)]) == 4
    rebuilt = _run(path)  # the cached triton stage no longer matches: it republishes
    assert rebuilt.manifest["stages"]["triton"]["cache_hit"] is False
    assert verify_repository(repo) == []


#: (fault point, overrides that make the run reach it, the stage it kills in or None for publish steps);
#: the export last, as its new key would make every later point export again
POINTS = [
    ("stage:quantize:start", {"quantize.calibration.samples": 9}, "quantize"),
    ("stage:quantize:end", {"quantize.calibration.samples": 10}, "quantize"),
    ("stage:build:end", {"build.workspace_mib": 2048}, "build"),
    ("stage:validate:end", {"validate.max_windows": 3}, "validate"),
    ("stage:triton:start", {"triton.dynamic_batching.max_queue_delay_microseconds": 11}, "triton"),
    ("stage:triton:end", {"triton.dynamic_batching.max_queue_delay_microseconds": 12}, "triton"),
    ("publish:journal", {"triton.dynamic_batching.max_queue_delay_microseconds": 13}, None),
    ("publish:model:0", {"triton.dynamic_batching.max_queue_delay_microseconds": 14}, None),
    ("publish:model:1", {"triton.dynamic_batching.max_queue_delay_microseconds": 15}, None),
    ("publish:index", {"triton.dynamic_batching.max_queue_delay_microseconds": 16}, None),
    ("publish:cleanup", {"triton.dynamic_batching.max_queue_delay_microseconds": 17}, None),
    ("stage:export:end", {"export.check_points": [{"batch": 1, "sequence": 4, "past_sequence": 0},
                                                   {"batch": 2, "sequence": 3, "past_sequence": 2},
                                                   {"batch": 3, "sequence": 1, "past_sequence": 5}]}, "export"),
]


def test_crash_at_every_stage_and_publish_step_leaves_old_or_new_set(tmp_path, tiny_model, tiny_export):
    """One workspace, crashed at each point in turn; each repaired run's set is the next one's old set."""
    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)  # the last crash point's check points make an export of its own
    repo = Path(_run(path).artifacts["triton"].repository)
    old = snapshot(repo)
    for point, overrides, stage in POINTS:
        proc = _crash(path, point, overrides)
        assert proc.returncode == -signal.SIGKILL, f"{point}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
        crashed, problems = snapshot(repo), verify_repository(repo)
        if problems:
            assert point.startswith("publish:") and point != "publish:cleanup", (point, problems)
            assert "half-published" in problems[0] and (repo / JOURNAL_FILE).is_file()
        repaired = _run(path, overrides)
        new = snapshot(repo)
        assert repaired.passed and verify_repository(repo) == [], point
        assert problems or crashed in (old, new), f"{point}: neither the old nor the new set"
        hits = _hits(repaired.manifest)
        if stage is not None:  # stages finished before the crash are cache hits; the killed one re-runs
            assert all(hits[s] for s in STAGES[:STAGES.index(stage)]) and not hits[stage], (point, hits)
        cfg = (repo / "smollm2_fp8" / "config.pbtxt").read_text()
        delay = overrides.get("triton.dynamic_batching.max_queue_delay_microseconds")
        assert delay is None or f"max_queue_delay_microseconds: {delay}" in cfg, point
        assert not [p for p in repo.parent.iterdir() if ".staging-" in p.name], point
        old = new


def test_real_sigkill_mid_build_then_resume(tmp_path, tiny_model, tiny_export):
    path = tiny_recipe(tmp_path, tiny_model)
    seed_export(tmp_path, tiny_export)
    repo = Path(_run(path).artifacts["triton"].repository)
    old = snapshot(repo)
    marker = tmp_path / "artifacts" / "tiny-llm" / "quantize" / "stage.json"
    stamp = marker.stat().st_mtime_ns
    overrides = {"quantize.calibration.samples": 12}
    proc = subprocess.Popen(_build_cmd(path, overrides), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    def quantize_committed() -> bool:  # the runner removes the old record first, then writes the new one
        try:
            return marker.stat().st_mtime_ns != stamp
        except FileNotFoundError:
            return False

    while not quantize_committed() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()  # somewhere after quantize: build, validate, triton or the publish itself
    proc.communicate(timeout=60)
    problems = verify_repository(repo)
    crashed = snapshot(repo)
    resumed = _run(path, overrides)
    assert resumed.passed and verify_repository(repo) == []
    assert _hits(resumed.manifest)["export"]
    if not problems:
        assert crashed in (old, snapshot(repo))
