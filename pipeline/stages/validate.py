"""Stage 4, validate: accuracy of the optimized model against the FP32
reference, and the recipe's gates, on what ships.

Both graphs run in ONNX Runtime. Where the build stage made a TensorRT engine
(status ``ok``), the same eval also runs through the engine
(:mod:`pipeline.runners`); its metrics are keyed ``engine.<metric>``, the
gates apply to them, and ``validate/engine_vs_onnxruntime.md`` puts the two
side by side. Without an engine the metrics say that the ONNX graph was
validated and is what gets served."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
from scipy.special import logsumexp

from pipeline import data
from pipeline import runners
from pipeline.artifacts import BuildArtifact, ExportArtifact, GateResult, QuantizedArtifact, ValidationArtifact
from pipeline.context import StageContext
from pipeline.errors import AccuracyError, RecipeError
from pipeline.manifest import code_hash, sha256_file, strict_jsonable, write_json_atomic, write_text_atomic
from pipeline.models import registry
from pipeline.models.llm import greedy_generate, layout_from_specs, prefill_feeds
from pipeline.recipe import Gates
from pipeline.runtime import ort_session

ENGINE = "engine."  # prefix of the engine's metrics
COMPARISON_FILE = "engine_vs_onnxruntime.md"

# gate field -> (metric name, comparison)
GATE_METRICS = {
    "max_relative_perplexity_increase": ("relative_perplexity_increase", "<="),
    "min_token_agreement": ("token_agreement", ">="),
    "max_spearman_drop": ("spearman_drop_max", "<="),
    "min_mean_cosine": ("mean_cosine", ">="),
}


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact, b: BuildArtifact | None = None) -> ValidationArtifact:
    """Measure, then gate. Never raises on a failed gate: the runner decides the exit code.

    Args:
        b: the build stage's artifact; with status ``ok`` the engine is measured
            too and the gates apply to its ``engine.*`` metrics.

    Raises:
        AccuracyError: the FP32 reference produced NaN (broken reference or input).
        RecipeError: a gate asks for a metric this model kind does not produce;
            ``quantize.rest_precision: bf16`` without an engine (BF16 is validated
            only through TensorRT).
        RunnerError: the engine does not load or run.
    """
    engine = engine_path(b)
    _check_bf16(ctx, engine, b)
    memo = ctx.stage_dir / "metrics.json"
    args = (ctx, exp, q, b) if engine else (ctx, exp, q)
    key = _metrics_key(*args[:3], engine) if engine else _metrics_key(ctx, exp, q)
    cached = json.loads(memo.read_text()) if memo.is_file() else {}
    if cached.get("key") == key:
        metrics, tokens = cached["metrics"], cached["tokens"]
    else:
        metrics, tokens = measure(*args)
        metrics = strict_jsonable(metrics)  # NaN/inf -> null + <metric>_reason, as the cache holds them
        write_json_atomic(memo, {"key": key, "metrics": metrics, "tokens": tokens}, strict=True)
    if engine:
        write_text_atomic(ctx.stage_dir / COMPARISON_FILE, comparison_markdown(metrics))
    gates = evaluate_gates(ctx.recipe.validate_.gates, metrics, prefix=ENGINE if engine else "")
    return ValidationArtifact(metrics, gates, tokens)


def engine_path(b: BuildArtifact | None) -> str | None:
    """The built engine's path, or None when the build made none (skipped)."""
    return b.engine_path if b is not None and b.status == "ok" and b.engine_path else None


def _check_bf16(ctx: StageContext, engine: str | None, b: BuildArtifact | None) -> None:
    rest = getattr(ctx.recipe.quantize, "rest_precision", "fp32")
    if rest == "bf16" and engine is None:
        why = b.reason if b is not None else "no build stage"
        raise RecipeError(
            "quantize.rest_precision: bf16 is validated only through a TensorRT engine (ONNX Runtime's CPU "
            f"provider lacks BF16 kernels), and no engine was built ({why}); use fp16 here, or build on a GPU")


def measure(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact,
            b: BuildArtifact | None = None) -> tuple[dict, dict]:
    """Metrics and greedy tokens for the recipe's model kind; ``engine.*`` ones too
    when ``b`` holds an engine, and ``validated_artifact`` saying what was measured."""
    engine = engine_path(b)
    runner = runners.tensorrt_runner(engine) if engine else None
    if ctx.recipe.model.kind == "causal-lm":
        metrics, tokens = llm_metrics(ctx, exp, q, runner)
    else:
        from pipeline.models.encoder import encoder_metrics

        metrics, tokens = encoder_metrics(ctx, exp, q), {}
        if runner is not None:
            metrics.update(encoder_engine_metrics(ctx, exp, q, runner))
    if runner is None:
        metrics["validated_artifact"] = (f"ONNX graph {q.onnx_path} in ONNX Runtime: no TensorRT engine was built, "
                                         "so this graph is what gets served")
    else:
        metrics["validated_artifact"] = (f"TensorRT engine {engine} ({runner.name}): gates use the engine.* metrics; "
                                         "ONNX Runtime's numbers of the same graph are shown beside them")
    return metrics, tokens


