"""Sentence-embedding metrics: Spearman correlation between the cosine similarity of
embedded word pairs and human scores (WordSim353, SimLex-999), for FP32 and the
candidate; the drop in points (x100); the mean FP32-vs-candidate cosine on held-out
sentences; and the same numbers for ONNX Runtime's ``quantize_static`` defaults
(``naive_ort_*``), calibrated on the quantize stage's own calibration feeds.
"""
from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Iterator, Sequence

import numpy as np
from onnxruntime.quantization import CalibrationDataReader

from pipeline.runners import base as runners
from pipeline.errors import AccuracyError
from pipeline.models.base import add_engine_metrics
from pipeline.models.sentence_embedding.model import INPUTS, OUTPUT, only
from pipeline.recipe.precisions import facts
from pipeline.sources.model import load_tokenizer

WORD_SETS = ("wordsim353", "simlex999")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


def tokenize(tok, texts: list[str], max_len: int, names: Sequence[str] = INPUTS,
             pad_to_max: bool = False) -> dict[str, np.ndarray]:
    """Tokenizer feeds (with [CLS]/[SEP], padded to the longest, or to ``max_len`` with
    ``pad_to_max``, truncated at ``max_len``).

    Returns int64 ``[len(texts), S]`` arrays for the graph inputs ``names`` (of ``INPUTS``).
    """
    enc = tok(texts, padding="max_length" if pad_to_max else True, truncation=True, max_length=max_len,
              return_tensors="np")
    ids = enc["input_ids"].astype(np.int64)
    types = enc.get("token_type_ids")
    return only({"input_ids": ids, "attention_mask": enc["attention_mask"].astype(np.int64),
                 "token_type_ids": np.zeros_like(ids) if types is None else types.astype(np.int64)}, names)


def embed(sess, tok, texts: list[str], batch: int, max_len: int, names: Sequence[str] = INPUTS) -> np.ndarray:
    """Embeddings of ``texts`` from an ORT session with inputs ``names``: float32 ``[len(texts), H]``."""
    out = [sess.run([OUTPUT], tokenize(tok, texts[i : i + batch], max_len, names))[0]
           for i in range(0, len(texts), batch)]
    return np.concatenate(out, axis=0)


def row_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of matching rows of two float ``[N, H]`` arrays: float64 ``[N]``."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norm = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return (a * b).sum(1) / np.maximum(norm, 1e-12)


def held_out_sentences(docs: list[str], limit: int, min_chars: int = 20) -> list[str]:
    """Up to ``limit`` sentences (at least ``min_chars`` characters) of ``docs``, in order.

    Raises:
        AccuracyError: the documents give no sentence.
    """
    out = [s for d in docs for s in _SENTENCE_END.split(d) if len(s) >= min_chars][:limit]
    if not out:
        raise AccuracyError("validate.data gives no sentence; nothing would be compared")
    return out


def word_vectors(sess, tok, words: list[str], batch: int, names: Sequence[str] = INPUTS) -> dict[str, np.ndarray]:
    """Embedding (float32 ``[H]``) of each word, embedded alone as ``[CLS] word [SEP]``."""
    vecs = embed(sess, tok, words, batch, 32, names)
    return dict(zip(words, vecs))


def pair_cosines(vectors: dict[str, np.ndarray], pairs: list[tuple[str, str]]) -> np.ndarray:
    """Cosine of each word pair's two embeddings: float64 ``[len(pairs)]``."""
    a = np.stack([vectors[x] for x, _ in pairs])
    b = np.stack([vectors[y] for _, y in pairs])
    return row_cosine(a, b)


def pair_spearman(vectors: dict[str, np.ndarray], pairs: list[tuple[str, str]], human: np.ndarray) -> float:
    """Spearman rho between pair cosines and human scores (float64 ``[n]``); NaN when a
    cosine is not finite (a broken candidate model)."""
    from scipy.stats import spearmanr

    cos = pair_cosines(vectors, pairs)
    return float(spearmanr(cos, human).statistic) if np.isfinite(cos).all() else math.nan


