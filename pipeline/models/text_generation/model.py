"""Text-generation model code: loading a causal LM, the KV-cache export wrapper,
feeds and greedy decoding. Graph I/O: :mod:`pipeline.models.text_generation.kv`.

* ``input_ids`` int64 ``[batch, sequence]``
* ``attention_mask`` int64 ``[batch, total_sequence]`` with
  ``total_sequence = past_sequence + sequence``
* ``past_key_values.{i}.key|value`` float32 ``[batch, H, past_sequence, D]``
* outputs ``logits`` float32 ``[batch, sequence, V]``,
  ``present.{i}.key|value`` float32 ``[batch, H, past_sequence + sequence, D]``
  and ``last_logits`` float32 ``[batch, V]`` (the last position's logits: what a
  generation step needs, without moving ``sequence x V`` floats through Triton's
  shared memory)
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pipeline.errors import ExportError
from pipeline.sources.model import ModelFileError, package_file
from pipeline.models.text_generation.attention import GROUPED, use_grouped_attention
from pipeline.models.text_generation.kv import LAST_LOGITS, KVLayout, layout_from_specs
from pipeline.recipe.schema import ModelSource
from pipeline.sources.model import load_tokenizer

__all__ = ["LAST_LOGITS", "KVLayout", "KVCacheLM", "load_causal_lm", "kv_layout", "sample_feeds", "complete_point",
           "greedy_generate", "prefill_feeds", "layout_from_specs", "package_file", "Step", "check_model_folder",
           "save_tokenizer", "PositionTable", "position_table", "token_id_range"]

#: the tokenizer files of a Hugging Face folder: the generation model loads tokenizer.json with the
#: tokenizers library; tokenizer_config.json names the special tokens and the chat template.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_tokenizer(tok, generation, folder: Path) -> None:
    """The export's tokenizer folder: ``tok``'s files (``save_pretrained``) and, where it
    has an ``eos_token_id``, the model's ``generation_config.json`` (``generation``, a
    transformers ``GenerationConfig``): the EOS set the generation model stops at and
    ``serve --check`` cuts at (:func:`pipeline.triton.repository.eos_token_ids` reads it first)."""
    tok.save_pretrained(str(folder))
    if generation is not None and generation.eos_token_id is not None:
        generation.save_pretrained(str(folder))


def check_model_folder(source: ModelSource) -> None:
    """Refuse, before any stage, a Hugging Face folder the build would fail on later: one
    whose tokenizer transformers cannot load as a fast tokenizer (the served tokenizer.json),
    or with no EOS id in any of generation_config.json, the tokenizer's special tokens or
    config.json. The EOS set is found as the build finds it: the tokenizer folder the
    export writes (:func:`save_tokenizer`), read by
    :func:`pipeline.triton.repository.eos_token_ids`. A GGUF file carries both.

    Also the tokenizer's ids against the embedding (:func:`_check_vocab`).

    Raises:
        ModelFileError: names the folder, what is missing and the missing files (exit 2); or the
            tokenizer's id count and config.json ``vocab_size`` when ids index past the embedding.
    """
    import tempfile

    from pipeline.errors import TritonConfigError
    from pipeline.triton.repository import eos_token_ids

    path = package_file(source)
    if not path.is_dir():
        return
    missing = [f for f in TOKENIZER_FILES if not (path / f).is_file()]
    lacks = f" (missing: {', '.join(missing)})" if missing else ""
    tok = _fast_tokenizer(path, lacks)
    _check_vocab(path, tok)
    with tempfile.TemporaryDirectory() as tmp:
        save_tokenizer(tok, _generation_config(path), Path(tmp))
        try:
            eos_token_ids(Path(tmp))
        except TritonConfigError as e:
            raise ModelFileError(
                f"model.source: {path}: no EOS token id{lacks}: neither generation_config.json nor config.json "
                "has eos_token_id, and the tokenizer names no eos_token; the generation model needs one to stop. "
                "Add the model's tokenizer_config.json or generation_config.json") from e


def token_id_range(tok) -> int:
    """How many token ids the tokenizer can give: its largest id (added tokens included) + 1."""
    return max(tok.get_vocab().values(), default=-1) + 1


def _check_vocab(path: Path, tok) -> None:
    """The tokenizer's ids must index the model's embedding: ``config.json`` ``vocab_size`` rows.
    More rows than ids (a vocabulary padded to a multiple of 64) is fine: the generation model
    never samples the ids past the tokenizer's (:mod:`pipeline.models.text_generation.served`).

    Raises:
        ModelFileError: the tokenizer has ids past the last embedding row, naming both numbers.
    """
    rows = _embedding_rows(path)
    ids = token_id_range(tok)
    if rows is not None and ids > rows:
        raise ModelFileError(
            f"model.source: {path}: the tokenizer gives token ids up to {ids - 1} ({ids} ids, tokenizer.json with "
            f"its added tokens), but config.json vocab_size is {rows}: the embedding has {rows} rows, so the "
            f"{ids - rows} ids from {rows} on index past it (ONNX Runtime: a Gather index out of range, on the first "
            "prompt that holds one). Use the tokenizer the model was trained with, or the config.json that matches "
            "its weights")


def _embedding_rows(path: Path) -> int | None:
    """``vocab_size`` of the folder's config.json (its text config's, for a composite model), or None."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError):
        return None  # the export's load says what is wrong with it
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    rows = getattr(text, "vocab_size", None)
    return rows if isinstance(rows, int) and rows > 0 else None


