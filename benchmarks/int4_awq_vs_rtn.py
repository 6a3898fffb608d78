"""INT4 weight-only blocks on SmolLM2-135M-Instruct: ``quantize.weights.method: rtn`` against ``awq``
(not a test; evidence for issue 37, "AWQ vs RTN").

Both recipes are recipes/int4-llm.yaml with ``weights: {method: rtn | awq, block_size: 64}``: the same
export (the GGUF file's FP32 dequantization, transformers; the FP32 reference), the same validate
split and metrics (the validate stage: 76 windows of 256 tokens, kld_mean and relative perplexity
with their paired-bootstrap standard errors), ``build.backend: none`` (the engine is not the subject here). ``awq`` calibrates on
fp8-llm's calibration section (lee_background documents 0-200, 32 windows of 128 tokens), disjoint
from the validate split. The runs go one after another in one process; each run's folder is
``<work-dir>/<name>``. An export made elsewhere is reused by its cache record (``--export-dir``,
as tests/tiny.py seed_export does), else the export stage runs.

    .venv/bin/python benchmarks/int4_awq_vs_rtn.py --export-dir /tmp/int4-run/int4-llm/export \
        [--work-dir /tmp/awq-bench] [--block 64] [--out benchmarks/results/int4_awq_vs_rtn]
    # block 128, the peer's, on SmolLM2's K = 576 through quantize.weights.pad (K -> 640), beside block 64:
    .venv/bin/python benchmarks/int4_awq_vs_rtn.py --export-dir ... --block 128 --pad \
        --beside benchmarks/results/int4_awq_vs_rtn.json --out benchmarks/results/int4_awq_vs_rtn_b128

Writes ``<out>.json`` and ``<out>.md`` (the table docs/quantization.md quotes) and prints the table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: the peer, measured by hand (issue 37): NVIDIA ModelOpt 0.47 ONNX int4 awq_clip, block 128, on this
#: tool's exported SmolLM2 graph, the validate split (TensorRT-RTX refuses its graph: 128 does not divide 576)
PEER = {"method": "ModelOpt 0.47 int4 awq_clip (block 128; cited)", "relative_perplexity_increase": 0.293,
        "relative_perplexity_increase_stderr": 0.009, "kld_mean": 0.33, "kld_mean_stderr": None}


def recipe(work: Path, method: str, block: int, pad: bool = False) -> Path:
    data = yaml.safe_load((ROOT / "recipes" / "int4-llm.yaml").read_text())
    fp8 = yaml.safe_load((ROOT / "recipes" / "fp8-llm.yaml").read_text())
    data["name"] = f"int4-{method}-b{block}" + ("-pad" if pad else "")
    data["quantize"]["weights"] = {"method": method, "block_size": block, **({"pad": True} if pad else {})}
    if method == "awq":
        data["quantize"]["calibration"] = fp8["quantize"]["calibration"]
    data["build"]["backend"] = "none"
    data["validate"].pop("generation", None)  # KL and perplexity are the subject
    data["validate"]["gates"] = [{"metric": "relative_perplexity_increase", "max": 10.0}]  # measured, not gated
    data["work_dir"], data["output_dir"] = str(work), str(work / "model_repository")
    path = work / f"{data['name']}.yaml"
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def run(work: Path, method: str, block: int, export_dir: Path | None, pad: bool = False) -> dict:
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    path = recipe(work, method, block, pad)
    r = load_recipe(path)
    if export_dir is not None and not (work / r.name / "export" / "stage.json").exists():
        dest = work / r.name / "export"
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(export_dir / "stage.json", dest / "stage.json")
    t0 = time.perf_counter()
    run_pipeline(r, path, quiet=True, only=["export", "quantize", "build", "validate"])
    wall = time.perf_counter() - t0
    m = json.loads((work / r.name / "validate" / "metrics.json").read_text())["metrics"]
    q = json.loads((work / r.name / "quantize" / "stage.json").read_text())["artifact"]["calibration"]
    row = {"method": f"{method} (block {block}{', K zero-padded' if pad else ''})", "kld_mean": m["kld_mean"], "kld_mean_stderr": m["kld_mean_stderr"],
           "relative_perplexity_increase": m["relative_perplexity_increase"],
           "relative_perplexity_increase_stderr": m["relative_perplexity_increase_stderr"],
           "top1_agreement": m.get("top1_agreement"), "eval_windows": m["eval_windows"],
           "eval_tokens": m["eval_tokens"], "gemm_formats": q.get("gemm_formats"), "wall_s": round(wall, 1),
           "graph": str(work / r.name / "quantize" / "model.onnx"), "padding": q.get("padding")}
    if "awq" in q:
        a = q["awq"]
        row["awq"] = {k: a[k] for k in ("scaled_points", "block_output_error", "block_output_error_rtn",
                                         "block_output_error_clipped", "clipped_blocks", "blocks",
                                         "equivalence_max_relative_difference", "rows")}
        row["awq"]["alphas"] = sorted({p["alpha"] for p in a["fold_points"].values()}, key=lambda x: (x is None, x))
    return row


def table(rows: list[dict]) -> str:
    def pm(v, se, pct=False):
        if v is None:
            return "n/a"
        f = (lambda x: f"{100 * x:+.2f} %") if pct else (lambda x: f"{x:.4f}")
        return f(v) + ("" if se is None else (f" ± {100 * se:.2f} %" if pct else f" ± {se:.4f}"))

    lines = ["| method | kld_mean ± se | relative perplexity increase ± se |", "|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {pm(r['kld_mean'], r.get('kld_mean_stderr'))} | "
                     f"{pm(r['relative_perplexity_increase'], r.get('relative_perplexity_increase_stderr'), True)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/awq-bench"))
    ap.add_argument("--export-dir", type=Path, default=None, help="an int4-llm / fp8-llm export stage folder to reuse")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=["rtn", "awq"])
    ap.add_argument("--pad", action="store_true", help="quantize.weights.pad: true (a block not dividing K)")
    ap.add_argument("--beside", type=Path, default=None, help="an earlier result .json whose rows the table shows first")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "int4_awq_vs_rtn")
    args = ap.parse_args()
    rows = []
    export_dir = args.export_dir
    for method in args.methods:
        rows.append(run(args.work_dir, method, args.block, export_dir, args.pad))
        export_dir = args.work_dir / f"int4-{method}-b{args.block}{'-pad' if args.pad else ''}" / "export"  # reused next
        print(json.dumps(rows[-1]), flush=True)
    by = {r["method"].split()[0]: r for r in rows}
    result = {"date": datetime.date.today().isoformat(), "model": "SmolLM2-135M-Instruct (FP32 dequantized Q4_1 GGUF)",
              "split": "recipes/int4-llm.yaml validate.data", "rows": rows, "peer": PEER}
    if "rtn" in by and "awq" in by:
        result["kld_cut_vs_rtn"] = 1 - by["awq"]["kld_mean"] / by["rtn"]["kld_mean"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    before = json.loads(args.beside.read_text())["rows"] if args.beside is not None else []
    md = table(before + rows + [PEER]) + f"\n\nMeasured {result['date']}; " + (
        f"AWQ cuts kld_mean by {100 * result['kld_cut_vs_rtn']:.1f} % against RTN.\n" if "kld_cut_vs_rtn" in result
        else "\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
