"""Where a decode step's cost grows with the past length (not a test).

Runs the served graph (as the python-onnxruntime generation model runs it: weight Q/DQ
dequantized once, CPU execution provider) at batch 1, one new token, past P in
``--pasts``, and reports per P, in ms (median of ``--repeats``):

* ``run_numpy``: ``session.run`` with numpy feeds (ORT allocates the outputs);
  each way also as ``<way>_min``, the fastest run (the median is the headline);
* ``iobinding_fresh``: IOBinding, outputs bound to freshly allocated numpy arrays each
  call (what InProcessCompute did before buffer reuse);
* ``iobinding_reused``: IOBinding, the same preallocated output arrays every call;
* ``numpy_gather``: the scheduler's old per-step gather, copying each layer's past
  into a new padded [B, H, P, D] buffer;
* ``ort_ops``: ONNX Runtime's own profile summed by operator type (ms per step), so the
  growth from P_min to P_max can be split into Concat (past + new KV), attention
  MatMul/Softmax, Expand (GQA repeat of K/V), and the rest.

    .venv/bin/python benchmarks/kv_step_cost.py artifacts/fp8-llm/quantize/model.onnx

Several graphs (e.g. an SDPA export and a grouped-attention export of the same model) are
timed interleaved in one run and reported under their labels (``--labels``, else each
file's folder name); ``--kinds`` picks the ways of running a step (all by default).

    .venv/bin/python benchmarks/kv_step_cost.py /tmp/sdpa/model.onnx /tmp/grouped/model.onnx \
        --labels sdpa grouped --kinds run_numpy iobinding_reused --pasts 16 256

Numbers on a shared 2-core CPU move with other load; compare columns of one run.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "pipeline" / "triton" / "templates" / "onnxruntime_model.py"


def helper():
    """The python-onnxruntime template module (its dequantize_once and graph levels)."""
    spec = importlib.util.spec_from_file_location("ort_template_helper", TEMPLATE)
    module = importlib.util.module_from_spec(spec)
    import sys
    import types
    sys.modules.setdefault("triton_python_backend_utils", types.SimpleNamespace())
    spec.loader.exec_module(module)
    return module


def session(path: Path, profile: str | None = None, threads: int = 0):
    """(session, dequantized weights as OrtValues, past input names, (H_kv, D))."""
    h = helper()
    model = onnx.load(str(path))
    weights = h.dequantize_once(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = h.LEVELS["basic"]
    options.intra_op_num_threads = threads  # 0: ONNX Runtime's default (one per core)
    if profile:
        options.enable_profiling, options.profile_file_prefix = True, profile
    with tempfile.TemporaryDirectory() as scratch:
        sess = ort.InferenceSession(h._source(model, scratch), sess_options=options,
                                    providers=["CPUExecutionProvider"])
    values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in weights.items()}
    pasts = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    shape = pasts[0].shape
    return sess, values, [p.name for p in pasts], (int(shape[1]), int(shape[3]))


def feeds(names, geometry, past, batch=1):
    rng = np.random.default_rng(0)
    heads, dim = geometry
    out = {"input_ids": np.array([[100]] * batch, np.int64),
           "attention_mask": np.ones((batch, past + 1), np.int64)}
    out.update({n: rng.standard_normal((batch, heads, past, dim)).astype(np.float32) for n in names})
    return out


def median_ms(fn, repeats):
    fn()  # warm up (first run of a shape plans buffers)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def binder(sess, values, f, vocab, reuse):
    """A callable running one step with IOBinding; outputs reused or fresh each call."""
    outs = [o.name for o in sess.get_outputs()]
    batch, past = f["input_ids"].shape[0], f["attention_mask"].shape[1] - 1
    heads, dim = f[next(n for n in f if n.startswith("past_"))].shape[1::2]

    def shapes():
        logits = {"logits": (batch, 1, vocab), "last_logits": (batch, vocab)}
        return {n: logits.get(n, (batch, heads, past + 1, dim)) for n in outs}

    kept = {n: np.empty(s, np.float32) for n, s in shapes().items()}

    def step():
        binding = sess.io_binding()
        for n, a in f.items():
            binding.bind_cpu_input(n, a)
        for n, v in values.items():
            binding.bind_ortvalue_input(n, v)
        arrays = kept if reuse else {n: np.empty(s, np.float32) for n, s in shapes().items()}
        for n, a in arrays.items():
            binding.bind_output(n, "cpu", 0, np.float32, list(a.shape), a.ctypes.data)
        sess.run_with_iobinding(binding)
    return step


def gather_ms(f, names, repeats):
    """The old scheduler gather: every layer's past copied into a new padded buffer."""
    def step():
        for n in names:
            out = np.zeros_like(f[n])
            out[0, :, :] = f[n][0]
    return median_ms(step, repeats)