@dataclass(frozen=True)
class PositionTable:
    """How a causal LM encodes positions, from its config and its modules (built on the meta
    device, no weights): ``kind`` ``learned`` (an embedding table of positions: GPT-2, OPT,
    GPT-BigCode; no position past it exists), ``rotary`` (RoPE: positions past the table were
    not trained, but compute) or ``none`` (ALiBi, or no positions); ``size``: the config's
    ``key`` (``n_positions`` / ``max_position_embeddings``); ``model``: its class name."""

    kind: str
    size: int | None
    key: str
    model: str


#: config.json keys that hold the position table's size, in the order they are read
POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length", "max_sequence_length")


def position_table(source: ModelSource) -> PositionTable | None:
    """:class:`PositionTable` of the source (a Hugging Face folder or a GGUF file); None when it is
    not there, its config does not load or names no table size."""
    import torch
    from transformers import AutoConfig

    try:
        path = package_file(source)
    except ModelFileError:
        return None
    size: object
    try:
        if path.suffix == ".gguf":  # its header alone: transformers reads the whole file's metadata (~9 s)
            arch, size = _gguf_positions(path)
            cfg = AutoConfig.for_model(arch, max_position_embeddings=size)
            key = f"{arch}.context_length (GGUF)"
        else:
            cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
            raw = _raw_config(path)
            found = next((k for k in POSITION_KEYS if isinstance(raw.get(k), int)), None)
            text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
            size = raw[found] if found else getattr(text, "max_position_embeddings", None)
            key = found or "max_position_embeddings"
    except (OSError, ValueError, KeyError):
        return None
    if not isinstance(size, int) or size <= 0:
        return None
    model = _meta_model(cfg)
    if model is None:
        return None
    name = type(model).__name__
    try:
        tokens = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        tokens = None
    tables = [m for m in model.modules() if isinstance(m, torch.nn.Embedding) and m is not tokens
              and size <= m.num_embeddings <= size + 2]  # OPT's table has 2 rows more (its offset)
    if tables:
        return PositionTable("learned", size, key, name)
    if any("Rotary" in type(m).__name__ for m in model.modules()):
        return PositionTable("rotary", size, key, name)
    return PositionTable("none", size, key, name)


