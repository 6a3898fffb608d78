"""A plan-build plan run locally against building each target from scratch in one process, side by side.

    .venv/bin/python benchmarks/plan_vs_scratch.py [--rounds 2]

On tests/tiny.py's recipe (FP8) for L4, H100 and sm120, with no GPU (the datacenter steps ``--simulate``):

* **plan**: plan-step cpu, gpu L4, gpu H100, assemble, each a process in its own folder, moto's S3
  between them (the CPU stages run once, the rest pull them);
* **scratch**: one process that builds the recipe once per target from an empty work folder (what a
  hand-written CI matrix without a shared cache does): sm120 (TensorRT-RTX), sm89 (the L4's check build)
  and sm90 (the H100's sm89 check build), every stage each time.

The two alternate, round by round, in one run; the output is each round's wall times, the cache hits of
the plan and the ratio plan / scratch (mean and the spread over rounds). Nothing here is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

SCRATCH = '''
import sys
from pathlib import Path
from pipeline.recipe.load import load_recipe
from pipeline.run.runner import run_pipeline
recipe_path, ws = Path(sys.argv[1]), Path(sys.argv[2])
for i, target in enumerate(["sm120", "sm89", "sm90"]):
    over = {"work_dir": str(ws / f"t{i}" / "artifacts"), "output_dir": str(ws / f"t{i}" / "repo"),
            "build.backend": "auto", "build.targets": [target]}
    run_pipeline(load_recipe(recipe_path, over), recipe_path, quiet=True)
'''


def run(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 4):
        raise SystemExit(f"{cmd}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from moto.server import ThreadedMotoServer

    from pipeline.triton.server import free_ports
    from tiny import make_tiny_llama, tiny_recipe

    port = free_ports(1)[0]
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "NO_PROXY": "127.0.0.1", "PYTHONPATH": str(ROOT)}
    os.environ.update(env)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    ratios = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ws = Path(tmp)
            model = make_tiny_llama(ws / "model")
            (ws / "src").mkdir()
            recipe = tiny_recipe(ws / "src", model)
            for r in range(args.rounds):
                out = ws / f"plan{r}"
                py = [sys.executable, "-m", "pipeline"]
                subprocess.run([*py, "plan-build", str(recipe), "--targets", "L4,H100,sm120", "--cache",
                                f"s3://bench/round{r}", "--out", str(out), "--container", "25.12-trtllm-python-py3",
                                "--local-sources", "--quiet"], cwd=ROOT, env=env, check=True)
                steps = [("cpu", []), ("gpu", ["--sku", "L4", "--simulate"]), ("gpu", ["--sku", "H100", "--simulate"]),
                         ("assemble", [])]
                first = ("plan", "scratch") if r % 2 == 0 else ("scratch", "plan")
                times = {}
                for which in first:
                    if which == "plan":
                        times["plan"] = sum(run([*py, "plan-step", str(out / "plan.json"), "--step", s, "--workdir",
                                                 str(ws / f"r{r}" / f"{s}{i}"), "--quiet", *extra], env)
                                            for i, (s, extra) in enumerate(steps))
                        hits = sum(len(json.loads((ws / f"r{r}" / f"{s}{i}" / "step-report.json").read_text())
                                       ["remote"]["pulled"]) for i, (s, _) in enumerate(steps))
                    else:
                        times["scratch"] = run([sys.executable, "-c", SCRATCH, str(recipe), str(ws / f"s{r}")], env)
                ratios.append(times["plan"] / times["scratch"])
                print(f"round {r}: plan {times['plan']:.1f} s ({hits} cache hits), scratch {times['scratch']:.1f} s, "
                      f"ratio {ratios[-1]:.3f}", flush=True)
    finally:
        server.stop()
    spread = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
    print(f"plan / scratch wall time: {statistics.mean(ratios):.3f} +- {spread:.3f} (standard error, "
          f"{len(ratios)} rounds)")


if __name__ == "__main__":
    main()
