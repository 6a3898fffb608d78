"""The KV-cache layout of a text-generation graph: the one home of its names and geometry.

Graph I/O (``L`` layers, ``H`` KV heads, ``D`` head dim, ``V`` vocab):

* ``past_key_values.{i}.key|value`` ``[batch, H, past_sequence, D]`` in
* ``present.{i}.key|value`` ``[batch, H, past_sequence + sequence, D]`` out
* ``logits`` float32 ``[batch, sequence, V]`` and ``last_logits`` float32 ``[batch, V]``

Used by the export (names), validate (greedy decoding), the Triton generation
model (its parameters, shared-memory sizing) and ``pipeline plan``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.artifacts import TensorSpec
from pipeline.errors import ExportError, PipelineError
from pipeline.recipe.kinds import KV_PAST, KV_PAST_RE, KV_PRESENT

LAST_LOGITS = "last_logits"


@dataclass(frozen=True)
class KVLayout:
    """KV-cache geometry: past tensors are ``dtype`` ``[batch, kv_heads, past, head_dim]``.

    ``vocab`` is the logits width (0 where unknown, e.g. read from inputs alone).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    vocab: int = 0

    def past_names(self) -> list[str]:
        """``past_key_values.{i}.key``, ``...value`` for i in 0..L-1, in graph order."""
        return [KV_PAST.format(i=i, kv=kv) for i in range(self.num_layers) for kv in ("key", "value")]

    def present_names(self) -> list[str]:
        """``present.{i}.key``, ``...value`` for i in 0..L-1, in graph order."""
        return [KV_PRESENT.format(i=i, kv=kv) for i in range(self.num_layers) for kv in ("key", "value")]

    def empty_past(self, batch: int) -> dict[str, np.ndarray]:
        """Zero-length past (prefill): float32 ``[batch, H, 0, D]`` per name."""
        shape = (batch, self.kv_heads, 0, self.head_dim)
        return {n: np.zeros(shape, np.float32) for n in self.past_names()}


def kv_layout(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec] = (),
              error: type[PipelineError] = ExportError) -> KVLayout:
    """L, kv_heads, head_dim and dtype from ``past_key_values.{i}.key/value``
    ``[batch, kv_heads, past, head_dim]``; ``vocab`` from a ``logits`` output when given.

    Raises:
        ``error`` (ExportError by default; the triton stage passes TritonConfigError):
            no past inputs, layers not numbered 0..L-1 with a key and a value each,
            non-rank-4 or symbolic kv_heads/head_dim, or layers that disagree.
    """
    past = {(int(m[1]), m[2]): s for s in inputs if (m := KV_PAST_RE.match(s.name))}
    layers = sorted({i for i, _ in past})
    if not past or layers != list(range(len(layers))) or len(past) != 2 * len(layers):
        raise error(
            "export inputs: the generation model needs past_key_values.{i}.key/.value for i in 0..L-1; "
            f"found {sorted(s.name for s in inputs)}"
        )
    geometry = {(len(s.shape), s.shape[1] if len(s.shape) == 4 else None, s.shape[-1], s.dtype) for s in past.values()}
    rank, heads, head_dim, dtype = next(iter(geometry))
    fixed = isinstance(heads, int) and isinstance(head_dim, int) and heads > 0 and head_dim > 0
    if len(geometry) != 1 or rank != 4 or not fixed:
        raise error(
            "export inputs: past_key_values.* must all be [batch, kv_heads, past_sequence, head_dim] with fixed "
            f"kv_heads/head_dim and one dtype; found {sorted((s.name, s.dtype, s.shape) for s in past.values())}"
        )
    assert isinstance(heads, int) and isinstance(head_dim, int)  # checked above
    logits = next((s for s in outputs if s.name == "logits"), None)
    vocab = int(logits.shape[-1]) if logits is not None and isinstance(logits.shape[-1], int) else 0
    return KVLayout(len(layers), heads, head_dim, dtype, vocab)


def layout_from_specs(inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> KVLayout:
    """KVLayout read back from an exported graph's TensorSpecs (with its vocab).

    Raises:
        ExportError: the graph does not have the KV-cache I/O described above, or no logits output.
    """
    if not any(s.name == "logits" for s in outputs):
        raise ExportError("graph has no logits output; not a KV-cache LM export")
    return kv_layout(inputs, outputs)
