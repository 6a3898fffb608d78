"""The per-kind facts the recipe checks need, without torch: one row per ``model.kind``.

Everything else about a kind lives in its adapter (``pipeline/models/<kind>/``); this table
holds only what is decided by the recipe alone, so the ground floor (the recipe checks,
:mod:`pipeline.recipe.checks`) never tests the kind itself. The gate metrics of each kind are
:data:`pipeline.recipe.gates.METRICS`; ``tests/architecture/test_kind_contract.py`` checks each row against its adapter.
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
    #: the ``model.source`` keys (``pipeline.sources.model.SOURCE_KEYS``) the kind takes, with what
    #: each is, for the error; None: any (its adapter checks the files)
    sources: dict[str, str] | None = None


#: model.kind -> its facts; the keys are :data:`pipeline.recipe.schema.ModelKind`'s values.
KINDS: dict[str, KindFacts] = {
    "text-generation": KindFacts(("input_ids", "attention_mask"), kv_cache=True, text_data=True,
                                 batching_front=False),
    "sentence-embedding": KindFacts(("input_ids", "attention_mask", "token_type_ids"), kv_cache=False,
                                    text_data=True, batching_front=True),
    "image-classification": KindFacts(None, kv_cache=False, text_data=False, batching_front=False),
    "generic": KindFacts(None, kv_cache=False, text_data=False, batching_front=False,
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
