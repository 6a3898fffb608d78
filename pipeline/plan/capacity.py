"""``pipeline plan RECIPE``: GPU capacity of a built causal-LM recipe, from the model's numbers.

Inputs, all read from what the build left under ``artifacts/<recipe>/``:

* ``export/model.onnx``: parameters (elements of the floating-point
  initializers; weights the exporter de-duplicated count once, as they are
  stored and read once) and the KV layout (``past_key_values.{i}.key/value``
  [batch, kv_heads, past, head_dim], :func:`pipeline.models.text_generation.kv.kv_layout`);
* ``quantize/stage.json``: the quantized GEMM nodes (their weights are FP8/INT8
  on a GPU, 1 byte) and ``quantize/model.onnx``: the served KV dtype;
* the recipe: max batch (``triton.max_batch_size`` and build profile 0's batch
  max), max context (:func:`pipeline.triton.repository.context_limits`), the
  TensorRT workspace (``build.workspace_mib``), the SLO (``serve.slo``).

Served precision: on CPU every weight is as wide as the graph's float type
(FP32: the python-onnxruntime model dequantizes Q/DQ weights at load); on a GPU
the engine keeps the quantized GEMM weights at 1 byte and the rest at the
graph's type (FP16 for fp16 recipes, else FP32: strongly typed TensorRT keeps
the ONNX types).

Formulas (units: bytes, seconds, FLOP; :mod:`pipeline.plan.formulas`, sources in its ``FORMULAS``):

* weights = parameters x bytes per element (per tensor, summed);
* KV per token = 2 x layers x kv_heads x head_dim x bytes (K and V; kv_heads,
  not query heads: GQA-aware);
* KV at the limit = KV per token x max context x max batch;
* max concurrent sequences per GPU = floor((memory - weights - workspace) /
  (KV per token x max context));
* decode roofline, tokens/s per sequence <= bandwidth / (weights + KV bytes read
  per step); MBU = measured tokens/s x bytes per step / bandwidth;
* prefill arithmetic intensity = 2 x parameters x tokens / (weights + KV
  written), against the ridge point peak FLOP/s / bandwidth;
* replicas for a request rate (estimate): Little's law, rate x request time /
  sequences per replica that keep the TPOT SLO on the roofline.

Everything GPU-side is an estimate from published peak figures (roofline upper
bounds on speed, so lower bounds on replicas). This machine's row is measured:
its copy bandwidth (:func:`pipeline.plan.measure.copy_bandwidth`), the KV bytes
of one ONNX Runtime run, and decode tokens/s (``bench/bench.json`` or ``--measure``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from pipeline.errors import PipelineError
from pipeline.plan.formulas import (
    FORMULAS,
    decode_roofline,
    kv_bytes_at_limit,
    kv_bytes_per_token,
    max_concurrent_sequences,
    mbu,
    prefill_intensity,
    replicas_for_rate,
    ridge_point,
)
from pipeline.plan.gpus import GPU, GPUS
from pipeline.plan.render import write_plan
from pipeline.recipe.schema import Recipe
from pipeline.recipe.precisions import facts

DEFAULT_RATE = 10.0  # req/s, when --rate is not given: the recipe's serve section has no request rate

# --- inputs from the build ------------------------------------------------------------------------


@dataclass
class ModelFacts:
    """What the plan needs from the built recipe (bytes, tokens)."""

    parameters: int
    quantized_parameters: int
    layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    kv_bytes_per_element: int
    weight_bytes_cpu: int
    weight_bytes_gpu: int
    precision: str
    max_batch: int
    max_context: int
    max_prompt_tokens: int
    workspace_bytes: int
    export_onnx: str
    served_onnx: str


def not_built(recipe: Recipe, path: Path) -> PipelineError:
    return PipelineError(f"{path} not found: recipe {recipe.name!r} has not been built; run "
                         f"`make build RECIPE={recipe.name}` (or `python -m pipeline build <recipe.yaml>`) first")


def model_facts(recipe: Recipe, workspace_bytes: int | None = None) -> ModelFacts:
    """Read the export, the quantize stage and the recipe (see the module docstring).

    Raises:
        PipelineError: the recipe is not a causal LM, has not been built (names the
            missing file and says to run ``make build RECIPE=...``), its quantize
            stage names a node the export lacks, or profile 0 sets no context limit.
        TritonConfigError: the export has no usable ``past_key_values.*`` inputs.
    """
    from pipeline.trt.profiles import resolve_profiles, shape_tensor_inputs
    from pipeline.onnx_io import graph_specs
    from pipeline.models.text_generation.triton import kv_layout
    from pipeline.recipe.kinds import facts
    from pipeline.triton.repository import context_limits, profile_batch

    if not facts(recipe.model.kind).kv_cache:
        raise PipelineError(f"model.kind: plan sizes the KV cache of causal LMs; recipe {recipe.name!r} is "
                            f"{recipe.model.kind!r}")
    run_dir = Path(recipe.work_dir) / recipe.name
    export_path, stage_path = run_dir / "export" / "model.onnx", run_dir / "quantize" / "stage.json"
    for path in (export_path, stage_path):
        if not path.is_file():
            raise not_built(recipe, path)
    quant = json.loads(stage_path.read_text())["artifact"]
    served_path = Path(quant["onnx_path"])
    if not served_path.is_file():
        raise not_built(recipe, served_path)
    export = onnx.load(str(export_path), load_external_data=False)
    inputs, _ = graph_specs(export)
    served_kv = kv_layout(graph_specs(onnx.load(str(served_path), load_external_data=False))[0])
    kv = kv_layout(inputs)
    profiles = resolve_profiles(list(recipe.build.profiles), inputs, set(shape_tensor_inputs(export)))
    limits = context_limits(profiles)
    if not limits["max_context"]:
        raise PipelineError("build.profiles[0]: no attention_mask / past_key_values max, so no context limit "
                            "to size the KV cache for; give dims total_sequence and past_sequence a max")
    batch_max, _ = profile_batch(profiles)
    batches = [b for b in (recipe.triton.max_batch_size, batch_max) if b]
    cpu, gpu, params, quantized = weight_bytes_by_target(export, quant["quantized_nodes"], quant["precision"])
    return ModelFacts(
        params, quantized, kv.num_layers, kv.kv_heads, kv.head_dim, served_kv.dtype,
        int(np.dtype(served_kv.dtype).itemsize), cpu, gpu, quant["precision"], min(batches, default=1),
        limits["max_context"], limits["max_prompt_tokens"],
        recipe.build.workspace_mib * 2**20 if workspace_bytes is None else workspace_bytes,
        str(export_path), str(served_path))


def weight_bytes_by_target(export: onnx.ModelProto, quantized_nodes: list[str],
                           precision: str) -> tuple[int, int, int, int]:
    """(CPU bytes, GPU bytes, parameters, quantized parameters) of the export's float initializers.

    CPU: each tensor at its ONNX type's width (2 for fp16 recipes); GPU: the
    weights of ``quantized_nodes`` (MatMul/Gemm input 1, or the initializer a Transpose there
    reads: a tied lm_head, whose table the embedding Gather still reads at its own width too) at the
    precision's weight bytes (1; 0.5 for int4), the rest as on CPU.

    Raises:
        PipelineError: a quantized node is not in the export, or has no initializer weight.
    """
    inits = {t.name: t for t in export.graph.initializer}
    nodes = {n.name: n for n in export.graph.node}
    transposed = {n.output[0]: n.input[0] for n in export.graph.node if n.op_type == "Transpose" and n.input}
    quantized, tied = set(), set()
    for name in quantized_nodes:
        node = nodes.get(name)
        direct = node.input[1] if node is not None and len(node.input) >= 2 else ""
        weight = direct if direct in inits else transposed.get(direct, "")
        if weight not in inits:
            raise PipelineError(f"quantize/stage.json: quantized node {name!r} has no weight initializer in "
                                "export/model.onnx; the stages are out of step: rebuild the recipe")
        quantized.add(weight)
        if weight != direct:
            tied.add(weight)
    cpu = gpu = params = qparams = 0
    for t in inits.values():
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
        if not np.issubdtype(dtype, np.floating):
            continue
        n = int(np.prod(t.dims, dtype=np.int64)) if t.dims else 1
        width = int(facts(precision).weight_bytes) if facts(precision).cast else dtype.itemsize
        params += n
        cpu += n * width
        if t.name in quantized:
            gpu += int(n * facts(precision).weight_bytes) + (n * width if t.name in tied else 0)
        else:
            gpu += n * width
        qparams += n if t.name in quantized else 0
    return cpu, gpu, params, qparams


def measured_from_bench(run_dir: Path) -> dict | None:
    """Batch-1 decode tokens/s of ``bench/bench.json`` (TPOT at the first ``tpot_positions`` of the
    concurrency-1 long request, through tritonserver), with its context; None if there is no bench."""
    path = run_dir / "bench" / "bench.json"
    if not path.is_file():
        return None
    llm = json.loads(path.read_text()).get("llm") or {}
    pos = llm.get("tpot_by_position", {}).get("tpot_ms") or {}
    if not pos:
        return None
    first = min(pos, key=int)
    return {"source": str(path), "tokens_per_s": 1e3 / pos[first],
            "context": int(llm.get("prompt_tokens", 0)) + int(first),
            "what": f"TPOT at output position {first}, concurrency 1, through tritonserver"}


# --- the plan -------------------------------------------------------------------------------------


def gemm_peak(gpu: GPU, precision: str) -> tuple[float, str]:
    """Peak FLOP/s of the served GEMMs on ``gpu``: FP8 for fp8 recipes where the GPU has FP8, else FP16."""
    if facts(precision).fp8_tensor_cores and gpu.fp8_tflops:
        return gpu.fp8_tflops * 1e12, "fp8"
    return gpu.fp16_tflops * 1e12, "fp16"


def gpu_row(f: ModelFacts, gpu: GPU, *, rate: float, prompt: int, output: int, tpot_s: float, ttft_s: float) -> dict:
    """Every planned figure for one GPU (bytes, tokens/s, FLOP/byte)."""
    per_token = kv_bytes_per_token(f.layers, f.kv_heads, f.head_dim, f.kv_bytes_per_element)
    kv_seq = per_token * f.max_context
    memory, bw = gpu.memory_gb * 1e9, gpu.bandwidth_gbs * 1e9
    peak, peak_kind = gemm_peak(gpu, f.precision)
    request_ctx = prompt + output
    rep = replicas_for_rate(
        rate, prompt=prompt, output=output, max_batch=f.max_batch,
        memory_sequences=max_concurrent_sequences(memory, f.weight_bytes_gpu, f.workspace_bytes, per_token * request_ctx),
        tpot_s=tpot_s, ttft_s=ttft_s, weights=f.weight_bytes_gpu, kv_per_token=per_token,
        parameters=f.parameters, bandwidth_bps=bw, peak_flops=peak)
    intensity = prefill_intensity(f.parameters, f.max_prompt_tokens or prompt, f.weight_bytes_gpu, per_token)
    ridge = ridge_point(peak, bw)
    notes = [gpu.note] if gpu.note else []
    if facts(f.precision).fp8_tensor_cores and not gpu.fp8_tflops:
        notes.append("FP8 GEMMs cannot run in FP8 here: FP16 peak used; an fp8 engine needs an fp16/int8 rebuild")
    return {
        "gpu": gpu.to_json(),
        "weights_bytes": f.weight_bytes_gpu,
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_sequence_at_max_context": kv_seq,
        "kv_bytes_at_limit": kv_bytes_at_limit(per_token, f.max_context, f.max_batch),
        "workspace_bytes": f.workspace_bytes,
        "max_concurrent_sequences": max_concurrent_sequences(memory, f.weight_bytes_gpu, f.workspace_bytes, kv_seq),
        "decode_roofline_tokens_per_s_at_max_context": decode_roofline(bw, f.weight_bytes_gpu, kv_seq),
        "decode_roofline_tokens_per_s_at_request_context": decode_roofline(bw, f.weight_bytes_gpu, per_token * request_ctx),
        "prefill": {"tokens": f.max_prompt_tokens or prompt, "intensity_flop_per_byte": intensity,
                    "ridge_flop_per_byte": ridge, "peak": peak_kind,
                    "bound": "compute" if intensity > ridge else "memory"},
        "replicas": {"estimate": True, **asdict(rep)},
        "notes": notes,
    }


def cpu_row(f: ModelFacts, bandwidth: dict, measured: list[dict], memory_bytes: int) -> dict:
    """This machine: measured copy bandwidth, the CPU-served weights, roofline vs measured decode tokens/s."""
    per_token = kv_bytes_per_token(f.layers, f.kv_heads, f.head_dim, f.kv_bytes_per_element)
    bw = bandwidth["median_gbs"] * 1e9
    cases = []
    for m in measured:
        kv_read = per_token * round(m["context"])
        roof = decode_roofline(bw, f.weight_bytes_cpu, kv_read)
        cases.append({**m, "kv_bytes_read": kv_read, "bytes_per_step": f.weight_bytes_cpu + kv_read,
                      "roofline_tokens_per_s": roof, "mbu": mbu(m["tokens_per_s"], f.weight_bytes_cpu, kv_read, bw)})
    return {
        "bandwidth": bandwidth, "memory_bytes": memory_bytes, "weights_bytes": f.weight_bytes_cpu,
        "kv_bytes_per_token": per_token,
        "max_concurrent_sequences": max_concurrent_sequences(memory_bytes, f.weight_bytes_cpu, 0, per_token * f.max_context),
        "decode_roofline_tokens_per_s_at_max_context": decode_roofline(bw, f.weight_bytes_cpu, per_token * f.max_context),
        "measured": cases,
    }


def kv_check(f: ModelFacts, batch: int = 2, sequence: int = 3, past: int = 5) -> dict:
    """The KV-per-token formula against the bytes of ``present.*`` from one ONNX Runtime run of the export."""
    from pipeline.plan.measure import present_kv_bytes

    got = present_kv_bytes(f.export_onnx, batch, sequence, past)
    export_width = int(np.dtype(kv_dtype_of(f.export_onnx)).itemsize)
    formula = kv_bytes_per_token(f.layers, f.kv_heads, f.head_dim, export_width) * got["tokens"] * batch
    return {**got, "formula_bytes": formula, "match": formula == got["bytes"]}


def kv_dtype_of(onnx_path: str) -> str:
    """dtype of a graph's past_key_values inputs."""
    from pipeline.onnx_io import graph_specs
    from pipeline.models.text_generation.triton import kv_layout

    return kv_layout(graph_specs(onnx.load(onnx_path, load_external_data=False))[0]).dtype


