"""The exported LM also returns the last position's logits,
and the triton stage writes the --shm-size the repository needs into deploy notes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.models.text_generation.model import LAST_LOGITS, KVCacheLM, kv_layout, load_causal_lm, sample_feeds
from pipeline.recipe.load import load_recipe
from pipeline.models.text_generation.kv import KVLayout
from pipeline.models.text_generation.triton import DEPLOY_NOTES, shm_bytes
from pipeline.stages.triton import write_repository
from test_repository import make_recipe, stage  # noqa: F401  (fixture)
from tiny import make_tiny_llama, tiny_recipe


def test_shm_formula():
    smollm2 = KVLayout(num_layers=30, kv_heads=3, head_dim=64, dtype="float32")
    need = shm_bytes(smollm2, batch=8, context=768, vocab=49152)
    assert need["kv_cache"] == 2 * 8 * 768 * 30 * 3 * 64 * 4 == 283_115_520
    assert need["last_logits"] == 8 * 49152 * 4
    assert need["step"] == 2 * need["kv_cache"] + need["last_logits"]
    assert need["total"] == need["step"] + need["step"] // 4
    assert shm_bytes(KVLayout(30, 3, 64, "float16"), 8, 768, 49152)["kv_cache"] == 283_115_520 // 2


def test_deploy_notes_written_outside_the_model_folders(stage, tmp_path):  # noqa: F811
    recipe = make_recipe().model_copy(update={"work_dir": str(tmp_path / "artifacts")})
    write_repository(recipe, **stage)
    notes = tmp_path / "artifacts" / "tiny-llm" / "triton" / DEPLOY_NOTES
    text = notes.read_text()
    # tiny graph: L 2, H 1, D 4, V 11, B 4, context min(40, 32 + 1) = 33 -> far below 64 MiB
    assert "--shm-size=64m" in text and "2 x B 4 x S 33 x L 2 x H_kv 1 x D 4" in text
    assert not list(stage["out_dir"].rglob(DEPLOY_NOTES))


def test_tiny_llama_exports_last_logits(tmp_path):
    path = tiny_recipe(tmp_path, make_tiny_llama(tmp_path / "model"))
    recipe = load_recipe(path)
    from pipeline.models.text_generation.adapter import TextGenerationAdapter as CausalLMAdapter
    from pipeline.ort_sessions import ort_session

    adapter = CausalLMAdapter(recipe.model)
    model, _ = load_causal_lm(recipe.model)
    adapter.layout = kv_layout(model)
    module = KVCacheLM(model, adapter.layout).eval()
    assert module.output_names()[-1] == LAST_LOGITS
    feeds = sample_feeds(adapter.layout, batch=3, sequence=5, past=2)
    with torch.no_grad():
        ref = [t.numpy() for t in adapter.torch_outputs(module, feeds)]
    assert ref[-1].shape == (3, adapter.layout.vocab) and np.array_equal(ref[-1], ref[0][:, -1, :])
    out = tmp_path / "m.onnx"
    adapter.export(module, recipe.export, out)
    sess = ort_session(str(out))
    got = sess.run(None, feeds)
    assert len(got) == len(ref) == 2 + len(adapter.layout.present_names())
    np.testing.assert_allclose(got[-1], got[0][:, -1, :], rtol=0, atol=0)
    np.testing.assert_allclose(got[-1], ref[-1], rtol=1e-4, atol=1e-4)
    assert [o.name for o in sess.get_outputs()] == module.output_names()
