"""A tiny random Llama with the real SmolLM2 tokenizer, and a recipe for it.

Used by tests that exercise pipeline mechanics (cache, interruption, locking)
without minutes of export and evaluation.
"""
from __future__ import annotations

import functools
import shutil
from pathlib import Path

import yaml

from conftest import ROOT


def make_tiny_llama(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    tok = smollm2_tokenizer(folder)  # the tokenizer alone: no dequantizing of the GGUF weights
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


#: Tiny causal-LM configs (2 layers, hidden 64, 4 heads): transformers config class name and the
#: fields that make each family's own scheme show (GQA / MQA, partial rotary, learned positions,
#: ALiBi, parallel blocks, sliding windows). Names are the matrix's test ids.
CAUSAL_LMS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=16, sliding_window=4096)),  # its default
    "phi3": ("Phi3Config", dict(num_key_value_heads=2, pad_token_id=None)),
    "gpt2": ("GPT2Config", dict(n_positions=1024)),                                  # learned positions
    "opt": ("OPTConfig", dict(ffn_dim=128, word_embed_proj_dim=64, max_position_embeddings=1024)),  # offset 2
    "gpt_neox": ("GPTNeoXConfig", dict(rotary_pct=0.25, use_parallel_residual=True)),  # Pythia
    "gptj": ("GPTJConfig", dict(rotary_dim=8, n_positions=1024)),                     # parallel block
    "phi": ("PhiConfig", dict(partial_rotary_factor=0.5)),
    "falcon": ("FalconConfig", dict(multi_query=True, parallel_attn=True)),           # fused QKV, MQA
    "bloom": ("BloomConfig", dict()),                                                 # ALiBi
    "gpt_bigcode": ("GPTBigCodeConfig", dict(multi_query=True, n_positions=1024)),    # MQA, learned
}


@functools.cache
def _gguf_tokenizer():
    """The SmolLM2 tokenizer read from its GGUF once per process (reading it takes seconds)."""
    from transformers import AutoTokenizer

    from pipeline.sources.model import package_file
    from pipeline.recipe.load import load_recipe

    path = package_file(load_recipe(ROOT / "recipes" / "fp8-llm.yaml").model)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def smollm2_tokenizer(folder: Path):
    """The real SmolLM2 tokenizer (from its GGUF, without loading the weights), saved in ``folder``."""
    from transformers import AutoTokenizer

    if not (folder / "tokenizer_config.json").exists():
        _gguf_tokenizer().save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def make_tiny_causal_lm(arch: str, folder: Path, tokenizer_dir: Path) -> Path:
    """A random-weight (seed 0) 2-layer, hidden-64 model of ``arch`` (a :data:`CAUSAL_LMS` key)
    with the SmolLM2 tokenizer, saved in ``folder``."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if (folder / "config.json").exists():
        return folder
    tok = smollm2_tokenizer(tokenizer_dir)
    cls, extra = CAUSAL_LMS[arch]
    size = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    cfg = getattr(transformers, cls)(**{**size, **extra})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(folder)
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
    # tests/integration/test_budget.py adds the search back where it is the subject.
    for key in ("tuning", "sensitivity", "accuracy_budget"):
        data["quantize"].pop(key, None)
    data["quantize"]["exclude"] = {"nodes": ["*mlp.down_proj*"]}
    data["validate"].update(seq_len=64, max_windows=4, generation={"prompts": 2, "new_tokens": 4})
    data["validate"]["gates"] = [{"metric": "relative_perplexity_increase", "max": 0.5}]
    # Engines are the subject of test_build_rtx's tiny run and the causal-LM matrix, which set
    # build.backend back to auto (test_shipped_engines builds the shipped recipes); here the build
    # writes trtexec.sh.
    data["build"]["backend"] = "none"
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


def seed_export(ws: Path, export_dir: Path, name: str = "tiny-llm") -> None:
    """Start the run in ``ws`` from an export made elsewhere (``conftest.tiny_export``): its cache
    record, which names that export's files where they are, is copied into ``ws``'s run folder.
    The runner takes it when the stage key matches (the same model bytes and export section; the
    key holds no path), else the export runs as usual. Later stages write only into ``ws``."""
    dest = ws / "artifacts" / name / "export"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(export_dir / "stage.json", dest / "stage.json")


def continuation(tok, prompt: list[int], tokens: list[int], skip_special_tokens: bool = True) -> str:
    """The text ``tokens`` add after ``prompt`` (a ``tokenizers.Tokenizer``): what a served
    generation streams, the generation model's decoder being seeded with the prompt."""
    head = tok.decode(prompt, skip_special_tokens=skip_special_tokens)
    return tok.decode(prompt + tokens, skip_special_tokens=skip_special_tokens)[len(head):]


def export_tiny(ws: Path, model_dir: Path, export_dir: Path):
    """The tiny recipe's export stage run alone in ``ws`` (seeded from ``export_dir``, so it is a
    cache hit): its :class:`pipeline.artifacts.ExportArtifact`."""
    from pipeline.recipe.load import load_recipe
    from pipeline.run.runner import run_pipeline

    path = tiny_recipe(ws, model_dir)
    seed_export(ws, export_dir)
    return run_pipeline(load_recipe(path), path, quiet=True, only=["export"]).artifacts["export"]


def run_graph(path, feeds: dict) -> dict:
    """Every output of the ONNX graph at ``path`` for ``feeds`` (name -> array), by name."""
    from pipeline.ort_sessions import ort_session

    sess = ort_session(str(path))
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))
