"""The generation model's scheduler on a real exported LLM, without tritonserver (not a test).

Loads the served generation model (pipeline/models/text_generation/served/) with a minimal stand-in for
triton_python_backend_utils and the compute graph run in process (as for target
python-onnxruntime), then reports:

* tokens: each prompt decoded alone (batch 1) vs all prompts at once, staggered so
  sequences at different positions share padded steps: the first differing position per
  prompt and the batch-1 reference's top-2 logit gap there;
* per-step cost: the graph's own decode step (batch 1, past 64, ONNX Runtime alone) vs the
  served batch-1 TPOT, and TPOT near output positions 16 and 256;
* throughput: output tokens/s at 1 and 8 concurrent requests, and the scheduler's
  executions by batch size.

    .venv/bin/python benchmarks/generate_scheduler.py artifacts/fp8-llm/export/model.onnx \\
        artifacts/fp8-llm/export/tokenizer [--dequantize]

Numbers on a shared CPU move with other load.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
from google.protobuf import json_format

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.onnx_io import graph_specs  # noqa: E402
from pipeline.triton.config import generate_config  # noqa: E402
from pipeline.models.text_generation.triton import kv_layout, write_served  # noqa: E402
from pipeline.triton.repository import eos_token_ids  # noqa: E402

TEMPLATES = ROOT / "pipeline" / "triton" / "templates"
PROMPTS = ["The history of the city begins", "In 1905 the physicist", "A recipe for bread needs",
           "The stock market fell sharply", "Rain is expected over the weekend", "The team won the final",
           "Scientists discovered a new species", "The museum opened its doors"]


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class Request:
    """A request whose responses are recorded with their arrival time."""

    def __init__(self, **arrays):
        self.inputs = {n: Tensor(n, a) for n, a in arrays.items()}
        self.sent_at, self.responses = time.perf_counter(), []

    def get_response_sender(self):
        return SimpleNamespace(send=lambda response=None, flags=0: self.responses.append((time.perf_counter(), response)))

    def tokens(self):
        return [int(r.outputs["token_ids"][0]) for _, r in self.responses if "token_ids" in r.outputs]

    def times(self):
        return [t for t, r in self.responses if "token_ids" in r.outputs]


def install_pb_utils():
    sys.modules["triton_python_backend_utils"] = SimpleNamespace(
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, Tensor=Tensor, TritonError=str,
        InferenceResponse=lambda output_tensors=None, error=None: SimpleNamespace(
            outputs={t.name(): t.as_numpy() for t in output_tensors or []}, error=error),
        get_input_tensor_by_name=lambda request, name: request.inputs.get(name),
        Logger=SimpleNamespace(log_info=lambda m: print(f"[model] {m}")))


def load_model(onnx_path: Path, tokenizer: Path, root: Path, max_batch: int, dequantize: bool,
               continuous: bool = True):
    """A repository in ``root`` (a copy of the graph, symlinks to the tokenizer) and the generation model on it."""
    compute = root / "llm" / "1"
    compute.mkdir(parents=True)
    for f in onnx_path.parent.iterdir():
        if f.name.startswith(onnx_path.name):
            shutil.copy(f, compute / f.name)  # onnx refuses symlinked or hard-linked external data
    (compute / "model.py").write_text((TEMPLATES / "onnxruntime_model.py").read_text())
    gen = root / "gen" / "1"
    gen.mkdir(parents=True)
    for f in tokenizer.iterdir():
        os.symlink(f.resolve(), gen / f.name)
    write_served(gen)
    inputs, _ = graph_specs(onnx.load(str(onnx_path), load_external_data=False))
    kv = kv_layout(inputs)
    params = {"compute_onnx": f"llm/1/{onnx_path.name}", "graph_optimization_level": "basic" if dequantize else "all"}
    if dequantize:
        params["dequantize_weights"] = "once"
    cfg = generate_config("gen", compute_model="llm", num_layers=kv.num_layers, kv_heads=kv.kv_heads,
                          head_dim=kv.head_dim, kv_dtype=kv.dtype, eos_token_ids=eos_token_ids(tokenizer),
                          default_max_tokens=32, max_context=1024, max_prompt_tokens=512,
                          max_concurrent_generations=max_batch, continuous_batching=continuous,
                          compute_runtime="onnxruntime",
                          compute_parameters=params)
    spec = importlib.util.spec_from_file_location("generate_bench_model", gen / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True)),
                      "model_repository": str(root / "gen"), "model_version": "1"})
    return model


def request(ids, max_tokens):
    return Request(input_ids=np.array(ids, np.int64), max_tokens=np.array([max_tokens], np.int32),
                   ignore_eos=np.array([True]))


def run(model, *requests):
    model.execute(list(requests))
    model.drain()
    return requests


def top2_gaps(model, ids, count):
    """Batch-1 greedy with the model's own session: tokens and the top-2 logit gap at each position."""
    layout = model.past_names
    past = {n: np.zeros((1, model.kv_heads, 0, model.head_dim), np.float32) for n in layout}
    step, total, tokens, gaps = list(ids), len(ids), [], []
    for _ in range(count):
        logits, *present = model.compute({"input_ids": np.array([step], np.int64),
                                          "attention_mask": np.ones((1, total), np.int64), **past})
        top = np.sort(logits[0, -1])[-2:]
        tokens.append(int(np.argmax(logits[0, -1])))
        gaps.append(float(top[1] - top[0]))
        past, step, total = dict(zip(layout, present)), [tokens[-1]], total + 1
    return tokens, gaps


