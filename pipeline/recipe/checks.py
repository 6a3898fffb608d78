"""Recipe constraints between sections, checked by the loader before any stage runs.

Everything here is decided by the recipe alone (no graph, no weights, no GPU):
the export's dynamic axes, the profiles, calibration shapes, gates and data types for the model
kind, the Triton section. Checks that need the exported graph (every dynamic
axis of every input covered by a profile, KV-cache geometry, dtypes) stay in the
export and triton stages. Each problem carries the key path (``loc``) it is
about, so :func:`pipeline.recipe.load.load_recipe` can print the YAML line.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pipeline.recipe.kinds import PAST_DIM, PROMPT_TOKENS, eval_units, facts, source_problem
from pipeline.recipe.problems import Loc, Problem
from pipeline.recipe.precisions import capability_problem, facts as facts_of

if TYPE_CHECKING:
    from pipeline.sources.data import DataSource
    from pipeline.recipe.schema import Profile, Recipe

_PAST = re.compile(r"^past_key_values\.\d+\.(key|value)$")
#: Record kinds (pipeline.sources.data) that give texts.
TEXT_RECORDS = ("documents", "labeled_documents")
#: Metrics measured by greedy generation, so only with validate.generation.
GENERATION_METRICS = frozenset({"token_agreement", "prompts_identical", "mean_common_prefix_tokens"})


def constraint_problems(r: Recipe) -> list[Problem]:
    """Every cross-section problem of ``r``, in recipe order (empty when consistent)."""
    return [
        *_source_problems(r),
        *_export_problems(r),
        *_check_point_problems(r),
        *_profile_problems(r),
        *_calibration_problems(r),
        *_validate_problems(r),
        *_data_problems(r),
        *_gate_problems(r),
        *_triton_problems(r),
        *_target_problems(r),
        *_weights_problems(r),
        *_bench_problems(r),
    ]


def _source_problems(r: Recipe) -> list[Problem]:
    """The kind takes the source's form (``generic``: entry or onnx, not a Hugging Face folder)."""
    problem = source_problem(r.model.kind, r.model.source.tag, r.model.source.describe())
    return [(("model", "source"), problem)] if problem else []


def _batch_dim(r: Recipe) -> str:
    if facts(r.model.kind).graph_inputs is None:  # any input's axis 0 (one batch name is checked below)
        return next((dims[0] for dims in r.export.dynamic_axes.values() if 0 in dims), "batch")
    return r.export.dynamic_axes.get("input_ids", {}).get(0, "batch")


def _sequence_dim(r: Recipe) -> str:
    return r.export.dynamic_axes.get("input_ids", {}).get(1, "sequence")


def total_dim(r: Recipe) -> str | None:
    """The attention mask's axis-1 name (past + new positions; ``total_sequence`` in the shipped
    recipes), or None when the recipe declares none."""
    return r.export.dynamic_axes.get("attention_mask", {}).get(1)


def _known_dims(r: Recipe) -> set[str]:
    """Symbolic dim names the exported graph will have."""
    names = {d for axes in r.export.dynamic_axes.values() for d in axes.values()}
    return names | ({PAST_DIM} if facts(r.model.kind).kv_cache else set())


def _export_problems(r: Recipe) -> list[Problem]:
    axes = r.export.dynamic_axes
    at: Loc = ("export", "dynamic_axes")
    out: list[Problem] = []
    kind = facts(r.model.kind)
    if kind.graph_inputs is None:  # the graph's own inputs are checked at export
        return _batch_name_problems(axes, at)
    if 0 not in axes.get("input_ids", {}):
        out.append((at, "needs input_ids with a dynamic batch axis, e.g. input_ids: {0: batch, 1: sequence}"))
    allowed = kind.graph_inputs
    for name, dims in axes.items():
        if name not in allowed and not (kind.kv_cache and _PAST.match(name)):
            out.append(((*at, name), f"a {r.model.kind} graph has no input {name!r}; its inputs are "
                        f"{list(allowed)}" + (" and past_key_values.N.key/value" if kind.kv_cache else "")))
            continue
        rank = 4 if _PAST.match(name) else 2
        for axis in dims:
            if not 0 <= axis < rank:
                out.append(((*at, name, axis), f"{name} has rank {rank}: axis {axis} does not exist "
                            f"(valid: 0..{rank - 1})"))
    return out + _batch_name_problems(axes, at)


