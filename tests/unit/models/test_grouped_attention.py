"""The KV-cache graph is exported with grouped-query attention
(pipeline/models/text_generation/attention.py), which gives SDPA's numbers without repeating
K/V to every query head (no Expand on the KV path of the ONNX graph)."""
from __future__ import annotations

import copy
import importlib.util

import numpy as np
import onnx
import pytest
import torch

from conftest import ROOT
from pipeline.models.text_generation.attention import GROUPED, grouped_attention_forward, use_grouped_attention
from pipeline.models.text_generation.model import KVCacheLM, kv_layout, load_causal_lm, sample_feeds
from pipeline.recipe.load import load_recipe
from tiny import make_tiny_llama, tiny_recipe

ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(recipe, grouped model, sdpa model) of tests/tiny.py's Llama (4 query / 2 KV heads)."""
    ws = tmp_path_factory.mktemp("grouped")
    recipe = load_recipe(tiny_recipe(ws, make_tiny_llama(ws / "model")))
    grouped, _ = load_causal_lm(recipe.model)
    sdpa, _ = load_causal_lm(recipe.model, attention="sdpa")
    return recipe, grouped, sdpa


def small_llama(heads: int, kv_heads: int):
    """(grouped, sdpa) copies of one random Llama: 2 layers, head_dim 8, vocab 97."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(heads * 10 + kv_heads)
    cfg = LlamaConfig(vocab_size=97, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256)
    sdpa = LlamaForCausalLM(cfg).eval()
    sdpa.set_attn_implementation("sdpa")
    grouped = copy.deepcopy(sdpa)
    assert use_grouped_attention(grouped) and grouped.config._attn_implementation == GROUPED
    assert sdpa.config._attn_implementation == "sdpa"
    return grouped, sdpa


def models(request, tiny):
    if request.param == "tiny":
        return tiny[1], tiny[2]
    return small_llama(*request.param)


@pytest.fixture(params=["tiny", (4, 4), (6, 2)], ids=["tiny_nrep2", "nrep1", "nrep3"])
def pair(request, tiny):
    """(grouped, sdpa) models with n_rep 2 (tests/tiny.py), 1 (multi-head) and 3 (as SmolLM2)."""
    return models(request, tiny)


def feeds_for(model, batch: int, sequence: int, past: int, pad: list[int]) -> dict[str, np.ndarray]:
    """Random feeds; row ``r`` left-padded by ``pad[r]`` positions (zeros at the mask's start)."""
    f = sample_feeds(kv_layout(model), batch, sequence, past, seed=batch + sequence + past)
    for row, n in enumerate(pad):
        f["attention_mask"][row, :n] = 0
    return f


def run(model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    module = KVCacheLM(model, kv_layout(model)).eval()
    names = ["input_ids", "attention_mask", *module.layout.past_names()]
    with torch.no_grad():
        return [t.numpy() for t in module(*(torch.from_numpy(feeds[n]) for n in names))]


CASES = {  # (batch, sequence, past, left padding per row)
    "prefill": (2, 7, 0, [0, 0]),
    "decode_with_past": (3, 1, 9, [0, 0, 0]),
    "prefill_left_padded": (3, 6, 0, [0, 2, 5]),
    "decode_left_padded_past": (3, 1, 8, [0, 3, 8]),
    "chunk_left_padded_past": (2, 4, 5, [2, 0]),
}


@pytest.mark.parametrize("case", CASES)
def test_grouped_matches_sdpa(pair, case):
    """Logits, presents and last_logits equal SDPA's within 1e-5 where attended. Positions
    that attend nothing (left padding) differ by design (SDPA: zero output; grouped: the mean
    of V), so query positions with mask 0 are left out of logits and presents."""
    grouped, sdpa = pair
    batch, seq, past, pad = CASES[case]
    f = feeds_for(sdpa, batch, seq, past, pad)
    got, ref = run(grouped, f), run(sdpa, f)
    assert len(got) == len(ref)
    valid = f["attention_mask"].astype(bool)  # [B, past + seq]
    logits_valid = valid[:, past:]
    np.testing.assert_allclose(got[0][logits_valid], ref[0][logits_valid], rtol=0, atol=ATOL)
    for a, b in zip(got[1:-1], ref[1:-1]):  # presents [B, H_kv, past + seq, D]
        assert a.shape == b.shape
        np.testing.assert_allclose(a.transpose(0, 2, 1, 3)[valid], b.transpose(0, 2, 1, 3)[valid],
                                   rtol=0, atol=ATOL)
    np.testing.assert_allclose(got[-1], ref[-1], rtol=0, atol=ATOL)  # the last position is never padding


class Layer(torch.nn.Module):
    """The attributes transformers' attention functions read from the attention layer."""

    def __init__(self, n_rep: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = n_rep, True


@pytest.mark.parametrize("n_rep", [1, 3])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
def test_function_matches_sdpa_forward(n_rep, mask_kind):
    """The function alone against transformers' sdpa_attention_forward: boolean, additive and no
    mask (causal), a scale other than D**-0.5, past 5 + 3 new positions; output [B, S, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(n_rep)
    batch, kv_heads, seq, total, dim = 2, 2, 3, 8, 16
    q = torch.randn(batch, kv_heads * n_rep, seq, dim)
    k, v = torch.randn(batch, kv_heads, total, dim), torch.randn(batch, kv_heads, total, dim)
    allowed = torch.arange(total)[None, :] <= torch.arange(seq)[:, None] + (total - seq)  # causal after the past
    allowed = allowed[None, None].repeat(batch, 1, 1, 1)
    allowed[1, :, :, :2] = False  # row 1 left-padded by 2
    mask = {"bool": allowed, "none": None,
            "additive": torch.where(allowed, 0.0, torch.finfo(torch.float32).min)}[mask_kind]
    ref_mask = allowed if mask_kind != "none" else torch.arange(total)[None, :] <= torch.arange(seq)[:, None] + 5
    layer = Layer(n_rep)
    got, weights = grouped_attention_forward(layer, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(layer, q, k, v, ref_mask, scaling=0.3)
    assert weights is None and got.shape == (batch, seq, kv_heads * n_rep, dim) and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=0, atol=ATOL)


def test_function_refuses_softcap_and_bad_heads():
    q, kv = torch.zeros(1, 4, 1, 8), torch.zeros(1, 3, 2, 8)
    with pytest.raises(ValueError, match="softcap"):
        grouped_attention_forward(Layer(1), q, q, q, None, softcap=30.0)
    with pytest.raises(ValueError, match="4 query heads is not a multiple of 3"):
        grouped_attention_forward(Layer(1), q, kv, kv, None)


def expands_on_kv(graph: onnx.GraphProto, prefix: str) -> list[str]:
    """Expand nodes whose data input derives from a graph input named ``prefix*`` (the past KV),
    following data edges only (a Shape of the past carries no KV values)."""
    tainted = {i.name for i in graph.input if i.name.startswith(prefix)}
    hits = []
    for node in graph.node:  # ONNX nodes are topologically sorted
        if node.op_type == "Shape" or not tainted.intersection(node.input):
            continue
        if node.op_type == "Expand" and node.input[0] in tainted:
            hits.append(node.name)
        tainted.update(node.output)
    return hits


def test_expand_checker_sees_the_sdpa_pattern():
    """The checker flags the exported SDPA form's GQA Expand and passes the grouped form
    (one-layer graphs of benchmarks/attention_pattern_cost.py)."""
    spec = importlib.util.spec_from_file_location("attention_pattern_cost",
                                                  ROOT / "benchmarks" / "attention_pattern_cost.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    exported = onnx.load_from_string(bench.model("exported", 1)).graph
    grouped = onnx.load_from_string(bench.model("grouped", 1)).graph
    assert len(expands_on_kv(exported, "past_")) == 2  # K and V
    assert expands_on_kv(grouped, "past_") == []


@pytest.mark.parametrize("which", ["tiny", (6, 2)], ids=["tiny_nrep2", "nrep3"])
def test_exported_graph_has_no_kv_expand_and_matches_torch(tiny, which, tmp_path):
    """The adapter's export of a grouped model: no Expand on the KV path, K transposed un-expanded,
    and ONNX Runtime equals torch (left padding, non-empty past) within 1e-4."""
    from pipeline.models.text_generation.adapter import TextGenerationAdapter
    from pipeline.ort_sessions import ort_session

    recipe = tiny[0]
    model = tiny[1] if which == "tiny" else small_llama(*which)[0]
    adapter = TextGenerationAdapter(recipe.model)
    adapter.layout = kv_layout(model)
    module = KVCacheLM(model, adapter.layout).eval()
    out = tmp_path / "model.onnx"
    adapter.export(module, recipe.export, out)
    graph = onnx.load(str(out), load_external_data=False).graph
    assert expands_on_kv(graph, "past_key_values.") == []
    assert sum(n.op_type == "Softmax" for n in graph.node) == adapter.layout.num_layers
    f = feeds_for(model, 3, 2, 6, [0, 4, 7])
    got = ort_session(str(out)).run(None, f)
    ref = run(model, f)
    assert [o.name for o in ort_session(str(out)).get_outputs()] == module.output_names()
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
