"""FP8 (and INT8) W8A8 ablation: smoothing, scale search and rotation, alone and combined (issue 38 §4).

Each row is the recipe (default ``recipes/fp8-llm.yaml``) with ``--set``-style overrides, taken
through the project's own code: the quantize stage (:func:`pipeline.stages.quantize.run`,
calibration, the transforms, with the row's ``+budget`` variant the accuracy-budget search) on one
exported FP32 graph, then the validate stage's perplexity pass
(:func:`pipeline.models.text_generation.metrics.llm_metrics`, greedy generation off) on the whole
``validate.data`` split against FP32 in ONNX Runtime (the FP32 logits computed once and replayed
from ``<work-dir>/reference``, 3.8 GB for fp8-llm). Columns: kld_mean ± se, relative perplexity
increase ± se (paired bootstrap over windows), GEMMs kept in high precision, the graph's extra ops
and bytes against the exported one, and the quantize stage's wall time (``make tune``'s share:
calibration, transforms, search).

Rows without ``+budget`` quantize all weight GEMMs (the recipe's tuning, sensitivity and
accuracy_budget dropped); ``+budget`` rows keep the recipe's search. Results go to one JSON file
(``--results``), one entry per row, written after each row; a row already there is skipped, so an
interrupted run resumes where it stopped. ``--table`` prints the Markdown table of that file.

    .venv/bin/python benchmarks/fp8_ablation.py [--recipe recipes/fp8-llm.yaml] [--rows max clip:mse ...]
        [--work-dir /tmp/fp8abl] [--export-dir DIR] [--results benchmarks/results/fp8_ablation.json]
    .venv/bin/python benchmarks/fp8_ablation.py --table
    .venv/bin/python benchmarks/fp8_ablation.py --recipe recipes/int8-llm.yaml --set validate.max_windows=80 \
        --results benchmarks/results/int8_ablation.json --rows max smooth:search

``--export-dir``: a finished export stage folder (``stage.json`` beside ``model.onnx``) to reuse;
without it the export stage runs once into ``<work-dir>/<recipe>/export``. Run time: about 4-6
minutes per row without the search and 8-15 minutes with it on 2 shared cores (each row states
its own); the measured table is in docs/quantization.md.

Peer (not run here; ``nvidia-modelopt`` does not install offline): NVIDIA ModelOpt's ONNX
post-training quantization on the same exported graph and calibration windows, measured by hand
and reported in issue 38 (filed 2026-12-06): FP8 on the same 210 weight GEMMs +3.48 % ± 0.29 %,
kld_mean 0.0455; with its defaults (attention matmuls and lm_head quantized too) +11.3 %.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: row name -> (overrides of the recipe, what it adds to the graph in ops/bytes when that is known a priori)
ROWS: dict[str, tuple[dict, str]] = {
    "max": ({}, "none"),
    "clip:mse": ({"quantize.calibration.method": "mse"}, "none (activation amax only)"),
    "clip:kl": ({"quantize.calibration.method": "kl"}, "none (activation amax only)"),
    "clip:entropy": ({"quantize.calibration.method": "entropy"}, "none (ONNX Runtime's INT8 KL threshold)"),
    "wclip:mse": ({"quantize.weight_clip": "mse"}, "none (weight scales only)"),
    "wclip:mse+clip:mse": ({"quantize.weight_clip": "mse", "quantize.calibration.method": "mse"}, "none"),
    "smooth:alpha0.5": ({"quantize.smoothquant": {"alpha": 0.5}}, "none (folded into norms and weights)"),
    "smooth:alpha0.8": ({"quantize.smoothquant": {"alpha": 0.8}}, "none (folded into norms and weights)"),
    "smooth:search": ({"quantize.smoothquant": {"mode": "search"}}, "none (folded into norms and weights)"),
    "rotate": ({"quantize.rotate": True}, "1 MatMul 576x576 before the lm_head (+1.3 MB FP32)"),
}
#: what a row drops so that it quantizes every weight GEMM (its +budget variant keeps them)
_NO_SEARCH = {"quantize.accuracy_budget": None, "quantize.tuning": None, "quantize.sensitivity": None}
BUDGET = "+budget"


def row_overrides(name: str) -> dict:
    """The overrides of a row name: ``a`` or ``a+b`` (transforms combined) with an optional ``+budget``.

    Raises:
        KeyError: an unknown transform (names the known ones).
    """
    search = name.endswith(BUDGET)
    parts = name.removesuffix(BUDGET)
    out: dict = {}
    for part in ([parts] if parts in ROWS else parts.split("+")):
        if part not in ROWS:
            raise KeyError(f"row {name!r}: unknown transform {part!r}; known: {', '.join(ROWS)}")
        out.update(ROWS[part][0])
    return out if search else {**out, **_NO_SEARCH}


def graph_size(onnx_path: str) -> tuple[int, int, dict[str, int]]:
    """``(bytes of the graph and its data, node count without Q/DQ, op counts)``."""
    import onnx

    path = Path(onnx_path)
    size = sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))
    model = onnx.load(str(path), load_external_data=False)
    ops: dict[str, int] = {}
    for n in model.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    plain = sum(v for k, v in ops.items() if k not in ("QuantizeLinear", "DequantizeLinear"))
    return size, plain, ops


class ReplayRunner:
    """The FP32 reference as a runner whose outputs for one feed are computed once and kept on disk
    (``<work-dir>/reference/<sha1 of the feeds>.npz``): every row compares against the same FP32
    logits, bit for bit, without running the reference graph again (about half of a row's time)."""

    def __init__(self, onnx_path: str, folder: Path):
        from pipeline.runners.base import OrtRunner

        self.inner = OrtRunner(onnx_path)
        self.name = self.inner.name + " (replayed)"
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def run(self, feeds: dict):
        import hashlib

        import numpy as np

        h = hashlib.sha1()
        for k in sorted(feeds):
            h.update(k.encode() + str(feeds[k].shape).encode() + np.ascontiguousarray(feeds[k]).tobytes())
        path = self.folder / f"{h.hexdigest()}.npy"
        if path.is_file():
            return {"logits": np.load(path)}
        logits = self.inner.run_names(["logits"], feeds)[0]
        tmp = path.with_name(path.stem + ".part.npy")
        np.save(tmp, logits)
        tmp.replace(path)
        return {"logits": logits}

    def __getattr__(self, item):
        return getattr(self.inner, item)


def run_row(name: str, args, exp, results: dict) -> dict:
    """Quantize and validate one row; returns its result entry."""
    from pipeline.context import Progress, StageContext
    from pipeline.models.text_generation.metrics import llm_metrics
    from pipeline.recipe.load import load_recipe
    from pipeline.stages import quantize

    work = Path(args.work_dir) / "rows" / name.replace(":", "_")
    over = {"work_dir": str(work), "output_dir": str(work / "repo"), "validate.generation": None,
            **args.set, **row_overrides(name)}
    recipe = load_recipe(args.recipe, over)
    run_dir = work / recipe.name
    progress = Progress(not args.quiet)
    t = time.perf_counter()
    qart = quantize.run(StageContext(recipe, Path(args.recipe), run_dir, "quantize", progress), exp)
    tune_s = time.perf_counter() - t
    t = time.perf_counter()
    reference = ReplayRunner(exp.onnx_path, Path(args.work_dir) / "reference")
    metrics, _ = llm_metrics(StageContext(recipe, Path(args.recipe), run_dir, "validate", progress), exp, qart,
                             reference=reference)
    validate_s = time.perf_counter() - t
    size, plain, ops = graph_size(qart.onnx_path)
    base_size, base_plain, _ = graph_size(exp.onnx_path)
    entry = {"row": name, "overrides": {k: v for k, v in over.items() if k.startswith("quantize.")},
             "kld_mean": metrics["kld_mean"], "kld_mean_stderr": metrics.get("kld_mean_stderr"),
             "relative_perplexity_increase": metrics["relative_perplexity_increase"],
             "relative_perplexity_increase_stderr": metrics.get("relative_perplexity_increase_stderr"),
             "perplexity_fp32": metrics["perplexity_fp32"], f"perplexity_{qart.precision}": metrics[f"perplexity_{qart.precision}"],
             "eval_windows": metrics["eval_windows"], "eval_tokens": metrics["eval_tokens"],
             "gemms_high_precision": len(qart.excluded_nodes), "gemms": len(qart.excluded_nodes) + len(qart.quantized_nodes),
             "extra_ops": plain - base_plain, "graph_bytes": size, "export_bytes": base_size,
             "extra_ops_note": ROWS.get(name.removesuffix(BUDGET), (None, "see the transforms"))[1],
             "tune_s": round(tune_s, 1), "validate_s": round(validate_s, 1),
             "quantize_info": {k: v for k, v in qart.calibration.items() if k not in ("amax",)}}
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return entry


def load_export(args, recipe_path: Path):
    """The export artifact: ``--export-dir``'s, or the export stage run once into the work dir."""
    from pydantic import TypeAdapter

    from pipeline.artifacts import ExportArtifact
    from pipeline.context import Progress, StageContext
    from pipeline.recipe.load import load_recipe
    from pipeline.stages import export

    folder = Path(args.export_dir) if args.export_dir else None
    if folder is None:
        recipe = load_recipe(recipe_path, {"work_dir": args.work_dir, "output_dir": f"{args.work_dir}/repo"})
        folder = Path(args.work_dir) / recipe.name / "export"
        if not (folder / "stage.json").is_file():
            art = export.run(StageContext(recipe, recipe_path, folder.parent, "export", Progress(not args.quiet)))
            from pipeline.artifacts import to_jsonable
            (folder / "stage.json").write_text(json.dumps({"artifact": to_jsonable(art)}))
            return art
    return TypeAdapter(ExportArtifact).validate_python(json.loads((folder / "stage.json").read_text())["artifact"])


def _pm(v, se, scale=1.0, fmt="{:.4f}") -> str:
    if v is None:
        return "n/a"
    return fmt.format(v * scale) + (" ± " + fmt.replace("+", "").format(se * scale) if se is not None else "")


def table(results: dict) -> str:
    """The Markdown table of a results file (rows in the order run)."""
    base = results["rows"].get("max")
    lines = ["| row | kld_mean ± se | relative perplexity ± se | GEMMs kept | extra ops / bytes vs row max | tune time |",
             "|---|---:|---:|---:|---|---:|"]
    for e in results["rows"].values():
        ops0, bytes0 = (base["extra_ops"], base["graph_bytes"]) if base else (0, e["export_bytes"])
        extra = f"{e['extra_ops'] - ops0:+d} ops, {e['graph_bytes'] - bytes0:+,} B"
        lines.append(f"| {e['row']} | {_pm(e['kld_mean'], e['kld_mean_stderr'])} | "
                     f"{_pm(e['relative_perplexity_increase'], e['relative_perplexity_increase_stderr'], 100, '{:+.2f}')} % | "
                     f"{e['gemms_high_precision']} / {e['gemms']} | {extra} | {e['tune_s']:.0f} s |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "fp8-llm.yaml"))
    ap.add_argument("--rows", nargs="+", default=["max", "clip:mse", "wclip:mse", "smooth:alpha0.5", "smooth:search",
                                                   "rotate", "max+budget"])
    ap.add_argument("--work-dir", default="/tmp/fp8abl")
    ap.add_argument("--export-dir", default=None)
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "fp8_ablation.json"))
    ap.add_argument("--keep", action="store_true", help="keep each row's quantized graph")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--table", action="store_true", help="print the results file's table and exit")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                    help="a recipe override for every row, e.g. validate.max_windows=80 (int8-llm on the whole split)")
    args = ap.parse_args()
    args.set = {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in args.set)}
    res_path = Path(args.results)
    results = json.loads(res_path.read_text()) if res_path.is_file() else {"recipe": args.recipe, "rows": {}}
    if args.table:
        print(table(results))
        return 0
    for name in args.rows:
        row_overrides(name)  # unknown names fail before anything runs
    exp = load_export(args, Path(args.recipe))
    start = time.perf_counter()
    for name in args.rows:
        if name in results["rows"]:
            print(f"{name}: in {res_path}, skipped", file=sys.stderr)
            continue
        t = time.perf_counter()
        entry = run_row(name, args, exp, results)
        entry["row_s"] = round(time.perf_counter() - t, 1)
        results["rows"][name] = entry
        res_path.parent.mkdir(parents=True, exist_ok=True)
        res_path.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps({k: entry[k] for k in ("row", "kld_mean", "relative_perplexity_increase",
                                                "gemms_high_precision", "tune_s", "row_s")}), file=sys.stderr)
    print(f"run time: {time.perf_counter() - start:.0f} s for {len(args.rows)} rows", file=sys.stderr)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