def _one_model(sess, tok, sets: dict, sentences: list[str], batch: int, max_len: int,
               names: Sequence[str]) -> tuple[dict, np.ndarray]:
    """Spearman and pair cosines (``cosines_<set>``) per word set and the count of
    non-finite embedding rows (words and sentences) for one session; also the
    sentence embeddings, float32 ``[N, H]``."""
    words = sorted({w for pairs, _ in sets.values() for p in pairs for w in p})
    vecs = word_vectors(sess, tok, words, batch, names)
    res: dict = {f"spearman_{n}": pair_spearman(vecs, pairs, human) for n, (pairs, human) in sets.items()}
    res.update({f"cosines_{n}": pair_cosines(vecs, pairs) for n, (pairs, _) in sets.items()})
    res["human_scores"] = {n: np.asarray(human, np.float64) for n, (_, human) in sets.items()}
    emb = embed(sess, tok, sentences, batch, max_len, names)
    bad_words = int((~np.isfinite(np.stack(list(vecs.values())))).any(1).sum())
    res["nonfinite_rows"] = bad_words + int((~np.isfinite(emb)).any(1).sum())
    return res, emb


def similarity_metrics(sessions: dict, tok, sentences: list[str], batch: int, max_len: int,
                       names: Sequence[str] = INPUTS) -> dict[str, dict]:
    """Per label of ``sessions`` (the first is the FP32 reference; all with the graph inputs
    ``names``): Spearman per word set,
    non-finite row count and, for the others, mean / min cosine to the reference on
    ``sentences`` (a non-finite row counts as cosine -1).

    Returns ``{label: {"spearman_<set>": rho, "nonfinite_rows": n, "mean_cosine": c, "min_cosine": c}}``,
    plus the per-item values the bootstrap needs: ``cosines_<set>`` (float64 ``[pairs]``),
    ``human_scores`` (``{set: [pairs]}``) and, for the others, ``sentence_cosines`` (``[N]``).

    Raises:
        AccuracyError: the reference embeddings hold NaN or Inf.
    """
    from pipeline.models import text as text_data

    sets = {name: text_data.word_pairs(name) for name in WORD_SETS}
    out: dict[str, dict] = {}
    ref = None
    for label, sess in sessions.items():
        res, emb = _one_model(sess, tok, sets, sentences, batch, max_len, names)
        if ref is None:
            if res["nonfinite_rows"]:
                raise AccuracyError(f"validate: the FP32 reference produced {res['nonfinite_rows']} non-finite embeddings")
            ref = emb
        else:
            cos = np.nan_to_num(row_cosine(ref, emb), nan=-1.0)
            res.update(mean_cosine=float(cos.mean()), min_cosine=float(cos.min()), sentence_cosines=cos)
        out[label] = res
    return out


def drop_points(ref: dict, cand: dict) -> dict[str, float]:
    """Spearman drop per word set in points (``100 * (ref - cand)``) and their max (NaN if any is)."""
    drops = {f"spearman_drop_{n}": 100.0 * (ref[f"spearman_{n}"] - cand[f"spearman_{n}"]) for n in WORD_SETS}
    return {**drops, "spearman_drop_max": float(np.max(list(drops.values())))}


def _rank_rows(x: np.ndarray) -> np.ndarray:
    """Average ranks along the last axis (ties share their mean rank, as Spearman's rho)."""
    from scipy.stats import rankdata

    return rankdata(x, axis=-1)


def _rowwise_spearman(cos: np.ndarray, human_ranks: np.ndarray) -> np.ndarray:
    """Spearman rho of each row of ``cos`` ``[R, n]`` with the matching row of already
    ranked human scores: the Pearson correlation of the ranks, ``[R]``."""
    a, b = _rank_rows(cos), human_ranks - human_ranks.mean(1, keepdims=True)
    a -= a.mean(1, keepdims=True)
    return (a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1))


