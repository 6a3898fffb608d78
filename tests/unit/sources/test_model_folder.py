"""A text-generation model folder without its tokenizer files: ``check`` and
the export stage refuse what a later stage would fail on (exit 2, naming the folder and
the missing files); the EOS set comes from the model's own config files."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.cli import app as cli
from pipeline.models.text_generation.model import check_model_folder
from pipeline.recipe.load import load_recipe
from pipeline.triton.repository import eos_token_ids
from tiny import tiny_recipe


def without(tiny_model: Path, dest: Path, *names: str) -> Path:
    """A copy of the tiny model folder lacking ``names``."""
    shutil.copytree(tiny_model, dest)
    for name in names:
        (dest / name).unlink(missing_ok=True)
    return dest


def check(tmp_path: Path, folder: Path, capsys) -> tuple[Path, int, str]:
    path = tiny_recipe(tmp_path, folder)
    capsys.readouterr()
    code = cli.main(["check", str(path)])
    return path, code, capsys.readouterr().err


def test_no_tokenizer_json_is_refused_by_check_and_by_the_export_stage(tmp_path, tiny_model, capsys):
    folder = without(tiny_model, tmp_path / "m", "tokenizer.json")
    path, code, err = check(tmp_path, folder, capsys)
    assert code == 2, err
    assert f"model.source: {folder}: no loadable tokenizer (missing: tokenizer.json)" in err
    code = cli.main(["build", str(path), "--quiet"])  # the same pre-flight
    assert code == 2 and not (tmp_path / "artifacts" / "tiny-llm" / "export").exists()
    from pipeline.models import registry

    with pytest.raises(Exception, match="no loadable tokenizer") as err:  # the first stage's own check
        registry.adapter(load_recipe(path).model).load(None)
    assert err.value.exit_code == 2


@pytest.mark.e2e  # a tiny-model export (~12 s): make test runs it, make test-fast does not
def test_no_tokenizer_config_takes_eos_from_the_model_config(tmp_path, tiny_model, capsys):
    folder = without(tiny_model, tmp_path / "m", "tokenizer_config.json", "special_tokens_map.json")
    expected = json.loads((tiny_model / "generation_config.json").read_text())["eos_token_id"]
    path, code, err = check(tmp_path, folder, capsys)
    assert code == 0, err
    check_model_folder(load_recipe(path).model)
    from pipeline.models.text_generation.model import load_causal_lm, save_tokenizer

    model, tok = load_causal_lm(load_recipe(path).model)
    save_tokenizer(tok, model.generation_config, tmp_path / "tok")  # what the export stage writes
    assert eos_token_ids(tmp_path / "tok") == [expected]
    assert cli.main(["build", str(path), "--quiet"]) == 0, capsys.readouterr().err  # the triton stage too
    served = tmp_path / "model_repository" / "smollm2_generate" / "1"
    assert eos_token_ids(served) == [expected] and (served / "generation_config.json").is_file()
    from pipeline.triton.config import parse_config

    cfg = parse_config((served.parent / "config.pbtxt").read_text())
    assert cfg.parameters["eos_token_ids"].string_value == str(expected)


def test_no_eos_anywhere_is_refused_naming_the_missing_files(tmp_path, tiny_model, capsys):
    folder = without(tiny_model, tmp_path / "m", "tokenizer_config.json", "special_tokens_map.json",
                     "generation_config.json")
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = None  # (absent, LlamaConfig would default to 2)
    (folder / "config.json").write_text(json.dumps(config))
    path, code, err = check(tmp_path, folder, capsys)
    assert code == 2, err
    assert f"model.source: {folder}: no EOS token id (missing: tokenizer_config.json)" in err
    assert "generation_config.json" in err and "config.json" in err