def _batch_name_problems(axes: dict, at: Loc) -> list[Problem]:
    batch_names = sorted({dims[0] for dims in axes.values() if 0 in dims})
    if len(batch_names) > 1:
        return [(at, f"axis 0 is one batch dim shared by every input; got the names {batch_names}")]
    return []


def _check_point_problems(r: Recipe) -> list[Problem]:
    points = r.export.check_points
    at: Loc = ("export", "check_points")
    if not points:
        return []
    out: list[Problem] = []
    if len(points) < 3:
        out.append((at, f"give at least 3 shape points (min, a middle one, max), got {len(points)}"))
    known = _known_dims(r)
    kind = facts(r.model.kind)
    required = {_batch_dim(r)} if kind.graph_inputs is None else (
        {"batch", "sequence"} | ({PAST_DIM} if kind.kv_cache else set()))
    for i, point in enumerate(points):
        for dim, size in point.items():
            if dim not in known:
                out.append(((*at, i, dim), f"{dim!r} is not a dynamic dim of the graph; "
                            f"export.dynamic_axes gives {sorted(known)}"))
            elif size < (0 if dim == PAST_DIM else 1):
                out.append(((*at, i, dim), f"size {size} is below {0 if dim == PAST_DIM else 1}"))
        missing = sorted(required - point.keys())
        if missing:
            out.append(((*at, i), f"point {point} lacks {missing}; a {r.model.kind} point needs {sorted(required)}"))
        total = total_dim(r)
        if kind.kv_cache and total in point and {"sequence", PAST_DIM} <= point.keys():
            if point[total] != point["sequence"] + point[PAST_DIM]:
                out.append(((*at, i, total), f"{total}={point[total]} must equal sequence + {PAST_DIM} "
                            f"({point['sequence']} + {point[PAST_DIM]}); omit it to have it computed"))
    return out


def _profile_problems(r: Recipe) -> list[Problem]:
    out: list[Problem] = []
    known = _known_dims(r)
    seen: dict[str, int] = {}
    for i, p in enumerate(r.build.profiles):
        if p.name in seen:
            out.append((("build", "profiles", i, "name"), f"{p.name!r} is also the name of profile {seen[p.name]}; "
                        "profile names must be unique"))
        seen.setdefault(p.name, i)
        for dim in p.dims:
            if dim not in known:
                out.append((("build", "profiles", i, "dims", dim), f"no graph input has the dynamic dim {dim!r}; "
                            f"export.dynamic_axes gives {sorted(known)}"))
    return out


def profile_batch_max(r: Recipe, p: Profile) -> int | None:
    """Largest batch profile ``p`` serves for every input: its batch dim max, lowered by
    any explicit input shape's axis-0 max; None when it states neither."""
    maxes = [p.dims[_batch_dim(r)].max] if _batch_dim(r) in p.dims else []
    maxes += [s.max[0] for s in p.inputs.values() if s.max]
    return min(maxes, default=None)


def _calibration_problems(r: Recipe) -> list[Problem]:
    cal = r.quantize.calibration
    return [] if cal is None else _prefill_problems(r, ("quantize", "calibration"), cal.batch_size, cal.seq_len,
                                                    "calibrate")


def _validate_problems(r: Recipe) -> list[Problem]:
    """A KV-cache model's validate runs what the engine must serve: prefills of ``batch_size``
    windows of ``seq_len`` tokens, and with ``generation`` one prompt at a time decoded to
    ``new_tokens``. (Other kinds pad their eval rows to lengths the data decides.)"""
    if not facts(r.model.kind).kv_cache:
        return []
    v = r.validate_
    out = _prefill_problems(r, ("validate",), v.batch_size, v.seq_len, "validate")
    return out + (_generation_problems(r, v.generation.new_tokens) if v.generation is not None else [])