def graph_step_ms(model, past_len=64, repeats=20):
    """Median ms of one batch-1 decode step of the graph alone (past ``past_len``)."""
    rng = np.random.default_rng(0)
    feeds = {"input_ids": np.array([[100]], np.int64), "attention_mask": np.ones((1, past_len + 1), np.int64),
             **{n: rng.standard_normal((1, model.kv_heads, past_len, model.head_dim)).astype(np.float32)
                for n in model.past_names}}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.compute(feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def tpot_near(times, position, window=8):
    gaps = np.diff(times) * 1e3
    lo = max(0, position - window // 2)
    return float(np.median(gaps[lo:lo + window]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("onnx", type=Path)
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("--dequantize", action="store_true", help="Q/DQ graph: dequantize weights once at load")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    install_pb_utils()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    with tempfile.TemporaryDirectory() as scratch:
        model = load_model(args.onnx, args.tokenizer, Path(scratch), 8, args.dequantize)
        out: dict = {"graph_step_ms_batch1_past64": graph_step_ms(model)}
        # Tokens: batch 1 vs batched (half the prompts start 6 tokens later: different positions).
        reference = [top2_gaps(model, p, args.tokens) for p in prompts]
        first = [request(p, args.tokens) for p in prompts[:4]]
        model.execute(first)
        while len(first[0].responses) < 6:
            time.sleep(0.005)
        second = [request(p, args.tokens) for p in prompts[4:]]
        run(model, *second)
        diffs = []
        for (ref, gaps), req in zip(reference, [*first, *second]):
            got = req.tokens()
            k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            diffs.append(None if k is None else {"position": k, "reference_gap": round(gaps[k], 4),
                                                  "min_gap_before": round(min(gaps[:k], default=99), 4)})
        out["batched_vs_batch1_first_difference"] = diffs
        out["batch1_min_top2_gap"] = [round(min(g), 4) for _, g in reference]
        # Per-step cost and TPOT growth, batch 1; the compute calls timed inside the same run.
        inner, spent = model.compute, []

        def timed(feeds):
            start = time.perf_counter()
            result = inner(feeds)
            spent.append((time.perf_counter() - start) * 1e3)
            return result

        model.compute = timed
        one, = run(model, request(prompts[0][:16], 260))
        model.compute = inner
        times = one.times()
        out["compute_ms_per_step_at_16"] = float(np.median(spent[13:21]))
        out["compute_ms_per_step_at_256"] = float(np.median(spent[253:261]))
        out["served_overhead_ms_per_step"] = float(np.median(np.diff(times) * 1e3 - np.array(spent[1:])))
        out["tpot_ms_batch1"] = float(np.median(np.diff(times[:32]) * 1e3))
        out["tpot_ms_at_16"], out["tpot_ms_at_256"] = tpot_near(times, 16), tpot_near(times, 256)
        out["tpot_ratio_256_16"] = out["tpot_ms_at_256"] / out["tpot_ms_at_16"]
        # Throughput at 1 and 8 concurrent requests.
        for c in (1, 8):
            start = time.perf_counter()
            reqs = run(model, *[request(prompts[i % 8], args.tokens) for i in range(c)])
            out[f"output_tokens_per_s_c{c}"] = sum(len(r.tokens()) for r in reqs) / (time.perf_counter() - start)
        out["throughput_ratio_c8_c1"] = out["output_tokens_per_s_c8"] / out["output_tokens_per_s_c1"]
        out["scheduler"] = model.stats()
        model.finalize()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
