"""Sentence-embedding model code (BERT family, e.g. all-MiniLM-L6-v2): loading, the
pooled export wrapper and random feeds.

Graph I/O (``H`` hidden size, 384 for MiniLM-L6):

* ``input_ids``, ``attention_mask`` and, where the model's forward takes it (BERT; not
  DistilBERT or ModernBERT), ``token_type_ids``: int64 ``[batch, sequence]``
  (:func:`model_inputs` decides)
* output ``embeddings``: float32 ``[batch, k * H]``: the last hidden states pooled over the
  positions where ``attention_mask`` is 1 as the folder's sentence-transformers modules say
  (``modules.json``, ``1_Pooling/config.json``; ``k`` pooling modes concatenated, usually 1),
  then each listed ``Dense`` module (Linear + activation; its ``out_features`` replaces
  ``k * H``), L2-normalised only where a ``Normalize`` module is listed. A folder without
  ``modules.json`` gets mean pooling + L2 (all-MiniLM-L6-v2's).
"""
from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pipeline.errors import ExportError
from pipeline.sources.model import package_file
from pipeline.recipe.schema import ModelSource
from pipeline.sources.model import load_tokenizer

#: every input an encoder graph of this kind may have, in graph order (:func:`model_inputs`).
INPUTS = ("input_ids", "attention_mask", "token_type_ids")
OUTPUT = "embeddings"


def model_inputs(model) -> tuple[str, ...]:
    """The graph inputs of a transformers encoder: the names of :data:`INPUTS` that are named
    parameters of ``model.forward``, in :data:`INPUTS` order (``token_type_ids`` only where the
    forward takes it). The one place the input names are decided; later stages read the
    export artifact's input specs.

    Raises:
        ExportError: the forward takes no ``input_ids`` or no ``attention_mask``.
    """
    params = inspect.signature(model.forward).parameters
    names = tuple(n for n in INPUTS if n in params)
    missing = [n for n in INPUTS[:2] if n not in names]
    if missing:
        raise ExportError(f"{type(model).__name__}.forward takes no {missing}; a sentence-embedding "
                          f"encoder needs input_ids and attention_mask (its parameters: {list(params)})")
    return names


def load_encoder(source: ModelSource):
    """Load the encoder (FP32, eval mode) and its tokenizer from the package folder, offline.

    Returns ``(transformers model, tokenizer)``.

    Raises:
        ExportError: the package or folder is missing (from ``package_file``).
    """
    from transformers import AutoModel

    folder = str(package_file(source))
    tok = load_tokenizer(folder)
    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    return model.eval(), tok


#: sentence-transformers pooling config keys, in the order its Pooling module concatenates them.
POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
SUPPORTED_MODES = ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")


