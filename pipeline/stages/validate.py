"""Stage 4, validate: accuracy of the optimized model against the FP32
reference, both run in ONNX Runtime, and the recipe's gates."""
from __future__ import annotations

import hashlib
import json
import math

import numpy as np
from scipy.special import logsumexp

from pipeline import data
from pipeline.artifacts import ExportArtifact, GateResult, QuantizedArtifact, ValidationArtifact
from pipeline.context import StageContext
from pipeline.errors import AccuracyError, RecipeError
from pipeline.manifest import code_hash, sha256_file, strict_jsonable, write_json_atomic
from pipeline.models import registry
from pipeline.models.llm import greedy_generate, layout_from_specs, prefill_feeds
from pipeline.recipe import Gates
from pipeline.runtime import ort_session

# gate field -> (metric name, comparison)
GATE_METRICS = {
    "max_relative_perplexity_increase": ("relative_perplexity_increase", "<="),
    "min_token_agreement": ("token_agreement", ">="),
    "max_spearman_drop": ("spearman_drop_max", "<="),
    "min_mean_cosine": ("mean_cosine", ">="),
}


def run(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact) -> ValidationArtifact:
    """Measure, then gate. Never raises on a failed gate: the runner decides the exit code.

    Raises:
        AccuracyError: the FP32 reference produced NaN (broken reference or input).
        RecipeError: a gate asks for a metric this model kind does not produce.
    """
    memo = ctx.stage_dir / "metrics.json"
    key = _metrics_key(ctx, exp, q)
    cached = json.loads(memo.read_text()) if memo.is_file() else {}
    if cached.get("key") == key:
        metrics, tokens = cached["metrics"], cached["tokens"]
    else:
        metrics, tokens = measure(ctx, exp, q)
        metrics = strict_jsonable(metrics)  # NaN/inf -> null + <metric>_reason, as the cache holds them
        write_json_atomic(memo, {"key": key, "metrics": metrics, "tokens": tokens}, strict=True)
    return ValidationArtifact(metrics, evaluate_gates(ctx.recipe.validate_.gates, metrics), tokens)


def measure(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact) -> tuple[dict, dict]:
    """Metrics and greedy tokens for the recipe's model kind."""
    if ctx.recipe.model.kind == "causal-lm":
        return llm_metrics(ctx, exp, q)
    from pipeline.models.encoder import encoder_metrics

    return encoder_metrics(ctx, exp, q), {}


def _metrics_key(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact) -> str:
    """Everything the metrics depend on; the gates are left out, so a gate-only
    change re-evaluates the gates without re-measuring."""
    cfg = {"validate": ctx.recipe.validate_.model_dump(mode="json", exclude={"gates"}),
           "quantize": ctx.recipe.quantize.model_dump(mode="json")}  # naive baselines re-calibrate
    parts = [json.dumps(cfg, sort_keys=True), sha256_file(exp.onnx_path), sha256_file(q.onnx_path), q.precision,
             code_hash()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def evaluate_gates(gates: Gates, metrics: dict) -> list[GateResult]:
    """One GateResult per gate the recipe sets; a metric with no finite value
    (``null`` with a ``<metric>_reason``) fails its gate with value NaN.

    Raises:
        RecipeError: the gate's metric was not measured.
    """
    out = []
    for field, bound in gates.model_dump().items():
        if bound is None:
            continue
        metric, op = GATE_METRICS[field]
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


def llm_metrics(ctx: StageContext, exp: ExportArtifact, q: QuantizedArtifact) -> tuple[dict, dict]:
    v = ctx.recipe.validate_
    tok = registry.load_tokenizer(exp.tokenizer_dir)
    docs = data.load_documents(v.dataset, v.split)
    windows = data.token_windows(tok, docs, v.seq_len, v.max_windows)
    if len(windows) == 0:
        raise AccuracyError(f"validate.split gives no window of {v.seq_len} tokens; nothing would be compared")
    layout = layout_from_specs(exp.inputs, exp.outputs)
    sessions = {"fp32": ort_session(exp.onnx_path), q.precision: ort_session(q.onnx_path)}
    conv = data.window_convention(tok, v.seq_len)
    context = v.seq_len - conv["scored_per_window"]
    metrics: dict = {"eval_windows": len(windows), "eval_tokens": len(windows) * conv["scored_per_window"],
                     "perplexity_convention": convention_text(conv)}
    for label, sess in sessions.items():
        logits_of = lambda ids, s=sess: s.run(["logits"], prefill_feeds(exp, ids))[0]  # noqa: E731
        metrics[f"perplexity_{label}"] = perplexity(logits_of, windows, v.batch_size, ctx.progress, label, context)
    ref, cand = metrics["perplexity_fp32"], metrics[f"perplexity_{q.precision}"]
    metrics["relative_perplexity_increase"] = (cand - ref) / ref
    tokens: dict = {}
    if v.generation is not None:
        metrics.update(_greedy(ctx, tok, docs, layout, sessions, tokens))
    return metrics, tokens


def convention_text(conv: dict) -> str:
    """One line naming the perplexity convention of :func:`pipeline.data.window_convention`."""
    bos = "yes (prepended to each window, context only)" if conv["bos"] else "no (the tokenizer adds none)"
    return (f"token-level exp(mean next-token NLL); non-overlapping windows of {conv['window_tokens']} tokens, "
            f"stride {conv['stride_tokens']} text tokens, documents joined by EOS; "
            f"{conv['scored_per_window']} scored tokens per window; BOS: {bos}")


def _greedy(ctx, tok, docs, layout, sessions, tokens: dict) -> dict:
    gen = ctx.recipe.validate_.generation
    prompt_ids = data.prompts(tok, docs, gen.prompts)
    tokens["prompt_ids"] = prompt_ids.tolist()
    for label, sess in sessions.items():
        with ctx.progress.step(f"validate: greedy generation ({label}, {gen.prompts} x {gen.new_tokens} tokens)"):
            # One prompt at a time, as the served generation model runs: batched
            # FP8 kernels can flip near-tie argmaxes and the tokens would differ.
            step = lambda f, s=sess: s.run(None, f)  # noqa: E731
            out = np.concatenate([greedy_generate(step, layout, p[None], gen.new_tokens) for p in prompt_ids])
        tokens[label] = out.tolist()
    ref, cand = (np.asarray(tokens[k]) for k in sessions)
    same = ref == cand
    prefix = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
    return {
        "token_agreement": float(same.mean()),
        "prompts_identical": int(same.all(1).sum()),
        "mean_common_prefix_tokens": float(prefix.mean()),
        "generation_prompts": int(same.shape[0]),
        "generation_new_tokens": int(same.shape[1]),
    }
