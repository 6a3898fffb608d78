"""One per-kind facts table (pipeline.recipe.kinds) for the recipe checks; each row
agrees with its kind's adapter."""
from __future__ import annotations

from types import SimpleNamespace
from typing import get_args

import pytest

from pipeline.recipe import kinds as recipe_kinds
from pipeline.models import registry
from pipeline.recipe.schema import ModelKind


def test_one_row_per_schema_kind_and_adapter():
    assert sorted(recipe_kinds.KINDS) == sorted(get_args(ModelKind)) == sorted(registry.ADAPTERS)


@pytest.mark.parametrize("kind", sorted(recipe_kinds.KINDS))
def test_each_row_matches_its_adapter(kind):
    row, cls = recipe_kinds.facts(kind), registry.adapter_class(kind)
    assert cls.kind == kind
    assert row.kv_cache == row.generates  # the generating kind decodes with its KV cache
    assert row.stderr_metrics <= row.gate_metrics
    assert row.text_data == (row.graph_inputs is not None)  # the tokenized kinds have fixed text inputs


def test_text_rows_name_the_adapters_graph_inputs():
    from pipeline.models.sentence_embedding.model import INPUTS
    from pipeline.models.text_generation.adapter import TextGenerationAdapter
    from pipeline.models.text_generation.kv import KVLayout

    assert recipe_kinds.facts("sentence-embedding").graph_inputs == INPUTS
    llm = TextGenerationAdapter(None)
    llm.layout = KVLayout(num_layers=2, kv_heads=1, head_dim=4)
    axes = llm.dynamic_axes(SimpleNamespace(dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                                          "attention_mask": {0: "batch", 1: "total"}}))
    fixed = tuple(n for n in axes if not n.startswith("past_key_values"))
    assert fixed == recipe_kinds.facts("text-generation").graph_inputs
    assert {a[2] for n, a in axes.items() if n.startswith("past_key_values")} == {recipe_kinds.PAST_DIM}


def test_an_unknown_kind_is_a_clear_bug():
    with pytest.raises(KeyError, match=r"model kind 'causal-lm' has no row .*rows: \['generic', "):
        recipe_kinds.facts("causal-lm")


def test_generic_row_takes_the_sources_its_adapter_takes():
    from pipeline.sources.model import EntrySource, OnnxSource

    assert set(recipe_kinds.facts("generic").sources) == {EntrySource.tag, OnnxSource.tag}
    assert recipe_kinds.source_problem("generic", "entry", "entry x.py:f") is None
    assert all(recipe_kinds.facts(k).sources is None for k in recipe_kinds.KINDS if k != "generic")