def _generation_problems(r: Recipe, new_tokens: int) -> list[Problem]:
    """Greedy generation's last step reads a context of prompt + ``new_tokens`` - 1 tokens; the
    prompt is :data:`PROMPT_TOKENS` text tokens plus the tokenizer's special ones (not known here,
    so the bound below is the least it needs)."""
    total = total_dim(r)
    rngs = [p.dims[total] for p in r.build.profiles if total in p.dims]
    need = PROMPT_TOKENS + new_tokens - 1
    if not rngs or any(rng.max >= need for rng in rngs):
        return []
    ranges = ", ".join(f"{p.name!r} max {p.dims[total].max}" for p in r.build.profiles if total in p.dims)
    return [(("validate", "generation", "new_tokens"),
             f"new_tokens={new_tokens}: greedy generation reaches a context of at least {need} tokens "
             f"({PROMPT_TOKENS}-token prompts, plus the tokenizer's special tokens, then {new_tokens - 1} decode "
             f"steps), beyond the {total} range of every build profile ({ranges}); lower new_tokens or raise "
             f"a profile's {total} max")]


def _prefill_problems(r: Recipe, at: Loc, batch_size: int, seq_len: int, use: str) -> list[Problem]:
    """Rows of ``batch_size`` x ``seq_len`` tokens (an empty past for a KV-cache model) must fit
    one build profile: ``use`` (calibrate, validate) runs them on the shapes the engine serves."""
    out: list[Problem] = []
    shape = {"batch_size": (_batch_dim(r), batch_size), "seq_len": (_sequence_dim(r), seq_len)}
    total = total_dim(r)
    if facts(r.model.kind).kv_cache:
        shape[f"{PAST_DIM} (empty past)"] = (PAST_DIM, 0)
        if total:
            shape[f"{total} (= seq_len)"] = (total, seq_len)

    def fits(p: Profile, dim: str, value: int) -> bool:
        rng = p.dims.get(dim)
        return rng is None or rng.min <= value <= rng.max

    profiles = r.build.profiles
    if any(all(fits(p, d, v) for d, v in shape.values()) for p in profiles):
        return out
    for field, (dim, value) in shape.items():
        if not any(fits(p, dim, value) for p in profiles):
            ranges = ", ".join(f"{p.name!r} [{p.dims[dim].min}, {p.dims[dim].max}]" for p in profiles if dim in p.dims)
            loc = (*at, field) if field in ("batch_size", "seq_len") else at
            out.append((loc, f"{field}={value} lies outside the {dim} range of every build profile ({ranges}); "
                        f"{use} on shapes the engine will serve"))
            return out
    shown = ", ".join(f"{f}={v}" for f, (_, v) in shape.items())
    out.append((at, f"{shown} fit no single build profile together; {use} on shapes the engine will serve"))
    return out


def _data_problems(r: Recipe) -> list[Problem]:
    """A text model's calibration and validate data must give texts. (Overlap between
    the uses needs the files: :func:`pipeline.sources.data.check_disjoint`, run by ``check``
    and ``build``.)"""
    if not facts(r.model.kind).text_data:
        return []
    uses: list[tuple[Loc, DataSource]] = [(("validate", "data"), r.validate_.data)]
    if r.quantize.calibration is not None:
        uses.insert(0, (("quantize", "calibration", "data"), r.quantize.calibration.data))
    out: list[Problem] = []
    for loc, src in uses:
        kind = src.record_kind
        if kind not in TEXT_RECORDS:
            out.append(((*loc, "type"), f"{src.describe()} gives {kind}; a {r.model.kind} model reads "
                        "texts here: a corpus (lee_background), text or jsonl source"))
    return out


