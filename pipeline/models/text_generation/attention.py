"""Grouped-query attention without repeating K/V: the attention function the KV-cache graph is
exported with.

transformers' SDPA path repeats each KV head to its ``n_rep`` query heads (``repeat_kv``:
Unsqueeze -> Expand -> Reshape in ONNX) and transposes the repeated K on every decode step, so
the step copies ``n_rep`` times the whole past per layer. Here the ``n_rep`` query heads of one
KV head become rows of one MatMul instead::

    Q [B, H, S, D] -> [B, H_kv, n_rep*S, D]      (a view: head h = kv * n_rep + r, as repeat_kv)
    scores = (Q * scaling) @ K^T                  [B, H_kv, n_rep*S, T]   (K^T: [B, H_kv, D, T])
    probs  = softmax(scores + mask)               mask [B, 1, S, T] broadcast over H_kv, n_rep
    out    = probs @ V                            [B, H_kv, n_rep*S, D] -> [B, S, H, D]

Same arithmetic as scaled dot-product attention (Vaswani et al. 2017, eq. 1), only the scale is
applied to Q (S*D multiplies) rather than to K (T*D). Measured forms:
``benchmarks/attention_pattern_cost.py``.

Registered with transformers' attention-function registry (``AttentionInterface``) under
:data:`GROUPED`, with ``eager_mask`` as its mask builder: the additive float mask (0 attended,
``finfo.min`` masked) is built once per forward pass, and each layer adds it.
"""
from __future__ import annotations

import torch

__all__ = ["GROUPED", "grouped_attention_forward", "register", "use_grouped_attention"]

GROUPED = "grouped_gqa"  # the name under transformers' AttentionInterface / AttentionMaskInterface


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as an additive one (0 / ``finfo(dtype).min``); float masks as they are."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)


def _causal(q_len: int, kv_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask [1, 1, q_len, kv_len], aligned to the end of the keys (the queries are
    the last ``q_len`` positions of ``kv_len``, as with a KV cache)."""
    q = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    allowed = torch.arange(kv_len, device=device)[None, :] <= q
    return _additive(allowed, dtype)[None, None]


def grouped_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, is_causal: bool | None = None,
                              **kwargs) -> tuple[torch.Tensor, None]:
    """Grouped-query attention with the signature of transformers' attention functions
    (``transformers.integrations.sdpa_attention.sdpa_attention_forward``).

    Args:
        module: the attention layer; ``module.num_key_value_groups`` (n_rep, 1 for plain
            multi-head attention) and, when ``is_causal`` is None, ``module.is_causal``.
        query: float ``[B, H, S, D]``, ``H = H_kv * n_rep``.
        key, value: float ``[B, H_kv, T, D]`` (past and new positions, ``T >= S``).
        attention_mask: ``[B, 1, S, T]`` (or broadcastable to it): additive float (0 attended,
            a large negative value masked) or boolean (True attended); None means no padding
            (causal when the layer is causal and ``S > 1``).
        dropout: dropout probability on the attention weights (transformers passes 0.0 in eval).
        scaling: the softmax scale; None means ``D ** -0.5``.
        is_causal: overrides ``module.is_causal`` when ``attention_mask`` is None.

    Returns:
        ``(output [B, S, H, D] contiguous, None)`` (no attention weights are returned).

    Raises:
        ValueError: an argument this function does not implement is set (``softcap``,
            ``s_aux`` / ``sinks``, ``position_bias``), or ``H`` is not a multiple of ``H_kv``.
    """
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"grouped attention ({GROUPED}): `{name}` is not supported; "
                             f"load the model with attn_implementation='sdpa' or 'eager'")
    batch, heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"grouped attention ({GROUPED}): {heads} query heads is not a multiple of "
                         f"{kv_heads} key/value heads")
    n_rep = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    q = (query * scale).reshape(batch, kv_heads, n_rep * q_len, dim)
    scores = torch.matmul(q, key.transpose(2, 3)).view(batch, kv_heads, n_rep, q_len, kv_len)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and q_len > 1:
        attention_mask = _causal(q_len, kv_len, scores.dtype, scores.device)
    if attention_mask is not None:  # [B, 1, S, T] -> [B, 1, 1, S, T]: shared by every head
        scores = scores + _additive(attention_mask, scores.dtype)[:, :, None]
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    if dropout:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs.view(batch, kv_heads, n_rep * q_len, kv_len), value)
    return out.view(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`grouped_attention_forward` (with transformers' ``eager_mask``) under
    :data:`GROUPED`; idempotent. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(GROUPED, grouped_attention_forward)
    AttentionMaskInterface.register(GROUPED, eager_mask)
    return GROUPED


def use_grouped_attention(model) -> bool:
    """Switch a loaded transformers model to :data:`GROUPED` attention, in place.

    Models that do not dispatch attention through ``AttentionInterface``
    (``_supports_attention_backend`` false) or that use logit soft-capping keep theirs.

    Returns:
        True when the model now uses grouped attention.
    """
    if not getattr(model, "_supports_attention_backend", False):
        return False
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        return False
    model.set_attn_implementation(register())
    return model.config._attn_implementation == GROUPED
