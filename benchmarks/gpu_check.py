"""GPU check helper (run by benchmarks/gpu_check.sh): the built engines against ONNX Runtime.

For each engine given (FP8 from ``trtexec.sh``, optionally an FP16 one), on the
recipe's validate windows (prefill, empty KV cache):
  * logits vs ONNX Runtime on the same graph family: max / mean |diff|, top-1 agreement;
  * the engine's perplexity (the validate stage's convention: pipeline.stages.validate.mean_nll);
  * prefill throughput, tokens/s at batch 1 and batch 8 (timing, so here and not in tests/).

Runs engines with Polygraphy's TensorRT runner when installed, else with the
tensorrt runtime on torch CUDA tensors; a TensorRT-RTX engine (``*.rtx-*.engine``)
with the tensorrt_rtx_bindings runtime. Needs the recipe's export and quantize
stages already run (``artifacts/<recipe>/export/stage.json``).

Usage: python benchmarks/gpu_check.py RECIPE.yaml --engine fp8=PLAN [--engine fp16=PLAN] [--windows 8]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.models import text as text_data  # noqa: E402
from pipeline.artifacts import ExportArtifact, TensorSpec  # noqa: E402
from pipeline.models.text_generation.model import prefill_feeds  # noqa: E402
from pipeline.recipe.schema import Recipe
from pipeline.recipe.load import load_recipe# noqa: E402
from pipeline.ort_sessions import ort_session  # noqa: E402
from pipeline.models.text_generation.metrics import mean_nll  # noqa: E402
from pipeline.sources.model import load_tokenizer  # noqa: E402

Runner = Callable[[dict[str, np.ndarray]], np.ndarray]  # feeds -> logits float32 [batch, seq, vocab]


def load_export(run_dir: Path) -> ExportArtifact:
    """The export stage's artifact from ``<run_dir>/export/stage.json``.

    Raises:
        SystemExit: the export stage has not run (message says which command runs it).
    """
    path = run_dir / "export" / "stage.json"
    if not path.is_file():
        raise SystemExit(f"gpu_check: {path} missing; run `python -m pipeline build <recipe>` (CPU is enough) first")
    art = json.loads(path.read_text())["artifact"]
    specs = lambda key: [TensorSpec(**s) for s in art[key]]  # noqa: E731
    return ExportArtifact(art["onnx_path"], specs("inputs"), specs("outputs"), art["tokenizer_dir"])


def trt_runner(plan: Path) -> Runner:
    """Logits of a serialized engine; Polygraphy's TrtRunner if importable, else tensorrt + torch CUDA.

    Raises:
        SystemExit: neither polygraphy nor a CUDA-enabled torch is available.
    """
    blob = plan.read_bytes()
    if ".rtx-" in plan.name:  # the build stage's TensorRT-RTX engine: its own runtime, not Polygraphy's
        return _torch_trt_runner(blob, "tensorrt_rtx_bindings")
    try:
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    except ImportError:
        return _torch_trt_runner(blob)
    runner = TrtRunner(EngineFromBytes(blob))
    runner.activate()
    return lambda feeds: np.asarray(runner.infer(feeds)["logits"], np.float32)


def _torch_trt_runner(blob: bytes, module: str = "tensorrt") -> Runner:
    """``module``: ``tensorrt`` or ``tensorrt_rtx_bindings`` (same runtime API)."""
    import importlib

    import torch

    trt = importlib.import_module(module)

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: install polygraphy (pip install polygraphy) or a CUDA build of torch to run engines")
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(blob)
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]

    def run(feeds: dict[str, np.ndarray]) -> np.ndarray:
        keep = {n: torch.from_numpy(np.ascontiguousarray(a)).cuda() for n, a in feeds.items()}
        for n, t in keep.items():
            context.set_input_shape(n, tuple(t.shape))
            context.set_tensor_address(n, t.data_ptr())
        for n in names:
            if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT:
                dtype = torch.from_numpy(np.zeros(0, trt.nptype(engine.get_tensor_dtype(n)))).dtype
                shape = context.get_tensor_shape(n)
                keep[n] = torch.empty([shape[i] for i in range(len(shape))], dtype=dtype, device="cuda")
                context.set_tensor_address(n, keep[n].data_ptr())
        stream = torch.cuda.current_stream()
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed")
        stream.synchronize()
        return keep["logits"].float().cpu().numpy()

    return run


def ort_runner(onnx_path: str) -> Runner:
    """Logits of an ONNX graph in ONNX Runtime (the validate stage's session settings)."""
    sess = ort_session(onnx_path)
    return lambda feeds: np.asarray(sess.run(["logits"], feeds)[0], np.float32)


def compare(engine: Runner, reference: Runner, exp: ExportArtifact, windows: np.ndarray, context: int,
            batch: int = 4) -> dict[str, float]:
    """Engine vs reference logits on ``windows`` int64 [n, seq]; also the engine's perplexity."""
    max_abs, sum_abs, cells, agree, tokens, nll, scored = 0.0, 0.0, 0, 0, 0, 0.0, 0
    for i in range(0, len(windows), batch):
        feeds = prefill_feeds(exp, windows[i:i + batch])
        got, want = engine(feeds), reference(feeds)
        diff = np.abs(got.astype(np.float64) - want)
        max_abs, sum_abs, cells = max(max_abs, float(diff.max())), sum_abs + float(diff.sum()), cells + diff.size
        agree += int((got.argmax(-1) == want.argmax(-1)).sum())
        tokens += got.shape[0] * got.shape[1]
        s, n = mean_nll(got, windows[i:i + batch], context)
        nll, scored = nll + s, scored + n
    return {"logits_max_abs_diff": max_abs, "logits_mean_abs_diff": sum_abs / cells,
            "top1_agreement": agree / tokens, "perplexity": math.exp(nll / scored)}


def tokens_per_second(engine: Runner, exp: ExportArtifact, windows: np.ndarray, batch: int, repeats: int = 5) -> float:
    """Prefill throughput: batch x seq tokens per call, median of ``repeats`` timed calls after one warm-up."""
    rows = np.resize(windows, (batch, windows.shape[1]))  # repeats windows if there are fewer than ``batch``
    feeds = prefill_feeds(exp, rows)
    engine(feeds)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine(feeds)
        times.append(time.perf_counter() - start)
    return rows.size / float(np.median(times))


def check(recipe: Recipe, engines: dict[str, Path], windows_limit: int) -> dict[str, dict[str, float]]:
    """All metrics per engine label (e.g. "fp8", "fp16")."""
    run_dir = Path(recipe.work_dir) / recipe.name
    exp = load_export(run_dir)
    v = recipe.validate_
    tok = load_tokenizer(exp.tokenizer_dir)
    windows = text_data.token_windows(tok, text_data.documents(v.data), v.seq_len, min(v.max_windows, windows_limit))
    context = v.seq_len - text_data.window_convention(tok, v.seq_len)["scored_per_window"]
    quantized = run_dir / "quantize" / "model.onnx"
    results: dict[str, dict[str, float]] = {}
    for label, plan in engines.items():
        # an FP8 engine is compared with its Q/DQ graph; an FP16 one with the FP32 export
        reference = ort_runner(str(quantized) if label != "fp16" and quantized.is_file() else exp.onnx_path)
        engine = trt_runner(plan)
        results[label] = compare(engine, reference, exp, windows, context)
        for b in (1, 8):
            results[label][f"tokens_per_s_batch{b}"] = tokens_per_second(engine, exp, windows, b)
    return results


def main(argv: list[str] | None = None) -> int:
    """CLI; prints one table row per engine and writes ``<run_dir>/gpu_check.json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("recipe")
    ap.add_argument("--engine", action="append", required=True, help="LABEL=PLAN, e.g. fp8=artifacts/x/build/model.plan")
    ap.add_argument("--windows", type=int, default=8, help="validate windows compared (default 8: a few minutes)")
    args = ap.parse_args(argv)
    recipe = load_recipe(args.recipe)
    engines = {}
    for item in args.engine:
        label, _, plan = item.partition("=")
        engines[label] = Path(plan)
    results = check(recipe, engines, args.windows)
    print("| engine | perplexity | top-1 agreement | max abs diff | mean abs diff | tok/s batch 1 | tok/s batch 8 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        print(f"| {label} | {r['perplexity']:.4f} | {r['top1_agreement']:.4f} | {r['logits_max_abs_diff']:.4g} | "
              f"{r['logits_mean_abs_diff']:.4g} | {r['tokens_per_s_batch1']:.0f} | {r['tokens_per_s_batch8']:.0f} |")
    out = Path(recipe.work_dir) / recipe.name / "gpu_check.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
