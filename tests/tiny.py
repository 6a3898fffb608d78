"""A tiny random Llama with the real SmolLM2 tokenizer, and a recipe for it.

Used by tests that exercise pipeline mechanics (cache, interruption, locking)
without minutes of export and evaluation.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from conftest import ROOT


def make_tiny_llama(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models.text_generation.model import load_causal_lm
    from pipeline.recipe_load import load_recipe

    if (folder / "config.json").exists():
        return folder
    _, tok = load_causal_lm(load_recipe(ROOT / "recipes" / "fp8-llm.yaml").model)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_recipe(ws: Path, model_dir: Path, **changes) -> Path:
    """Write a recipe for the tiny model into ``ws``; ``changes`` are dotted overrides."""
    data = yaml.safe_load((ROOT / "recipes" / "fp8-llm.yaml").read_text())
    data["name"] = "tiny-llm"
    data["model"] = {"kind": "text-generation", "source": {"path": str(model_dir)}}
    data["export"]["check_points"] = [{"batch": 1, "sequence": 4, "past_sequence": 0},
                                      {"batch": 3, "sequence": 1, "past_sequence": 5},
                                      {"batch": 2, "sequence": 7, "past_sequence": 9}]
    data["quantize"]["calibration"].update(samples=8, seq_len=32, batch_size=4)
    # Mechanics tests pin the quantization (down_proj high precision, as fp8-llm was hand-tuned);
    # tests/test_budget.py adds the search back where it is the subject.
    for key in ("tuning", "sensitivity", "accuracy_budget"):
        data["quantize"].pop(key, None)
    data["quantize"]["exclude"] = {"nodes": ["*mlp.down_proj*"]}
    data["validate"].update(seq_len=64, max_windows=4, generation={"prompts": 2, "new_tokens": 4})
    data["validate"]["gates"] = [{"metric": "relative_perplexity_increase", "max": 0.5}]
    data["work_dir"], data["output_dir"] = str(ws / "artifacts"), str(ws / "model_repository")
    for dotted, value in changes.items():
        node = data
        *keys, last = dotted.split(".")
        for k in keys:
            node = node[int(k)] if isinstance(node, list) else node[k]  # list items by index: gates.0.max
        node[int(last) if isinstance(node, list) else last] = value
    path = ws / "tiny-llm.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
