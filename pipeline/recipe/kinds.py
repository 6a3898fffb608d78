"""The per-kind facts the recipe checks need, without torch: one row per ``model.kind``.

Everything else about a kind lives in its adapter (``pipeline/models/<kind>/``); this table
holds only what is decided by the recipe alone, so the ground floor (the recipe checks,
:mod:`pipeline.recipe.checks`) never tests the kind itself. Each row also names the kind's gate metrics and
which of them carry a standard error (read by :mod:`pipeline.recipe.gates`); the map from a kind to its
adapter class stays in :mod:`pipeline.models.registry` (a ground-floor table naming the classes would
import upward). ``tests/architecture/test_kind_contract.py`` checks both list the same kinds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

#: The KV cache's graph names, the one definition: inputs ``past_key_values.{i}.key|value`` and outputs
#: ``present.{i}.key|value``, both float ``[batch, kv_heads, past_sequence (+ sequence), head_dim]``.
KV_PAST = "past_key_values.{i}.{kv}"
KV_PRESENT = "present.{i}.{kv}"
KV_PAST_RE = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
KV_PRESENT_RE = re.compile(r"^present\.(\d+)\.(key|value)$")


def past_name(present: str) -> str:
    """The past input a ``present.{i}.{kv}`` output feeds at the next step.

    Raises:
        ValueError: ``present`` is not a KV output name.
    """
    m = KV_PRESENT_RE.match(present)
    if m is None:
        raise ValueError(f"{present!r} is not a KV cache output ({KV_PRESENT})")
    return KV_PAST.format(i=m[1], kv=m[2])


#: the adapter's dim name for axis 2 of every past input (``past_key_values.N.key/value``)
PAST_DIM = "past_sequence"
#: text tokens of each greedy-generation prompt (:func:`pipeline.models.text.prompts`), before special tokens
PROMPT_TOKENS = 16


@dataclass(frozen=True)
class KindFacts:
    """What the recipe checks may assume about a model kind's graph and data."""

    #: the inputs the graph may have besides the KV cache, each rank 2 ``[batch, sequence]`` (the
    #: model's forward decides which, at export: e.g. no ``token_type_ids`` for DistilBERT); None:
    #: the model's own inputs (read from the graph at export, nothing to check beforehand)
    graph_inputs: tuple[str, ...] | None
    #: the graph also takes ``past_key_values.N.key/value`` ``[batch, H, past_sequence, D]``
    kv_cache: bool
    #: calibration and validate data are texts (documents), tokenized by the model's tokenizer
    text_data: bool
    #: served behind a tokenizer model and an ensemble that batch requests (max_batch_size >= 1)
    batching_front: bool
    #: the front model streams generated tokens (a decoupled generation model: ``serve --check``,
    #: the OpenAI endpoint and the TTFT/TPOT bench apply)
    generates: bool = False
    #: the metrics its validate stage writes that a gate may name (``validate.gates``, checked at
    #: ``check``); a standard error (``<metric>_stderr``) is not one: it measures the eval, not the model
    gate_metrics: frozenset[str] = frozenset()
    #: the gate metrics that carry a standard error, the only ones a statistical gate may name
    stderr_metrics: frozenset[str] = frozenset()
    #: the ``model.source`` keys (``pipeline.sources.model.SOURCE_KEYS``) the kind takes, with what
    #: each is, for the error; None: any (its adapter checks the files)
    sources: dict[str, str] | None = None


_TEXT_GENERATION = frozenset({
    "relative_perplexity_increase",  # (ppl_candidate - ppl_fp32) / ppl_fp32
    "token_agreement",  # greedy tokens equal to FP32's, fraction in [0, 1]
    "prompts_identical",  # prompts whose greedy tokens all equal FP32's (count)
    "mean_common_prefix_tokens",  # greedy tokens before the first difference, mean over prompts
    "perplexity_fp32",  # the reference itself (a floor on the eval data)
    # against FP32 per scored token, as llama.cpp's --kl-divergence (pipeline/metrics/llm_quality.py)
    "perplexity_ratio",  # PPL(cand) / PPL(fp32)
    "kld_mean", "kld_p50", "kld_p90", "kld_p99", "kld_p999", "kld_max",  # KL(fp32 || cand), nats
    "top1_agreement",  # teacher-forced: same argmax at each scored position, fraction
    "delta_p_rms", "delta_p_p01", "delta_p_p99",  # p_cand - p_fp32 of the correct token
    "speedup_vs_fp32",  # median FP32 / candidate prefill latency in ONNX Runtime (pipeline/metrics/speed.py)
    "decode_speedup_vs_fp32",  # the same for one decode step, batch 1, past validate.seq_len
    "quantized_fraction",  # Q/DQ weight GEMMs / all weight GEMMs (validate, from the quantize artifact)
})
_SENTENCE_EMBEDDING = frozenset({
    "spearman_drop_wordsim353", "spearman_drop_simlex999",  # Spearman points (x100) lost vs FP32
    "spearman_drop_max",  # the larger of the two
    "mean_cosine", "min_cosine",  # candidate vs FP32 embeddings of the held-out sentences
    "speedup_vs_fp32",  # FP32 / candidate median latency in ONNX Runtime, batch 8 x 64 tokens
})
_IMAGE_CLASSIFICATION = frozenset({
    "top1_accuracy_drop",  # top-1 accuracy points (x100) lost vs FP32, on the labels
    "top1_agreement",  # fraction of inputs whose top-1 class equals FP32's
})

