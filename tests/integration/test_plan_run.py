"""A plan-build plan run locally, each step its own process in its own folder, moto's S3 between them.

tests/tiny.py's recipe (FP8) for L4, H100 (datacenter: simulated here, no GPU) and sm120 (RTX-class: a
real TensorRT-RTX engine in the cpu step). The cpu step builds the CPU stages once and pushes them;
every other step pulls them; assemble writes the repository to its scratch folder and refuses to
publish while a SKU is simulated (exit 4, naming them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import MOTO_BUCKET, ROOT
from pipeline.errors import EXIT_ENVIRONMENT
from pipeline.remote.plan import Plan
from tiny import make_tiny_llama, tiny_recipe

CACHE = f"s3://{MOTO_BUCKET}/plan-cache"
CPU_STAGES = ["export", "quantize", "build", "validate", "triton"]


def step(plan: Path, name: str, folder: Path, *extra: str) -> subprocess.CompletedProcess:
    """``python -m pipeline plan-step`` in its own process (the environment names moto's endpoint, as
    a cluster step's Secret names its store's)."""
    return subprocess.run([sys.executable, "-m", "pipeline", "plan-step", str(plan), "--step", name,
                           "--workdir", str(folder), "--quiet", *extra], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)


def report(folder: Path) -> dict:
    return json.loads((folder / "step-report.json").read_text())


@pytest.fixture(scope="module")
def local_run(moto_s3, tmp_path_factory):
    """Plan, then run cpu, gpu-L4 and gpu-H100 (simulated) and assemble; the folders and results."""
    from pipeline.cli.app import main

    ws = tmp_path_factory.mktemp("plan")
    model = make_tiny_llama(ws / "model")
    (ws / "src").mkdir()
    recipe = tiny_recipe(ws / "src", model)
    out = ws / "plan"
    assert main(["plan-build", str(recipe), "--targets", "L4,H100,sm120", "--cache", CACHE, "--out", str(out),
                 "--container", "25.12-trtllm-python-py3", "--local-sources", "--quiet"]) == 0
    runs = {}
    for name, extra in (("cpu", ()), ("gpu-L4", ("--sku", "L4", "--simulate")),
                        ("gpu-H100", ("--sku", "H100", "--simulate")), ("assemble", ())):
        runs[name] = step(out / "plan.json", name.split("-")[0], ws / "steps" / name, *extra)
    return ws, Plan.read(out / "plan.json"), runs


@pytest.mark.e2e
def test_the_cpu_stages_run_once_and_every_other_step_pulls_them(local_run):
    ws, plan, runs = local_run
    for name in ("cpu", "gpu-L4", "gpu-H100"):
        assert runs[name].returncode == 0, f"{name}: {runs[name].stderr[-3000:]}"
    cpu = report(ws / "steps" / "cpu")
    assert cpu["remote"]["pushed"] == CPU_STAGES and cpu["remote"]["pulled"] == []
    assert cpu["result"]["wheel"]["file"].endswith(".whl")
    for sku in ("L4", "H100"):
        gpu = report(ws / "steps" / f"gpu-{sku}")
        assert gpu["remote"]["pulled"] == ["export", "quantize"], gpu["remote"]
        assert gpu["result"]["status"] == "simulated"
    assemble = report(ws / "steps" / "assemble")
    assert assemble["remote"]["pulled"] == CPU_STAGES and assemble["remote"]["pushed"] == []
    hits = sum(len(report(ws / "steps" / n)["remote"]["pulled"]) for n in runs)
    print(f"cache hits: {hits}; wall s: " + ", ".join(f"{n} {report(ws / 'steps' / n)['wall_s']:.1f}" for n in runs))
    assert hits == 2 + 2 + len(CPU_STAGES)


@pytest.mark.e2e
def test_rtx_targets_get_real_engines_and_datacenter_steps_only_a_simulated_stamp(local_run):
    import boto3

    ws, plan, runs = local_run
    cpu_build = ws / "steps" / "cpu" / "run" / "artifacts" / "tiny-llm" / "build"
    engine = cpu_build / "model.rtx-sm120.engine"
    assert engine.is_file() and engine.stat().st_size > 10_000
    assert json.loads((cpu_build / "engine_stamp.json").read_text())["targets"] == ["sm120"]
    s3 = boto3.client("s3")
    for sku, check in (("L4", ["sm89"]), ("H100", ["sm89"])):
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=MOTO_BUCKET, Prefix=plan.prefix("skus", sku))["Contents"]]
        assert keys == [plan.prefix("skus", sku, "result.json")]  # no engine written
        res = json.loads(s3.get_object(Bucket=MOTO_BUCKET, Key=keys[0])["Body"].read())
        assert res["stamp"]["simulated"] is True and "no GPU here" in res["stamp"]["reason"]
        assert res["stamp"]["check_build"]["targets"] == check and res["stamp"]["check_build"]["engine_bytes"] > 0
        assert res["stamp"]["check_build"]["check_only"] is (sku == "H100")  # sm90: TensorRT-RTX lacks it


@pytest.mark.e2e
def test_assemble_writes_the_repository_and_refuses_to_publish_simulated_skus(local_run):
    from pipeline.triton.config import parse_config

    ws, plan, runs = local_run
    done = runs["assemble"]
    assert done.returncode == EXIT_ENVIRONMENT, done.stderr[-3000:]
    assert "refusing to publish" in done.stderr and "L4" in done.stderr and "H100" in done.stderr
    assert "simulated" in done.stderr
    scratch = ws / "steps" / "assemble" / "scratch"
    names = json.loads((scratch / "repository" / "repository.json").read_text())
    compute = next(m for m, e in names.items() if e.get("target") == "tensorrt")
    cfg = parse_config((scratch / "repository" / compute / "config.pbtxt").read_text())
    assert cfg.platform == "tensorrt_plan"
    assert dict(cfg.cc_model_filenames) == {"8.9": "model.sm89.plan", "9.0": "model.sm90.plan"}
    assert not list((scratch / "repository" / compute).rglob("*.plan"))  # simulated: no engine to place
    assert (scratch / "rtx-engines" / "model.rtx-sm120.engine").is_file()
    summary = json.loads((scratch / "assemble.json").read_text())
    assert sorted(summary["simulated"]) == ["H100", "L4"] and summary["published"] is None