@dataclass(frozen=True)
class Pooling:
    """How token states become one embedding: ``modes`` (concatenated, :data:`SUPPORTED_MODES`),
    then the ``Dense`` module folders of ``dense`` in order, then L2 normalisation when
    ``normalize``; ``note`` says where the choice came from."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = True
    note: str = "no modules.json: mean pooling + L2 normalisation (the default)"
    dense: tuple[Path, ...] = ()


#: modules.json types the exported graph computes, in the only order it computes them.
MODULE_ORDER = ("Transformer", "Pooling", "Dense", "Normalize")


def _module_kind(entry: dict) -> str:
    """``Dense`` for ``sentence_transformers.models.Dense`` or ``sentence_transformers.base.modules.dense.Dense``."""
    kind = str(entry.get("type", ""))
    return kind.rsplit(".", 1)[-1] if kind.startswith("sentence_transformers.") else kind


def read_pooling(folder: str | Path) -> Pooling:
    """The pooling a sentence-transformers folder describes: ``modules.json`` is the list of
    modules (a ``Normalize`` entry counts whether or not its folder exists), the Pooling
    module's ``<path>/config.json`` gives the modes, ``Dense`` modules follow it (their
    folders are read by :func:`load_dense`). Without ``modules.json``: the default.

    Raises:
        ExportError: a module other than Transformer / Pooling / Dense / Normalize, modules out
            of that order, a missing or unreadable pooling config, or a mode not in
            :data:`SUPPORTED_MODES`.
    """
    folder = Path(folder)
    listing = folder / "modules.json"
    if not listing.is_file():
        return Pooling()
    modules = json.loads(listing.read_text())
    kinds = [_module_kind(m) for m in modules]
    unknown = [f"{m.get('type')} ({m.get('path') or '.'})" for m, k in zip(modules, kinds) if k not in MODULE_ORDER]
    if unknown:
        raise ExportError(f"{listing}: module(s) {unknown} are not supported in the exported graph; "
                          f"supported: {', '.join(MODULE_ORDER)}")
    ranks = [MODULE_ORDER.index(k) for k in kinds]
    if ranks != sorted(ranks) or kinds.count("Pooling") != 1:
        raise ExportError(f"{listing}: modules {kinds}: the exported graph computes one Pooling after the "
                          f"Transformer, then any Dense modules, then Normalize ({' -> '.join(MODULE_ORDER)})")
    pool = modules[kinds.index("Pooling")]
    cfg_path = folder / pool.get("path", "") / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{listing}: the Pooling module's config {cfg_path} is missing")
    modes = pooling_modes(json.loads(cfg_path.read_text()))
    bad = [m for m in modes if m not in SUPPORTED_MODES]
    if bad:
        raise ExportError(f"{cfg_path}: pooling mode(s) {bad} set; supported: {list(SUPPORTED_MODES)}")
    dense = tuple(folder / m.get("path", "") for m, k in zip(modules, kinds) if k == "Dense")
    normalize = "Normalize" in kinds
    steps = [" + ".join(modes) + " pooling", *(f"Dense ({d.name})" for d in dense), *(["L2"] if normalize else [])]
    return Pooling(modes, normalize, f"{listing}: {' -> '.join(steps)}", dense)


def pooling_modes(cfg: dict) -> tuple[str, ...]:
    """The modes of a Pooling ``config.json``, as sentence-transformers reads it: ``pooling_mode``
    (a name or a list; sentence-transformers >= 6) else the ``pooling_mode_*`` flags; none set: mean."""
    given = cfg.get("pooling_mode")
    if given is not None:
        names = [given] if isinstance(given, str) else list(given)
        return tuple("mean_sqrt_len" if n == "mean_sqrt_len_tokens" else str(n) for n in names) or ("mean",)
    return tuple(mode for key, mode in POOLING_MODES.items() if cfg.get(key)) or ("mean",)


class DenseHead(torch.nn.Module):
    """sentence-transformers' ``Dense``: float ``[B, in] -> [B, out]`` = activation(Linear(x)),
    plus ``x`` (or a bias-free Linear of it) when ``use_residual``."""

    def __init__(self, linear: torch.nn.Linear, activation: torch.nn.Module,
                 residual: torch.nn.Module | None = None):
        super().__init__()
        self.linear, self.activation, self.residual = linear, activation, residual

    def forward(self, x):
        out = self.activation(self.linear(x))
        return out if self.residual is None else out + self.residual(x)


def _activation(spec: str | None, where: Path) -> torch.nn.Module:
    """The torch.nn Module class a Dense config names (``torch.nn.modules.activation.Tanh``),
    instantiated; None or absent: Tanh, sentence-transformers' default. Only ``torch.`` classes:
    anything else would be running the folder's own code."""
    import importlib

    if spec is None:
        return torch.nn.Tanh()
    module_name, _, cls_name = str(spec).rpartition(".")
    cls = None
    if spec.startswith("torch."):
        try:
            cls = getattr(importlib.import_module(module_name), cls_name, None)
        except ImportError:
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ExportError(f"{where}: activation_function {spec!r} is not a torch.nn Module class "
                          "(e.g. torch.nn.modules.activation.Tanh); the exported graph computes only those")
    return cls()


