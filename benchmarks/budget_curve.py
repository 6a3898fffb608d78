"""GEMMs kept in high precision vs perplexity on the validate split (not a test; evidence for issue 10 §4).

Reads a refined budget search (``quantize/budget.json`` written with ``sensitivity.refine``):
its ranking trials re-quantize one GEMM of the kept set at a time, which orders the GEMMs
from most to least costly to quantize. For each ``--keep`` count K it leaves the K most
costly in high precision, quantizes the rest, and measures the teacher-forced relative
perplexity increase and KL on the recipe's *validate* windows (``validate.data``,
``validate.seq_len``, ``validate.max_windows``) against FP32, in one switch-graph session
(:class:`pipeline.quant.sensitivity.TrialRunner`). It also measures the hand-picked 30
``down_proj``. The search itself never sees the validate split; this is a post-hoc check of
how its tuning-split choice carries over. Prints one JSON object.

    .venv/bin/python benchmarks/budget_curve.py --budget-json /tmp/budget-bench/fp8-llm/quantize/budget.json \
        [--work-dir /tmp/budget-bench] [--keep 60 34 30 25 20 0]

Measured (recipes/fp8-llm.yaml, SDPA-attention export of the previous commit, a refined search
with ``kld_mean <= 0.024`` that ranked gate_proj + down_proj; 24 validate windows x 256 tokens):

| GEMMs in high precision | validate kld_mean | validate relative perplexity |
|---|---:|---:|
| 0 (all FP8) | 0.0350 | +2.00 % |
| 20 (ranking's top 20) | 0.0254 | +1.12 % |
| 25 | 0.0245 | +1.30 % |
| 30 | 0.0237 | +0.95 % |
| 34 (what the search chose) | 0.0232 | +1.14 % |
| 60 (gate_proj + down_proj) | 0.0192 | +0.36 % |
| 30 down_proj by hand | 0.0265 | +1.30 % |

KL falls steadily with the GEMMs kept, and the ranking's top 20 already beats the hand-picked
30 on it; perplexity over these 6100 tokens moves by +-0.2 % between neighbouring sets (its
stderr is ~0.3 %), so at +1.0 % the gate cannot tell sets of 20-34 GEMMs apart.
"""
from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def ranking(found: dict) -> list[str]:
    """GEMM scopes of the refined set, most costly to re-quantize first: the refinement's
    ranking trials (fewer windows, single-GEMM group names) each leave one GEMM of the set out."""
    full = max(t["windows"] for t in found["trials"])
    rows = [t for t in found["trials"] if t["windows"] < full and t["excluded_groups"]
            and all(g.count(".") > 1 for g in t["excluded_groups"])]
    fine = set().union(*(set(t["excluded_groups"]) for t in rows))
    cost = {(fine - set(t["excluded_groups"])).pop(): t[found["metric"]] for t in rows}
    return sorted(cost, key=lambda g: -cost[g])


def main() -> int:
    from budget_time import calibrated

    from pipeline.context import Progress, StageContext
    from pipeline.models import registry
    from pipeline.quant import budget, sensitivity as S
    from pipeline.recipe.load import load_recipe

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "fp8-llm.yaml"))
    ap.add_argument("--work-dir", default="/tmp/budget-bench")
    ap.add_argument("--budget-json", required=True)
    ap.add_argument("--keep", type=int, nargs="+", default=[60, 34, 30, 25, 20, 0])
    args = ap.parse_args()
    path = Path(args.recipe)
    recipe = load_recipe(path, {"work_dir": args.work_dir, "output_dir": f"{args.work_dir}/repo"})
    run_dir = Path(args.work_dir) / recipe.name
    exp = pickle.loads((run_dir / "export" / "export.pkl").read_bytes())  # written by benchmarks/budget_time.py
    q = recipe.quantize
    ctx = StageContext(recipe, path, run_dir, "quantize", Progress(False))
    model, kept, _, amax, fmt, weights_dir = calibrated(ctx, exp)
    v = recipe.validate_
    cal = q.calibration.model_copy(update={"samples": v.max_windows, "min_samples": 1, "seq_len": v.seq_len,
                                           "batch_size": 4})
    feeds = registry.adapter(recipe.model).calibration_feeds(exp, v.data, cal)
    runner = S.TrialRunner(model, kept, S.groups(kept, "per_gemm"), amax, fmt, q.per_channel_weights, feeds,
                           lambda sess, f: sess.run(["logits"], f)[0], budget.reference_session(exp.onnx_path),
                           weights_dir=weights_dir)
    order = ranking(json.loads(Path(args.budget_json).read_text()))
    out = {"validate": v.data.describe(), "windows": sum(int(f["input_ids"].shape[0]) for f in feeds),
           "seq_len": v.seq_len, "ranked_gemms": len(order), "points": []}
    configs = [(f"top {k} of the ranking", order[:k]) for k in args.keep]
    configs.append(("down_proj by hand", [g for g in runner.group_nodes if g.endswith("mlp.down_proj")]))
    for label, keep in configs:
        m = runner.measure(keep).metrics
        out["points"].append({"config": label, "gemms_high_precision": len(keep), **{k: round(x, 6) for k, x in m.items()}})
        print(json.dumps(out["points"][-1]), file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
