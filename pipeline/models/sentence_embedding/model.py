"""Sentence-embedding model code (BERT family, e.g. all-MiniLM-L6-v2): loading, the
pooled export wrapper and random feeds.

Graph I/O (``H`` hidden size, 384 for MiniLM-L6):

* ``input_ids``, ``attention_mask``, ``token_type_ids``: int64 ``[batch, sequence]``
* output ``embeddings``: float32 ``[batch, k * H]``: the last hidden states pooled over the
  positions where ``attention_mask`` is 1 as the folder's sentence-transformers modules say
  (``modules.json``, ``1_Pooling/config.json``; ``k`` pooling modes concatenated, usually 1),
  L2-normalised only where a ``Normalize`` module is listed. A folder without ``modules.json``
  gets mean pooling + L2 (all-MiniLM-L6-v2's).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import ExportError
from pipeline.model_source import package_file
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


#: sentence-transformers pooling config keys, in the order its Pooling module concatenates them.
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
SUPPORTED_MODES = ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")
ST = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooling:
    """How token states become one embedding: ``modes`` (concatenated, :data:`SUPPORTED_MODES`),
    then L2 normalisation when ``normalize``; ``note`` says where the choice came from."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = True
    note: str = "no modules.json: mean pooling + L2 normalisation (the default)"


def read_pooling(folder: str | Path) -> Pooling:
    """The pooling a sentence-transformers folder describes: ``modules.json`` is the list of
    modules (a ``Normalize`` entry counts whether or not its folder exists), the Pooling
    module's ``<path>/config.json`` gives the modes. Without ``modules.json``: the default.

    Raises:
        ExportError: a module other than Transformer / Pooling / Normalize (e.g. ``Dense``), a
            missing or unreadable pooling config, or a mode not in :data:`SUPPORTED_MODES`.
    """
    folder = Path(folder)
    listing = folder / "modules.json"
    if not listing.is_file():
        return Pooling()
    modules = json.loads(listing.read_text())
    kinds = [m.get("type", "").removeprefix(ST) for m in modules]
    unknown = [f"{m.get('type')} ({m.get('path') or '.'})" for m, k in zip(modules, kinds)
               if k not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise ExportError(f"{listing}: module(s) {unknown} are not supported in the exported graph; "
                          "supported: Transformer, Pooling, Normalize")
    pool = next((m for m, k in zip(modules, kinds) if k == "Pooling"), None)
    if pool is None:
        raise ExportError(f"{listing}: no Pooling module; the embedding export needs one")
    cfg_path = folder / pool.get("path", "") / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{listing}: the Pooling module's config {cfg_path} is missing")
    cfg = json.loads(cfg_path.read_text())
    modes = tuple(mode for key, mode in POOLING_MODES.items() if cfg.get(key))
    bad = [m for m in modes if m not in SUPPORTED_MODES]
    if not modes or bad:
        raise ExportError(f"{cfg_path}: pooling mode(s) {bad or 'none'} set; supported: {list(SUPPORTED_MODES)}")
    normalize = "Normalize" in kinds
    return Pooling(modes, normalize, f"{listing}: {' + '.join(modes)} pooling{' + L2' if normalize else ''}")


def max_seq_length(folder: str | Path) -> int | None:
    """``max_seq_length`` of the folder's ``sentence_bert_config.json`` (tokens; the
    sentence-transformers truncation), None when the file or field is absent.

    Raises:
        ExportError: the value is not a positive integer.
    """
    path = Path(folder) / "sentence_bert_config.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get("max_seq_length")
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ExportError(f"{path}: max_seq_length must be a positive integer, got {value!r}")
    return value


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """float ``[B, S, H]`` states and int ``[B, S]`` mask -> float ``[B, k * H]`` as
    sentence-transformers' Pooling and Normalize modules compute it: the mean's count clamped
    at 1e-9, max over positions with masked ones set to -1e9, ``lasttoken`` the last attended
    position (left or right padding)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    count = mask.sum(1).clamp(min=1e-9)
    parts = []
    for mode in pooling.modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode in ("mean", "mean_sqrt_len"):
            total = (hidden * mask).sum(1)
            parts.append(total / count if mode == "mean" else total / count.sqrt())
        elif mode == "max":
            parts.append(hidden.masked_fill(mask == 0, -1e9).max(1).values)
        else:  # lasttoken: the highest attended index of each row
            steps = torch.arange(hidden.shape[1], device=hidden.device)[None, :]
            last = (attention_mask.long() * (steps + 1)).argmax(1)
            parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])
    out = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    return torch.nn.functional.normalize(out, p=2.0, dim=-1) if pooling.normalize else out


class PooledEncoder(torch.nn.Module):
    """``(input_ids, attention_mask, token_type_ids) -> embeddings`` float32 ``[B, k * H]``:
    ``last_hidden_state`` pooled by :func:`pool` with ``pooling`` (default: mean + L2)."""

    def __init__(self, model, pooling: Pooling = Pooling()):
        super().__init__()
        self.model, self.pooling = model, pooling

    def forward(self, input_ids, attention_mask, token_type_ids):
        hidden = self.model(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        return pool(hidden, attention_mask, self.pooling)


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