def _gate_problems(r: Recipe) -> list[Problem]:
    """Each gate names a metric its kind produces (pipeline.recipe.gates); generation metrics
    need validate.generation."""
    from pipeline.recipe import gates

    at: Loc = ("validate", "gates")
    out = gates.problems(r.validate_.gates, r.model.kind, at)
    for i, gate in enumerate(r.validate_.gates):
        if gate.metric in GENERATION_METRICS and r.validate_.generation is None:
            out.append(((*at, i, "metric"), f"{gate.metric} is measured by greedy generation: add "
                        "validate.generation (e.g. {prompts: 8, new_tokens: 32})"))
        units = eval_units(r, gate.metric) if gate.statistic != "point" else None
        if units is not None and units[1] < 2:
            field, n, unit = units
            out.append(((*at, i, "statistic"), f"{gate.statistic} needs the standard error of {gate.metric}, which "
                        f"resamples {unit}, and {field} is {n}: one {unit.rstrip('s')} has none, so the gate could "
                        f"only fail at the end of the build; valid: {field} >= 2 (a useful test needs many more), "
                        "or statistic: point"))
    return out


def served_context(r: Recipe) -> tuple[int, str] | None:
    """The largest context (prompt + generated tokens) a KV-cache model's decode steps fit in a
    build profile, and that profile's name: over the profiles that admit a one-token step,
    min(``total_sequence`` max, ``past_sequence`` max + 1), as the generation model computes it
    (:func:`pipeline.triton.repository.context_limits`); None when no profile bounds it. The
    model's own position limit can lower it further (checked with its config.json)."""
    total, seq = total_dim(r), _sequence_dim(r)
    best: tuple[int, str] | None = None
    for p in r.build.profiles:
        if seq in p.dims and p.dims[seq].min > 1:
            continue
        limits = ([p.dims[total].max] if total in p.dims else []) + (
            [p.dims[PAST_DIM].max + 1] if PAST_DIM in p.dims else [])
        if limits and (best is None or min(limits) > best[0]):
            best = (min(limits), p.name)
    return best


def _bench_problems(r: Recipe) -> list[Problem]:
    """``serve.tpot_positions`` the generation can reach: bench's long requests need
    ``tpot_positions[1] + 4`` tokens after a prompt of at least :data:`PROMPT_TOKENS`, each decode
    step inside the served context (:func:`served_context`)."""
    if not facts(r.model.kind).kv_cache:
        return []
    context = served_context(r)
    if context is None:
        return []
    limit, profile = context
    second = r.serve.tpot_positions[1]
    reach = limit - PROMPT_TOKENS - 3  # token k reads a context of prompt + k - 1; k = position + 4
    if second <= reach:
        return []
    return [(("serve", "tpot_positions", 1),
             f"{second}: TPOT there needs {second + 4} generated tokens after a prompt of at least {PROMPT_TOKENS} "
             f"tokens, a context of {PROMPT_TOKENS + second + 3}, and the generation stops at {limit} (build.profiles "
             f"{profile!r}); the largest position it reaches is {reach}: valid: "
             + (f"tpot_positions[1] <= {reach} (with long_max_tokens >= it + 4), or " if reach >= 2 else "")
             + "raise the profile's total_sequence / past_sequence max")]