def _meta_model(cfg):
    """The causal LM of ``cfg`` on torch's meta device (no memory), with one layer where the config
    allows it (the module types are what is read; 32 layers take seconds to make); None when
    transformers cannot build it (the export then says why)."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    one = copy.deepcopy(cfg)
    text = one.get_text_config() if hasattr(one, "get_text_config") else one
    layers = getattr(text, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 1:
        text.num_hidden_layers = 1
        for key in ("layer_types", "block_types"):  # per-layer lists follow the count
            if isinstance(getattr(text, key, None), list):
                setattr(text, key, getattr(text, key)[:1])
    for attempt in (one, cfg):
        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(attempt)
        except Exception:  # noqa: BLE001  a config that needs its layers, then one transformers cannot build
            continue
    return None


def _gguf_positions(path: Path) -> tuple[str, int]:
    """``(general.architecture, <arch>.context_length)`` of a GGUF file, read from its header's
    key-value pairs until both are found (they come before the tokenizer's large arrays).

    Raises:
        ValueError: not a GGUF file, or it has neither key.
    """
    import struct

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as fh:
        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = fh.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: truncated GGUF header")
            return struct.unpack("<" + fmt, data)[0]

        def string() -> str:
            return fh.read(read("Q")).decode("utf-8", "replace")

        def value(kind: int):
            if kind == 8:
                return string()
            if kind == 9:
                item, count = read("I"), read("Q")
                if item in scalar:  # skip without reading each item
                    fh.seek(count * struct.calcsize("<" + scalar[item]), 1)
                else:
                    for _ in range(count):
                        value(item)
                return None
            if kind not in scalar:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")
            return read(scalar[kind])

        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        read("I")  # version
        read("Q")  # tensor count
        found: dict[str, object] = {}
        for _ in range(read("Q")):
            name = string()
            found[name] = value(read("I"))
            arch = found.get("general.architecture")
            if isinstance(arch, str) and isinstance(found.get(f"{arch}.context_length"), int):
                return arch, int(found[f"{arch}.context_length"])  # type: ignore[call-overload]
    raise ValueError(f"{path}: no general.architecture / <arch>.context_length in its header")


def _raw_config(folder: Path) -> dict:
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    inner = data.get("text_config")
    return {**data, **inner} if isinstance(inner, dict) else data


def _fast_tokenizer(path: Path, lacks: str):
    """The folder's tokenizer, which must be a fast one (it saves tokenizer.json).

    Raises:
        ModelFileError: transformers cannot load it, or only as a slow tokenizer.
    """
    try:
        tok = load_tokenizer(path)
    except (OSError, ValueError) as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise ModelFileError(f"model.source: {path}: no loadable tokenizer{lacks} ({why}); the build loads it from "
                             "tokenizer.json: copy the model's tokenizer files into the folder") from None
    if not tok.is_fast:
        raise ModelFileError(f"model.source: {path}: only a slow tokenizer{lacks}; the generation model loads "
                             "tokenizer.json with the tokenizers library: add the model's tokenizer.json")
    return tok


def _generation_config(path: Path):
    """The folder's GenerationConfig as transformers builds it for the model: generation_config.json,
    else derived from config.json."""
    from transformers import AutoConfig, GenerationConfig

    if (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(path), local_files_only=True)
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(path), local_files_only=True))


def load_causal_lm(source: ModelSource, attention: str = GROUPED):
    """Load the model (FP32, eval mode) and its tokenizer, offline.

    A ``.gguf`` path is dequantized to FP32 by transformers (needs ``gguf``).
    ``attention``: :data:`~pipeline.models.text_generation.attention.GROUPED` (default: grouped-query
    attention without repeated K/V, for models that dispatch through transformers'
    ``AttentionInterface``; others keep their own) or a transformers implementation name
    (``"sdpa"``, ``"eager"``). The export and its torch reference both use the loaded model,
    so they compare the same attention.
    Returns ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM

    path = package_file(source)
    kw: dict = {"local_files_only": True}
    if path.suffix == ".gguf":
        folder, kw["gguf_file"] = str(path.parent), path.name
    else:
        folder = str(path)
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    if attention == GROUPED:
        use_grouped_attention(model)
    else:
        model.set_attn_implementation(attention)
    return model.eval(), tok


def kv_layout(model) -> KVLayout:
    """The KV layout of a loaded transformers causal LM, read from what it returns: one
    forward pass on 2 tokens (ids 0 and 1), the cache layers' key shapes ``[1, H, 2, D]``
    and the logits width. Works whatever the config calls its heads (MQA, GQA, fused QKV).

    Raises:
        ExportError: the model returns no per-layer key/value cache (e.g. state-space
            layers), or its layers disagree on ``[H, D]`` or dtype.
    """
    out, cache, layers = _probe(model)
    keys = [getattr(layer, "keys", None) for layer in layers]
    name = type(model).__name__
    if not keys or any(k is None or k.ndim != 4 for k in keys):
        raise ExportError(f"model {name}: it returns no per-layer key/value cache [batch, heads, sequence, "
                          f"head_dim] (got {type(cache).__name__}); state-space or recurrent layers have no KV "
                          "cache, which the text-generation export needs")
    geometry = {(k.shape[1], k.shape[3]) for k in keys} | {(v.shape[1], v.shape[3]) for v in
                                                            (layer.values for layer in layers)}
    if len(geometry) != 1:
        raise ExportError(f"model {name}: its cache layers differ in [kv_heads, head_dim] ({sorted(geometry)}); "
                          "the text-generation export needs one geometry for every layer")
    heads, head_dim = next(iter(geometry))
    return KVLayout(num_layers=len(keys), kv_heads=int(heads), head_dim=int(head_dim), vocab=int(out.logits.shape[-1]))


def output_cache(out):
    """The KV cache a forward pass returned: ``out.cache`` (transformers >= 5.24, whose
    ``past_key_values`` property logs a deprecation), else ``out.past_key_values``."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _probe(model):
    """``(output, cache, cache layers)`` of one forward pass on 2 tokens (ids 0 and 1)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[0, 1]]), use_cache=True)
    cache = output_cache(out)
    return out, cache, list(getattr(cache, "layers", None) or [])


def sliding_window(model) -> int | None:
    """The smallest ``sliding_window`` of the cache layers the model returns (transformers'
    ``DynamicSlidingWindowLayer``, e.g. Gemma 2, Mistral with a window), None when every layer
    keeps the whole past. Such a layer keeps only its last ``window - 1`` positions."""
    windows = [w for layer in _probe(model)[2] if (w := getattr(layer, "sliding_window", None))]
    return min(windows) if windows else None