def encoder_engine_metrics(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact,
                           runner: runners.Runner) -> dict:
    """The encoder eval of :func:`pipeline.models.encoder.encoder_metrics` with the engine as
    the candidate (FP32 reference in ONNX Runtime); keys prefixed ``engine.``."""
    from pipeline.models import encoder

    v = ctx.recipe.validate_
    tok = registry.load_tokenizer(exp.tokenizer_dir)
    sentences = encoder.held_out_sentences(data.load_documents(v.dataset, v.split), v.max_windows)
    models = {"reference": ort_session(exp.onnx_path), "candidate": runners.SessionView(runner)}
    with ctx.progress.step("validate: word similarity + cosine (engine)"):
        res = encoder.similarity_metrics(models, tok, sentences, v.batch_size, v.seq_len)
    flat = encoder._flatten(res, q.precision, len(sentences))
    return {f"{ENGINE}{k}": val for k, val in flat.items() if not k.endswith("_fp32")}


def comparison_markdown(metrics: dict) -> str:
    """A table of every metric measured both ways: ONNX Runtime beside the engine."""
    rows = ["| metric | ONNX Runtime | TensorRT engine |", "|---|---|---|"]
    for key, value in metrics.items():
        if key.startswith(ENGINE) and not key.endswith("_reason"):
            base = key[len(ENGINE):]
            rows.append(f"| {base} | {_cell(metrics.get(base))} | {_cell(value)} |")
    return "# ONNX Runtime and the TensorRT engine, same eval\n\n" + "\n".join(rows) + "\n"


