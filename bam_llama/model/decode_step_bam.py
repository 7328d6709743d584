"""The decoding step: one query at position P against keys 0..P without gradients. Its mask is the prior table
itself (distances -P .. 0), none of the planning of query blocks: one call of the fused CPU kernel (`fused_cpu_bam`),
or three PyTorch calls elsewhere. The route (`attention_route_bam`) picks which; a compiled graph's static-cache step
reaches this code through the route's operator `bam_llama::traced_decode_step`.

Shapes: B batch, H query heads, Hkv key/value heads, K keys, D head size.
"""

import math

import torch
import torch.nn.functional as F

from .block_masks_bam import HIDDEN_KEY_SCORE, key_bias, visible_counts
from .fused_cpu_bam import bam_attention_fused_cpu
from .prior_bam import ssmax_factor

def attend_single_query(
    query, key, value, query_positions, prior_table, scaling, ssmax_scale, ssmax_prior, key_valid, fused: bool
) -> torch.Tensor:
    """One query at position P (the table's last entry, distance 0) against keys 0..P, without gradients: its mask is
    the prior table itself, (H, P + 1), no future key in it, and none of the planning of query blocks. The SSMax
    factor scales the query and, where SSMax scales the prior, the prior. Returns (B, 1, H, D), zeros where no key
    is seen. `fused`: in the fused CPU kernel (the route's "decode_step_fused"), else in three PyTorch calls.

    Eager float32 on the CPU, the fused kernel (`fused_cpu_bam`) runs the step in one call: each key/value head's
    query heads against key tiles, the table read in place. It took 0.83x SDPA's time at 4K keys and 0.64x at 16K
    (one query, no mask; 8 heads, 4 key/value heads, head size 32, one thread, Intel Xeon), where three PyTorch
    calls (scores = mask + q K^T, softmax, P V; `_grouped_single_query_attention`, which other devices and dtypes
    keep) took 1.1x and 0.8x, and the SSMax factor's operators on the scores 0.2x more."""
    keys = prior_table.shape[-1]
    counts = None if key_valid is None else visible_counts(query_positions, keys, key_valid, None)
    factor = None
    if ssmax_scale is not None:
        if counts is None:  # every key up to P is seen: n = P + 1, known on the host (a few operators fewer a step)
            factor = (ssmax_scale * math.log(keys)).view(1, -1, 1, 1)
        else:
            factor = ssmax_factor(counts, ssmax_scale)  # (B, H, 1, 1)
        factor = factor if factor.dtype == query.dtype else factor.to(query.dtype)
    if fused:
        output = _single_query_fused(query, key, value, prior_table, scaling, factor, ssmax_prior, key_valid, counts)
    else:
        output = _single_query_grouped(query, key, value, prior_table, scaling, factor, ssmax_prior, key_valid)
    if key_valid is not None:  # a row that sees no key gives zeros
        output = output.masked_fill((counts == 0)[:, :, None, None], 0.0)
    return output


def _single_query_fused(query, key, value, prior_table, scaling, factor, ssmax_prior, key_valid, counts):
    """`attend_single_query` in `fused_cpu_bam`'s kernel: (B, 1, H, D). A static cache's slots past P are passed
    but never read; a padding mask as wide as them is the kernel's key bias."""
    keys = prior_table.shape[-1]
    if key_valid is not None and key_valid.shape[-1] != key.shape[2]:
        key, value, key_valid = key[:, :, :keys], value[:, :, :keys], key_valid[:, :keys]
    prior_factor = None
    if factor is not None:
        query = query * factor
        prior_factor = factor.view(factor.shape[0], -1, 1) if ssmax_prior else None  # (1 or B, H, 1)
    return bam_attention_fused_cpu(
        query, key, value, keys - 1, prior_table, scaling, prior_factor, key_bias(key_valid, query.dtype), None,
        counts,
    )


def _single_query_grouped(query, key, value, prior_table, scaling, factor, ssmax_prior, key_valid):
    """`attend_single_query` in three PyTorch calls: (B, 1, H, D)."""
    keys = prior_table.shape[-1]
    key, value = key[:, :, :keys], value[:, :, :keys]  # a static cache holds more slots than keys so far
    mask = prior_table.to(query.dtype)[None, :, None, :]  # (1, H, 1, P + 1)
    score_factor = None
    if factor is not None:
        if ssmax_prior:
            score_factor = factor
        else:
            query = query * factor
    hidden = None if key_valid is None else ~key_valid[:, :keys].bool()
    return _grouped_single_query_attention(query, key, value, mask, scaling, score_factor, hidden).transpose(1, 2)


def _grouped_single_query_attention(
    query, key, value, mask, scaling: float, score_factor=None, hidden_keys=None
) -> torch.Tensor:
    """softmax(c (q K^T * scaling + mask)) V for one query a head, hidden keys left out: query (B, H, 1, D), key /
    value (B, Hkv, K, D), mask (B or 1, H, 1, K), score_factor c (B or 1, H, 1, 1) or None (c = 1), hidden_keys
    (B, K) bool or None -> (B, H, 1, D). Query head h reads key/value head h // (H / Hkv): the G = H / Hkv query heads
    of a key/value head are the G rows of one (G x K) matmul."""
    batch, heads, _, head_dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    pairs, group = batch * kv_heads, heads // kv_heads
    scores = torch.baddbmm(
        mask.expand(batch, -1, -1, -1).reshape(pairs, group, keys),
        query.reshape(pairs, group, head_dim),
        key.reshape(pairs, keys, head_dim).transpose(1, 2),
        alpha=scaling,
    )
    if score_factor is not None:
        scores.view(batch, heads, 1, keys).mul_(score_factor)
    if hidden_keys is not None:  # after the factor: a factor of 0 or below must not reveal a hidden key
        scores.view(batch, kv_heads, group, keys).masked_fill_(hidden_keys[:, None, None, :], HIDDEN_KEY_SCORE)
    probs = torch.softmax(scores, dim=-1, out=scores)
    # Probabilities below the dtype's normal range (far keys under a steep prior, or SSMax's sharpened rows) are set
    # to 0, as the fused kernels flush them: as subnormal inputs they made the P V product 3x slower (a 601-key
    # step, BAM + SSMax, one thread, Intel Xeon). Each is below 1.2e-38 in float32: the output does not move.
    F.threshold_(probs, torch.finfo(probs.dtype).tiny, 0.0)
    return torch.bmm(probs, value.reshape(pairs, keys, head_dim)).view(batch, heads, 1, head_dim)