def load_dense(folder: Path) -> DenseHead:
    """A ``Dense`` module folder (``config.json``: in_features, out_features, bias,
    activation_function, use_residual; weights ``linear.*`` / ``residual.*`` in
    ``model.safetensors`` or ``pytorch_model.bin``) as a float32 :class:`DenseHead`.

    Raises:
        ExportError: the config or weights are missing, it reads or writes another feature
            than ``sentence_embedding``, or the weights do not fit the config.
    """
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ExportError(f"{folder}: the Dense module's config.json is missing")
    cfg = json.loads(cfg_path.read_text())
    ports = {k: cfg[k] for k in ("module_input_name", "module_output_name") if cfg.get(k) not in (None, "sentence_embedding")}
    if ports:
        raise ExportError(f"{cfg_path}: {ports}: the exported graph applies Dense to the pooled "
                          "sentence_embedding only")
    weights = _dense_weights(folder)
    try:
        n_in, n_out = int(cfg["in_features"]), int(cfg["out_features"])
        linear = torch.nn.Linear(n_in, n_out, bias=bool(cfg.get("bias", True)))
        residual = None
        if cfg.get("use_residual"):
            residual = torch.nn.Identity() if n_in == n_out else torch.nn.Linear(n_in, n_out, bias=False)
        head = DenseHead(linear, _activation(cfg.get("activation_function"), cfg_path), residual)
        head.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ExportError(f"{folder}: the Dense module does not load: {type(e).__name__}: {e}") from e
    return head.eval()


def _dense_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise ExportError(f"{folder}: the Dense module has no model.safetensors or pytorch_model.bin")


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


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling: Pooling,
         dense: Sequence[torch.nn.Module] = ()) -> torch.Tensor:
    """float ``[B, S, H]`` states and int ``[B, S]`` mask -> float ``[B, k * H]`` (or the last
    ``dense`` module's width) as sentence-transformers' Pooling, Dense and Normalize modules
    compute it: the mean's count clamped at 1e-9, max over positions with masked ones set to
    -1e9, ``cls`` the first and ``lasttoken`` the last attended position (left or right padding)."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    count = mask.sum(1).clamp(min=1e-9)
    parts = []
    for mode in pooling.modes:
        if mode == "cls":  # the first attended position (0 unless left-padded)
            first = attention_mask.to(torch.int32).argmax(1)
            parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), first])
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
    for head in dense:
        out = head(out)
    return torch.nn.functional.normalize(out, p=2.0, dim=-1) if pooling.normalize else out


class PooledEncoder(torch.nn.Module):
    """``(input_ids, attention_mask[, token_type_ids]) -> embeddings`` float32 ``[B, k * H]``:
    ``last_hidden_state`` pooled by :func:`pool` with ``pooling`` (default: mean + L2) and its
    Dense modules (:func:`load_dense`). ``input_names``: the inputs it takes, positionally
    (:func:`model_inputs` of ``model``).

    Raises:
        ExportError: a Dense module does not load (:func:`load_dense`), or the model's forward
            lacks input_ids / attention_mask (:func:`model_inputs`).
    """

    def __init__(self, model, pooling: Pooling = Pooling()):
        super().__init__()
        self.model, self.pooling = model, pooling
        self.input_names = model_inputs(model)
        self.dense = torch.nn.ModuleList(load_dense(d) for d in pooling.dense)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        return pool(hidden, attention_mask, self.pooling, self.dense)


def random_feeds(vocab: int, batch: int, sequence: int, seed: int = 0,
                 names: Sequence[str] = INPUTS) -> dict[str, np.ndarray]:
    """Random valid int64 ``[batch, sequence]`` feeds for the inputs ``names``; row ``i`` has
    ``i`` trailing pad positions (at most ``sequence - 1``), so the masked pooling is exercised."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab, (batch, sequence), dtype=np.int64)
    mask = np.ones((batch, sequence), np.int64)
    for i in range(batch):
        pad = min(i, sequence - 1)
        if pad:
            mask[i, -pad:] = 0
            ids[i, -pad:] = 0
    return only({"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}, names)


def only(feeds: dict[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
    """``feeds`` restricted to the graph inputs ``names`` (a subset of :data:`INPUTS`), in that order."""
    return {n: feeds[n] for n in names}


