"""Offline Hadamard rotations R1 (the residual stream) and R2 (per head, v -> o) folded into the
weights of an exported Llama-style ONNX graph: the FP32 function is unchanged, the values the
quantizers see are spread over all channels (outliers flattened).

QuaRot (Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", NeurIPS 2024) and
SpinQuant (Liu et al., 2024) rotate a pre-norm transformer's residual stream by an orthogonal
``R1 [C, C]``: ``h' = h R1``. RMSNorm commutes with it once its scale ``gamma`` is folded into the
next weights (``rms(h R1) = rms(h)``), so, with ``W`` ``[in, out]`` as the MatMuls hold them:

* each norm -> q/k/v, gate/up: ``W' = R1^T diag(gamma) W``, ``gamma`` -> ones;
* each residual writer (o_proj, down_proj): ``W' = W R1`` (a bias ``b' = b R1``);
* the embedding table: ``E' = E R1``.

The final norm feeds the lm_head. A *tied* lm_head reads the embedding table
(``logits = n diag(gamma_f) E^T``); this module keeps it tied: the table is stored once as
``E R1`` and one MatMul by ``M = R1^T diag(gamma_f) R1`` ``[C, C]`` is inserted before the lm_head
(``n' M (E R1)^T = n diag(gamma_f) E^T``), ``gamma_f`` -> ones. Cost: ``C^2`` FP32 values
(576 x 576: 1.33 MB) and ``C^2`` multiply-adds per token (1.2 % of SmolLM2's 576 x 49152 lm_head),
against 113 MB (28.3 M parameters) for an untied copy. An untied lm_head (an initializer) gets
``W' = R1^T diag(gamma_f) W`` instead, no extra op.

R2 rotates each attention head's value channels by one orthogonal ``H [d, d]`` (``d`` = head_dim):
``W_v' = W_v blockdiag(H)`` (and its bias), ``W_o' = blockdiag(H^T) W_o``. Attention mixes
positions, never channels, so every query head's output carries its KV head's ``H``; one ``H`` for
all heads makes grouped-query attention need nothing more. The KV cache output ``present.N.value``
then holds rotated values; only the graph reads it back, so decoding is unchanged, but a cache
from the unrotated graph must not be fed to this one (and a future FP8 KV cache would calibrate
rotated values).

The matrices are randomized Hadamard ones (QuaRot): ``diag(signs) H_n / sqrt(n)`` with ``H_n``
Sylvester's or a Kronecker product with Paley's construction I (order ``q + 1``, ``q`` a prime
``= 3 mod 4``: 576 = 12 x 12 x 4) and signs from ``numpy.random.default_rng(seed)``: the same bytes
on every runner. Only initializers change and one MatMul is added: standard ONNX ops, and the Q/DQ
placement is the caller's (the added MatMul is not a weight GEMM target).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline import onnx_io
from pipeline.errors import QuantizationError
from pipeline.quant.qdq import Target

#: the seed of the Hadamard matrices' random signs
SEED = 0
#: ops a value passes through between v_proj and o_proj without mixing its channels
_PASS = {"Reshape", "Transpose", "Expand", "Unsqueeze", "Identity", "Concat", "MatMul"}


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % k for k in range(2, int(q ** 0.5) + 1))


def _paley(q: int) -> np.ndarray:
    """Paley's construction I: a Hadamard matrix of order ``q + 1`` (``q`` prime, ``q % 4 == 3``)."""
    squares = {(k * k) % q for k in range(1, q)}
    chi = np.array([0] + [1 if k in squares else -1 for k in range(1, q)])
    jac = np.array([[chi[(j - i) % q] for j in range(q)] for i in range(q)])
    s = np.zeros((q + 1, q + 1), np.int64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jac
    return s + np.eye(q + 1, dtype=np.int64)


def hadamard(n: int) -> np.ndarray:
    """An ``n x n`` matrix of +-1 with ``H H^T = n I`` (int64): Sylvester's doubling and Kronecker
    products with Paley's construction I.

    Raises:
        QuantizationError: no such construction for ``n`` here (e.g. n not a multiple of 4 above 2).
    """
    h = _hadamard(n)
    if h is None:
        raise QuantizationError(f"rotate: no Hadamard matrix of order {n} from Sylvester's and Paley's constructions "
                                "(the hidden size or head_dim must be 1, 2 or a multiple of 4 built from them)")
    return h


def _hadamard(n: int) -> np.ndarray | None:
    if n == 1:
        return np.ones((1, 1), np.int64)
    if n % 2 == 0 and n & (n - 1) == 0:
        half = _hadamard(n // 2)
        return np.block([[half, half], [half, -half]])
    for m in range(n, 3, -1):  # the largest Paley order that divides n and leaves a constructible rest
        if n % m == 0 and m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
            rest = _hadamard(n // m)
            if rest is not None:
                return np.kron(_paley(m - 1), rest)
    if n % 2 == 0:
        half = _hadamard(n // 2)
        if half is not None:
            return np.kron(np.array([[1, 1], [1, -1]]), half)
    return None


def rotation(n: int, seed: int = SEED) -> np.ndarray:
    """float64 ``[n, n]`` orthogonal: ``diag(signs) H_n / sqrt(n)``, signs from ``default_rng(seed)``."""
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], n)
    return signs[:, None] * hadamard(n).astype(np.float64) / np.sqrt(n)


@dataclass
class RotateReport:
    """What :func:`rotate` did (JSON-ready with :meth:`summary`)."""

    hidden: int = 0
    head_dim: int = 0
    norms: list[str] = field(default_factory=list)       # norm scale initializers folded (then ones)
    writers: list[str] = field(default_factory=list)     # residual-writing GEMMs (W R1)
    readers: list[str] = field(default_factory=list)     # GEMMs after a norm (R1^T diag(gamma) W)
    r2: list[tuple[str, str]] = field(default_factory=list)  # (v_proj, o_proj) node pairs
    lm_head: str = ""                                    # "tied: +MatMul <name>" or "untied: <node>"
    added_bytes: int = 0

    def summary(self) -> dict:
        return {"hidden": self.hidden, "head_dim": self.head_dim, "norms_folded": len(self.norms),
                "gemms_reading_the_stream": len(self.readers), "gemms_writing_the_stream": len(self.writers),
                "r2_pairs": len(self.r2), "lm_head": self.lm_head, "added_bytes": self.added_bytes}


def rotate(model: onnx.ModelProto, targets: list[Target], *, r1: bool = True, r2: bool = True,
           seed: int = SEED) -> RotateReport:
    """Fold R1 and R2 into ``model`` in place (its initializers loaded; module notes).

    Args:
        model: an exported Llama-style FP32 graph: ``Gather(E, input_ids)`` embedding, RMSNorms
            ending in ``Mul(gamma [C], .)`` read only by weight GEMMs, residual writers
            (MatMul ``[K, C]`` whose output only an Add reads), a final norm before the lm_head.
        targets: the graph's weight GEMMs (:func:`pipeline.quant.qdq.find_targets`).
        r1, r2: which rotations; seed: the signs' seed.

    Returns:
        The :class:`RotateReport`.

    Raises:
        QuantizationError: the graph is not that shape (names what is missing or what reads the
            residual stream otherwise), or no Hadamard matrix of the hidden size / head_dim.
    """
    g = model.graph
    inits, producer, consumers = onnx_io.graph_index(g)
    by_node = {t.node: t for t in targets}
    out_of = {n.name: n.output[0] for n in g.node}
    arrays: dict[str, np.ndarray] = {}

    def value(name: str) -> np.ndarray:
        if name not in arrays:
            arrays[name] = numpy_helper.to_array(inits[name]).astype(np.float64)
        return arrays[name]

    emb = [n for n in g.node if n.op_type == "Gather" and n.input[0] in inits and len(inits[n.input[0]].dims) == 2
           and n.input[1] in {i.name for i in g.input}]
    if len(emb) != 1:
        raise QuantizationError(f"rotate: expected one embedding Gather(table, input_ids), found {len(emb)}")
    table = emb[0].input[0]
    hidden = int(inits[table].dims[1])
    report = RotateReport(hidden=hidden)
    norms, final = _norms(g, inits, consumers, by_node, hidden, table, producer)
    writers = [t for t in targets if t.weight_axis == 1 and len(inits[t.weight].dims) == 2
               and inits[t.weight].dims[1] == hidden and _writes_residual(t, out_of, consumers, inits)]
    readers = [by_node[c.name] for _, gemms in norms for c in gemms]
    if not norms or len(writers) != len(norms):
        raise QuantizationError(f"rotate: {len(norms)} norms before weight GEMMs but {len(writers)} GEMMs writing the "
                                "residual stream; expected one writer per norm (a pre-norm Llama-style block)")
    if r1:
        rot = rotation(hidden, seed)
        for gamma, gemms in norms:
            scale = value(gamma)
            for node in gemms:
                t = by_node[node.name]
                arrays[t.weight] = rot.T @ (scale[:, None] * value(t.weight))
            arrays[gamma] = np.ones_like(scale)
            report.norms.append(gamma)
        for t in writers:
            arrays[t.weight] = value(t.weight) @ rot
            bias = _bias(t, out_of, consumers, inits)
            if bias is not None:
                arrays[bias] = value(bias) @ rot
        arrays[table] = value(table) @ rot
        report.writers, report.readers = [t.node for t in writers], [t.node for t in readers]
        report.lm_head = _fold_lm_head(g, final, table, inits, consumers, by_node, rot, value, arrays, report)
    if r2:
        head_dim = _head_dim(g)
        report.head_dim = head_dim
        h2 = rotation(head_dim, seed + 1)
        for t in writers:
            v = _value_projection(t, producer, by_node, inits)
            if v is None:
                continue  # down_proj: its input is not attention's output
            k_in = inits[t.weight].dims[0]
            n_out = inits[v.weight].dims[1]
            if k_in % head_dim or n_out % head_dim:
                raise QuantizationError(f"rotate: {v.node} -> {t.node}: {n_out} / {k_in} channels are not whole heads "
                                        f"of {head_dim}")
            arrays[v.weight] = _per_head(value(v.weight), h2, head_dim, right=True)
            bias = _bias(v, out_of, consumers, inits)
            if bias is not None:
                arrays[bias] = _per_head(value(bias)[None, :], h2, head_dim, right=True)[0]
            arrays[t.weight] = _per_head(value(t.weight), h2, head_dim, right=False)
            report.r2.append((v.node, t.node))
        if not report.r2:
            raise QuantizationError("rotate: R2 found no v_proj -> o_proj path (Reshape/Transpose/Concat/MatMul only)")
    for name, arr in arrays.items():
        if name in inits:
            inits[name].CopyFrom(numpy_helper.from_array(arr.astype(np.float32), name))
    return report


def _norms(g, inits, consumers, by_node, hidden: int, table: str, producer):
    """``([(gamma, [GEMM nodes]) ...], final)``: each ``Mul(gamma [C], x)`` read only by weight
    GEMMs (``[C, out]``), and the final norm's ``(Mul node, gamma)`` read by the lm_head."""
    found, final = [], None
    for n in g.node:
        if n.op_type != "Mul" or len(n.input) != 2:
            continue
        gammas = [i for i in n.input if i in inits and tuple(inits[i].dims) == (hidden,)]
        if len(gammas) != 1:
            continue
        other = next(i for i in n.input if i != gammas[0])
        src = producer.get(other)
        if src is None or src.op_type != "Mul":  # x * rsqrt(mean(x^2) + eps)
            continue
        readers = consumers[n.output[0]]
        if readers and all(r.name in by_node and by_node[r.name].act == n.output[0] for r in readers):
            found.append((gammas[0], readers))
        elif len(readers) == 1 and readers[0].op_type == "MatMul" and readers[0].input[0] == n.output[0]:
            if final is not None:
                raise QuantizationError("rotate: two norms feed a GEMM that is not a weight GEMM target")
            final = (n, gammas[0])
    if final is None:
        raise QuantizationError("rotate: no final norm feeding the lm_head MatMul")
    return found, final


def _writes_residual(t: Target, out_of: dict, consumers, inits) -> bool:
    """The GEMM's output (after an optional bias Add) is read only by one Add of two activations."""
    out = consumers[_output(t, out_of, consumers, inits)]
    return len(out) == 1 and out[0].op_type == "Add" and not any(i in inits for i in out[0].input)


def _bias(t: Target, out_of: dict, consumers, inits) -> str | None:
    """The 1-D initializer of an ``Add`` right after the GEMM (its bias), or None."""
    outs = consumers.get(out_of[t.node], [])
    if len(outs) == 1 and outs[0].op_type == "Add":
        b = [i for i in outs[0].input if i in inits and len(inits[i].dims) == 1]
        return b[0] if b else None
    return None


def _output(t: Target, out_of: dict, consumers, inits) -> str:
    """The tensor a GEMM's result reaches the graph as: its own output, or its bias Add's."""
    after = consumers.get(out_of[t.node], [])
    if _bias(t, out_of, consumers, inits) is not None:
        return after[0].output[0]
    return out_of[t.node]


def _fold_lm_head(g, final, table, inits, consumers, by_node, rot, value, arrays, report) -> str:
    node, gamma = final
    head = consumers[node.output[0]][0]
    scale = value(gamma)
    arrays[gamma] = np.ones_like(scale)
    report.norms.append(gamma)
    if head.name in by_node:  # untied: an initializer weight [C, V]
        w = by_node[head.name].weight
        arrays[w] = rot.T @ (scale[:, None] * value(w))
        return f"untied: {head.name}"
    m = rot.T @ (scale[:, None] * rot)
    name = f"{gamma}_rotated_head"
    g.initializer.append(numpy_helper.from_array(m.astype(np.float32), name))
    inits[name] = g.initializer[-1]
    out = f"{node.output[0]}_rotated"
    mm = helper.make_node("MatMul", [node.output[0], name], [out], name=f"{node.name}_rotate_back")
    idx = list(g.node).index(head)
    g.node.insert(idx, mm)
    head.input[0] = out
    report.added_bytes = int(m.size * 4)
    return f"tied: +MatMul {mm.name} [{m.shape[0]}, {m.shape[1]}] before {head.name}; table stored as E R1"


def _head_dim(g) -> int:
    """head_dim: the last dim of the value cache input ``past_key_values.N.value`` (static)."""
    for i in g.input:
        if i.name.endswith(".value") and "past" in i.name:
            dims = i.type.tensor_type.shape.dim
            if dims and dims[-1].HasField("dim_value"):
                return int(dims[-1].dim_value)
    raise QuantizationError("rotate: R2 needs head_dim: no past_key_values.N.value input with a static last dim")


def _value_projection(o: Target, producer, by_node, inits) -> Target | None:
    """The weight GEMM whose output reaches ``o``'s input through channel-preserving ops only
    (Reshape, Transpose, Concat with the past cache, Expand, Unsqueeze, and attention's
    ``MatMul(P, V)`` as its B input), or None."""
    name = o.act
    for _ in range(64):
        node = producer.get(name)
        if node is None or node.op_type not in _PASS:
            return None
        if node.name in by_node:
            return by_node[node.name]
        if node.op_type == "MatMul":
            name = node.input[1]
        elif node.op_type == "Concat":
            inner = [i for i in node.input if i in producer]
            if len(inner) != 1:
                return None
            name = inner[0]
        elif node.op_type == "Transpose":
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if perm is None or perm[-1] != len(perm) - 1:
                return None  # the channel axis moved
            name = node.input[0]
        else:
            name = node.input[0]
    return None


def _per_head(w: np.ndarray, h: np.ndarray, d: int, *, right: bool) -> np.ndarray:
    """``w blockdiag(h)`` over its columns (``right``) or ``blockdiag(h^T) w`` over its rows."""
    if right:
        r, c = w.shape
        return (w.reshape(r, c // d, d) @ h).reshape(r, c)
    r, c = w.shape
    return (h.T @ w.reshape(r // d, d, c)).reshape(r, c)