def forward_arguments(model) -> tuple[str, bool]:
    """``(cache argument name, takes position_ids)`` of the model's ``forward``: ``cache``
    (transformers >= 5.24) or ``past_key_values``; ALiBi models (BLOOM, MPT) take no positions.

    Raises:
        ExportError: ``forward`` takes neither cache argument.
    """
    params = inspect.signature(model.forward).parameters
    cache = next((n for n in ("cache", "past_key_values") if n in params), None)
    if cache is None:
        raise ExportError(f"model {type(model).__name__}: forward takes no `cache` / `past_key_values` argument; "
                          "the text-generation export feeds the KV cache through it")
    return cache, "position_ids" in params


class KVCacheLM(torch.nn.Module):
    """Flat-tensor wrapper: ``(input_ids, attention_mask, *past) -> (logits, *present, last_logits)``.

    ``last_logits`` (``logits[:, -1, :]``) comes last, so code that unpacks
    ``logits, *present`` and zips ``present`` with the past names is unaffected.

    Position ids are derived from the attention mask (``cumsum - 1``, as transformers'
    ``generate`` does), so left padding and a non-empty past give the right rotary or
    learned positions (OPT adds its offset of 2 itself); models whose ``forward`` takes no
    ``position_ids`` (ALiBi: BLOOM, MPT) read positions from the mask themselves.
    """

    def __init__(self, model, layout: KVLayout):
        super().__init__()
        self.model, self.layout = model, layout
        self.cache_arg, self.takes_positions = forward_arguments(model)

    def output_names(self) -> list[str]:
        """Graph output names, in :meth:`forward`'s order (for ``torch.onnx.export``)."""
        return ["logits", *self.layout.present_names(), LAST_LOGITS]

    def forward(self, input_ids, attention_mask, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(self.layout.num_layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        kwargs = {self.cache_arg: cache}
        if self.takes_positions:
            past_len = past[0].shape[2]
            kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **kwargs)
        flat = []
        for layer in output_cache(out).layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat, out.logits[:, -1, :])


def sample_feeds(layout: KVLayout, batch: int, sequence: int, past: int, seed: int = 0,
                 left_pad: int = 0) -> dict[str, np.ndarray]:
    """Random but valid feeds for one shape point: an all-ones attention mask, except that with
    ``left_pad`` > 0 and ``batch`` >= 2 row 0 is left-padded: its first ``left_pad`` positions
    of ``total_sequence`` masked (cut to leave one real position), past or new tokens alike."""
    rng = np.random.default_rng(seed)
    feeds = {
        "input_ids": rng.integers(0, layout.vocab, (batch, sequence), dtype=np.int64),
        "attention_mask": np.ones((batch, past + sequence), np.int64),
    }
    if batch >= 2:
        feeds["attention_mask"][0, :min(left_pad, past + sequence - 1)] = 0
    shape = (batch, layout.kv_heads, past, layout.head_dim)
    for n in layout.past_names():
        feeds[n] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def complete_point(point: dict[str, int]) -> dict[str, int]:
    """Fill in ``total_sequence = past_sequence + sequence`` when absent."""
    out = dict(point)
    if "total_sequence" not in out and {"sequence", "past_sequence"} <= out.keys():
        out["total_sequence"] = out["sequence"] + out["past_sequence"]
    return out


Step = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def greedy_generate(step: Step, layout: KVLayout, prompt_ids: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy decoding with the KV cache: one prefill, then one token per step.

    Args:
        step: runs the graph on a feed dict and returns ``[logits, *present]``.
        prompt_ids: int64 ``[batch, prompt_len]``; all rows the same length, no padding.
        new_tokens: number of tokens to generate per row.

    Returns:
        int64 ``[batch, new_tokens]``.
    """
    batch, plen = prompt_ids.shape
    feeds = {"input_ids": prompt_ids.astype(np.int64), "attention_mask": np.ones((batch, plen), np.int64)}
    feeds.update(layout.empty_past(batch))
    out = np.zeros((batch, new_tokens), np.int64)
    for t in range(new_tokens):
        logits, *present = step(feeds)
        nxt = logits[:, -1, :].argmax(-1).astype(np.int64)
        out[:, t] = nxt
        total = feeds["attention_mask"].shape[1] + 1
        feeds = {"input_ids": nxt[:, None], "attention_mask": np.ones((batch, total), np.int64)}
        feeds.update(dict(zip(layout.past_names(), present)))
    return out


def prefill_feeds(exp, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Prefill feeds for token windows int64 ``[batch, seq]`` (empty past)."""
    layout = layout_from_specs(exp.inputs, exp.outputs)
    feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones(ids.shape, np.int64)}
    feeds.update(layout.empty_past(ids.shape[0]))
    return feeds

