"""Sentence-embedding model code (BERT family, e.g. all-MiniLM-L6-v2): loading, the
mean-pooled export wrapper and random feeds.

Graph I/O (``H`` hidden size, 384 for MiniLM-L6):

* ``input_ids``, ``attention_mask``, ``token_type_ids``: int64 ``[batch, sequence]``
* output ``embeddings``: float32 ``[batch, H]``, the mean of the last hidden
  states over the positions where ``attention_mask`` is 1, L2-normalised
  (the sentence-transformers pooling of all-MiniLM-L6-v2, inside the graph).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.models.sources import package_file
from pipeline.recipe import ModelSource

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "embeddings"


def load_encoder(source: ModelSource):
    """Load the encoder (FP32, eval mode) and its tokenizer from the package folder, offline.

    Returns ``(transformers model, tokenizer)``.

    Raises:
        ExportError: the package or folder is missing (from ``package_file``).
    """
    from transformers import AutoModel, AutoTokenizer

    folder = str(package_file(source))
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    return model.eval(), tok


class MeanPooledEncoder(torch.nn.Module):
    """``(input_ids, attention_mask, token_type_ids) -> embeddings`` float32 ``[B, H]``.

    Masked mean of ``last_hidden_state`` (the mask count is clamped at 1e-9 as
    sentence-transformers does), then L2 normalisation.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=-1)


def random_feeds(vocab: int, batch: int, sequence: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random valid int64 ``[batch, sequence]`` feeds; row ``i`` has ``i`` trailing pad positions
    (at most ``sequence - 1``), so the masked pooling is exercised."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, (batch, sequence), dtype=np.int64)
    mask = np.ones((batch, sequence), np.int64)
    for i in range(batch):
        pad = min(i, sequence - 1)
        if pad:
            mask[i, -pad:] = 0
            ids[i, -pad:] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