def _check_positive(flag: str, value: float) -> None:
    """Raises PipelineError (exit 2) naming ``flag`` unless ``value`` is finite and > 0."""
    if not (math.isfinite(value) and value > 0):
        raise PipelineError(f"{flag}: must be a finite number > 0, got {value:g}")


def build_plan(recipe: Recipe, *, rate: float | None = None, prompt: int | None = None, output: int | None = None,
               workspace_bytes: int | None = None, measure: bool = False, bandwidth: dict | None = None,
               gpus: tuple[GPU, ...] = GPUS) -> dict:
    """The whole plan as a JSON-ready dict (see :func:`write_plan`).

    ``rate`` req/s (default :data:`DEFAULT_RATE`), ``prompt`` / ``output`` tokens
    per request (default ``serve.bucket_tokens`` / ``serve.max_tokens``);
    ``bandwidth``: a :func:`~pipeline.plan.measure.copy_bandwidth` result
    (measured here when None); ``measure``: also time decode steps of the served graph.

    Raises:
        PipelineError: see :func:`model_facts`; a non-positive ``rate``, ``prompt`` or ``output``.
    """
    import psutil

    from pipeline.plan.measure import copy_bandwidth, decode_tokens_per_s

    f = model_facts(recipe, workspace_bytes)
    serve = recipe.serve
    prompt = serve.bucket_tokens if prompt is None else prompt
    output = serve.max_tokens if output is None else output
    rate_source = "--rate" if rate is not None else "default (the recipe's serve section has no request rate)"
    rate = DEFAULT_RATE if rate is None else rate
    for flag, value in (("--rate", rate), ("--prompt-tokens", prompt), ("--output-tokens", output)):
        _check_positive(flag, value)
    if prompt + output > f.max_context:
        raise PipelineError(f"--prompt-tokens + --output-tokens = {prompt + output} exceeds the max context "
                            f"{f.max_context} of build.profiles[0]")
    run_dir = Path(recipe.work_dir) / recipe.name
    measured = [m for m in [measured_from_bench(run_dir)] if m]
    if measure:
        d = decode_tokens_per_s(f.served_onnx)
        measured.append({"source": "--measure", "tokens_per_s": d["tokens_per_s"], "context": d["mean_context"],
                         "what": f"median of {d['steps']} batch-1 decode steps of the served graph in ONNX Runtime",
                         "step_ms": d["step_ms"]})
    slo = {"tpot_ms": serve.slo.tpot_ms, "ttft_ms": serve.slo.ttft_ms}
    rows = [gpu_row(f, g, rate=rate, prompt=prompt, output=output, tpot_s=slo["tpot_ms"] / 1e3,
                    ttft_s=slo["ttft_ms"] / 1e3) for g in gpus]
    return {
        "recipe": recipe.name,
        "generated_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "label": "GPU figures are ESTIMATES from published peak figures (roofline bounds); this machine's are measured",
        "model": asdict(f),
        "request": {"rate_per_s": rate, "rate_source": rate_source, "prompt_tokens": prompt,
                    "output_tokens": output, "slo": slo},
        "formulas": FORMULAS,
        "gpus": rows,
        "this_machine": {**cpu_row(f, bandwidth or copy_bandwidth(), measured, psutil.virtual_memory().total),
                         "kv_check": kv_check(f)},
    }