def _triton_problems(r: Recipe) -> list[Problem]:
    t = r.triton
    at: Loc = ("triton",)
    out: list[Problem] = []
    if t.generate_model_name is not None and t.generate_model_name == t.model_name:
        out.append(((*at, "generate_model_name"), f"{t.model_name!r} is also triton.model_name; "
                    "the two models need different names"))
    for i, p in enumerate(r.build.profiles):
        batch_max = profile_batch_max(r, p)
        if batch_max is not None and t.max_batch_size > batch_max:
            out.append(((*at, "max_batch_size"), f"{t.max_batch_size} is greater than the max batch {batch_max} of "
                        f"build.profiles[{i}] ({p.name!r}); lower it or raise that profile's batch max"))
    if t.max_batch_size > 0 or t.dynamic_batching is not None:
        for name, dims in r.export.dynamic_axes.items():
            if 0 not in dims:
                out.append((("export", "dynamic_axes", name), f"axis 0 of {name} is not dynamic, but "
                            "triton.max_batch_size > 0 / dynamic_batching batches it; add 0: batch "
                            "or set triton.max_batch_size: 0 without dynamic_batching"))
    if facts(r.model.kind).batching_front and t.max_batch_size < 1:
        out.append(((*at, "max_batch_size"), "an encoder's tokenizer model and ensemble batch requests: "
                    "max_batch_size must be >= 1"))
    if t.dynamic_batching is not None:
        for j, size in enumerate(t.dynamic_batching.preferred_batch_size or []):
            if not 1 <= size <= max(t.max_batch_size, 1):
                out.append(((*at, "dynamic_batching", "preferred_batch_size", j),
                            f"{size} is outside 1..max_batch_size ({t.max_batch_size})"))
    for i, group in enumerate(t.instance_group):
        loc = (*at, "instance_group", i, "kind")
        if t.target == "tensorrt" and group.kind == "KIND_CPU":
            out.append((loc, "KIND_CPU cannot run a tensorrt_plan (TensorRT engines run only on GPU); "
                        "use KIND_GPU or KIND_AUTO"))
        if t.target == "python-onnxruntime" and group.kind == "KIND_GPU":
            out.append((loc, "KIND_GPU on target 'python-onnxruntime', which runs ONNX Runtime's CPU "
                        "provider; use KIND_CPU or KIND_AUTO"))
    return out


def _target_problems(r: Recipe) -> list[Problem]:
    """``build.targets`` against the precision's GPUs (the precision table's minimum compute
    capability: FP8 sm89+, INT4 sm86+) and TensorRT-RTX's architectures."""
    from pipeline import targets as serving_targets
    from pipeline.recipe.precisions import runs_on

    b = r.build
    out: list[Problem] = []
    for i, target in enumerate(b.targets):
        cap = serving_targets.sm_capability(target)
        problem = capability_problem(r.quantize.precision, cap, target)
        if problem:
            there = ", ".join(runs_on(serving_targets.capability_tuple(cap)))
            out.append((("build", "targets", i), f"{target}: {problem}; drop it, or quantize to a precision "
                        f"{target} runs ({there})"))
    if b.backend == "tensorrt-rtx" and b.targets and not any(t in serving_targets.RTX_TARGETS for t in b.targets):
        out.append((("build", "backend"), f"tensorrt-rtx cannot build for {b.targets} (it builds "
                    f"{', '.join(serving_targets.RTX_TARGETS)}); use backend auto (a TensorRT-RTX check build for "
                    f"{serving_targets.RTX_CHECK_TARGET} plus trtexec.sh) or tensorrt on such a GPU"))
    if b.embedding_lookup == "runtime" and r.triton.target in ("tensorrt", "auto"):
        out.append((("build", "embedding_lookup"), f"runtime: the engine then takes inputs_embeds, but triton.target "
                    f"{r.triton.target!r} can serve the engine, and its generation model feeds token ids; use "
                    "embedding_lookup: engine, or triton.target python-onnxruntime / onnxruntime (they serve the ONNX "
                    "graph, which keeps its lookup)"))
    if b.embedding_lookup == "runtime" and b.backend in ("tensorrt", "auto"):
        out.append((("build", "embedding_lookup"), f"runtime: the engine then takes inputs_embeds, but build.backend "
                    f"{b.backend!r} builds a datacenter TensorRT engine where a GPU has TensorRT, and validate runs "
                    "that engine feeding token ids; use embedding_lookup: engine, or build.backend tensorrt-rtx "
                    "(its engine is not run here) or none"))
    return out


#: GGUF block types carried as INT4 (pipeline.quant.gguf_blocks.SUPPORTED) all have 32-wide blocks
#: (Q4_0, Q4_1; Q4_K's sub-blocks); kept here so that check reads no file
GGUF_INT4_BLOCK = 32