def _cell(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _metrics_key(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact, engine: str | None = None) -> str:
    """Everything the metrics depend on; the gates are left out, so a gate-only
    change re-evaluates the gates without re-measuring."""
    cfg = {"validate": ctx.recipe.validate_.model_dump(mode="json", exclude={"gates"}),
           "quantize": ctx.recipe.quantize.model_dump(mode="json")}  # naive baselines re-calibrate
    parts = [json.dumps(cfg, sort_keys=True), sha256_file(exp.onnx_path), sha256_file(q.onnx_path), q.precision,
             code_hash(), sha256_file(engine) if engine else "no engine"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def evaluate_gates(gates: Gates, metrics: dict, prefix: str = "") -> list[GateResult]:
    """One GateResult per gate the recipe sets, on metric ``prefix + <metric>``
    (``engine.`` where an engine ships); a metric with no finite value
    (``null`` with a ``<metric>_reason``) fails its gate with value NaN.

    Raises:
        RecipeError: the gate's metric was not measured.
    """
    out = []
    for field, bound in gates.model_dump().items():
        if bound is None:
            continue
        metric, op = GATE_METRICS[field]
        metric = prefix + metric
        if metric not in metrics:
            raise RecipeError(f"validate.gates.{field}: needs metric {metric!r}, which this model kind does not produce")
        value = math.nan if metrics[metric] is None else float(metrics[metric])
        passed = value <= bound if op == "<=" else value >= bound
        out.append(GateResult(field, metric, value, float(bound), op, bool(passed and math.isfinite(value))))
    return out


def mean_nll(logits: np.ndarray, ids: np.ndarray, context: int = 1) -> tuple[float, int]:
    """Summed next-token negative log-likelihood (nats) and token count.

    Args:
        logits: float32 ``[batch, seq, vocab]``.
        ids: int64 ``[batch, seq]``; position t predicts token t+1.
        context: leading tokens of each row that are never scored (at least 1:
            the first token has no prediction; a BOS prefix is context only).

    Raises:
        ValueError: ``context`` is below 1 or leaves nothing to score.
    """
    if not 1 <= context < ids.shape[1]:
        raise ValueError(f"context={context} must be in [1, {ids.shape[1]}) for windows of {ids.shape[1]} tokens")
    total, count = 0.0, 0
    for row, tokens in zip(logits, ids):  # one row at a time keeps float64 copies small
        lg = row[context - 1 : -1].astype(np.float64)
        picked = np.take_along_axis(lg, tokens[context:, None], axis=-1)[:, 0]
        nll = logsumexp(lg, axis=-1) - picked
        total, count = total + float(nll.sum()), count + int(nll.size)
    return total, count


def perplexity(run_logits, windows: np.ndarray, batch: int, progress, label: str, context: int = 1) -> float:
    """``exp(mean NLL)`` over all windows (Jelinek et al., 1977; the usual LM metric);
    ``context`` as in :func:`mean_nll`.

    Raises:
        AccuracyError: NaN logits from the reference model.
    """
    total, count = 0.0, 0
    starts = list(range(0, len(windows), batch))
    for i in progress.track(starts, f"validate: perplexity ({label})"):
        logits = run_logits(windows[i : i + batch])
        if label == "fp32" and np.isnan(logits).any():
            raise AccuracyError("validate: the FP32 reference produced NaN logits")
        s, n = mean_nll(logits, windows[i : i + batch], context)
        total, count = total + s, count + n
    return math.exp(total / count) if math.isfinite(total) else math.inf


def llm_metrics(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact,
                engine: runners.Runner | None = None) -> tuple[dict, dict]:
    """Perplexity (and greedy agreement) of FP32 and the optimized graph in ONNX Runtime;
    with ``engine``, the engine's as ``engine.*`` against the same FP32 reference."""
    v = ctx.recipe.validate_
    tok = registry.load_tokenizer(exp.tokenizer_dir)
    docs = data.load_documents(v.dataset, v.split)
    windows = data.token_windows(tok, docs, v.seq_len, v.max_windows)
    if len(windows) == 0:
        raise AccuracyError(f"validate.split gives no window of {v.seq_len} tokens; nothing would be compared")
    layout = layout_from_specs(exp.inputs, exp.outputs)
    # ONNX Runtime sessions, and the engine seen as one: run(names, feeds) -> list
    sessions: dict = {"fp32": ort_session(exp.onnx_path), q.precision: ort_session(q.onnx_path)}
    if engine is not None:
        sessions[ENGINE] = runners.SessionView(engine)
    conv = data.window_convention(tok, v.seq_len)
    context = v.seq_len - conv["scored_per_window"]
    metrics: dict = {"eval_windows": len(windows), "eval_tokens": len(windows) * conv["scored_per_window"],
                     "perplexity_convention": convention_text(conv)}
    for label, sess in sessions.items():
        logits_of = lambda ids, s=sess: s.run(["logits"], prefill_feeds(exp, ids))[0]  # noqa: E731
        key = f"{ENGINE}perplexity_{q.precision}" if label == ENGINE else f"perplexity_{label}"
        metrics[key] = perplexity(logits_of, windows, v.batch_size, ctx.progress, label, context)
    ref, cand = metrics["perplexity_fp32"], metrics[f"perplexity_{q.precision}"]
    metrics["relative_perplexity_increase"] = (cand - ref) / ref
    if engine is not None:
        metrics[f"{ENGINE}relative_perplexity_increase"] = (metrics[f"{ENGINE}perplexity_{q.precision}"] - ref) / ref
    tokens: dict = {}
    if v.generation is not None:
        metrics.update(_greedy(ctx, tok, docs, layout, {k: s for k, s in sessions.items() if k != ENGINE}, tokens))
        if engine is not None:
            engine_tokens: dict = {"fp32": tokens["fp32"]}
            metrics.update(_greedy(ctx, tok, docs, layout, {ENGINE: sessions[ENGINE]}, engine_tokens, prefix=ENGINE))
            tokens["engine"] = engine_tokens[ENGINE]
    return metrics, tokens


def convention_text(conv: dict) -> str:
    """One line naming the perplexity convention of :func:`pipeline.data.window_convention`."""
    bos = "yes (prepended to each window, context only)" if conv["bos"] else "no (the tokenizer adds none)"
    return (f"token-level exp(mean next-token NLL); non-overlapping windows of {conv['window_tokens']} tokens, "
            f"stride {conv['stride_tokens']} text tokens, documents joined by EOS; "
            f"{conv['scored_per_window']} scored tokens per window; BOS: {bos}")


def _greedy(ctx, tok, docs, layout, sessions: dict, tokens: dict, prefix: str = "") -> dict:
    """Greedy tokens of each runner into ``tokens``; agreement of the last one with
    ``tokens["fp32"]`` (measured here when "fp32" is among ``sessions``)."""
    gen = ctx.recipe.validate_.generation
    prompt_ids = data.prompts(tok, docs, gen.prompts)
    tokens["prompt_ids"] = prompt_ids.tolist()
    for label, sess in sessions.items():
        with ctx.progress.step(f"validate: greedy generation ({label}, {gen.prompts} x {gen.new_tokens} tokens)"):
            # One prompt at a time, as the served generation model runs: batched
            # FP8 kernels can flip near-tie argmaxes and the tokens would differ.
            names = ["logits", *layout.present_names()]
            step = lambda f, s=sess: s.run(names, f)  # noqa: E731
            out = np.concatenate([greedy_generate(step, layout, p[None], gen.new_tokens) for p in prompt_ids])
        tokens[label] = out.tolist()
    ref, cand = np.asarray(tokens["fp32"]), np.asarray(tokens[list(sessions)[-1]])
    same = ref == cand
    common = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
    return {
        f"{prefix}token_agreement": float(same.mean()),
        f"{prefix}prompts_identical": int(same.all(1).sum()),
        f"{prefix}mean_common_prefix_tokens": float(common.mean()),
        **({} if prefix else {"generation_prompts": int(same.shape[0]), "generation_new_tokens": int(same.shape[1])}),
    }
