"""Pick the adapter for a recipe's ``model.kind``."""
from __future__ import annotations

from pipeline.recipe import ModelSource


def adapter(source: ModelSource):
    """The adapter object for ``source.kind`` ("causal-lm" or "encoder")."""
    if source.kind == "causal-lm":
        from pipeline.models.llm import CausalLMAdapter

        return CausalLMAdapter(source)
    from pipeline.models.encoder import EncoderAdapter

    return EncoderAdapter(source)


def load_tokenizer(folder: str):
    """The tokenizer saved by the export stage (local files only)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
