"""A model folder whose files contradict each other (or the recipe) is refused by
``check``, or served within what it holds, instead of building, passing, publishing and then
failing requests.

* C82: a tokenizer with more ids than the embedding has rows (config.json ``vocab_size``) is exit 2
  at ``check``, naming both numbers (was: exit 0 and a Gather out of range at the first rare word;
  or, further off, a failure at calibration after the export).
* C81: learned positions (GPT-2) under profiles past their table are exit 2 at ``check``; rotary
  ones (Llama) get a warning, and the generation model serves min(profile, max_position_embeddings)
  unless ``triton.allow_context_beyond_max_positions``.
* C83: a vocabulary padded past the tokenizer passes ``check`` (the generation model never samples
  or lists the ids with no tokenizer entry: tests/test_serve_generation.py).

Tiny random models built from transformers configs, with the tiny Llama's (SmolLM2) tokenizer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.cli import app as cli
from pipeline.recipe.load import load_recipe
from tiny import tiny_recipe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def with_config(tiny_model: Path, dest: Path, **changes) -> Path:
    """A copy of the tiny Llama whose config.json has ``changes``."""
    shutil.copytree(tiny_model, dest)
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **changes}))
    return dest


def check(tmp_path: Path, folder: Path, capsys, **changes) -> tuple[Path, int, str]:
    path = tiny_recipe(tmp_path, folder, **changes)
    capsys.readouterr()
    code = cli.main(["check", str(path)])
    return path, code, capsys.readouterr().err


# --- C82 / C83: the tokenizer's ids against the embedding's rows --------------------------------


@pytest.mark.parametrize("rows", [49130, 40000])
def test_a_tokenizer_with_ids_past_the_embedding_is_refused_by_check(tmp_path, tiny_model, capsys, rows):
    folder = with_config(tiny_model, tmp_path / "m", vocab_size=rows)
    path, code, err = check(tmp_path, folder, capsys)
    assert code == 2, err
    assert (f"model.source: {folder}: the tokenizer gives token ids up to 49151 (49152 ids, tokenizer.json with its "
            f"added tokens), but config.json vocab_size is {rows}: the embedding has {rows} rows, so the "
            f"{49152 - rows} ids from {rows} on index past it") in err
    assert cli.main(["build", str(path), "--quiet"]) == 2  # the same pre-flight: nothing exported
    assert not (tmp_path / "artifacts" / "tiny-llm" / "export").exists()


def test_a_vocabulary_padded_past_the_tokenizer_passes_check(tmp_path, tiny_model, capsys):
    folder = with_config(tiny_model, tmp_path / "m", vocab_size=65536)
    _, code, err = check(tmp_path, folder, capsys)
    assert code == 0, err


# --- C81: the profiles' positions against the model's position table ----------------------------


def _tiny_gpt2(folder: Path, tokenizer_from: Path, n_positions: int) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, folder / name)
    cfg = GPT2Config(vocab_size=49152, n_embd=32, n_layer=1, n_head=2, n_positions=n_positions,
                     bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
    return folder


def test_learned_positions_past_their_table_are_refused_by_check(tmp_path, tiny_model, capsys):
    """GPT-2 with n_positions 128 under the fp8-llm profile (total_sequence max 768): exit 2."""
    folder = _tiny_gpt2(tmp_path / "gpt2", tiny_model, 128)
    path, code, err = check(tmp_path, folder, capsys)
    assert code == 2, err
    assert ("build.profiles 'default' reaches 768 positions (total_sequence max 768), but GPT2LMHeadModel learns a "
            "table of 128 positions (config.json n_positions 128): no position past 127 exists") in err
    assert "Lower total_sequence max (and past_sequence / sequence max with it) to at most 128" in err
    profile = {"name": "default", "dims": {"batch": {"min": 1, "opt": 2, "max": 8},
                                          "sequence": {"min": 1, "opt": 16, "max": 64},
                                          "past_sequence": {"min": 0, "opt": 16, "max": 64},
                                          "total_sequence": {"min": 1, "opt": 32, "max": 128}}}
    _, code, err = check(tmp_path, folder, capsys, **{"build.profiles": [profile], "quantize.calibration.seq_len": 32,
                                                     "validate.seq_len": 64, "serve.tpot_positions": [8, 40],
                                                     "serve.long_max_tokens": 44})  # a 65-token context reaches 46
    assert code == 0 and "warning" not in err, err


def test_rotary_positions_past_max_position_embeddings_warn_and_cap_the_served_context(tmp_path, tiny_model, capsys):
    """A Llama with max_position_embeddings 64 under a 513-token served context: a warning at check,
    and the generation model's max_context is 64 unless the recipe opts in to the profile's."""
    from pipeline.models.text_generation.triton import served_limits
    from serve_tiny import context_build

    folder = with_config(tiny_model, tmp_path / "m", max_position_embeddings=64)
    path, code, err = check(tmp_path, folder, capsys)
    assert code == 0, err
    assert ("warning: build.profiles 'default' reaches 768 positions (total_sequence max 768), past LlamaForCausalLM's "
            "max_position_embeddings 64: its rotary positions were not trained beyond 63") in err
    assert "the generation model serves at most 64 tokens of context" in err
    recipe = load_recipe(path)
    profiles = context_build(513).profiles
    assert served_limits(recipe, profiles) == {"max_prompt_tokens": 16, "max_context": 64}
    opted = load_recipe(path, {"triton.allow_context_beyond_max_positions": True})
    assert served_limits(opted, profiles) == {"max_prompt_tokens": 16, "max_context": 513}
    _, code, err = check(tmp_path, folder, capsys, **{"triton.allow_context_beyond_max_positions": True})
    assert code == 0 and "triton.allow_context_beyond_max_positions is true: the generation model serves the " \
                         "profiles' context" in err
    with_table = with_config(tiny_model, tmp_path / "ok")  # max_position_embeddings 1024: within it
    _, code, err = check(tmp_path, with_table, capsys)
    assert code == 0 and "warning" not in err, err


def test_the_served_config_carries_the_capped_context(tmp_path, tiny_model):
    """The triton stage writes the capped max_context into the generation model's config.pbtxt."""
    from pipeline.recipe.schema import ModelSource
    from pipeline.stages.triton import write_repository
    from pipeline.triton.config import parse_config
    from serve_tiny import context_build, llm_artifacts, llm_recipe

    folder = with_config(tiny_model, tmp_path / "m", max_position_embeddings=64)
    artifacts = llm_artifacts(tmp_path, build=context_build(513))
    recipe = llm_recipe(tmp_path)
    recipe = recipe.model_copy(update={"model": ModelSource.model_validate(
        {"kind": "text-generation", "source": {"path": str(folder)}})})
    write_repository(recipe, export=artifacts["export"], quantized=artifacts["quantize"], build=artifacts["build"],
                     out_dir=Path(recipe.output_dir))
    cfg = parse_config((Path(recipe.output_dir) / "tiny_generate" / "config.pbtxt").read_text())
    assert cfg.parameters["max_context"].string_value == "64"


def test_the_new_recipe_field_at_its_default_keeps_the_digest(tmp_path):
    from conftest import ROOT

    shipped = load_recipe(ROOT / "recipes" / "fp8-llm.yaml")
    explicit = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"triton.allow_context_beyond_max_positions": False})
    opted = load_recipe(ROOT / "recipes" / "fp8-llm.yaml", {"triton.allow_context_beyond_max_positions": True})
    assert "allow_context_beyond_max_positions" not in shipped.model_dump(mode="json", by_alias=True)["triton"]
    assert shipped.digest == explicit.digest != opted.digest
    assert shipped.engine_hash == opted.engine_hash  # it shapes no engine
