"""Text-generation metrics: perplexity of the FP32 reference and the candidate on
held-out token windows, and greedy-generation agreement (token ids per prompt).

Metric names (``validate/metrics.json``): ``perplexity_fp32``,
``perplexity_<precision>``, ``relative_perplexity_increase`` (fraction),
``token_agreement`` (fraction of generated positions equal to FP32's),
``prompts_identical``, ``mean_common_prefix_tokens``, ``eval_windows``,
``eval_tokens``, ``perplexity_convention``; ``engine.<name>`` where an engine ran.
Against FP32 (not the engine): :data:`pipeline.metrics.llm_quality.QUALITY_KEYS`
(perplexity ratio and its stderr, KL divergence, teacher-forced top-1, delta p);
``speedup_vs_fp32`` (a prefill of one validate window) and ``decode_speedup_vs_fp32`` (one decode
step at batch 1 after a past of ``validate.seq_len`` tokens), with their context and spread
(:mod:`pipeline.metrics.speed`). Standard errors (:mod:`pipeline.metrics.uncertainty`), ``<metric>_stderr``:
``relative_perplexity_increase`` (= the perplexity ratio's: the increase is ratio - 1)
and its ``engine.`` twin by a paired bootstrap over eval windows; ``token_agreement``
by a bootstrap over greedy prompts; ``stderr_basis`` says what each rests on.
"""
from __future__ import annotations

import math

import numpy as np

from pipeline.models import text as text_data
from pipeline.runners import base as runners
from pipeline.errors import AccuracyError
from pipeline.metrics import llm_quality, speed, uncertainty
from pipeline.models.base import ENGINE_PREFIX as ENGINE
from pipeline.models.text_generation.model import greedy_generate, layout_from_specs, prefill_feeds, sample_feeds
from pipeline.recipe.precisions import REFERENCE
from pipeline.sources.model import load_tokenizer
from pipeline.recipe.gates import BASIS_KEY

def mean_nll(logits: np.ndarray, ids: np.ndarray, context: int = 1, rows: list | None = None) -> tuple[float, int]:
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
        nll = llm_quality.logsumexp64(lg) - picked
        total, count = total + float(nll.sum()), count + int(nll.size)
        if rows is not None:
            rows.append(float(nll.sum()))
    return total, count


def perplexity(run_logits, windows: np.ndarray, batch: int, progress, label: str, context: int = 1,
               rows: list | None = None) -> float:
    """``exp(mean NLL)`` over all windows (Jelinek et al., 1977; the usual LM metric);
    ``context`` and ``rows`` (per-window NLL sums, appended) as in :func:`mean_nll`.

    Raises:
        AccuracyError: NaN logits from the reference model.
    """
    total, count = 0.0, 0
    starts = list(range(0, len(windows), batch))
    for i in progress.track(starts, f"validate: perplexity ({label})"):
        logits = run_logits(windows[i : i + batch])
        if label == REFERENCE and np.isnan(logits).any():
            raise AccuracyError("validate: the FP32 reference produced NaN logits")
        s, n = mean_nll(logits, windows[i : i + batch], context, rows)
        total, count = total + s, count + n
    return math.exp(total / count) if math.isfinite(total) else math.inf