# --- command line ---------------------------------------------------------------------------------


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan's own options (the recipe positional, --set and --quiet are the CLI's common ones)."""
    parser.add_argument("--rate", type=float, default=None, metavar="REQ_PER_S",
                        help=f"target request rate for the replica estimate (default {DEFAULT_RATE:g})")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt tokens per request (default serve.bucket_tokens)")
    parser.add_argument("--output-tokens", type=int, default=None,
                        help="output tokens per request (default serve.max_tokens)")
    parser.add_argument("--workspace-gib", type=float, default=None,
                        help="GPU memory kept for TensorRT workspace and activations (default build.workspace_mib)")
    parser.add_argument("--measure", action="store_true",
                        help="also time a few batch-1 decode steps of the served graph with ONNX Runtime")


def cmd_plan(args) -> int:
    """``python -m pipeline plan RECIPE``: print the table, write artifacts/<recipe>/plan/plan.{json,md,png}.

    Raises:
        PipelineError: see :func:`build_plan` (exit 2; an unbuilt recipe says to run make build first).
    """
    from pipeline.recipe.load import load_from_args

    recipe = load_from_args(args)
    if args.workspace_gib is not None:
        _check_positive("--workspace-gib", args.workspace_gib)
        if not math.isfinite(args.workspace_gib * 2**30):
            raise PipelineError(f"--workspace-gib: {args.workspace_gib:g} GiB is more bytes than a float holds")
    workspace = None if args.workspace_gib is None else int(args.workspace_gib * 2**30)
    plan = build_plan(recipe, rate=args.rate, prompt=args.prompt_tokens, output=args.output_tokens,
                      workspace_bytes=workspace, measure=args.measure)
    run_dir = Path(recipe.work_dir) / recipe.name
    paths = write_plan(plan, run_dir / "plan")
    from pipeline.run.report import add_report_section

    add_report_section(run_dir, "Capacity plan", paths["md"].read_text() + "\n\n![plan](plan/plan.png)\n")
    print(paths["md"].read_text())
    print("plan: " + "\n      ".join(str(p) for p in paths.values()))
    return 0
