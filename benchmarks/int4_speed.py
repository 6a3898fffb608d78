"""Weight-only INT4 (``quantize.precision: int4``) against FP32 on this CPU, in ONNX Runtime (not a test).

Every comparison runs side by side in one process, interleaved: each repeat times one call of
every variant in turn, and each variant's speed-up is the per-repeat ratio ``t_fp32 / t_variant``
(paired with the FP32 call of the same repeat), reported as mean +- its standard error, with the
median and the 10th / 90th percentile of the ratios as the spread. All sessions run at graph
optimization level ``all`` (the level validate and the served python-onnxruntime model use for
weight-only blocks, :func:`pipeline.ort_sessions.optimization_level`), ONNX Runtime's default
thread count (one per core). The INT4 variants differ only in the MatMulNBits accuracy level,
the session config entry ``session.qdq_matmulnbits_accuracy_level``:

* level 1: the activations stay FP32 (what the int4 recipes validate and serve,
  :data:`pipeline.ort_sessions.MATMULNBITS_FP32`);
* level 4: the activations are quantized to INT8 per block inside MatMulNBits (ONNX Runtime's
  default; integer kernels that differ by instruction set: AVX2, AVX-512 VNNI, AMX).

Parts (``--parts``, all by default):

``gemms``
    A SmolLM2-135M-shaped GEMM chain: 30 layers of q/k/v/o (576->576, 576->192 x 2, 576->576) and
    gate/up/down (576->1536 x 2, 1536->576), 210 GEMMs, with random Q4_1-like blocks written by
    :func:`pipeline.quant.int4.block_matmul` (INT4 block 32 + the per-block offset term), at
    ``--tokens`` rows (1: decode). FP32: the same chain with the decoded weights.
``head``
    The lm_head alone (576 -> 49152, Q8_0-like INT8 blocks): FP32, INT8 block 32 (an 8-bit
    MatMulNBits) and the two INT4 halves the served graph uses (:func:`pipeline.quant.int4.int4_halves`).
``model``
    The whole graph: the export stage's FP32 graph against the graph ONNX Runtime validates and
    serves (``--fp32`` / ``--int4``, default: this checkout's ``artifacts/int4-llm``,
    ``quantize/model_cpu.onnx``): one decode step at batch 1 with a past of ``--past`` (256) and one
    prefill of 1 x ``--prefill`` (256) tokens.
``table``
    The tied embedding / lm_head: the served graph against the graph TensorRT builds
    (``--engine-graph``, ``quantize/model.onnx``: one INT8 table, which ONNX Runtime cannot fuse as the
    Gather reads it too), and what the DequantizeLinear of that whole table (28.3 M values for
    SmolLM2, block 32) costs per call alone; the initializer bytes of both graphs.

    .venv/bin/python benchmarks/int4_speed.py                      # all parts
    .venv/bin/python benchmarks/int4_speed.py --parts gemms --repeats 30 --json out.json

Numbers on a shared 2-core CPU move with other load; compare the ratios of one run.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's pipeline, not an installed one
H, LAYERS, FFN, KV = 576, 30, 1536, 192
LEVEL_KEY = "session.qdq_matmulnbits_accuracy_level"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                isa = [f for f in ("amx_int8", "avx512_vnni", "avx_vnni", "avx512f", "avx2") if f" {f}" in flags]
                return f"{line.split(':', 1)[1].strip()} ({', '.join(isa)}), {_cores()} cores"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


def session(model: str | bytes, level: int | None) -> ort.InferenceSession:
    """A CPU session at optimization level ``all``; ``level``: the MatMulNBits accuracy level
    (None: an FP32 graph, no entry)."""
    from pipeline.ort_sessions import session_options

    config = {} if level is None else {LEVEL_KEY: str(level)}
    return ort.InferenceSession(model, sess_options=session_options("all", config=config),
                                providers=["CPUExecutionProvider"])


def interleaved(runs: dict[str, callable], repeats: int, warmup: int = 2) -> dict[str, dict]:
    """Time each callable once per repeat, in turn; the first key is the baseline.

    Returns, per key: ``ms`` (median call time), ``ms_p10`` / ``ms_p90`` and, for all but the
    baseline, ``speedup`` (mean of the per-repeat ratios baseline / variant), ``speedup_se`` (its
    standard error, sd / sqrt(repeats)), ``speedup_median``, ``speedup_p10``, ``speedup_p90``."""
    for _ in range(warmup):
        for f in runs.values():
            f()
    times: dict[str, list[float]] = {k: [] for k in runs}
    keys = list(runs)
    for r in range(repeats):
        order = keys if r % 2 == 0 else keys[::-1]  # alternate so neither side always runs first
        for k in order:
            t = time.perf_counter()
            runs[k]()
            times[k].append(time.perf_counter() - t)
    base = np.array(times[keys[0]])
    out = {}
    for k in keys:
        t = np.array(times[k]) * 1e3
        row = {"ms": float(np.median(t)), "ms_p10": float(np.percentile(t, 10)), "ms_p90": float(np.percentile(t, 90))}
        if k != keys[0]:
            ratio = base / np.array(times[k])
            row.update(speedup=float(ratio.mean()), speedup_se=float(ratio.std(ddof=1) / np.sqrt(len(ratio))),
                       speedup_median=float(np.median(ratio)), speedup_p10=float(np.percentile(ratio, 10)),
                       speedup_p90=float(np.percentile(ratio, 90)))
        out[k] = row
    return out


# --- a SmolLM2-shaped GEMM chain ---------------------------------------------------------------


def _q4_1_form(rng: np.random.Generator, n: int, k: int):
    """A random Q4_1-like weight ``[n, k]`` in :class:`~pipeline.quant.gguf_blocks.DQForm` (INT4
    codes in [-8, 7], positive fp16-exact scales, float offsets)."""
    from pipeline.quant.gguf_blocks import DQForm

    blocks = k // 32
    # a gain of about 1/2 per GEMM (codes of sd ~4.6): tanh(h) stays off saturation over 30 layers
    d = (rng.uniform(0.8, 1.2, (n, blocks)) / (2 * 4.6 * np.sqrt(k))).astype(np.float16).astype(np.float32)
    m = (-8 * d + rng.standard_normal((n, blocks)).astype(np.float32) * 0.1 * d).astype(np.float32)
    return DQForm(4, 32, rng.integers(-8, 8, (n, k)).astype(np.int8), d, m)


def gemm_chain(tokens: int) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """``(fp32, int4)`` graphs of the 210-GEMM chain: ``x [1, tokens, 576]`` -> per layer
    ``h = tanh(h + o(q(h)) + down(gate(h) * up(h)))``, k and v as graph outputs (so they are computed)."""
    from pipeline.quant.int4 import block_matmul

    rng = np.random.default_rng(0)
    graphs = []
    forms = {}
    for variant in ("fp32", "int4"):
        nodes, inits, outs = [], [], []
        h = "x"
        shapes = [("q", H, H), ("k", KV, H), ("v", KV, H), ("o", H, H), ("gate", FFN, H), ("up", FFN, H),
                  ("down", H, FFN)]
        for layer in range(LAYERS):
            names = {}
            for proj, n, k in shapes:
                key = (layer, proj)
                form = forms.setdefault(key, _q4_1_form(rng, n, k))
                x = {"o": f"l{layer}.q", "down": f"l{layer}.act"}.get(proj, h)
                y = f"l{layer}.{proj}"
                if variant == "fp32":
                    w = form.weight().astype(np.float32).T.copy()
                    inits.append(numpy_helper.from_array(w, f"{y}.w"))
                    nodes.append(helper.make_node("MatMul", [x, f"{y}.w"], [y], name=y))
                else:
                    ns, ins = block_matmul(form, x, y, name=y, prefix=f"{y}.blocks", x_rank=3)
                    nodes += ns
                    inits += ins
                names[proj] = y
                if proj == "up":
                    nodes.append(helper.make_node("Mul", [f"l{layer}.gate", y], [f"l{layer}.act"]))
            nodes += [helper.make_node("Add", [h, f"l{layer}.o"], [f"l{layer}.h1"]),
                      helper.make_node("Add", [f"l{layer}.h1", f"l{layer}.down"], [f"l{layer}.h2"]),
                      helper.make_node("Tanh", [f"l{layer}.h2"], [f"l{layer}.h"])]  # bounded: no overflow
            outs += [helper.make_tensor_value_info(f"l{layer}.{p}", TensorProto.FLOAT, [1, tokens, KV]) for p in "kv"]
            h = f"l{layer}.h"
        outs.insert(0, helper.make_tensor_value_info(h, TensorProto.FLOAT, [1, tokens, H]))
        g = helper.make_graph(nodes, variant, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, H])],
                              outs, inits)
        graphs.append(helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))
    return graphs[0], graphs[1]


def part_gemms(args) -> dict:
    out = {}
    for tokens in args.tokens:
        fp32, int4 = gemm_chain(tokens)
        x = {"x": np.random.default_rng(1).standard_normal((1, tokens, H)).astype(np.float32) }
        s32, s1, s4 = (session(m.SerializeToString(), lv) for m, lv in ((fp32, None), (int4, 1), (int4, 4)))
        ref = s32.run(None, x)
        errs = {lv: max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(s.run(None, x), ref))
                for lv, s in ((1, s1), (4, s4))}  # the largest over all outputs, each relative to its max
        res = interleaved({"fp32": lambda: s32.run(None, x), "int4_level1": lambda: s1.run(None, x),
                           "int4_level4": lambda: s4.run(None, x)}, args.repeats)
        res["max_relative_error_vs_fp32"] = {f"level{lv}": e for lv, e in errs.items()}
        out[f"tokens_{tokens}"] = res
        print(f"gemm chain, 210 GEMMs, {tokens} token(s): {_line(res)}; max |rel err| level 1 "
              f"{errs[1]:.1e}, level 4 {errs[4]:.1e}", flush=True)
    return out


# --- the whole model ---------------------------------------------------------------------------


def step_feeds(sess: ort.InferenceSession, batch: int, new: int, past: int) -> dict[str, np.ndarray]:
    """Feeds of a causal-LM step: ``new`` tokens after ``past`` (random past K/V, all attended)."""
    rng = np.random.default_rng(0)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 49152, (batch, new)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((batch, past + new), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(past, past + new, dtype=np.int64)[None].repeat(batch, 0)
        elif i.name.startswith("past_key_values."):
            heads, dim = int(i.shape[1]), int(i.shape[3])
            feeds[i.name] = rng.standard_normal((batch, heads, past, dim)).astype(np.float32)
        else:
            raise SystemExit(f"unknown graph input {i.name} {i.shape}")
    return feeds


def part_model(args) -> dict:
    fp32, int4 = str(args.fp32), str(args.int4)
    variants = {"fp32": session(fp32, None), "int4_level1": session(int4, 1), "int4_level4": session(int4, 4)}
    out = {}
    for label, new, past in (("decode", 1, args.past), ("prefill", args.prefill, 0)):
        feeds = step_feeds(variants["fp32"], 1, new, past)
        ref = variants["fp32"].run(["logits"], feeds)[0]
        errs = {k: float(np.abs(s.run(["logits"], feeds)[0] - ref).max()) for k, s in variants.items() if k != "fp32"}
        res = interleaved({k: (lambda s=s: s.run(["logits"], feeds)) for k, s in variants.items()}, args.repeats)
        res["max_abs_logit_difference_vs_fp32"] = errs
        out[f"{label}_batch1_new{new}_past{past}"] = res
        print(f"{label} (batch 1, {new} new, past {past}): {_line(res)}; max |logit diff| "
              + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()), flush=True)
    return out


# --- the tied embedding / lm_head table --------------------------------------------------------


def part_head(args) -> dict:
    """The lm_head alone, ``[1, 1, 576] x [576, 49152]`` with random Q8_0-like blocks: FP32, INT8 block 32 (an
    8-bit MatMulNBits) and the two INT4 halves (:func:`pipeline.quant.int4.int4_halves`), at levels 1 and 4."""
    from pipeline.quant.gguf_blocks import DQForm
    from pipeline.quant.int4 import block_matmul, int4_halves

    k, n = H, 49152
    rng = np.random.default_rng(0)
    form = DQForm(8, 32, rng.integers(-127, 128, (n, k)).astype(np.int8),
                  (rng.uniform(0.5, 1.5, (n, k // 32)) * 1e-3).astype(np.float16).astype(np.float32), None)

    def graph(nodes, inits):
        g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, n])], inits)
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10).SerializeToString()

    w = form.dequantized()
    fp32 = graph([helper.make_node("MatMul", ["x", "w"], ["y"])], [numpy_helper.from_array(np.ascontiguousarray(w.T), "w")])
    int8 = graph(*block_matmul(form, "x", "y", name="head", prefix="t", x_rank=3))
    hi, lo = int4_halves(form)
    na, ia = block_matmul(hi, "x", "y_hi", name="head", prefix="hi", x_rank=3)
    nb, ib = block_matmul(lo, "x", "y_lo", name="head/lo", prefix="lo", x_rank=3)
    halves = graph([*na, *nb, helper.make_node("Add", ["y_hi", "y_lo"], ["y"])], ia + ib)
    x = {"x": rng.standard_normal((1, 1, k)).astype(np.float32)}
    sessions = {"fp32": session(fp32, None), "int8_level1": session(int8, 1), "int8_level4": session(int8, 4),
                "int4_halves_level1": session(halves, 1), "int4_halves_level4": session(halves, 4)}
    exact = x["x"][0].astype(np.float64) @ w.T.astype(np.float64)
    errs = {key: float(np.abs(s.run(None, x)[0][0] - exact).max() / np.abs(exact).max()) for key, s in sessions.items()}
    res = interleaved({key: (lambda s=s: s.run(None, x)) for key, s in sessions.items()}, args.repeats)
    res["max_relative_error_vs_exact"] = errs
    print(f"lm_head 576 x 49152: {_line(res)}; max |rel err| " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()),
          flush=True)
    return res


def part_table(args) -> dict:
    """The served CPU graph (``--int4``: the FP32 table for the Gather, the lm_head as INT4 halves) against the
    graph TensorRT builds (``--engine-graph``: one INT8 table read by the Gather through an unfused
    DequantizeLinear and by the lm_head), and that DequantizeLinear alone, at level 1."""
    model = onnx.load(str(args.engine_graph))
    inits = {t.name: t for t in model.graph.initializer}
    head = next(n for n in model.graph.node if n.op_type == "DequantizeLinear"
                and inits[n.input[0]].data_type == TensorProto.INT8 and list(inits[n.input[0]].dims)[1] > 10000)
    values, scales = (numpy_helper.to_array(inits[n]) for n in head.input[:2])
    block = next(a.i for a in head.attribute if a.name == "block_size")
    dq = helper.make_model(helper.make_graph(
        [helper.make_node("DequantizeLinear", ["v", "s"], ["w"], axis=0, block_size=block)], "dq", [],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, list(values.shape))],
        [numpy_helper.from_array(values, "v"), numpy_helper.from_array(scales, "s")]),
        opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    dq_sess = session(dq.SerializeToString(), 1)
    served, single = session(str(args.int4), 1), session(str(args.engine_graph), 1)
    feeds = step_feeds(served, 1, 1, args.past)
    a, b = served.run(["logits"], feeds)[0], single.run(["logits"], feeds)[0]
    res = interleaved({"served_cpu_graph": lambda: served.run(["logits"], feeds),
                       "one_int8_table_engine_graph": lambda: single.run(["logits"], feeds),
                       "dequantize_table_alone": lambda: dq_sess.run(None, {})}, args.repeats)
    res["values"] = int(values.size)
    res["max_abs_logit_difference"] = float(np.abs(a - b).max())
    res["bytes"] = {key: _initializer_bytes(path) for key, path in (("served_cpu_graph", args.int4),
                                                                   ("engine_graph", args.engine_graph))}
    print(f"tied table ({values.size / 1e6:.1f} M values): DequantizeLinear alone "
          f"{res['dequantize_table_alone']['ms']:.1f} ms/call; decode step served {res['served_cpu_graph']['ms']:.1f} ms, "
          f"one INT8 table {res['one_int8_table_engine_graph']['ms']:.1f} ms; max |logit diff| "
          f"{res['max_abs_logit_difference']:.1e}; initializer bytes {res['bytes']}", flush=True)
    return res


def _initializer_bytes(path: Path) -> dict[str, int]:
    """Initializer bytes of a graph by element type (INT4 at half a byte), read without the data."""
    from collections import Counter

    model = onnx.load(str(path), load_external_data=False)
    out: Counter = Counter()
    for t in model.graph.initializer:
        n = int(np.prod(t.dims, dtype=np.int64))
        bits = 4 if t.data_type in (TensorProto.INT4, TensorProto.UINT4) else 8 * helper.tensor_dtype_to_np_dtype(
            t.data_type).itemsize
        out[TensorProto.DataType.Name(t.data_type)] += n * bits // 8
    return {**dict(out), "total": sum(out.values())}


def _line(res: dict) -> str:
    parts = []
    for k, r in res.items():
        if not isinstance(r, dict) or "ms" not in r:
            continue
        s = f"{k} {r['ms']:.1f} ms"
        if "speedup" in r:
            s += (f" (x{r['speedup']:.2f} +- {r['speedup_se']:.2f} of fp32, median {r['speedup_median']:.2f}, "
                  f"p10-p90 {r['speedup_p10']:.2f}-{r['speedup_p90']:.2f})")
        parts.append(s)
    return "; ".join(parts)


def main() -> None:
    art = ROOT / "artifacts" / "int4-llm"
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["gemms", "head", "model", "table"],
                    choices=["gemms", "head", "model", "table"])
    ap.add_argument("--fp32", type=Path, default=art / "export" / "model.onnx")
    ap.add_argument("--int4", type=Path, default=art / "quantize" / "model_cpu.onnx",
                    help="the graph ONNX Runtime validates and serves")
    ap.add_argument("--engine-graph", type=Path, default=art / "quantize" / "model.onnx",
                    help="the graph TensorRT builds (one tied INT8 table)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1], help="GEMM chain rows (1: decode)")
    ap.add_argument("--past", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = {"cpu": cpu_name(), "onnxruntime": ort.__version__, "date": time.strftime("%Y-%m-%d"),
              "repeats": args.repeats}
    print(f"{result['cpu']}; onnxruntime {ort.__version__}; {args.repeats} interleaved repeats", flush=True)
    for part in args.parts:
        result[part] = {"gemms": part_gemms, "head": part_head, "model": part_model, "table": part_table}[part](args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