def drop_stderrs(ref: dict, cand: dict) -> dict:
    """Standard errors of :func:`drop_points` (points) by a paired bootstrap over word
    pairs (:mod:`pipeline.metrics.uncertainty`): each resample draws pairs with
    replacement and recomputes both models' Spearman on the same pairs; the max's
    resample is the larger of the sets' resampled drops. Also ``mean_cosine_stderr``,
    a bootstrap over the held-out sentences. None where a cosine is not finite.

    Args:
        ref, cand: :func:`similarity_metrics` entries (``cosines_<set>``, ``human_scores``,
            ``sentence_cosines`` for the candidate).
    """
    from pipeline.metrics import uncertainty

    drops: dict[str, np.ndarray] = {}
    for n in WORD_SETS:
        cr, cc, human = ref[f"cosines_{n}"], cand[f"cosines_{n}"], ref["human_scores"][n]
        if not (np.isfinite(cr).all() and np.isfinite(cc).all()):
            continue
        idx = uncertainty.resample_indices(len(human))
        with np.errstate(invalid="ignore", divide="ignore"):  # a resample of one repeated pair: undefined rho
            ranks = _rank_rows(human[idx])
            drops[n] = 100.0 * (_rowwise_spearman(cr[idx], ranks) - _rowwise_spearman(cc[idx], ranks))
    out: dict = {f"spearman_drop_{n}_stderr": _finite_std(drops[n]) if n in drops else None for n in WORD_SETS}
    both = len(drops) == len(WORD_SETS)
    out["spearman_drop_max_stderr"] = _finite_std(np.max(list(drops.values()), axis=0)) if both else None
    cos = cand["sentence_cosines"]
    out["mean_cosine_stderr"] = (uncertainty.ratio_of_sums_stderr(cos, np.ones_like(cos)) if len(cos) >= 2
                                 else None)
    return out


def _finite_std(stat: np.ndarray) -> float | None:
    """Sample standard deviation (ddof 1) of the finite resampled values (a resample whose
    Spearman is undefined is left out); None when fewer than 2 are finite."""
    finite = stat[np.isfinite(stat)]
    return float(np.std(finite, ddof=1)) if len(finite) >= 2 else None


def stderr_basis(ref: dict, n_sentences: int) -> dict:
    """``stderr_basis`` records of :func:`drop_stderrs`' metrics (pairs per word set; the
    max rests on both sets' pairs)."""
    from pipeline.metrics import uncertainty

    sizes = {n: len(ref["human_scores"][n]) for n in WORD_SETS}
    out = {f"spearman_drop_{n}": uncertainty.basis(k, "word pairs", k, f"{n} word pairs") for n, k in sizes.items()}
    total = sum(sizes.values())
    out["spearman_drop_max"] = uncertainty.basis(total, "word pairs", total, "word pairs (each set resampled alone)")
    if n_sentences >= 2:
        out["mean_cosine"] = uncertainty.basis(n_sentences, "sentences", n_sentences, "held-out sentences")
    return out


class _FeedReader(CalibrationDataReader):
    """ORT calibration reader over a list of feed dicts."""

    def __init__(self, batches: list[dict[str, np.ndarray]]):
        self._it = iter(batches)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)


def _softmax_nodes(onnx_path: str) -> list[str]:
    import onnx

    return [n.name for n in onnx.load(onnx_path, load_external_data=False).graph.node if n.op_type == "Softmax"]