def llm_metrics(ctx, exp, q, engine: runners.Runner | None = None, reference: runners.Runner | None = None,
                candidate: runners.Runner | None = None) -> tuple[dict, dict]:
    """Perplexity (and greedy agreement) of the FP32 reference and the optimized graph;
    with ``engine``, the engine's as ``engine.*`` against the same FP32 reference.

    Args:
        ctx: the validate stage context (``recipe.validate``: split, seq_len, max_windows, batch_size, generation).
        exp, q: the export and quantize artifacts.
        reference, candidate: runners (default: both graphs in ONNX Runtime).

    Returns:
        ``(metrics, tokens)``: see the module docstring; ``tokens`` holds
        ``prompt_ids`` and the greedy ids per label (int lists ``[prompts, new_tokens]``).

    Raises:
        AccuracyError: no window of ``seq_len`` tokens, or NaN logits from the reference.
    """
    v = ctx.recipe.validate_
    tok = load_tokenizer(exp.tokenizer_dir)
    docs = text_data.documents(v.data)
    windows = text_data.token_windows(tok, docs, v.seq_len, v.max_windows)
    if len(windows) == 0:
        raise AccuracyError(f"validate.data: {v.data.describe()} gives no window of {v.seq_len} tokens (validate.seq_len); "
                            "nothing would be compared")
    layout = layout_from_specs(exp.inputs, exp.outputs)
    # ONNX Runtime sessions, and the engine seen as one: run(names, feeds) -> list
    reference = reference or runners.OrtRunner(exp.onnx_path)
    candidate = candidate or runners.OrtRunner(q.ort_path, user_graph=not q.quantized_nodes)
    sessions: dict = {REFERENCE: runners.SessionView(reference), q.precision: runners.SessionView(candidate)}
    if engine is not None:
        sessions[ENGINE] = runners.SessionView(engine)
    conv = text_data.window_convention(tok, v.seq_len)
    context = v.seq_len - conv["scored_per_window"]
    metrics: dict = {"eval_windows": len(windows), "eval_tokens": len(windows) * conv["scored_per_window"],
                     "perplexity_convention": convention_text(conv)}
    logits_of = {label: (lambda ids, s=sess: s.run(["logits"], prefill_feeds(exp, ids))[0])  # noqa: E731
                 for label, sess in sessions.items()}
    # both graphs per window batch, into one accumulator (pipeline.metrics.llm_quality)
    acc = llm_quality.QualityAccumulator(context)
    metrics["perplexity_fp32"], metrics[f"perplexity_{q.precision}"], stats = llm_quality.paired_perplexity(
        logits_of[REFERENCE], logits_of[q.precision], windows, v.batch_size, ctx.progress, q.precision, context, acc)
    metrics.update(stats)
    metrics.update(llm_prefill_speedup(exp, q.precision, reference, candidate, windows[:1]))
    metrics.update(llm_decode_speedup(exp, q.precision, reference, candidate, past=v.seq_len))
    engine_rows: list[float] = []
    if engine is not None:
        metrics[f"{ENGINE}perplexity_{q.precision}"] = perplexity(
            logits_of[ENGINE], windows, v.batch_size, ctx.progress, ENGINE, context, engine_rows)
    ref, cand = metrics["perplexity_fp32"], metrics[f"perplexity_{q.precision}"]
    metrics["relative_perplexity_increase"] = (cand - ref) / ref
    # (cand - ref) / ref = ratio - 1, so it has the perplexity ratio's standard error
    metrics["relative_perplexity_increase_stderr"] = stats["perplexity_ratio_stderr"]
    basis = acc.basis()
    basis.update({"relative_perplexity_increase": basis["perplexity_ratio"]} if basis else {})
    if engine is not None:
        metrics[f"{ENGINE}relative_perplexity_increase"] = (metrics[f"{ENGINE}perplexity_{q.precision}"] - ref) / ref
        metrics.update(_engine_stderr(acc, engine_rows, basis))
    tokens: dict = {}
    if v.generation is not None:
        metrics.update(_greedy(ctx, tok, docs, layout, {k: s for k, s in sessions.items() if k != ENGINE}, tokens))
        if engine is not None:
            engine_tokens: dict = {REFERENCE: tokens[REFERENCE]}
            metrics.update(_greedy(ctx, tok, docs, layout, {ENGINE: sessions[ENGINE]}, engine_tokens, prefix=ENGINE))
            tokens["engine"] = engine_tokens[ENGINE]
        prompts, new = metrics["generation_prompts"], metrics["generation_new_tokens"]
        if prompts >= 2:
            rec = uncertainty.basis(prompts * new, "generated tokens", prompts, "greedy prompts")
            basis.update({f"{p}token_agreement": rec for p in ("", ENGINE) if f"{p}token_agreement" in metrics})
    metrics[BASIS_KEY] = basis
    return metrics, tokens


def _engine_stderr(acc, engine_rows: list[float], basis: dict) -> dict:
    """``engine.relative_perplexity_increase_stderr``: the paired bootstrap over windows of
    the engine's per-window NLL sums against the reference's in ``acc`` (same windows, same
    order); adds its record to ``basis``. None with fewer than 2 windows."""
    key = f"{ENGINE}relative_perplexity_increase"
    if acc.windows < 2:
        return {f"{key}_stderr": None}
    d = np.asarray(engine_rows) - acc.window_sums("nll_ref")
    basis[key] = basis["perplexity_ratio"]
    return {f"{key}_stderr": uncertainty.ratio_of_sums_stderr(d, acc.window_tokens(), np.exp)}


def convention_text(conv: dict) -> str:
    """One line naming the perplexity convention of :func:`pipeline.models.text.window_convention`."""
    bos = "yes (prepended to each window, context only)" if conv["bos"] else "no (the tokenizer adds none)"
    return (f"token-level exp(mean next-token NLL); non-overlapping windows of {conv['window_tokens']} tokens, "
            f"stride {conv['stride_tokens']} text tokens, documents joined by EOS; "
            f"{conv['scored_per_window']} scored tokens per window; BOS: {bos}")


