"""A small torch model written for the "bring your own model" example.

``ByteClassifier`` reads UTF-8 bytes: an embedding, one masked self-attention
block and a feed-forward block, mean pooling over the unmasked bytes, and a
4-way class head. Inputs (both int64 ``[batch, length]``): ``byte_ids`` (0-255)
and ``attention_mask`` (1 = byte, 0 = padding). Outputs: ``logits`` float32
``[batch, 4]`` and ``features`` float32 ``[batch, 64]`` (the pooled vector).

The pipeline imports this file by path and calls :func:`make_model`
(``model.source: {entry: ./model.py:make_model}``). Weights are a seeded random
init, so the file alone defines the model (the stage keys hash every ``.py``
file in this folder).
"""
from __future__ import annotations

import math

import torch
from torch import nn


class ByteClassifier(nn.Module):
    #: graph output names, in forward's order (read by the pipeline)
    output_names = ("logits", "features")

    def __init__(self, dim: int = 64, classes: int = 4):
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(256, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def positions(self, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Sinusoidal position codes ``[length, dim]``, computed from the length (no table)."""
        freq = torch.exp(torch.arange(0, self.dim, 2, dtype=dtype) * (-math.log(10000.0) / self.dim))
        angle = torch.arange(length, dtype=dtype)[:, None] * freq[None, :]
        return torch.cat([angle.sin(), angle.cos()], dim=-1)

    def forward(self, byte_ids: torch.Tensor, attention_mask: torch.Tensor):
        x = self.embed(byte_ids) + self.positions(byte_ids.shape[1], torch.float32)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(self.dim)
        # A finite fill (not -inf): a fully masked row stays defined in torch and ONNX alike.
        scores = scores.masked_fill(attention_mask[:, None, :] == 0, torch.finfo(scores.dtype).min)
        x = x + self.proj(scores.softmax(-1) @ v)
        x = x + self.ff(self.norm2(x))
        keep = attention_mask.to(x.dtype)[..., None]
        features = (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(features), features


def encode(texts: list[str], length: int) -> dict[str, torch.Tensor]:
    """UTF-8 bytes of each text, cut or zero-padded to ``length``: ``byte_ids`` and
    ``attention_mask``, int64 ``[len(texts), length]``."""
    ids = torch.zeros(len(texts), length, dtype=torch.int64)
    mask = torch.zeros(len(texts), length, dtype=torch.int64)
    for i, text in enumerate(texts):
        raw = list(text.encode("utf-8")[:length])
        ids[i, : len(raw)] = torch.tensor(raw, dtype=torch.int64)
        mask[i, : len(raw)] = 1
    return {"byte_ids": ids, "attention_mask": mask}


def make_model() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model (seeded init, eval mode) and example inputs by name: batch 2 and length
    16 (both >= 2, so the exporter keeps them dynamic), the second row padded."""
    torch.manual_seed(0)
    model = ByteClassifier().eval()
    return model, encode(["A small example.", "Padded row"], length=16)