def index_arithmetic_nodes(onnx_path: str) -> list[str]:
    """Nodes whose outputs end in a Cast to an integer type, with every node that feeds them:
    float arithmetic that computes indices (e.g. MPNet/T5 relative-position buckets,
    ``log(n / max_exact)`` with ``-inf`` at ``n = 0``). A Q/DQ there turns the ``-inf`` range into a
    NaN scale and every bucket into an index of -2^63 (an ORT Gather error), so it is left FP32."""
    import onnx

    graph = onnx.load(onnx_path, load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    ints = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
    todo = [n for n in graph.node if n.op_type == "Cast"
            and any(a.name == "to" and a.i in ints for a in n.attribute)]
    seen: dict[str, onnx.NodeProto] = {}
    while todo:
        node = todo.pop()
        if node.name in seen:
            continue
        seen[node.name] = node
        todo += [producer[i] for i in node.input if i in producer]
    return sorted(seen)


@contextlib.contextmanager
def _root_log_errors_only() -> Iterator[None]:
    """ORT's quantizer advises pre-processing through ``logging.warning`` (the root
    logger) on every call; the naive baseline is ORT's defaults on purpose."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def naive_ort_model(ctx, exp, q) -> str:
    """ONNX Runtime ``quantize_static`` with its QDQ defaults on the FP32 export and the
    quantize stage's calibration feeds (``q.calibration_feeds_path``); FP8 uses E4M3FN activation
    and weight types, the Distribution calibrator (the only one ``quantize_static`` accepts
    for float8) and leaves Softmax nodes unquantized (ORT's float8 path fails on them). Index
    arithmetic (:func:`index_arithmetic_nodes`) stays FP32 at both precisions.

    Returns the path of the written model (in the validate stage folder).

    Raises:
        PipelineError: the quantize artifact holds no calibration feeds (re-run quantize).
    """
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from pipeline.errors import PipelineError
    from pipeline.quant.feeds import load_batches

    precision = q.precision
    if not getattr(q, "calibration_feeds_path", None):
        raise PipelineError(f"{q.onnx_path}: the quantize artifact has no calibration feeds; re-run the quantize stage")
    out = ctx.stage_dir / f"naive_ort_{precision}.onnx"
    kw: dict = {"quant_format": QuantFormat.QDQ, "nodes_to_exclude": index_arithmetic_nodes(exp.onnx_path)}
    if not facts(precision).integer:  # FP8
        # quantize_static accepts only the Distribution calibrator for float8 types, and its
        # fixed [0, 1] range for Softmax outputs carries no avg/std, which float8 scales need
        # (AttributeError in ORT 1.31): Softmax nodes are left out, everything else is default.
        kw.update(activation_type=QuantType.QFLOAT8E4M3FN, weight_type=QuantType.QFLOAT8E4M3FN,
                  calibrate_method=CalibrationMethod.Distribution,
                  nodes_to_exclude=kw["nodes_to_exclude"] + _softmax_nodes(exp.onnx_path))
    with ctx.progress.step(f"validate: naive ORT quantize_static ({precision})"), _root_log_errors_only():
        quantize_static(exp.onnx_path, str(out), _FeedReader(load_batches(q.calibration_feeds_path)), **kw)
    return str(out)


def validate_sentences(validate_cfg, limit: int | None = None) -> list[str]:
    """The held-out sentences of ``validate`` (documents of its split, at most
    ``max_windows`` sentences, or ``limit``): the one choice shared by validate and the bench.

    Raises:
        AccuracyError: the documents give no sentence.
        DataError: the split reaches past the corpus.
    """
    from pipeline.models import text as text_data

    docs = text_data.documents(validate_cfg.data)
    return held_out_sentences(docs, validate_cfg.max_windows if limit is None else limit)


def encoder_metrics(ctx, exp, q, engine: runners.Runner | None = None, reference: runners.Runner | None = None,
                    candidate: runners.Runner | None = None) -> dict:
    """Accuracy of the candidate encoder vs the FP32 reference, and of ORT's naive PTQ.

    Reads ``validate.data`` (held-out sentences: at most ``max_windows`` of them,
    ``seq_len`` tokens max, ``batch_size`` rows per run) and the word-similarity sets.
    ``reference`` / ``candidate`` default to both graphs in ONNX Runtime; with
    ``engine``, the same eval runs with the engine as the candidate (keys ``engine.*``).

    Returns a flat dict: ``spearman_<set>_fp32``, ``spearman_<set>_<precision>``,
    ``spearman_drop_<set>`` and ``spearman_drop_max`` (points), ``mean_cosine``,
    ``min_cosine``, ``nonfinite_rows``, ``eval_sentences``, and the same with a
    ``naive_ort_`` prefix (int8/fp8 only); standard errors ``spearman_drop_<set>_stderr``,
    ``spearman_drop_max_stderr``, ``mean_cosine_stderr`` (:func:`drop_stderrs`) and
    ``stderr_basis`` (:func:`stderr_basis`). A broken candidate gives NaN, never an error.

    Raises:
        AccuracyError: NaN/Inf in the FP32 reference, or no held-out sentence.
        DataError: the split reaches past the corpus.
    """

    v = ctx.recipe.validate_
    tok = load_tokenizer(exp.tokenizer_dir)
    sentences = validate_sentences(v)
    names = [s.name for s in exp.inputs]  # the graph's inputs, as exported
    reference = reference or runners.OrtRunner(exp.onnx_path)
    candidate = candidate or runners.OrtRunner(q.ort_path, user_graph=not q.quantized_nodes)
    sessions = {"reference": runners.SessionView(reference), "candidate": runners.SessionView(candidate)}
    if facts(q.precision).qdq:
        sessions["naive_ort"] = runners.SessionView(runners.OrtRunner(naive_ort_model(ctx, exp, q), user_graph=False))
    with ctx.progress.step(f"validate: word similarity + cosine ({len(sessions)} models)"):
        res = similarity_metrics(sessions, tok, sentences, v.batch_size, v.seq_len, names)
    out = _flatten(res, q.precision, len(sentences))
    with ctx.progress.step(f"validate: speed, batch {SPEED_BATCH} x {SPEED_TOKENS} tokens"):
        out.update(encoder_speedup(reference, candidate, tok, sentences, q.precision, names))
    if engine is not None:
        models = {"reference": sessions["reference"], "candidate": runners.SessionView(engine)}
        with ctx.progress.step("validate: word similarity + cosine (engine)"):
            res = similarity_metrics(models, tok, sentences, v.batch_size, v.seq_len, names)
        flat = _flatten(res, q.precision, len(sentences))
        add_engine_metrics(out, {k: val for k, val in flat.items() if not k.endswith("_fp32")})
    return out


#: the shape ``speedup_vs_fp32`` is timed at: batch x tokens
SPEED_BATCH, SPEED_TOKENS = 8, 64


def encoder_speedup(reference, candidate, tok, sentences: list[str], precision: str, names: Sequence[str]) -> dict:
    """:func:`pipeline.metrics.speed.speedup_metrics` of one run at ``SPEED_BATCH`` held-out
    sentences padded to ``SPEED_TOKENS`` tokens (int64 ``[8, 64]`` feeds); ``speedup_vs_fp32``
    None with ``speedup_vs_fp32_reason`` unless both runners are ONNX Runtime sessions."""
    from pipeline.metrics import speed

    level = speed.session_level(candidate)
    if speed.session_level(reference) is None or level is None:
        return {"speedup_vs_fp32": None,
                "speedup_vs_fp32_reason": "timed only when both graphs run in ONNX Runtime sessions"}
    feeds = tokenize(tok, (sentences * SPEED_BATCH)[:SPEED_BATCH], SPEED_TOKENS, names, pad_to_max=True)
    ref, cand = runners.SessionView(reference), speed.timed_view(candidate, runners.SessionView(candidate))
    return speed.speedup_metrics(lambda: ref.run([OUTPUT], feeds), lambda: cand.run([OUTPUT], feeds),
                                 shape=f"batch {SPEED_BATCH} x {SPEED_TOKENS} tokens", precision=precision,
                                 level=level[0], providers=level[1])


def _flatten(res: dict[str, dict], precision: str, n_sentences: int) -> dict:
    ref, cand = res["reference"], res["candidate"]
    out: dict = {"eval_sentences": n_sentences}
    for n in WORD_SETS:
        out[f"spearman_{n}_fp32"] = ref[f"spearman_{n}"]
        out[f"spearman_{n}_{precision}"] = cand[f"spearman_{n}"]
    out.update(drop_points(ref, cand))
    out.update({k: cand[k] for k in ("mean_cosine", "min_cosine", "nonfinite_rows")})
    out.update(drop_stderrs(ref, cand))
    out["stderr_basis"] = stderr_basis(ref, n_sentences)
    if "naive_ort" in res:
        naive = res["naive_ort"]
        out.update({f"naive_ort_spearman_{n}": naive[f"spearman_{n}"] for n in WORD_SETS})
        out.update({f"naive_ort_{k}": val for k, val in drop_points(ref, naive).items()})
        out.update({f"naive_ort_{k}": naive[k] for k in ("mean_cosine", "min_cosine", "nonfinite_rows")})
    return {**out, **nan_reasons(out, res, precision)}


def nan_reasons(flat: dict, res: dict[str, dict], precision: str) -> dict[str, str]:
    """``<metric>_reason`` for each NaN metric of :func:`_flatten`'s output: the model
    whose embeddings were non-finite, else an undefined (constant-input) Spearman.
    The JSON writer turns the NaN into ``null`` and keeps this reason."""
    out = {}
    for key, value in flat.items():
        if not (isinstance(value, float) and math.isnan(value)):
            continue
        label = "naive_ort" if key.startswith("naive_ort_") else "candidate"
        who = "ONNX Runtime's naive quantize_static model" if label == "naive_ort" else f"the {precision} model"
        bad = res[label]["nonfinite_rows"]
        out[f"{key}_reason"] = (
            f"{who} gave {bad} non-finite embedding row(s), so the Spearman correlation is undefined" if bad
            else f"the Spearman correlation of {who} is undefined (constant similarities)")
    return out
