"""Materialized GGD-BAM attention: every (Lq x Lk) score exists at once.

`bam_attention_reference` is the ground truth the faster paths (`attention_route_bam.py`'s, the Triton kernels of
`triton_bam.py` among them) are tested against, and the "eager" attention; `bam_attention_sdpa` is the same through PyTorch's
SDPA with a float mask, for custom 4D masks, static caches in traced GPU graphs and exported programs (a dynamic
length).

Shapes: B batch, H query heads, Hkv key/value heads, Lq queries, Lk keys, D head size.
"""

import torch
import torch.nn.functional as F

from .prior_bam import attention_compute_dtype, autocast_off, visibility_from_positions


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, Hkv, L, D) -> (B, Hkv * n_rep, L, D), each key/value head shared by n_rep query heads."""
    if n_rep == 1:
        return hidden_states
    batch, kv_heads, length, head_dim = hidden_states.shape
    expanded = hidden_states[:, :, None].expand(batch, kv_heads, n_rep, length, head_dim)
    return expanded.reshape(batch, kv_heads * n_rep, length, head_dim)


def _rows_with_keys(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that see no key would give NaN: let them see everything, and report which rows are real."""
    has_keys = visible.any(-1, keepdim=True)
    return visible | ~has_keys, has_keys


def bam_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
    row_factor: torch.Tensor | None = None,
    ssmax_prior: bool = True,
    dropout: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialized GGD-BAM attention with an fp32 softmax.

    score_ij = c_i * (q_i.k_j * scaling + b_ij)   (ssmax_prior) or   c_i * q_i.k_j * scaling + b_ij

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D).
        visible: bool, broadcastable to (B, H, Lq, Lk).
        bias: float32, broadcastable to (B, H, Lq, Lk).
        row_factor: SSMax factor c (B, H, Lq, 1) float32, or None for plain softmax.
    Returns:
        output (B, H, Lq, D) in the query dtype (zero for rows that see no key), probabilities (B, H, Lq, Lk).
    """
    n_rep = query.shape[1] // key.shape[1]
    key = repeat_kv(key, n_rep)
    value = repeat_kv(value, n_rep)
    scores = torch.matmul(query, key.transpose(2, 3)).float() * scaling
    if row_factor is None:
        scores = scores + bias
    elif ssmax_prior:
        scores = (scores + bias) * row_factor
    else:
        scores = scores * row_factor + bias
    visible, has_keys = _rows_with_keys(visible)
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(has_keys, probs, torch.zeros_like(probs))
    if dropout > 0.0:
        probs = F.dropout(probs, p=dropout, training=True)
    output = torch.matmul(probs.to(value.dtype), value)
    return output, probs


def bam_attention_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
    row_factor: torch.Tensor | None = None,
    ssmax_prior: bool = True,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Same result as `bam_attention_reference` through `F.scaled_dot_product_attention` with a float mask.

    The SSMax factor multiplies the queries (so q.k is scaled per row); the prior, scaled or not, is the mask.
    The mask stays float32 and 16-bit inputs are computed in float32: in fp16 the prior overflows to -inf
    (distance 0 with a negative beta), in bf16 far priors round to equal values. Under autocast too: autocast is
    off inside (it would run SDPA, and round the mask, in 16 bits); the output comes in the query's dtype.
    """
    input_dtype = query.dtype
    with autocast_off(query.device):
        query, key, value = (tensor.to(attention_compute_dtype(input_dtype)) for tensor in (query, key, value))
        n_rep = query.shape[1] // key.shape[1]
        key = repeat_kv(key, n_rep)
        value = repeat_kv(value, n_rep)
        visible, has_keys = _rows_with_keys(visible)
        if row_factor is not None:
            query = query * row_factor.to(query.dtype)
            if ssmax_prior:
                bias = bias * row_factor
        float_mask = bias.masked_fill(~visible, float("-inf")).to(query.dtype)  # no (Lq x Lk) tensor of -inf
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=float_mask, dropout_p=dropout, scale=scaling
        )
        return torch.where(has_keys, output, torch.zeros_like(output)).to(input_dtype)


def _visible_mask(attention_mask, query_positions, key_length, document_ids=None) -> torch.Tensor:
    """The boolean (B, 1, Lq, Lk) visibility from whatever mask the mask interface produced."""
    if attention_mask is None or attention_mask.dim() == 2:
        return visibility_from_positions(query_positions, key_length, attention_mask, document_ids)
    if attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask > torch.finfo(attention_mask.dtype).min / 2  # a custom additive mask


def materialized_inputs(module, key, attention_mask, query_positions, prior, document_ids=None):
    """The visibility (B, 1, Lq, Lk), the prior's bias (1, H, Lq, Lk) and the SSMax row factor (or None) of the
    materialized paths, from the attention module (its `ssmax`) and its prior."""
    visible = _visible_mask(attention_mask, query_positions, key.shape[2], document_ids)
    bias = prior.bias(query_positions, key.shape[2])
    row_factor = module.ssmax.row_factor(visible.sum(-1).squeeze(1)) if module.ssmax is not None else None
    return visible, bias, row_factor
