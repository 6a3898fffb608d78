"""Wall time of the accuracy-budget search for fp8-llm (issue 10 §7; issue 18 §5: <= 60 s on 2 cores).

``--compare REV`` times the search of git revision ``REV`` (default ``fc23566``, the last one
before the proxy-ranked fine search) and of this checkout side by side in one run, on the same
exported graph, and prints both results and the ratios (time, trials, GEMMs kept):

    .venv/bin/python benchmarks/budget_time.py --compare [REV]

Runs what the quantize stage runs for ``quantize.accuracy_budget`` (calibration,
then :func:`pipeline.quant.budget.tune`: FP32 reference once, sensitivity on half
the tuning windows, greedy revert, step back) on an exported FP32 graph, and prints one
JSON object: seconds per phase, trials, the GEMMs left in high precision and the
tuning-split metrics. Not a test: timing depends on the machine.

    .venv/bin/python benchmarks/budget_time.py [--recipe recipes/fp8-llm.yaml]
        [--work-dir /tmp/budget-bench] [--budget 0.03] [--groups per_block] [--refine on]

The export stage runs first unless ``<work-dir>/<recipe>/export/export.pkl`` holds it.

Measured (nice -n 5, 2 cores shared: a full fp8-llm build and a pytest run of
this session ran alongside, load average 3-6), recipes/fp8-llm.yaml (8 tuning windows,
budget kld_mean <= 0.030): ``--groups per_block`` calibration 66 s + sensitivity and
search 351 s (35 trials) = 6.9 min, down from 11.7 min (the same search before the
one-session switch graph and the half-window ranking pass); ``--groups per_projection``
(the recipe's) 83 s + 122 s (10 trials) = 3.4 min. A trial takes 3 s (4 windows) to
10 s (8 windows) on idle cores, 15-25 s when the cores are shared.

Session 4, grouped-attention export, ``sensitivity: {groups: per_projection, refine: true}``
(the recipe's): budget 0.0265: calibration 21 s + sensitivity and search 252 s (83 trials,
29 GEMMs kept) = 4.5 min with nothing else running; budget 0.0255: 37 s + 592 s (86 trials,
33 GEMMs) = 10.5 min while an int8-llm build shared the cores. A 4-window trial takes ~2.3 s
on idle cores.
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def calibrated(ctx, exp) -> tuple:
    """What the quantize stage does before the search (pipeline.stages.quantize): the FP32
    graph (smoothed if the recipe says so), its quantizable and excluded GEMMs, the calibrated
    activation amax and the format. Returns ``(model, kept, excluded, amax, fmt, weights_dir)``."""
    import onnx

    from pipeline.quant import calibrate, qdq, smoothquant
    from pipeline.stages.quantize import calibration

    q = ctx.recipe.quantize
    src = Path(exp.onnx_path)
    model = onnx.load(str(src), load_external_data=False)
    targets = qdq.find_targets(model, list(q.quantize_op_types))
    kept, excluded = qdq.apply_exclusions(model, targets, q.exclude)
    fmt = qdq.FORMATS[q.precision]
    batches, _ = calibration.calibration_data(ctx, exp)
    model, kept, cal_src, *_ = smoothquant.prepare(q.smoothquant, ctx.stage_dir, ctx.progress, src, model, kept, batches)
    amax = calibrate.collect_amax(cal_src, sorted({x.act for x in kept}), batches, q.calibration.method, fmt,
                                  q.calibration.percentile, scratch_dir=ctx.stage_dir)
    return model, kept, excluded, amax, fmt, str(Path(cal_src).parent)  # the last: where on-disk weights live


def main() -> int:
    from pipeline.context import Progress, StageContext
    from pipeline.stages.quantize import tuning
    from pipeline.quant import budget
    from pipeline.recipe.load import load_recipe
    from pipeline.stages import export

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "fp8-llm.yaml"))
    ap.add_argument("--work-dir", default="/tmp/budget-bench")
    ap.add_argument("--budget", type=float, default=None, help="override the recipe's accuracy_budget max")
    ap.add_argument("--groups", default=None, choices=["per_block", "per_projection", "per_gemm"],
                    help="override the grouping")
    ap.add_argument("--refine", default=None, choices=["on", "off"], help="override sensitivity.refine")
    ap.add_argument("--compare", nargs="?", const="fc23566", default=None, metavar="REV",
                    help="time REV's search and this checkout's side by side")
    args = ap.parse_args()
    if args.compare:
        return compare(args)
    over: dict = {"work_dir": args.work_dir, "output_dir": f"{args.work_dir}/repo"}
    if args.groups:
        over["quantize.sensitivity.groups"] = args.groups
    if args.refine:
        over["quantize.sensitivity.refine"] = args.refine == "on"
    path = Path(args.recipe)
    recipe = load_recipe(path, over)
    if args.budget is not None:
        recipe = load_recipe(path, {**over, "quantize.accuracy_budget": {
            **recipe.quantize.accuracy_budget.model_dump(exclude_none=True, exclude={"name"}), "max": args.budget}})
    if recipe.quantize.tuning is None:
        ap.error(f"{path}: quantize.tuning is not set; nothing to time")
    run_dir = Path(args.work_dir) / recipe.name
    progress = Progress(False)
    times: dict[str, float] = {}
    cached = run_dir / "export" / "export.pkl"
    t = time.perf_counter()
    if cached.is_file():
        exp = pickle.loads(cached.read_bytes())
    else:
        exp = export.run(StageContext(recipe, path, run_dir, "export", progress))
        cached.write_bytes(pickle.dumps(exp))
    times["export_s"] = time.perf_counter() - t
    ctx = StageContext(recipe, path, run_dir, "quantize", progress)
    q = recipe.quantize
    t = time.perf_counter()
    model, kept, excluded, amax, fmt, weights_dir = calibrated(ctx, exp)
    times["calibration_s"] = time.perf_counter() - t
    t = time.perf_counter()
    status, result = "met", None
    try:
        chosen, result, sens = budget.tune(q, tuning.tuning_feeds(ctx, exp), tuning.score_logits,
                                           budget.reference_session(exp.onnx_path), model, kept, len(excluded),
                                           amax, fmt, weights_dir=weights_dir, out_dir=ctx.stage_dir,
                                           progress=ctx.progress)
    except Exception as e:  # GateFailed: report the numbers anyway
        status = f"{type(e).__name__}: {e}"
    times["sensitivity_and_search_s"] = time.perf_counter() - t
    found = json.loads((ctx.stage_dir / "budget.json").read_text()) if (ctx.stage_dir / "budget.json").is_file() else {}
    out = {"recipe": recipe.name, "budget": q.accuracy_budget.model_dump(exclude_none=True) if q.accuracy_budget
           else None, "groups": q.sensitivity.groups if q.sensitivity else "per_block",
           "refine": bool(q.sensitivity and q.sensitivity.refine),
           "status": found.get("status", status), "error": None if status == "met" else status,
           **{k: round(v, 1) for k, v in times.items()},
           "trials": len(found.get("trials", [])), "gemms_high_precision": len(found.get("excluded_scopes", [])),
           "excluded_groups": found.get("excluded_groups"), "tuning_metrics": found.get("metrics"),
           "quantized_fraction": found.get("quantized_fraction"), "folder": str(ctx.stage_dir)}
    print(json.dumps(out, indent=1))
    return 0


def compare(args) -> int:
    """Run this script for ``args.compare`` (in a temporary git worktree) and for this checkout,
    one after the other on the same export, and print both JSON results and the ratios."""
    import subprocess
    import tempfile

    rest = [a for a in sys.argv[1:] if a not in ("--compare", args.compare)]
    work = Path(args.work_dir)
    results = {}
    with tempfile.TemporaryDirectory(prefix="budget-before-") as tmp:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", tmp, args.compare], check=True,
                       capture_output=True)
        try:
            for label, tree in (("after", ROOT), ("before", Path(tmp))):  # after first: it exports for both
                work.mkdir(parents=True, exist_ok=True)
                out = subprocess.run([sys.executable, str(tree / "benchmarks" / "budget_time.py"), *rest,
                                      "--work-dir", str(work / label)], cwd=tree, capture_output=True, text=True,
                                     env={**__import__("os").environ, "PYTHONPATH": str(tree)})
                if label == "after":
                    _share_export(work / "after", work / "before")
                text = out.stdout[out.stdout.index("{"):] if "{" in out.stdout else "{}"
                results[label] = json.loads(text)
                results[label]["rev"] = args.compare if label == "before" else "HEAD"
                print(f"{label}: exit {out.returncode}", file=sys.stderr)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", tmp], capture_output=True)
    b, a = results["before"], results["after"]
    ratio = {k: round(b[k] / a[k], 2) for k in ("sensitivity_and_search_s", "trials") if b.get(k) and a.get(k)}
    print(json.dumps({"before": b, "after": a, "before_over_after": ratio}, indent=1))
    return 0


def _share_export(src: Path, dst: Path) -> None:
    """Give the second run the first run's cached export (the pickled artifact points at its files)."""
    for pkl in src.glob("*/export/export.pkl"):
        target = dst / pkl.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(pkl.read_bytes())


if __name__ == "__main__":
    raise SystemExit(main())