def op_profile(path: Path, pasts, repeats, threads: int = 0):
    """ms per step by operator type, per past length, from ORT's profiler."""
    with tempfile.TemporaryDirectory() as scratch:
        sess, values, names, geometry = session(path, profile=os.path.join(scratch, "ort"), threads=threads)
        marks = []
        for past in pasts:
            f = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in feeds(names, geometry, past).items()}
            f.update(values)
            sess.run_with_ort_values(["logits"], f)
            marks.append(time.perf_counter())  # runs of this past follow this mark
            for _ in range(repeats):
                sess.run_with_ort_values(["logits"], f)
        trace = json.load(open(sess.end_profiling()))
    runs = [e for e in trace if e.get("cat") == "Session" and e["name"] == "model_run"]
    nodes = [e for e in trace if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    # model_run events in order: per past, 1 warm-up + repeats.
    per = 1 + repeats
    out = {}
    for k, past in enumerate(pasts):
        window = runs[k * per + 1:(k + 1) * per]
        lo, hi = window[0]["ts"], window[-1]["ts"] + window[-1]["dur"]
        by_op = collections.Counter()
        for e in nodes:
            if lo <= e["ts"] <= hi:
                by_op[e["args"]["op_name"]] += e["dur"] / 1e3 / repeats
        out[past] = {op: round(ms, 3) for op, ms in by_op.most_common()}
    return out


KINDS = ("run_numpy", "iobinding_fresh", "iobinding_reused")


def step_calls(path: Path, pasts, kinds, repeats, threads: int) -> tuple[dict, dict]:
    """(report with the geometry and the gather cost per past, {past: {kind: step callable}})."""
    sess, values, names, geometry = session(path, threads=threads)
    vocab = sess.get_outputs()[0].shape[-1]
    if not isinstance(vocab, int):
        f = feeds(names, geometry, 1)
        vocab = sess.run(["logits"], {**f, **{n: v.numpy() for n, v in values.items()}})[0].shape[-1]
    report: dict = {"graph": str(path),
                    "geometry": {"layers": len(names) // 2, "kv_heads": geometry[0], "head_dim": geometry[1]}}
    calls = {}
    for past in pasts:
        f = feeds(names, geometry, past)
        plain = {**f, **{n: v.numpy() for n, v in values.items()}}
        ways = {"run_numpy": lambda plain=plain: sess.run(None, plain),
                "iobinding_fresh": binder(sess, values, f, vocab, reuse=False),
                "iobinding_reused": binder(sess, values, f, vocab, reuse=True)}
        calls[past] = {k: ways[k] for k in kinds}
        report[f"past_{past}"] = {"numpy_gather": gather_ms(f, names, repeats)}
    return report, calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("onnx", type=Path, nargs="+")
    parser.add_argument("--labels", nargs="+", help="one per graph (default: each file's folder name)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--pasts", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    parser.add_argument("--no-op-profile", action="store_true", help="skip the per-operator profile")
    args = parser.parse_args()
    labels = args.labels or [p.parent.name for p in args.onnx]
    if len(labels) != len(args.onnx) or len(set(labels)) != len(labels):
        parser.error(f"--labels: give {len(args.onnx)} distinct labels, one per graph (got {labels})")
    reports, calls = {}, {}
    for label, path in zip(labels, args.onnx):
        reports[label], calls[label] = step_calls(path, args.pasts, args.kinds, args.repeats, args.threads)
    # Interleaved (every graph, past and way, in turn, per repeat) so load drift hits all alike.
    times = {(g, p, k): [] for g in calls for p in calls[g] for k in calls[g][p]}
    for g, p, k in times:
        calls[g][p][k]()  # warm-up
    for _ in range(args.repeats):
        for (g, past, kind), got in times.items():
            start = time.perf_counter()
            calls[g][past][kind]()
            got.append((time.perf_counter() - start) * 1e3)
    for (g, past, kind), got in times.items():
        reports[g][f"past_{past}"][kind] = float(np.median(got))
        # the least disturbed run: other load only ever adds time
        reports[g][f"past_{past}"][f"{kind}_min"] = float(np.min(got))
    calls.clear()  # frees the sessions before profiling
    lo, hi = min(args.pasts), max(args.pasts)
    for label, path in zip(labels, args.onnx):
        report = reports[label]
        for key in report[f"past_{lo}"]:
            report[f"ratio_{hi}_{lo}_{key}"] = report[f"past_{hi}"][key] / report[f"past_{lo}"][key]
        if not args.no_op_profile:
            ops = op_profile(path, [lo, hi], max(5, args.repeats // 2), args.threads)
            growth = {op: round(ops[hi].get(op, 0) - ops[lo].get(op, 0), 3) for op in set(ops[lo]) | set(ops[hi])}
            report["ort_ops_ms"] = {str(p): dict(list(v.items())[:12]) for p, v in ops.items()}
            report[f"ort_ops_growth_ms_{lo}_to_{hi}"] = dict(sorted(growth.items(), key=lambda kv: -kv[1])[:10])
            report["ort_ops_total_ms"] = {str(p): round(sum(v.values()), 3) for p, v in ops.items()}
    print(json.dumps(reports[labels[0]] if len(labels) == 1 else reports, indent=1))


if __name__ == "__main__":
    main()