def _greedy(ctx, tok, docs, layout, sessions: dict, tokens: dict, prefix: str = "") -> dict:
    """Greedy tokens of each runner into ``tokens``; agreement of the last one with
    ``tokens[REFERENCE]`` (measured here when REFERENCE is among ``sessions``)."""
    gen = ctx.recipe.validate_.generation
    prompt_ids = text_data.prompts(tok, docs, gen.prompts)
    tokens["prompt_ids"] = prompt_ids.tolist()
    for label, sess in sessions.items():
        with ctx.progress.step(f"validate: greedy generation ({label}, {gen.prompts} x {gen.new_tokens} tokens)"):
            # One prompt at a time, as the served generation model runs: batched
            # FP8 kernels can flip near-tie argmaxes and the tokens would differ.
            names = ["logits", *layout.present_names()]
            step = lambda f, s=sess: s.run(names, f)  # noqa: E731
            out = np.concatenate([greedy_generate(step, layout, p[None], gen.new_tokens) for p in prompt_ids])
        tokens[label] = out.tolist()
    ref, cand = np.asarray(tokens[REFERENCE]), np.asarray(tokens[list(sessions)[-1]])
    same = ref == cand
    common = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
    return {
        f"{prefix}token_agreement": float(same.mean()),
        **_agreement_stderr(same, prefix),
        f"{prefix}prompts_identical": int(same.all(1).sum()),
        f"{prefix}mean_common_prefix_tokens": float(common.mean()),
        **({} if prefix else {"generation_prompts": int(same.shape[0]), "generation_new_tokens": int(same.shape[1])}),
    }


def _agreement_stderr(same: np.ndarray, prefix: str) -> dict:
    """``token_agreement_stderr``: bootstrap over prompts of the greedy agreement
    (``same``: bool ``[prompts, new_tokens]``), None for a single prompt."""
    key = f"{prefix}token_agreement"
    if same.shape[0] < 2:
        return {f"{key}_stderr": None}
    se = uncertainty.ratio_of_sums_stderr(same.sum(1), np.full(same.shape[0], float(same.shape[1])))
    return {f"{key}_stderr": se}


def llm_prefill_speedup(exp, precision: str, reference, candidate, ids, runs: int = 5) -> dict:
    """:func:`pipeline.metrics.speed.speedup_metrics` of one prefill (``logits`` only) of
    token ids int64 ``[batch, seq]``.

    Args:
        exp: the export artifact (graph I/O, for the empty KV cache).
        reference, candidate: :class:`pipeline.runners.base.Runner` (ONNX Runtime in validate).

    Returns:
        :func:`~pipeline.metrics.speed.speedup_metrics`; ``speedup_vs_fp32`` None with
        ``speedup_vs_fp32_reason`` where either runner is not an ONNX Runtime session (nothing served is timed).
    """
    cand_level = speed.session_level(candidate)
    if speed.session_level(reference) is None or cand_level is None:
        return {"speedup_vs_fp32": None,
                "speedup_vs_fp32_reason": "timed only when both graphs run in ONNX Runtime sessions"}
    level, providers = cand_level
    feeds = prefill_feeds(exp, ids)
    ref, cand = runners.SessionView(reference), speed.timed_view(candidate, runners.SessionView(candidate))
    return speed.speedup_metrics(lambda: ref.run(["logits"], feeds), lambda: cand.run(["logits"], feeds),
                                 shape=f"prefill batch {ids.shape[0]} x {ids.shape[1]} tokens", precision=precision,
                                 level=level, providers=providers, runs=runs)


def llm_decode_speedup(exp, precision: str, reference, candidate, past: int, runs: int = 5) -> dict:
    """``decode_speedup_vs_fp32`` and its ``decode_`` context (:func:`pipeline.metrics.speed.speedup_metrics`)
    of one decode step: batch 1, one new token after ``past`` positions of random K/V (``logits`` only),
    the step a served generation repeats per token (TPOT on a CPU). About ``2 * (runs + 1)`` steps:
    SmolLM2-135M at past 256, ~4 s on two shared cores.

    Returns:
        ``decode_speedup_vs_fp32`` None with ``decode_speedup_vs_fp32_reason`` where either runner is not an
        ONNX Runtime session, or the graph has no KV cache inputs.
    """
    cand_level = speed.session_level(candidate)
    layout = layout_from_specs(exp.inputs, exp.outputs)
    if speed.session_level(reference) is None or cand_level is None or not layout.past_names():
        return {"decode_speedup_vs_fp32": None,
                "decode_speedup_vs_fp32_reason": "timed only when both graphs run in ONNX Runtime sessions with a KV cache"}
    level, providers = cand_level
    feeds = sample_feeds(layout, 1, 1, past)
    ref, cand = runners.SessionView(reference), speed.timed_view(candidate, runners.SessionView(candidate))
    return speed.speedup_metrics(lambda: ref.run(["logits"], feeds), lambda: cand.run(["logits"], feeds),
                                 shape=f"decode step, batch 1, 1 token after a past of {past}", precision=precision,
                                 level=level, providers=providers, runs=runs, prefix="decode_")
