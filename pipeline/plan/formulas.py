"""The capacity plan's formulas (units: bytes, seconds, FLOP), each with its source in
:data:`FORMULAS`: weight bytes, KV bytes per token and at the limit, sequences that fit, the
decode roofline and MBU, prefill arithmetic intensity against the ridge point, and replicas for a
request rate (Little's law on the roofline step). :mod:`pipeline.plan.capacity` applies them."""
from __future__ import annotations

import math
from dataclasses import dataclass

FORMULAS: dict[str, dict[str, str]] = {
    "weights": {
        "expression": "sum over weight tensors of elements x bytes per element",
        "source": "definition; bytes per element from the served graph's ONNX dtypes and the quantize "
                  "stage's quantized-node list (FP8/INT8 = 1 byte on a GPU)"},
    "kv_per_token": {
        "expression": "2 x layers x kv_heads x head_dim x bytes",
        "source": "Pope et al. 2022, 'Efficiently Scaling Transformer Inference' (KV cache size); kv_heads < "
                  "query heads under GQA: Ainslie et al. 2023, 'GQA: Training Generalized Multi-Query "
                  "Transformer Models from Multi-Head Checkpoints'"},
    "kv_at_limit": {
        "expression": "kv_per_token x max_context x max_batch",
        "source": "the KV cache of max_batch sequences, each at the profile's max context"},
    "max_concurrent_sequences": {
        "expression": "floor((memory - weights - workspace) / (kv_per_token x max_context))",
        "source": "Kwon et al. 2023, 'Efficient Memory Management for Large Language Model Serving with "
                  "PagedAttention' (the KV cache fills the memory left after weights and workspace)"},
    "decode_roofline": {
        "expression": "tokens/s per sequence <= bandwidth / (weights + kv_per_token x context); "
                      "MBU = measured tokens/s x (weights + kv_per_token x context) / bandwidth",
        "source": "Databricks 2023, 'LLM Inference Performance Engineering: Best Practices' (MBU); "
                  "Williams, Waterman, Patterson 2009, 'Roofline', CACM 52(4)"},
    "prefill_intensity": {
        "expression": "2 x parameters x tokens / (weights + kv_per_token x tokens) FLOP/byte vs ridge = "
                      "peak FLOP/s / bandwidth",
        "source": "2N FLOPs per token forward: Kaplan et al. 2020, 'Scaling Laws for Neural Language "
                  "Models'; ridge point: Williams et al. 2009, 'Roofline'"},
    "replicas": {
        "expression": "ceil(rate x (prefill + output_tokens x step(B)) / B), B = largest batch <= max batch "
                      "and memory with step(B) = max((weights + B x KV per sequence) / bandwidth, "
                      "2 x parameters x B / peak) <= slo.tpot",
        "source": "Little's law (Little 1961, 'A Proof for the Queuing Formula L = lambda W') on the roofline "
                  "step time: an ESTIMATE (100 % of peak bandwidth and FLOP/s; prefill interference ignored)"},
}


def weight_bytes(elements: int, bytes_per_element: float) -> int:
    """Weights = parameters x bytes per element (bytes)."""
    return int(round(elements * bytes_per_element))


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, bytes_per_element: int) -> int:
    """KV cache bytes of one token of one sequence: 2 (K and V) x layers x kv_heads x head_dim x bytes."""
    return 2 * layers * kv_heads * head_dim * bytes_per_element


def kv_bytes_at_limit(per_token: int, max_context: int, max_batch: int) -> int:
    """KV cache bytes of ``max_batch`` sequences at ``max_context`` tokens each."""
    return per_token * max_context * max_batch


def max_concurrent_sequences(memory_bytes: float, weights: int, workspace: int, kv_per_sequence: int) -> int:
    """Sequences whose KV cache fits next to the weights and workspace: floor((mem - w - ws) / kv); 0 if none.

    Raises:
        ValueError: ``kv_per_sequence`` is not positive.
    """
    if kv_per_sequence <= 0:
        raise ValueError(f"kv_per_sequence must be > 0, got {kv_per_sequence}")
    return max(0, math.floor((memory_bytes - weights - workspace) / kv_per_sequence))


def decode_roofline(bandwidth_bps: float, weights: int, kv_read: int) -> float:
    """Upper bound on one sequence's decode tokens/s: every step reads all weights and its KV cache once."""
    return bandwidth_bps / (weights + kv_read)


def mbu(tokens_per_s: float, weights: int, kv_read: int, bandwidth_bps: float) -> float:
    """Model bandwidth utilisation: bytes a step must read x steps/s over the peak bandwidth (0..1)."""
    return tokens_per_s * (weights + kv_read) / bandwidth_bps


def prefill_intensity(parameters: int, tokens: int, weights: int, kv_per_token: int) -> float:
    """Arithmetic intensity (FLOP/byte) of a ``tokens``-token prefill: 2N FLOPs per token over the
    weights read once plus the KV written."""
    return 2 * parameters * tokens / (weights + kv_per_token * tokens)


def ridge_point(peak_flops: float, bandwidth_bps: float) -> float:
    """FLOP/byte above which a kernel is compute bound on this GPU (roofline ridge)."""
    return peak_flops / bandwidth_bps


def step_seconds(batch: int, weights: int, kv_per_sequence: int, parameters: int,
                 bandwidth_bps: float, peak_flops: float) -> float:
    """Roofline time of one decode step of ``batch`` sequences: max(memory time, compute time)."""
    return max((weights + batch * kv_per_sequence) / bandwidth_bps, 2 * parameters * batch / peak_flops)


@dataclass
class ReplicaEstimate:
    """Replicas for ``rate`` req/s; ``batch`` sequences per replica; ``reason`` when the SLO is unreachable."""

    rate: float
    replicas: int | None
    batch: int
    step_ms: float
    prefill_ms: float
    request_s: float
    requests_per_s_per_replica: float
    reason: str = ""


def replicas_for_rate(rate: float, *, prompt: int, output: int, max_batch: int, memory_sequences: int,
                      tpot_s: float, ttft_s: float, weights: int, kv_per_token: int, parameters: int,
                      bandwidth_bps: float, peak_flops: float) -> ReplicaEstimate:
    """Replicas needed for ``rate`` requests/s of ``prompt`` + ``output`` tokens (see FORMULAS["replicas"]).

    ``memory_sequences``: sequences at ``prompt + output`` context that fit in memory.
    """
    kv_seq = kv_per_token * (prompt + output)
    prefill = max(2 * parameters * prompt / peak_flops, (weights + kv_per_token * prompt) / bandwidth_bps)
    cap = min(max_batch, memory_sequences)
    batch = max((b for b in range(1, cap + 1)
                 if step_seconds(b, weights, kv_seq, parameters, bandwidth_bps, peak_flops) <= tpot_s), default=0)
    step = step_seconds(max(batch, 1), weights, kv_seq, parameters, bandwidth_bps, peak_flops)
    request = prefill + output * step
    reason = ("no sequence fits in memory" if cap < 1 else
              f"one decode step takes {step * 1e3:.3g} ms > slo.tpot_ms" if batch < 1 else
              f"prefill takes {prefill * 1e3:.3g} ms > slo.ttft_ms" if prefill > ttft_s else "")
    if reason:
        return ReplicaEstimate(rate, None, batch, step * 1e3, prefill * 1e3, request, 0.0, reason)
    return ReplicaEstimate(rate, math.ceil(round(rate * request / batch, 9)), batch, step * 1e3, prefill * 1e3,
                           request, batch / request)