_GENERIC = frozenset({
    "mean_cosine", "min_cosine",  # cosine of candidate vs FP32 outputs (worst output counts)
    "max_abs_diff", "rel_l2",  # largest absolute difference; relative L2 error
    "top1_agreement",  # argmax of class-score outputs equal to FP32's
})


#: model.kind -> its facts; the keys are :data:`pipeline.recipe.schema.ModelKind`'s values.
KINDS: dict[str, KindFacts] = {
    "text-generation": KindFacts(("input_ids", "attention_mask"), kv_cache=True, text_data=True,
                                 batching_front=False, generates=True, gate_metrics=_TEXT_GENERATION,
                                 stderr_metrics=frozenset({"relative_perplexity_increase", "perplexity_ratio", "kld_mean",
                                                           "top1_agreement", "token_agreement"})),
    "sentence-embedding": KindFacts(("input_ids", "attention_mask", "token_type_ids"), kv_cache=False,
                                    text_data=True, batching_front=True, gate_metrics=_SENTENCE_EMBEDDING,
                                    stderr_metrics=frozenset({"spearman_drop_wordsim353", "spearman_drop_simlex999",
                                                              "spearman_drop_max", "mean_cosine"})),
    "image-classification": KindFacts(None, kv_cache=False, text_data=False, batching_front=False,
                                      gate_metrics=_IMAGE_CLASSIFICATION,
                                      stderr_metrics=frozenset({"top1_accuracy_drop", "top1_agreement"})),  # over eval images
    "generic": KindFacts(None, kv_cache=False, text_data=False, batching_front=False, gate_metrics=_GENERIC,
                         stderr_metrics=frozenset({"mean_cosine", "top1_agreement"}),  # over eval samples
                         sources={"entry": "entry: ./my_model.py:make_model (returning (nn.Module, example inputs))",
                                  "onnx": "onnx: ./model.onnx"}),
}

#: What a Hugging Face folder or a package's model is, for a kind that refuses one.
HF_HINT = ("a Hugging Face folder is kind: text-generation (a causal LM; template recipes/fp8-llm.yaml) or "
           "kind: sentence-embedding (an encoder; template recipes/int8-encoder.yaml)")


def source_problem(kind: str, tag: str, described: str) -> str | None:
    """Why ``kind`` cannot take a ``model.source`` of key ``tag`` (``described``: the source's
    ``describe()``), or None when it can."""
    allowed = facts(kind).sources
    if allowed is None or tag in allowed:
        return None
    hint = f"; {HF_HINT}" if tag in ("path", "package") else ""
    return f"a {kind} model comes from {' or '.join(allowed.values())}; got {described}{hint}"


def facts(kind: str) -> KindFacts:
    """The facts of ``kind``.

    Raises:
        KeyError: ``kind`` has no row (the message lists the kinds); the schema refuses such a
            kind first, so this is a pipeline bug.
    """
    try:
        return KINDS[kind]
    except KeyError:
        raise KeyError(f"model kind {kind!r} has no row in pipeline.recipe.kinds.KINDS; rows: {sorted(KINDS)}") from None


def eval_units(r, metric: str) -> tuple[str, int, str] | None:
    """The recipe field that caps the eval units ``metric``'s standard error resamples, its value
    and the unit (:mod:`pipeline.metrics.uncertainty`; each kind's ``stderr_basis``), or None where
    the data alone decides (word-pair sets, perplexity windows cut from the documents). ``r``: a
    :class:`pipeline.recipe.schema.Recipe`."""
    v, kind = r.validate_, r.model.kind
    if kind == "text-generation":
        if metric == "token_agreement":
            return None if v.generation is None else ("validate.generation.prompts", v.generation.prompts,
                                                      "greedy prompts")
        return "validate.max_windows", v.max_windows, "eval windows"
    if kind == "sentence-embedding":
        return ("validate.max_windows", v.max_windows, "held-out sentences") if metric == "mean_cosine" else None
    split = v.data.split
    size = None if split.stop is None else split.stop - split.start
    if kind == "generic":
        if size is not None and size < v.max_windows:
            return "validate.data.split", size, "eval samples"
        return "validate.max_windows", v.max_windows, "eval samples"
    if kind == "image-classification" and size is not None:
        return "validate.data.split", size, "eval images"
    return None