def _weights_problems(r: Recipe) -> list[Problem]:
    """``quantize.weights`` (weight-only precisions): its method exists, ``source`` reads a GGUF file
    with the file's block size, and the served ONNX graph can run at ONNX Runtime's accuracy level 1
    (Triton's stock onnxruntime backend cannot set it)."""
    from pipeline.recipe.precisions import REFERENCE
    from pipeline.recipe.schema import WEIGHT_METHODS_DONE

    w = r.quantize.weights
    if w is None:
        return []
    at: Loc = ("quantize", "weights")
    out: list[Problem] = []
    own = facts_of(r.quantize.precision)
    if own.weight_methods and w.method not in own.weight_methods:  # a format with its own quantizer (nvfp4)
        out.append(((*at, "method"), f"{w.method!r} is not a {r.quantize.precision} method; valid: "
                    f"{', '.join(own.weight_methods)} (from the FP32 export; a GGUF source is dequantized first)"))
    elif not own.weight_methods and w.method not in WEIGHT_METHODS_DONE:
        out.append(((*at, "method"), f"{w.method!r} is not implemented yet; valid now: "
                    f"{', '.join(WEIGHT_METHODS_DONE)} (a GGUF model source's own blocks)"))
    if w.method == "source" and not own.weight_methods:
        src = r.model.source
        name = getattr(src, "file", None) or getattr(src, "path", None) or ""
        if src.tag not in ("package", "path") or not str(name).endswith(".gguf"):
            out.append((("model", "source"), f"{src.describe()} is not a GGUF file, and quantize.weights.method: "
                        "source takes the weights' blocks from one; use {path: ./model.gguf} or {package: P, file: "
                        "F.gguf}, or another weights.method"))
        if w.block_size != GGUF_INT4_BLOCK:
            out.append(((*at, "block_size"), f"{w.block_size}: method source keeps the GGUF file's blocks, which are "
                        f"{GGUF_INT4_BLOCK} weights wide for every 4-bit type (Q4_0, Q4_1, Q4_K); set block_size: "
                        f"{GGUF_INT4_BLOCK}"))
    if w.pad and (w.method == "source" or own.weight_methods):
        why = (f"GGUF blocks are {GGUF_INT4_BLOCK} wide and divide every K" if w.method == "source"
               else f"{r.quantize.precision}'s quantizer has no padding")
        out.append(((*at, "pad"), f"true: zero padding of K is for precision int4 with method rtn or awq ({why}); "
                    "drop pad"))
    q = r.quantize
    if w.method == "source" and (q.exclude.nodes or q.exclude.op_types):
        out.append(((*at[:1], "exclude"), f"not implemented yet for {q.precision}: every GEMM whose weight is a tensor "
                    "of the GGUF file gets its blocks; drop quantize.exclude"))
    if q.rest_precision != REFERENCE:
        out.append(((*at[:1], "rest_precision"), f"{q.rest_precision!r}: {q.precision} keeps the activations and "
                    f"everything but the GEMM weights in {REFERENCE} (MatMulNBits computes in FP32); use "
                    f"rest_precision: {REFERENCE}"))
    if r.triton.target in ("onnxruntime", "auto") and not own.cpu_decoded:  # a decoded twin is plain FP32
        why = ("" if r.triton.target == "onnxruntime" else
               " (auto serves onnxruntime_onnx wherever no datacenter TensorRT engine is built)")
        out.append((("triton", "target"), f"{r.triton.target!r}{why}: Triton's stock onnxruntime backend cannot set "
                    "ONNX Runtime's session.qdq_matmulnbits_accuracy_level, so it would run the "
                    f"{r.quantize.precision.upper()} GEMMs with INT8-quantized activations (accuracy level 4), not "
                    "what validate measured; use target python-onnxruntime (or tensorrt with a datacenter engine)"))
    return out
