"""Where AWQ's search time goes at one model's fold-point shapes, and the int4 search helpers of
another revision side by side (issue 37: awq on the random 0.5 B of ``make bench-scale``).

Per fold point of one decoder layer (norm -> q/k/v, norm -> gate/up, v -> o, up -> down; shapes of
benchmarks/scale.py's ``SIZES``), on random float32 rows ``X [rows, C]`` and weights ``W_k [C, out_k]``,
the three costs :func:`pipeline.quant.awq.fold` pays: one alpha of the scale search is one
``int4.fake_quantize`` per GEMM and one ``X @ W`` per GEMM (21 alphas, the first, alpha 0, reusing
the baseline), and ``int4.clip_search`` once per GEMM. With ``--before REV`` the same calls of
``pipeline/quant/int4.py`` at git revision REV run interleaved with the working tree's, ``--repeat``
times each, and the ratio (before / now) is printed with its spread (min..max over the repeats).
Both must give the same ratios (clip_search) and the same fake-quantized weights, or it stops.

    .venv/bin/python benchmarks/awq_cost.py [--size 0.5b] [--block 64] [--before HEAD~1] [--repeat 3]
"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def fold_point_shapes(size: str) -> dict[str, tuple[int, list[int]]]:
    """fold point -> (C, [out_k]) for one decoder layer of ``scale.SIZES[size]``."""
    from scale import SIZES

    s = SIZES[size]
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    return {"norm -> q/k/v": (h, [h, kv, kv]), "norm -> gate/up": (h, [i, i]), "v -> o": (h, [h]),
            "up -> down": (i, [h])}


def _module_at(rev: str, tmp: Path):
    text = subprocess.run(["git", "show", f"{rev}:pipeline/quant/int4.py"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    path = tmp / "int4_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("int4_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["int4_before"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def main() -> None:
    from scale import SIZES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.5b", choices=list(SIZES))
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--rows", type=int, default=2048, help="calibration rows (pipeline.quant.awq.ROWS)")
    ap.add_argument("--before", default=None, help="git revision whose int4 helpers run side by side")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from pipeline.quant import awq, fold_search, int4

    layers = SIZES[args.size]["num_hidden_layers"]
    alphas = len(fold_search.GRID) - 1
    with tempfile.TemporaryDirectory() as tmp:
        before = _module_at(args.before, Path(tmp)) if args.before else None
        impls = {"now": int4, **({"before": before} if before else {})}
        rng = np.random.default_rng(0)
        total = {name: {"fake_quantize": 0.0, "gemm": 0.0, "clip_search": 0.0} for name in impls}
        print(f"{args.size}: {layers} layers, {args.rows} rows, block {args.block}, {alphas} alphas searched "
              f"(awq.ROWS = {awq.ROWS}); seconds per layer, min over {args.repeat} repeats")
        for point, (c, outs) in fold_point_shapes(args.size).items():
            x = rng.standard_normal((args.rows, c), dtype=np.float32)
            ws = [rng.standard_normal((c, o), dtype=np.float32) * np.float32(0.02) for o in outs]
            times = {name: {"fake_quantize": [], "gemm": [], "clip_search": []} for name in impls}
            for _ in range(args.repeat):
                outputs = {}
                for name, mod in impls.items():  # interleaved: each repeat runs both
                    t_fq, fq = _timed(lambda: [mod.fake_quantize(w, args.block) for w in ws])
                    t_mm, _ = _timed(lambda: [x @ w for w in ws])
                    t_cl, cl = _timed(lambda: [mod.clip_search(x, w, args.block) for w in ws])
                    times[name]["fake_quantize"].append(t_fq)
                    times[name]["gemm"].append(t_mm)
                    times[name]["clip_search"].append(t_cl)
                    outputs[name] = (fq, cl)
                if before:
                    same_fq = all(np.array_equal(a, b) for a, b in zip(outputs["now"][0], outputs["before"][0]))
                    agree = np.mean([np.mean(a == b) for a, b in zip(outputs["now"][1], outputs["before"][1])])
                    if not same_fq:
                        sys.exit(f"{point}: fake_quantize differs from {args.before}'s")
                    if agree < 0.999:
                        sys.exit(f"{point}: clip ratios agree on {agree:.4%} of blocks with {args.before}'s")
            for name in impls:
                t = {k: min(v) for k, v in times[name].items()}
                for k in t:
                    total[name][k] += t[k] * (alphas if k in ("fake_quantize", "gemm") else 1)
                print(f"  {point:16s} C={c:5d} out={outs}  {name:6s}: per alpha fake_quantize {t['fake_quantize']:.2f} s, "
                      f"GEMMs {t['gemm']:.2f} s; clip_search {t['clip_search']:.2f} s")
            if before:
                for k in ("fake_quantize", "clip_search"):
                    r = [b / n for b, n in zip(times["before"][k], times["now"][k])]
                    print(f"  {'':16s} {k} before / now: {np.median(r):.2f} (min {min(r):.2f}, max {max(r):.2f})")
        for name, t in total.items():
            per_layer = sum(t.values())
            print(f"{name}: per layer {per_layer:.0f} s (scale search: fake_quantize {t['fake_quantize']:.0f} s, GEMMs "
                  f"{t['gemm']:.0f} s; clip_search {t['clip_search']:.0f} s); x {layers} layers = "
                  f"{per_layer * layers / 60:.1f} min")


if __name__ == "__main__":
    main()
