"""GGUF block-quantized weights as integers, block scales and block offsets (``method: source``).

A GGUF file (llama.cpp) stores a linear layer's weight ``W`` as ``[N_out, K_in]`` rows (GGUF
lists the dimensions reversed, ``ne = [K, N]``), each row cut into blocks along ``K``. This
module reads the blocks (``gguf.GGUFReader``), proves they decode to a given FP32 weight, and
turns them, with no second rounding of any value, into what a blocked ``DequantizeLinear``
holds (:class:`DQForm`); :mod:`pipeline.quant.int4` builds the ONNX graph from that.

The block formats are GGML's (structs ``block_q4_0`` ... in ``ggml/src/ggml-common.h``, decoded
by ``dequantize_row_*`` in ``ggml/src/ggml-quants.c``; the NumPy twins are
``gguf.quants.<TYPE>.dequantize_blocks``, which transformers uses to load a GGUF file and which
:meth:`BlockTensor.ggml_decode` reproduces bit for bit). ``q`` is the stored code, ``fp16`` an
IEEE half, ``fl()`` one float32 rounding:

======  =====  ================================================  ======================================
type    block  GGML float32 value of an element                  :class:`DQForm` (``d > 0`` blocks)
======  =====  ================================================  ======================================
Q4_0    32     ``d * (q - 8)``; ``d`` fp16, ``q`` in 0..15        INT4 ``q - 8``, scale ``d``
Q8_0    32     ``d * q``; ``d`` fp16, ``q`` int8                   INT8 ``q``, scale ``d``
Q4_1    32     ``fl(d * q + m)``; ``d``, ``m`` fp16, ``q`` 0..15   INT4 ``q - 8``, ``d``, offset ``fl(m + 8d)``
Q4_K    256    per 32-wide sub-block ``j``: ``fl(s_j * q -         per sub-block (block 32): INT4 ``q - 8``,
               dmin * mn_j)``, ``s_j = d * sc_j``; ``d``,          ``s_j``, offset ``fl(8 s_j - dmin*mn_j)``
               ``dmin`` fp16, ``sc_j``, ``mn_j`` 6-bit, q 0..15
Q6_K    256    per 16-wide sub-block ``j``: ``s_j * (q - 32)``,    per sub-block (block 16): INT8
               ``s_j = d * sc_j``; ``d`` fp16, ``sc_j`` int8,      ``q - 32``, scale ``s_j``
               ``q`` in 0..63
======  =====  ================================================  ======================================

Exactness: every scale (``d``; ``d * sc_j`` with ``|sc_j| <= 128``) has at most 18 significant
bits and every integer at most 5, so scales and ``scale * value`` are exact in float32:
DequantizeLinear's ``value * scale`` *is* GGML's value for Q4_0, Q8_0 and Q6_K. For Q4_1 / Q4_K
GGML rounds once, ``fl(d*q + m)``; the DQ form computes ``d*(q-8)`` exactly and adds
``offset = fl(m + 8d)`` per block through the activations (:func:`pipeline.quant.int4.
block_matmul`), so its weight ``d*(q-8) + offset`` equals the exact ``d*q + m`` up to that one
float32 rounding of ``m + 8d`` per block (none when ``m`` and ``8d`` are within about 2**13 of
each other: every block of SmolLM2-135M's Q4_1 file), and GGML's float32 weight up to that plus
GGML's own rounding (half an ulp of the weight).

Scales are made positive, as TensorRT needs (its parser refuses zero and negative INT8 scales;
``pipeline.checks.graph`` refuses them for every type). A block with ``d < 0`` is stored negated:
INT8 ``-q`` (refused if ``q`` holds -128); INT4 ``7 - q`` with scale ``-d`` and offset
``fl(m + 7d)`` (``-8`` has no INT4 negation), which for Q4_0 (``m = -8d``) is ``-d``, exact.
llama.cpp's Q4_0 quantizer gives ``d < 0`` to every block whose largest magnitude is positive,
so a real Q4_0 file gets the offset branch too, with exact offsets. A block with ``d = 0`` is
stored as values 0, scale 1 (offset ``m``). Equal products, so none of this rounds anything.

Errors are :class:`GGUFWeightError` (exit 2, bad input): an unsupported type (names the tensor
and the type), a block with a NaN or infinite fp16 field (names the block), blocks that do not
decode to the reference weight.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.errors import QuantizationError

if TYPE_CHECKING:
    import gguf

#: GGML block types carried as block DequantizeLinear: type -> (bits of the ONNX integer,
#: block size along K in the ONNX graph).
SUPPORTED: dict[str, tuple[int, int]] = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q4_K": (4, 32),
                                         "Q6_K": (8, 16)}

#: elements and bytes per GGML block (``gguf.constants.GGML_QUANT_SIZES``)
_LAYOUT = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210)}

#: GGUF tensor types that are plain floats, not blocks
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


class GGUFWeightError(QuantizationError):
    """A GGUF weight cannot be carried as block DequantizeLinear: its type is not one of
    :data:`SUPPORTED`, a block has a NaN or infinite scale or minimum, or its blocks do not
    decode to the weight the graph holds (exit 2: the GGUF file or graph is bad input)."""


@dataclass(frozen=True)
class DQForm:
    """A weight ``W [N, K]`` as blocked DequantizeLinear parts, GGUF orientation (rows = output
    features, blocks along ``K``): ``W = values * scales + offsets`` per block.

    Attributes:
        bits: 4 (ONNX INT4: values in [-8, 7]) or 8 (ONNX INT8: values in [-128, 127]).
        block_size: elements per scale along ``K`` (32; 16 for Q6_K).
        values: int8 ``[N, K]``.
        scales: float32 ``[N, K // block_size]``, all finite and > 0.
        offsets: float32 ``[N, K // block_size]`` added to every element of a block, or None when
            it is 0 everywhere (Q8_0, Q6_K, and Q4_0 without negative scales).
    """

    bits: int
    block_size: int
    values: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None

    def weight(self) -> np.ndarray:
        """float64 ``[N, K]``: ``values * scales + offsets``, the weight the DQ form computes with
        (exact: a sum of two float32 terms), for error measurements."""
        w = np.repeat(self.scales, self.block_size, axis=1).astype(np.float64) * self.values
        return w if self.offsets is None else w + np.repeat(self.offsets, self.block_size, axis=1)

    def dequantized(self) -> np.ndarray:
        """float32 ``[N, K]``: what DequantizeLinear gives, ``values * scales`` (one exact product)."""
        return np.repeat(self.scales, self.block_size, axis=1) * self.values.astype(np.float32)

    def onnx_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """``(values [K, N] int8, scales [K // block_size, N] float32, offsets [K // block_size, N]
        float32 or None)``: the ``B`` of ``MatMul(x [.., K], B [K, N])`` with blocks along axis 0,
        as DequantizeLinear ``axis=0, block_size=block_size`` takes them."""
        off = None if self.offsets is None else np.ascontiguousarray(self.offsets.T)
        return np.ascontiguousarray(self.values.T), np.ascontiguousarray(self.scales.T), off


@dataclass(frozen=True)
class BlockTensor:
    """One 2-D GGUF weight ``W [N, K]`` as GGML stores it, per block ``W = fl(d * code + mins)``
    (``d * code`` when ``mins`` is None; that product is exact).

    Attributes:
        name: the GGUF tensor name (``blk.0.attn_q.weight``).
        ggml_type: ``Q4_0`` / ``Q4_1`` / ``Q8_0`` / ``Q4_K`` / ``Q6_K``.
        codes: ``[N, K]``: uint8 0..15 for the 4-bit types; int8 for Q8_0 (``q``) and Q6_K
            (``q - 32``).
        d: float32 ``[N, K // block_size]``, the (sub-)block scale: ``d``; ``d * sc_j`` for K-quants.
        mins: float32 ``[N, K // block_size]``, the additive term: Q4_0 ``-8d`` (so that
            ``fl(d*q - 8d) = d*(q - 8)``, both exact), Q4_1 ``m``, Q4_K ``-(dmin * mn_j)``; None
            for Q8_0 and Q6_K.
    """

    name: str
    ggml_type: str
    codes: np.ndarray
    d: np.ndarray
    mins: np.ndarray | None

    @property
    def shape(self) -> tuple[int, int]:
        """``(N, K)``: output features, input features."""
        return self.codes.shape  # type: ignore[return-value]

    @property
    def bits(self) -> int:
        return SUPPORTED[self.ggml_type][0]

    @property
    def block_size(self) -> int:
        return SUPPORTED[self.ggml_type][1]

    def ggml_decode(self) -> np.ndarray:
        """float32 ``[N, K]``: every element as GGML computes it, equal (IEEE ``==``; a zero's
        sign may differ) to ``gguf.quants.dequantize`` of the source blocks."""
        w = np.repeat(self.d, self.block_size, axis=1) * self.codes.astype(np.float32)
        return w if self.mins is None else w + np.repeat(self.mins, self.block_size, axis=1)

    def rows(self, order: np.ndarray) -> BlockTensor:
        """The same weight with rows reordered, ``new[i] = self[order[i]]``: whole rows, so whole
        blocks, move (codes and per-block terms together)."""
        return replace(self, codes=np.ascontiguousarray(self.codes[order]), d=np.ascontiguousarray(self.d[order]),
                       mins=None if self.mins is None else np.ascontiguousarray(self.mins[order]))

    def dq_form(self) -> DQForm:
        """The blocks as :class:`DQForm`, scales made positive (see the module notes).

        Raises:
            GGUFWeightError: an INT8 block with a negative scale holds -128 (names the block).
        """
        bits, bs = SUPPORTED[self.ggml_type]
        n, k = self.shape
        codes = self.codes.reshape(n, k // bs, bs)
        neg, zero = (self.d < 0)[..., None], (self.d == 0)[..., None]
        scales = np.where(self.d == 0, np.float32(1), np.abs(self.d)).astype(np.float32)
        if bits == 8:
            clash = neg[..., 0] & (codes == -128).any(axis=2)
            if clash.any():
                row, blk = (int(i[0]) for i in np.nonzero(clash))
                raise GGUFWeightError(
                    f"GGUF tensor {self.name!r} ({self.ggml_type}): {_block_words(row, blk, k, bs)} has a negative "
                    "scale and the value -128; INT8 DequantizeLinear needs positive scales (TensorRT) and "
                    "-(-128) is not INT8")
            values = np.where(zero, 0, np.where(neg, -codes, codes)).astype(np.int8)
            return DQForm(bits, bs, values.reshape(n, k), scales, None)
        assert self.mins is not None  # every 4-bit type has one (Q4_0: -8d)
        c = codes.astype(np.int8)
        values = np.where(zero, np.int8(0), np.where(neg, 7 - c, c - 8)).astype(np.int8)
        # one float32 rounding of mins + 8d (7d for a negated block); mins alone where d = 0
        step = np.where(self.d < 0, np.float32(7), np.float32(8)) * self.d
        offsets = np.where(self.d == 0, self.mins, self.mins + step).astype(np.float32)
        return DQForm(bits, bs, values.reshape(n, k), scales, offsets if offsets.any() else None)


def _block_words(row: int, blk: int, k: int, width: int) -> str:
    return f"block {row * (k // width) + blk} (row {row}, columns {blk * width}..{(blk + 1) * width - 1})"


def _fp16(raw: np.ndarray) -> np.ndarray:
    """float32 ``[n]`` of little-endian IEEE halves stored as ``[n, 2]`` uint8."""
    return np.ascontiguousarray(raw).view("<f2")[:, 0].astype(np.float32)


def _check_finite(name: str, ggml_type: str, fields: dict[str, np.ndarray], k: int) -> None:
    """Raise naming the first GGML block (flat index, row, columns) whose fp16 field is NaN/inf."""
    width = _LAYOUT[ggml_type][0]
    for field, vals in fields.items():
        bad = ~np.isfinite(vals)
        if bad.any():
            flat = int(np.flatnonzero(bad)[0])
            row, blk = divmod(flat, k // width)
            raise GGUFWeightError(
                f"GGUF tensor {name!r} ({ggml_type}): {_block_words(row, blk, k, width)} has {field} = "
                f"{float(vals[flat])}; a NaN or infinite scale has no DequantizeLinear form ({int(bad.sum())} "
                "such block(s) in the tensor)")


def from_bytes(name: str, ggml_type: str, data: np.ndarray, shape: tuple[int, int]) -> BlockTensor:
    """Read raw GGUF blocks as a :class:`BlockTensor`.

    Args:
        name: the tensor's name, for messages.
        ggml_type: the GGML type's name (``gguf.GGMLQuantizationType.Q4_1.name``).
        data: uint8, the tensor's bytes in GGUF order (``[N, bytes per row]`` as ``GGUFReader``
            gives them, or flat).
        shape: ``(N, K)``: rows, elements per row (``ReaderTensor.shape`` reversed).

    Raises:
        GGUFWeightError: ``ggml_type`` is not in :data:`SUPPORTED` (names the tensor and its
            type); the bytes are not ``N`` rows of whole blocks; a block's ``d`` / ``m`` /
            ``dmin`` is NaN or infinite (names the tensor and the block).
    """
    if ggml_type not in SUPPORTED:
        kind = "a float type, not block-quantized" if ggml_type in FLOAT_TYPES else "a block type with no DQ form here"
        raise GGUFWeightError(
            f"GGUF tensor {name!r} is {ggml_type} ({kind}); block DequantizeLinear takes "
            f"{', '.join(SUPPORTED)}")
    n, k = (int(s) for s in shape)
    width, nbytes = _LAYOUT[ggml_type]
    data = np.asarray(data)
    if k % width or data.size != n * (k // width) * nbytes or data.dtype != np.uint8:
        raise GGUFWeightError(f"GGUF tensor {name!r} ({ggml_type}) of shape [{n}, {k}]: {data.size} {data.dtype} "
                              f"values, expected {n} rows of {width}-element blocks of {nbytes} bytes")
    blocks = np.ascontiguousarray(data).reshape(-1, nbytes)
    mins = None
    if ggml_type == "Q4_0":
        d = _fp16(blocks[:, 0:2])
        _check_finite(name, ggml_type, {"d": d}, k)
        codes, d, mins = _nibbles(blocks[:, 2:18]), d[:, None], (np.float32(-8) * d)[:, None]
    elif ggml_type == "Q4_1":
        d, m = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
        _check_finite(name, ggml_type, {"d": d, "m": m}, k)
        codes, d, mins = _nibbles(blocks[:, 4:20]), d[:, None], m[:, None]
    elif ggml_type == "Q8_0":
        d = _fp16(blocks[:, 0:2])
        _check_finite(name, ggml_type, {"d": d}, k)
        codes, d = blocks[:, 2:34].view(np.int8), d[:, None]
    elif ggml_type == "Q4_K":
        codes, d, mins = _q4_k(name, blocks, k)
    else:
        codes, d = _q6_k(name, blocks, k)
    bs = SUPPORTED[ggml_type][1]
    per_block = (n, k // bs)
    return BlockTensor(name, ggml_type, np.ascontiguousarray(codes.reshape(n, k)),
                       np.ascontiguousarray(d.reshape(per_block), np.float32),
                       None if mins is None else np.ascontiguousarray(mins.reshape(per_block), np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[n, 16]`` bytes -> ``[n, 32]`` codes: low nibbles are elements 0..15, high 16..31 (GGML)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_k(name: str, blocks: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks ``[n, 144]`` (``block_q4_K``: ``d``, ``dmin`` fp16; 12 bytes of 6-bit
    scales and mins unpacked as ``get_scale_min_k4``; 128 bytes of codes, each 32 bytes holding
    64 elements, low nibbles first) -> codes ``[n, 256]``, ``d * sc_j`` ``[n, 8]``,
    ``-(dmin * mn_j)`` ``[n, 8]``."""
    d, dmin = _fp16(blocks[:, 0:2]), _fp16(blocks[:, 2:4])
    _check_finite(name, "Q4_K", {"d": d, "dmin": dmin}, k)
    s = blocks[:, 4:16]
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1).astype(np.float32)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1).astype(np.float32)
    qs = blocks[:, 16:144].reshape(-1, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    return codes, d[:, None] * sc, -(dmin[:, None] * mn)


def _q6_k(name: str, blocks: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks ``[n, 210]`` (``block_q6_K``: 128 bytes ``ql`` of low nibbles, 64 bytes
    ``qh`` of 2-bit pairs, 16 int8 scales, ``d`` fp16). ``dequantize_row_q6_K``'s order: in each
    128-element half, element ``32j + l`` (j 0..3) takes the low (j < 2) or high nibble of
    ``ql[l + 32 (j % 2)]`` and bits ``2j..2j+1`` of ``qh[l]`` -> codes ``q - 32`` int8
    ``[n, 256]``, ``d * sc_j`` ``[n, 16]``."""
    d = _fp16(blocks[:, 208:210])
    _check_finite(name, "Q6_K", {"d": d}, k)
    ql = blocks[:, 0:128].reshape(-1, 2, 2, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, half, j, l]
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (low | ((qh & 0x03) << 4)).reshape(-1, 256)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    return q.astype(np.int8) - np.int8(32), d[:, None] * sc


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """``gguf.GGUFReader`` of ``path`` (memory-mapped, read-only).

    Raises:
        GGUFWeightError: not readable as GGUF (names the file and the reader's complaint)."""
    import gguf

    try:
        return gguf.GGUFReader(str(path), "r")
    except (OSError, ValueError) as e:
        raise GGUFWeightError(f"{path}: not a readable GGUF file ({e})") from e


def tensor_info(reader: gguf.GGUFReader, name: str):
    """The ``gguf.ReaderTensor`` named ``name``.

    Raises:
        GGUFWeightError: the file has no tensor of that name."""
    for t in reader.tensors:
        if t.name == name:
            return t
    raise GGUFWeightError(f"the GGUF file has no tensor {name!r}")


def read_tensor(reader: gguf.GGUFReader, name: str) -> BlockTensor:
    """The GGUF tensor ``name`` as a :class:`BlockTensor`, rows in GGUF's order.

    Raises:
        GGUFWeightError: no such tensor, not 2-D, or as :func:`from_bytes`.
    """
    t = tensor_info(reader, name)
    if len(t.shape) != 2:
        raise GGUFWeightError(f"GGUF tensor {name!r} has shape {list(reversed(t.shape.tolist()))}; "
                              "block DequantizeLinear carries 2-D weights only")
    k, n = (int(s) for s in t.shape)
    return from_bytes(name, t.tensor_type.name, t.data, (n, k))


def _field(reader: gguf.GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def hf_row_order(reader: gguf.GGUFReader, name: str) -> np.ndarray | None:
    """The row order undoing llama.cpp's rotary permutation of tensor ``name``
    (``hf[i] = gguf[order[i]]``), or None where the tensor has none.

    llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders the rows of
    ``attn_q`` (``n_head`` = ``llama.attention.head_count``) and ``attn_k`` (``n_head`` =
    ``llama.attention.head_count_kv``) inside each head, interleaving the two rotary halves;
    transformers undoes it on load (``LlamaTensorProcessor._reverse_permute_weights`` in
    ``transformers/modeling_gguf_pytorch_utils.py``), for ``general.architecture`` ``llama``
    only, as here. See :func:`llama_qk_order`.
    """
    if _field(reader, "general.architecture") != "llama":
        return None
    part = next((p for p in (".attn_q.", ".attn_k.") if p in name), None)
    if part is None:
        return None
    heads = _field(reader, "llama.attention.head_count" if part == ".attn_q." else "llama.attention.head_count_kv")
    if heads is None:
        return None
    return llama_qk_order(int(tensor_info(reader, name).shape[-1]), int(heads))


#: llama.cpp's per-layer GGUF tensors (``blk.{i}.<part>.weight``) -> transformers' Llama modules
#: (``model.layers.{i}.<module>``), as ``gguf.constants.TENSOR_NAMES`` / ``MODEL_TENSORS`` name them
LLAMA_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}


def hf_module(reader: gguf.GGUFReader, name: str) -> str | None:
    """The transformers Llama module whose Linear holds GGUF tensor ``name``:
    ``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj``; ``output.weight`` -> ``lm_head``, and
    ``token_embd.weight`` -> ``lm_head`` too when the file has no ``output.weight`` (tied); None
    for other tensors or architectures than ``llama``."""
    if _field(reader, "general.architecture") != "llama":
        return None
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in LLAMA_MODULES:
        return f"layers.{parts[1]}.{LLAMA_MODULES[parts[2]]}"
    if name == "output.weight" or (name == "token_embd.weight" and
                                   not any(t.name == "output.weight" for t in reader.tensors)):
        return "lm_head"
    return None


def llama_qk_order(rows: int, n_head: int) -> np.ndarray:
    """int64 ``[rows]``: transformers' reverse of llama.cpp's q/k row permutation as row indices,
    ``arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)``, ``dim = rows / n_head / 2``
    (the same reshape transformers applies to the weight)."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(2, 1).reshape(rows)


def prove_decode(block: BlockTensor, reference: np.ndarray, what: str = "") -> None:
    """Check that ``block`` decodes (:meth:`BlockTensor.ggml_decode`) to ``reference``, the FP32
    weight ``[N, K]`` in the same row order, element for element (IEEE ``==``: +0 and -0 are
    equal, nothing else may differ).

    Raises:
        GGUFWeightError: shapes differ, or some element differs; names the tensor (and ``what``,
            e.g. the graph's initializer), the count and the first differing row, column and block.
    """
    where = f" ({what})" if what else ""
    reference = np.asarray(reference)
    if reference.shape != block.shape:
        raise GGUFWeightError(f"GGUF tensor {block.name!r}{where}: shape [N, K] {list(block.shape)} differs from "
                              f"the reference weight's {list(reference.shape)}")
    decoded = block.ggml_decode()
    diff = decoded != reference
    if diff.any():
        row, col = (int(i[0]) for i in np.nonzero(diff))
        raise GGUFWeightError(
            f"GGUF tensor {block.name!r} ({block.ggml_type}){where}: its blocks do not decode to the reference FP32 "
            f"weight: {int(diff.sum())} of {diff.size} elements differ, first at row {row}, column {col} (block "
            f"{col // block.block_size} of the row): {float(decoded[row, col])!r} vs {float(reference[row, col])!r}; "
            "refusing to carry it as block DequantizeLinear")


@dataclass(frozen=True)
class FormError:
    """How far a :class:`DQForm` is from its :class:`BlockTensor` (:func:`form_error`)."""

    #: blocks whose offset was rounded (``fl(m + 8d) != m + 8d``), and all blocks
    rounded_offsets: int
    blocks: int
    #: max over elements of |DQ form weight - GGML's exact value ``d*q + m``| (real arithmetic)
    max_vs_exact: float
    #: max over elements of |DQ form weight - GGML's float32 value| (``ggml_decode``)
    max_vs_ggml: float


def form_error(block: BlockTensor, form: DQForm | None = None) -> FormError:
    """Measure ``form`` (default ``block.dq_form()``) against ``block``, in float64."""
    form = block.dq_form() if form is None else form
    bs = block.block_size
    exact = np.repeat(block.d, bs, axis=1).astype(np.float64) * block.codes
    rounded = 0
    if block.mins is not None:
        exact += np.repeat(block.mins, bs, axis=1)
        if form.offsets is not None:
            c = np.where(block.d < 0, 7.0, 8.0)
            want = np.where(block.d == 0, block.mins, block.mins.astype(np.float64) + c * block.d)
            rounded = int(np.sum(form.offsets.astype(np.float64) != want))
    w = form.weight()
    return FormError(rounded, block.d.size, float(np.max(np.abs(w - exact), initial=0.0)),
                     float(np.max(np.abs(w - block.ggml_decode()), initial=0.0)))
