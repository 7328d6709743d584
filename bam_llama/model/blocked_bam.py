"""GGD-BAM attention without any (Lq x Lk) tensor: PyTorch SDPA over blocks of queries whose float mask is a window
of one prior table per head, with a flash-style backward for the prior's gradient. The "sdpa" attention. Eager
float32 code on the CPU runs one fused kernel instead (`fused_cpu_bam`), forward and backward.

Shapes: B batch, H query heads, Hkv key/value heads, Lq queries, Lk keys, D head size.
"""

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakTensorKeyDictionary

from .fused_cpu_bam import bam_attention_fused_cpu, fused_cpu_available
from .prior_bam import (
    KeptPriorTable, attention_compute_dtype, autocast_off, exporting, ssmax_factor, visible_key_counts,
)

# The score of a key a query must not see (padding, another document): a finite "minus infinity", so that a row that
# sees no key stays finite (its output is then zeroed). Future keys get a true -inf.
HIDDEN_KEY_SCORE = -1e30


def bam_attention_blocked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    prior_table: torch.Tensor,
    scaling: float,
    ssmax_scale: torch.Tensor | None = None,
    ssmax_prior: bool = True,
    key_valid: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    dropout: float = 0.0,
    block_rows: int | None = None,
    block_heads: int | None = None,
) -> torch.Tensor:
    """Same result as `bam_attention_reference` without any (Lq x Lk) tensor: SDPA over blocks of queries.

    The prior depends on j - i only, so every mask row is a window of one table per head. With the queries in
    reverse order, the rows of a block are consecutive windows: the block's mask is a strided VIEW of the table
    (no copy), with the causal -inf in the table's padding. A block of queries at positions <= p attends to keys
    0..p only (causal blocks are skipped). With SSMax scaling the prior, or padding, or packed documents, the
    mask of one block is materialized. A block is `block_rows` queries of `block_heads` query heads (a multiple of
    the heads sharing a key/value head); both default to `default_block_shape`. The blocks are planned from
    shapes only (P is the table's length - 1), never from tensor values, so a traced graph has no data-dependent
    branch. Without gradients or dropout, a decoding step (one query) reads the table itself as its mask, in one
    call of the fused kernel or three PyTorch calls (`_attend_single_query`), and a compiled graph calls the
    blocks as one operator (`_blocked_inference`).
    Without dropout or explicit block shapes, eager float32 CPU queries run the fused kernel of `fused_cpu_bam` (the
    table read in cache, no mask written; its own backward; packed documents as runs of ids), where it was built.

    Precision: 16-bit inputs are computed in float32 (`attention_compute_dtype`), with autocast off inside: under
    autocast SDPA would run, and the prior's mask be rounded, in 16 bits. The output comes in the query's dtype.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D).
        query_positions: (Lq,) consecutive absolute positions p_0, p_0 + 1, ..., P.
        prior_table: (H, P + 1) float32 prior at distances j - i = -P, ..., 0 (the keys of the last query).
        ssmax_scale: (H,) Scalable-Softmax scale s (c_i = s ln n_i), or None for plain softmax.
        key_valid: (B, Lk) bool/int, False for padding; document_ids: (B, Lk) int (packed sequences).
    Returns:
        (B, H, Lq, D) in the query dtype, zero for rows that see no key (a view of a (B, Lq, H, D) tensor).
    """
    lengths = (query.shape[2], key.shape[2], prior_table.shape[-1])
    if exporting() and not all(isinstance(length, int) for length in lengths):  # (torch.compile recompiles instead)
        raise NotImplementedError(
            "bam_attention_blocked plans its query blocks in Python from the sequence length: exported with a "
            "dynamic length, the program would be fixed to the example's length. An exported BamLlama model "
            "takes the materialized SDPA path instead (bam_attention_sdpa)."
        )
    input_dtype = query.dtype
    compute_dtype = attention_compute_dtype(input_dtype)
    keys = prior_table.shape[-1]  # keys 0 .. P are read: a static cache's slots past P hold no key yet
    if key.shape[2] > keys and key.dtype != compute_dtype:  # converted below: the keys that are read, not every slot
        key, value = key[:, :, :keys], value[:, :, :keys]
        key_valid = None if key_valid is None else key_valid[:, :keys]
        document_ids = None if document_ids is None else document_ids[:, :keys]
    with autocast_off(query.device):
        if query.dtype != compute_dtype or key.dtype != compute_dtype or value.dtype != compute_dtype:
            query, key, value = (tensor.to(compute_dtype) for tensor in (query, key, value))
        inference = dropout == 0.0 and not _needs_gradient(query, key, value, prior_table, ssmax_scale)
        compiling = torch.compiler.is_compiling()
        if inference and not compiling and query.shape[2] == 1 and document_ids is None:  # a decoding step
            output = _attend_single_query(
                query, key, value, query_positions, prior_table, scaling, ssmax_scale, ssmax_prior, key_valid
            )
        elif inference and compiling and not exporting():
            # Traced, each block's mask would be written by Inductor's generated loops, which took 2.3x the eager
            # blocks' time (BAM + SSMax, 2048 tokens, CPU): the graph calls the eager code as one operator instead.
            # Exported programs stay plain ATen.
            output = _blocked_inference(
                query, key, value, query_positions, prior_table, scaling, ssmax_scale, ssmax_prior, key_valid,
                document_ids, block_rows or 0, block_heads or 0,
            )
        else:
            output = _attention_over_query_blocks(
                query, key, value, query_positions, prior_table, scaling, ssmax_scale, ssmax_prior, key_valid,
                document_ids, dropout, block_rows, block_heads,
            )
    return (output if output.dtype == input_dtype else output.to(input_dtype)).transpose(1, 2)


def _attend_single_query(
    query, key, value, query_positions, prior_table, scaling, ssmax_scale, ssmax_prior, key_valid
) -> torch.Tensor:
    """One query at position P (the table's last entry, distance 0) against keys 0..P, without gradients: its mask is
    the prior table itself, (H, P + 1), no future key in it, and none of the planning of query blocks. The SSMax
    factor scales the query and, where SSMax scales the prior, the prior. Returns (B, 1, H, D), zeros where no key
    is seen.

    Eager float32 on the CPU, the fused kernel (`fused_cpu_bam`) runs the step in one call: each key/value head's
    query heads against key tiles, the table read in place. It took 0.83x SDPA's time at 4K keys and 0.64x at 16K
    (one query, no mask; 8 heads, 4 key/value heads, head size 32, one thread, Intel Xeon), where three PyTorch
    calls (scores = mask + q K^T, softmax, P V; `_grouped_single_query_attention`, which other devices and dtypes
    keep) took 1.1x and 0.8x, and the SSMax factor's operators on the scores 0.2x more."""
    keys = prior_table.shape[-1]
    counts = None if key_valid is None else _visible_counts(query_positions, keys, key_valid, None)
    factor = None
    if ssmax_scale is not None:
        if counts is None:  # every key up to P is seen: n = P + 1, known on the host (a few operators fewer a step)
            factor = (ssmax_scale * math.log(keys)).view(1, -1, 1, 1)
        else:
            factor = ssmax_factor(counts, ssmax_scale)  # (B, H, 1, 1)
        factor = factor if factor.dtype == query.dtype else factor.to(query.dtype)
    if _fused_kernel_runs(query, None):
        output = _single_query_fused(query, key, value, prior_table, scaling, factor, ssmax_prior, key_valid, counts)
    else:
        output = _single_query_grouped(query, key, value, prior_table, scaling, factor, ssmax_prior, key_valid)
    if key_valid is not None:  # a row that sees no key gives zeros
        output = output.masked_fill((counts == 0)[:, :, None, None], 0.0)
    return output


def _single_query_fused(query, key, value, prior_table, scaling, factor, ssmax_prior, key_valid, counts):
    """`_attend_single_query` in `fused_cpu_bam`'s kernel: (B, 1, H, D). A static cache's slots past P are passed
    but never read; a padding mask as wide as them is the kernel's key bias."""
    keys = prior_table.shape[-1]
    if key_valid is not None and key_valid.shape[-1] != key.shape[2]:
        key, value, key_valid = key[:, :, :keys], value[:, :, :keys], key_valid[:, :keys]
    prior_factor = None
    if factor is not None:
        query = query * factor
        prior_factor = factor.view(factor.shape[0], -1, 1) if ssmax_prior else None  # (1 or B, H, 1)
    return bam_attention_fused_cpu(
        query, key, value, keys - 1, prior_table, scaling, prior_factor, _key_bias(key_valid, query.dtype), None,
        counts,
    )


def _single_query_grouped(query, key, value, prior_table, scaling, factor, ssmax_prior, key_valid):
    """`_attend_single_query` in three PyTorch calls: (B, 1, H, D)."""
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


# A static cache of at most this many slots keeps the materialized step in a compiled graph: Inductor fuses the
# prior over every slot into a few loops, cheaper there than the operator's fixed cost (host code, about 0.1 ms a
# layer on the Intel Xeon of benchmarks/results/cpu-speed-compiled.md: 1.12-1.23x compiled Llama's step at 577
# slots, against 1.03-1.05x materialized; at 1,089 slots the operator is ahead).
TRACED_DECODE_MIN_SLOTS = 1024


def traced_decode_step_runs(query: torch.Tensor, key: torch.Tensor, dropout: float, document_ids, *tensors) -> bool:
    """Whether a decoding step in a compiled graph on the CPU (one query, no gradients, no dropout, no packed
    documents: a static cache's step, over more than TRACED_DECODE_MIN_SLOTS slots) runs
    `bam_attention_traced_decode_step`. Exported programs stay plain ATen; on a GPU the materialized path stays
    (the operator reads the position on the host, which would sync the device in every layer). Decided from shapes
    only: one graph for every step."""
    return (
        torch.compiler.is_compiling() and not exporting() and query.device.type == "cpu" and query.shape[2] == 1
        and key.shape[2] > TRACED_DECODE_MIN_SLOTS and dropout == 0.0 and document_ids is None
        and not _needs_gradient(query, key, *tensors)
    )


def bam_attention_traced_decode_step(
    query, key, value, query_positions, prior_parameters, formula: str, eps: float, scaling: float,
    ssmax_scale=None, ssmax_prior: bool = True, key_valid=None,
) -> torch.Tensor:
    """A static cache's decoding step in a compiled graph: (B, 1, H, D). A traced graph knows the position only as
    a tensor, so the materialized path computed the prior for every slot of the cache in every layer and step
    (H x max_cache_len powers) and attended to every slot. As one operator, the step reads the position, takes the
    prior from a table kept for these parameter values (computed once for all steps) and attends to keys 0..P
    only, as an eager step does (`_attend_single_query`).

    query: (B, H, 1, D); key, value: (B, Hkv, Lk, D), the cache's slots; prior_parameters: theta_alpha,
    theta_beta, theta_mu (H,); key_valid: (B, Lk) bool or None."""
    return _traced_decode_step(
        query, key, value, query_positions, *prior_parameters, formula, eps, scaling, ssmax_scale, ssmax_prior,
        key_valid,
    )


# The tables of the priors a compiled decoding step has seen, by their theta_alpha tensor (weakly: a table goes with
# its model); each is used only while the parameters hold its values (`KeptPriorTable`).
_TRACED_DECODE_TABLES = WeakTensorKeyDictionary()


@torch.library.custom_op("bam_llama::traced_decode_step", mutates_args=())
def _traced_decode_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    theta_alpha: torch.Tensor,
    theta_beta: torch.Tensor,
    theta_mu: torch.Tensor,
    formula: str,
    eps: float,
    scaling: float,
    ssmax_scale: Optional[torch.Tensor],
    ssmax_prior: bool,
    key_valid: Optional[torch.Tensor],
) -> torch.Tensor:
    last = int(query_positions[-1])
    if last >= key.shape[2]:
        raise ValueError(f"a decoding step at position {last} past the cache's {key.shape[2]} slots")
    kept = _TRACED_DECODE_TABLES.get(theta_alpha)
    if kept is None:
        kept = _TRACED_DECODE_TABLES[theta_alpha] = KeptPriorTable()
    table = kept.window(last, theta_alpha, theta_beta, theta_mu, formula, eps)
    if key_valid is not None and bool(key_valid[:, : last + 1].all()):  # nothing padded in the filled slots
        key_valid = None
    output = bam_attention_blocked(  # eager code here: a decoding step (`_attend_single_query`); it converts and
        query, key, value, query_positions, table, scaling,  # reads the filled slots only (keys 0 .. P, P the table's)
        ssmax_scale=ssmax_scale, ssmax_prior=ssmax_prior, key_valid=key_valid,
    )
    return output.transpose(1, 2).contiguous()


@_traced_decode_step.register_fake
def _traced_decode_step_fake(query, *arguments) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)


def _visible_counts(query_positions, keys: int, key_valid, document_ids) -> torch.Tensor:
    """(1 or B, Lq) keys each query sees (Scalable Softmax's n): every key up to its own position, unless padding or
    packed documents hide some."""
    if key_valid is None and document_ids is None:
        return (query_positions + 1)[None]
    return visible_key_counts(query_positions, keys, key_valid, document_ids)


def _needs_gradient(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@torch.library.custom_op("bam_llama::blocked_attention_inference", mutates_args=())
def _blocked_inference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    prior_table: torch.Tensor,
    scaling: float,
    ssmax_scale: Optional[torch.Tensor],
    ssmax_prior: bool,
    key_valid: Optional[torch.Tensor],
    document_ids: Optional[torch.Tensor],
    block_rows: int,
    block_heads: int,
) -> torch.Tensor:
    """`_attention_over_query_blocks` without gradients, as one operator of a compiled graph: (B, Lq, H, D)
    contiguous. block_rows / block_heads: 0 for the default block shape."""
    output = _attention_over_query_blocks(
        query, key, value, query_positions, prior_table, scaling, ssmax_scale, ssmax_prior, key_valid,
        document_ids, 0.0, block_rows or None, block_heads or None,
    )
    return output.contiguous()


@_blocked_inference.register_fake
def _blocked_inference_fake(query, *arguments) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)


def _attention_over_query_blocks(
    query, key, value, query_positions, prior_table, scaling, ssmax_scale, ssmax_prior, key_valid, document_ids,
    dropout, block_rows, block_heads,
) -> torch.Tensor:
    """`bam_attention_blocked` on inputs already in the compute dtype: plans the query blocks, picks the backward
    (SDPA's own, a flash-style one for the prior, a replay per block, or autograd's in a traced graph) and attends;
    returns (B, Lq, H, D)."""
    compute_dtype = query.dtype
    batch, heads, q_len, _ = query.shape
    last = prior_table.shape[-1] - 1  # the last query's position, from a shape: no tensor value plans the blocks
    counts = _visible_counts(query_positions, key.shape[2], key_valid, document_ids)  # (1 or B, Lq)
    row_factor = None if ssmax_scale is None else ssmax_factor(counts, ssmax_scale)
    scale_prior = row_factor is not None and ssmax_prior
    if not (block_rows or block_heads) and dropout == 0.0 and _fused_kernel_runs(query, document_ids):
        row_factor = None if row_factor is None else row_factor.to(compute_dtype)
        output = bam_attention_fused_cpu(
            query if row_factor is None else query * row_factor, key, value, last - q_len + 1,
            prior_table.to(compute_dtype), scaling, row_factor[..., 0] if scale_prior else None,
            _key_bias(key_valid, compute_dtype), _document_starts(document_ids, query_positions), counts,
        )
        return output if key_valid is None else output.masked_fill((counts == 0)[:, :, None, None], 0.0)
    # dropout runs SDPA's unfused path, which materializes each block's probabilities: keep those bounded too
    mask_is_view = not scale_prior and key_valid is None and document_ids is None and dropout == 0.0
    group = heads // key.shape[1]
    prior_trains = torch.is_grad_enabled() and (prior_table.requires_grad or (scale_prior and row_factor.requires_grad))
    inputs_train = _needs_gradient(query, key, value, row_factor)  # the row factor is folded into q
    key_tiled = _in_key_tiles(query, last + 1, mask_is_view, prior_trains or inputs_train, dropout)
    if key_tiled:
        default_rows, default_heads = key_tile_block_shape(batch, heads, group, q_len)
    else:
        default_rows, default_heads = default_block_shape(batch, heads, group, q_len, last + 1, mask_is_view)
    block, head_block = min(q_len, block_rows or default_rows), min(heads, block_heads or default_heads)
    if head_block % group:
        raise ValueError(f"block_heads={head_block} must be a multiple of the {group} query heads of a key/value head")
    backward_block = min(q_len, BACKWARD_BLOCK_ROWS)
    # table[m] = prior at distance m - P; entries past P are future keys: -inf (times a row factor c > 0 still
    # -inf; blocks with a factor c <= 0 are masked again, see `_write_block_mask`)
    padding = max(block, backward_block) - 1  # windows of the last row of a block reach this far past distance 0
    table = F.pad(prior_table.to(compute_dtype), (0, padding), value=float("-inf"))

    query = query.flip(2).contiguous() if q_len > 1 else query.contiguous()
    key, value = key.contiguous(), value.contiguous()  # SDPA's CPU kernel is much slower on (B, L, H, D) layouts
    if row_factor is not None:
        row_factor = (row_factor.flip(2) if q_len > 1 else row_factor).to(compute_dtype)
        query = query * row_factor
    key_mask = _key_bias(key_valid, compute_dtype)
    key_mask = None if key_mask is None else key_mask[:, None, None, :]
    query_documents = None if document_ids is None else document_ids[:, query_positions.flip(0)]

    # Training a prior: SDPA has no gradient for its mask, so the blocks run without autograd (fused kernel) and
    # a flash-style backward recomputes each block's probabilities once for every gradient; no block's scores
    # are kept, memory stays O(L). With dropout, each block is replayed under autograd instead. A frozen prior
    # (only q, k, v need gradients) keeps SDPA's own fused backward where the mask is a view of the table; a
    # materialized mask would be kept by SDPA for every block (O(L^2) a layer), so those take the same paths.
    prior_factor = row_factor if scale_prior else None
    tensors = (query, key, value, table, prior_factor, key_mask, query_documents, document_ids)
    # An exported program is plain ATen (SDPA over the blocks, differentiable as any graph): no custom operator.
    own_backward = (prior_trains or (inputs_train and not mask_is_view)) and not exporting()
    if own_backward and dropout == 0.0:
        output = _prior_gradient_attention(*tensors, block, head_block, backward_block, last, scaling)
    else:
        attend = _RecomputedBlock.apply  # with dropout: each block replayed under autograd
        if key_tiled:  # no gradient, a long block whose mask is written out
            attend = _attend_in_key_tiles(query, block, head_block)
        elif not own_backward:  # no gradient, or SDPA's own backward with a view mask (which reuses no buffer)
            attend = _attend_reusing_masks(query, block, head_block, last)
        elif torch.compiler.is_compiling():  # a traced graph cannot replay a block in its backward: autograd keeps it
            attend = _attend_block
        output = _attend_blocks(attend, q_len, block, heads, head_block, last, scaling, dropout, *tensors)
    output = output.flip(1) if q_len > 1 else output  # (B, Lq, H, D), natural order
    if key_valid is not None:  # rows that see no key (queries on padding) give zeros
        output = output.masked_fill((counts == 0)[:, :, None, None], 0.0)
    return output


def _fused_kernel_runs(query: torch.Tensor, document_ids: torch.Tensor | None) -> bool:
    """Whether the queries run `fused_cpu_bam`'s kernel: eager float32 code on the CPU (a traced graph reaches it
    without gradients through `_blocked_inference`; an exported program stays plain ATen), where the kernel could be
    built, with packed documents only as runs of keys (ids that never decrease along a row, as the model's own
    detection from restarting position_ids makes them): the kernel sees each query's keys from its document's first."""
    eager_cpu = query.device.type == "cpu" and not torch.compiler.is_compiling() and not exporting()
    if not eager_cpu or query.dtype != torch.float32:
        return False
    if document_ids is not None and not bool((document_ids[:, 1:] >= document_ids[:, :-1]).all()):
        return False
    return fused_cpu_available()


def _document_starts(document_ids: torch.Tensor | None, query_positions: torch.Tensor) -> torch.Tensor | None:
    """(B, Lq) index of the first key of each query's document (documents are runs of equal ids), or None."""
    if document_ids is None:
        return None
    keys = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    run_start = torch.where(starts, keys, torch.zeros_like(keys)).cummax(-1).values
    return run_start[:, query_positions]


def _key_bias(key_valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(B, Lk) score added to every key: 0, HIDDEN_KEY_SCORE on padding."""
    if key_valid is None:
        return None
    hidden = ~key_valid.bool()
    return torch.zeros(key_valid.shape, dtype=dtype, device=key_valid.device).masked_fill(hidden, HIDDEN_KEY_SCORE)


VIEW_BLOCK_ROWS = 256  # SDPA's CPU kernel is fastest on 256-query calls here (benchmarks/results/cpu-speed-ab.md)
MASK_BLOCK_ROWS = 192  # SDPA's CPU kernel tiles 192 queries and more by 64 (fewer by 32, which is slower)
MASK_BLOCK_ELEMENTS = 3 << 19  # a materialized block mask of 6 MiB (fp32): larger ones fall out of the cache
# Past ~24K keys the mask budget leaves fewer queries a call than SDPA's CPU kernel tiles, each call re-reading
# every key for a few rows: at 1024 queries x 64K keys, 12-row blocks took 1.7x the time of 32-128
# (benchmarks/results/cpu-attention-serving.md). A block keeps this many rows of one head group even where its mask
# then passes MASK_BLOCK_ELEMENTS: batch x group x 32 x keys values, growing with the keys like the KV cache.
MIN_MASK_BLOCK_ROWS = 32
BACKWARD_BLOCK_ROWS = 64  # the prior-gradient backward keeps two (rows x keys) buffers: small ones stay in cache
# Without gradients, a block whose mask is written out (SSMax scaling the prior, padding, packed documents) and
# sees more than KEY_TILED_AFTER keys runs over tiles of KEY_TILE keys, each tile's mask written just before SDPA
# reads it (in cache) instead of a whole block's mask written out to memory and read back: one chunk of bam-eval's
# prefill, 1024 queries x 64K keys with SSMax, took 0.74x the time (0.94x at 16K keys, none gained at 4K; Intel
# Xeon, one thread, benchmarks/results/cpu-speed-long.md).
KEY_TILE = 512
KEY_TILED_AFTER = 8192
KEY_TILE_ELEMENTS = 1 << 20  # a tile's mask of 4 MiB (fp32) at most: batch x heads x rows x KEY_TILE


def default_block_shape(
    batch: int, heads: int, group: int, queries: int, keys: int, mask_is_view: bool
) -> tuple[int, int]:
    """(queries, query heads) of one SDPA call. Where the mask is a view of the prior table (it costs no memory):
    a fixed tile of queries, every head. Else the materialized (batch x heads x rows x keys) mask stays within
    MASK_BLOCK_ELEMENTS, but a call keeps MIN_MASK_BLOCK_ROWS queries (or every query, if fewer) of one head group.
    Short keys: every head, and fewer queries. Long keys: MASK_BLOCK_ROWS queries (SDPA's CPU kernel tiles 64 at a
    time from there on) over as many groups of `group` heads (those sharing a key/value head) as fit, since every
    call re-reads its heads' keys and values; fewer queries for very long keys."""
    if mask_is_view:
        return min(queries, VIEW_BLOCK_ROWS), heads
    # a block of R rows computes ~R / 2 future keys per row, which a float mask cannot skip: R <= keys / 8, but
    # at least 32 (a short prompt in one call, not one call per few rows)
    rows = min(queries, MASK_BLOCK_ROWS, max(MIN_MASK_BLOCK_ROWS, keys // 8))
    least_rows = min(rows, MIN_MASK_BLOCK_ROWS)
    rows_of_every_head = MASK_BLOCK_ELEMENTS // (batch * heads * keys)
    if rows < MASK_BLOCK_ROWS and rows_of_every_head >= least_rows:  # fewer heads would not reach larger tiles
        return min(rows, rows_of_every_head), heads
    group_row = batch * group * keys  # mask elements of one query row of one head group
    rows = max(least_rows, min(rows, MASK_BLOCK_ELEMENTS // group_row))
    groups, groups_per_call = heads // group, max(1, MASK_BLOCK_ELEMENTS // (rows * group_row))
    calls = -(-groups // groups_per_call)
    return rows, group * -(-groups // calls)  # calls of equal size: 4 groups at most 3 a call make 2 + 2, not 3 + 1


def key_tile_block_shape(batch: int, heads: int, group: int, queries: int) -> tuple[int, int]:
    """(queries, query heads) of one block of `_attend_block_in_key_tiles`: VIEW_BLOCK_ROWS queries (each key tile
    is read once for all of them) of as many whole key/value groups as keep a tile's mask within KEY_TILE_ELEMENTS."""
    rows = min(queries, VIEW_BLOCK_ROWS)
    groups = max(1, KEY_TILE_ELEMENTS // (batch * group * rows * KEY_TILE))
    return rows, group * min(heads // group, groups)


def _in_key_tiles(query: torch.Tensor, keys: int, mask_is_view: bool, gradient: bool, dropout: float) -> bool:
    """Whether the blocks run over key tiles: eager CPU code past KEY_TILED_AFTER keys whose masks are written out,
    without gradients or dropout (the op that returns SDPA's log-sum-exp is the CPU kernel's)."""
    return (
        not (mask_is_view or gradient or dropout > 0.0) and query.device.type == "cpu" and keys > KEY_TILED_AFTER
        and not torch.compiler.is_compiling() and not exporting()
    )


def _blocks(q_len: int, block: int, last: int):
    """(start, rows, keys) of every block: reversed rows start..start+rows, whose last query sits at position
    last - start, against keys 0..keys-1."""
    for start in range(0, q_len, block):
        yield start, min(block, q_len - start), last - start + 1


def _attend_reusing_masks(query: torch.Tensor, block: int, head_block: int, last: int):
    """`_attend_block` writing every materialized block mask into one buffer, allocated at the first (the largest:
    it sees every key) block: a fresh multi-MiB mask per block would be page-faulted in every time. A single block
    (a decoding step) has nothing to reuse. Never under autograd with a materialized mask: SDPA would keep each
    block's mask for its backward (`bam_attention_blocked` routes those blocks to its own backward). Nor in a
    traced graph: its buffers are the compiler's to plan (and a view of a reused buffer written with `out=` does
    not trace)."""
    batch, heads, q_len, _ = query.shape
    if (q_len <= block and heads <= head_block) or torch.compiler.is_compiling():
        return _attend_block
    workspace = _Workspace(1, batch * head_block * block * (last + 1), query)
    return functools.partial(_attend_block, take=functools.partial(workspace.take, 0))


def _attend_blocks(attend, q_len, block, heads, head_block, last, scaling, dropout, *tensors) -> torch.Tensor:
    """`attend(*tensors, start, rows, keys, head_slice, scaling, dropout)` over every block of rows and heads (None:
    every head), joined into (B, Lq, H, D), reversed rows."""
    head_slices = [slice(first, min(first + head_block, heads)) for first in range(0, heads, head_block)]
    head_slices = head_slices if len(head_slices) > 1 else [None]
    outputs = []
    for start, rows, keys in _blocks(q_len, block, last):
        parts = [attend(*tensors, start, rows, keys, head_slice, scaling, dropout) for head_slice in head_slices]
        outputs.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]


def _block_mask(
    table, prior_factor, key_mask, query_documents, document_ids, start, rows, keys, take=None
) -> torch.Tensor:
    """Float mask of reversed rows start..start+rows against keys 0..keys-1: (1 or B, H, rows, keys).

    prior_factor: the SSMax factor (B, H, Lq, 1) where it scales the prior.
    A mask that is not a view of the table is written into `take(shape)` (a reused buffer) if given."""
    windows = _table_windows(table, start, rows, keys)[None]  # (1, H, rows, keys) view
    if prior_factor is None and key_mask is None and query_documents is None:
        return windows  # the table's padding hides future keys
    batch = max(t.shape[0] for t in (prior_factor, key_mask, query_documents) if t is not None)
    shape = (batch, *windows.shape[1:])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (table, prior_factor)):
        mask = windows.new_empty(shape).copy_(windows)  # out= has no autograd
        if prior_factor is not None:  # the factor's gradient sums mask * dS: 0 on future keys, not -inf * 0 = NaN
            mask = _hide_future_(mask, rows, keys, 0.0).mul_(prior_factor[:, :, start : start + rows])
        return _hide_keys_(mask, key_mask, query_documents, document_ids, start, rows, keys)
    out = windows.new_empty(shape) if take is None else take(shape)
    return _write_block_mask(out, table, prior_factor, key_mask, query_documents, document_ids, start, rows, keys)


def _write_block_mask(
    out, table, prior_factor, key_mask, query_documents, document_ids, start, rows, keys, first_key=0, future=True
) -> torch.Tensor:
    """`_block_mask` written into `out`, a contiguous (B, H, rows, keys - first_key) tensor the scores are then
    added to: the block's keys first_key..keys-1 (a key tile; `future` False where no row has a future key there)."""
    windows = _table_windows(table, start + first_key, rows, keys - first_key)[None].expand(out.shape)
    if prior_factor is None:
        out.copy_(windows)  # future keys: the table's -inf
        future_hidden = True
    else:
        factor = prior_factor[:, :, start : start + rows]
        torch.mul(windows, factor, out=out)
        # c * -inf is -inf for c > 0 only (NaN for c = 0); on a GPU the check would stall every block, and a traced
        # graph cannot branch on it: fill there
        future_hidden = not future or (
            factor.device.type == "cpu" and not torch.compiler.is_compiling() and bool(factor.min() > 0)
        )
    return _hide_keys_(out, key_mask, query_documents, document_ids, start, rows, keys, future_hidden, first_key)


def _hide_keys_(
    scores, key_mask, query_documents, document_ids, start, rows, keys, future_hidden=False, first_key=0
) -> torch.Tensor:
    """In place on a block's (B or 1, H, rows, keys - first_key) scores or mask: -inf on future keys (unless
    `future_hidden` says they already are), HIDDEN_KEY_SCORE on padding and on keys of other documents."""
    if not future_hidden:
        _hide_future_(scores, rows, keys - first_key, float("-inf"))
    if key_mask is not None:
        scores.add_(key_mask[..., first_key:keys])
    if query_documents is not None:
        other_documents = _other_documents(query_documents, document_ids, start, rows, keys, first_key)
        scores.masked_fill_(other_documents, HIDDEN_KEY_SCORE)
    return scores


def _hide_future_(scores: torch.Tensor, rows: int, keys: int, value: float) -> torch.Tensor:
    """In place: `value` on the future keys of a block's (..., rows, keys) reversed rows."""
    if rows > 1:  # a single query sees every key of its block
        scores[..., keys - rows :].masked_fill_(_future(rows, rows, scores.device), value)
    return scores


def _table_windows(table: torch.Tensor, start: int, rows: int, keys: int) -> torch.Tensor:
    """(H, rows, keys) view: row r is table[:, start + r : start + r + keys]."""
    return table[:, start : start + rows + keys - 1].unfold(-1, keys, 1)


def _other_documents(query_documents, document_ids, start, rows, keys, first_key=0) -> torch.Tensor:
    """(B, 1, rows, keys - first_key) bool, True where the key belongs to another document than the query."""
    return (query_documents[:, start : start + rows, None] != document_ids[:, None, first_key:keys])[:, None]


def _attend_block(
    query, key, value, table, prior_factor, key_mask, query_documents, document_ids,
    start, rows, keys, heads, scaling, dropout, take=None,
) -> torch.Tensor:
    """Reversed query rows start..start+rows of query heads `heads` (a slice of whole key/value groups, or None for
    all) against keys 0..keys-1: (B, rows, heads, D). take: see `_block_mask`."""
    if heads is not None:
        query, key, value, table, prior_factor = _select_heads(query, key, value, table, prior_factor, heads)
    mask = _block_mask(table, prior_factor, key_mask, query_documents, document_ids, start, rows, keys, take)
    output = F.scaled_dot_product_attention(
        query[:, :, start : start + rows], key[:, :, :keys], value[:, :, :keys], attn_mask=mask,
        dropout_p=dropout, scale=scaling, enable_gqa=True,
    )
    return output.transpose(1, 2)


def _attend_in_key_tiles(query, block: int, head_block: int):
    """`_attend_block_in_key_tiles` writing every tile's mask into one buffer of the largest tile."""
    workspace = _Workspace(1, query.shape[0] * head_block * block * (KEY_TILE + block), query)
    return functools.partial(_attend_block_in_key_tiles, take=functools.partial(workspace.take, 0))


def _attend_block_in_key_tiles(
    query, key, value, table, prior_factor, key_mask, query_documents, document_ids,
    start, rows, keys, heads, scaling, dropout, take,
) -> torch.Tensor:
    """`_attend_block` (no gradient, no dropout) over tiles of the block's keys: each tile's mask is written into
    `take(shape)` and read by SDPA's CPU kernel while in cache; the tiles' outputs o_t, whose softmax sums are
    exp(lse_t), merge exactly: o = sum_t exp(lse_t - lse) o_t with lse = log sum_t exp(lse_t). The query heads
    sharing a key/value head are stacked as rows of one (group x rows)-query call.

    Precision: lse_t comes in float32, and a score sum of e^50 would carry an error of 50 x 6e-8 in its logarithm,
    the same in every weight. So the tile with the diagonal (the keys nearest each query) runs first and its lse
    is subtracted from every later tile's mask rows: their lse_t arrive as differences near 0, and the first
    tile's weight is exactly 1."""
    if heads is not None:
        query, key, value, table, prior_factor = _select_heads(query, key, value, table, prior_factor, heads)
    batch, block_heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    stacked = (batch, kv_heads, block_heads // kv_heads * rows)
    block_query = query[:, :, start : start + rows].reshape(*stacked, head_dim)
    masking = (table, prior_factor, key_mask, query_documents, document_ids)
    output = log_sum = shift = None
    for first_key, end_key, future in reversed(list(_key_tiles(keys, rows))):
        mask = take((batch, block_heads, rows, end_key - first_key))
        mask = _write_block_mask(mask, *masking, start, rows, end_key, first_key, future)
        if shift is not None:
            mask.sub_(shift)
        part, part_log_sum = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            block_query, key[:, :, first_key:end_key], value[:, :, first_key:end_key],
            attn_mask=mask.view(*stacked, -1), scale=scaling,
        )
        if shift is None:  # the diagonal tile: its lse is the shift of the rest
            shift = part_log_sum.reshape(batch, block_heads, rows, 1)
            output, log_sum = part, torch.zeros_like(part_log_sum)
        else:
            output, log_sum = _merged(output, log_sum, part, part_log_sum)
    return output.view(batch, block_heads, rows, head_dim).transpose(1, 2)


def _key_tiles(keys: int, rows: int):
    """(first, end, future) of the key tiles of a block of `rows` reversed rows against keys 0..keys-1: KEY_TILE
    keys at a time among the keys every row sees (0..keys-rows, up to the block's earliest query), then the rest,
    the diagonal, which holds each row's own key (no row of a tile sees -inf only), `future` True."""
    first = 0
    while keys - rows - first > KEY_TILE:
        yield first, first + KEY_TILE, False
        first += KEY_TILE
    yield first, keys, True


def _merged(output, log_sum, part, part_log_sum):
    """(output, log-sum-exp) of the keys so far joined with a tile's: (B, Hkv, R, D), (B, Hkv, R)."""
    total = torch.logaddexp(log_sum, part_log_sum)
    part = part.mul_(torch.exp(part_log_sum - total)[..., None])
    return output.mul_(torch.exp(log_sum - total)[..., None]).add_(part), total


def _select_heads(query, key, value, table, prior_factor, heads: slice):
    """The tensors of query heads `heads` (whole key/value groups) and their key/value heads."""
    group = query.shape[1] // key.shape[1]
    key_heads = slice(heads.start // group, heads.stop // group)
    prior_factor = None if prior_factor is None else prior_factor[:, heads]
    return query[:, heads], key[:, key_heads], value[:, key_heads], table[heads], prior_factor


@torch.library.custom_op("bam_llama::blocked_prior_attention", mutates_args=())
def _prior_gradient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    prior_factor: Optional[torch.Tensor],
    key_mask: Optional[torch.Tensor],
    query_documents: Optional[torch.Tensor],
    document_ids: Optional[torch.Tensor],
    block: int,
    head_block: int,
    backward_block: int,
    last: int,
    scaling: float,
) -> torch.Tensor:
    """All blocks of `bam_attention_blocked` when the prior trains (no dropout), with a flash-style backward:
    (B, Lq, H, D) contiguous, reversed rows (`backward_block`: the backward's block of rows).

    Forward: each block through SDPA's fused kernel; only the inputs are kept (O(L) memory).
    Backward, block by block: P = softmax(S) recomputed once, then dV = P^T dO, dS = P * (dP - rowsum(P * dP))
    with dP = dO V^T (the softmax backward: a row that sees one key gets dS = 0 exactly, which matters because
    the prior's gradient at distance 0 is huge for a negative beta), dQ = dS K, dK = dS^T Q (scaled), and the
    mask's gradient dS goes to the prior table along the diagonals (row r of a block's mask is a window of the
    table, see `_table_windows`) and, where SSMax scales the prior, to the row factor. Key/value heads are shared
    by groups of query heads: (B, H, R, .) is viewed as (B * Hkv, group * R, .), so the matmuls sum over a group.

    Both passes are custom operators (`bam_llama::blocked_prior_attention` and its backward), opaque to
    torch.compile like a fused kernel: a compiled model runs this same code. Autocast, as torch.amp.custom_fwd /
    custom_bwd would have it, for any device: the floating inputs come in the compute dtype with autocast off
    (`bam_attention_blocked`; a compiled graph runs with autocast off too), the backward turns it off itself, so
    SDPA and the matmuls keep that dtype; each gradient is returned in its input's dtype."""
    tensors = (query, key, value, table, prior_factor, key_mask, query_documents, document_ids)
    tensors = [t.detach() if t is not None else None for t in tensors]  # else SDPA avoids its fused kernel
    attend = _attend_reusing_masks(query, block, head_block, last)
    output = _attend_blocks(attend, query.shape[2], block, query.shape[1], head_block, last, scaling, 0.0, *tensors)
    return output.contiguous()


@_prior_gradient_attention.register_fake
def _prior_gradient_attention_fake(query, *arguments) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)


@torch.library.custom_op("bam_llama::blocked_prior_attention_backward", mutates_args=())
def _prior_gradient_attention_backward(
    grad_output: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    table: torch.Tensor,
    prior_factor: Optional[torch.Tensor],
    key_mask: Optional[torch.Tensor],
    query_documents: Optional[torch.Tensor],
    document_ids: Optional[torch.Tensor],
    block: int,
    last: int,
    scaling: float,
    table_grad: bool,
    factor_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV, d table, d factor); the last two are empty where not asked for. Autocast off: a backward
    called inside an autocast region runs as the forward did."""
    with autocast_off(query.device):
        grads = _prior_gradient_backward(
            grad_output, query, key, value, table, prior_factor, key_mask, query_documents, document_ids, block,
            last, scaling, table_grad, factor_grad,
        )
    return tuple(query.new_empty(0) if grad is None else grad for grad in grads)


@_prior_gradient_attention_backward.register_fake
def _prior_gradient_attention_backward_fake(
    grad_output, query, key, value, table, prior_factor, key_mask, query_documents, document_ids, block, last,
    scaling, table_grad, factor_grad,
):
    grad_table = torch.empty_like(table) if table_grad else query.new_empty(0)
    grad_factor = torch.empty_like(prior_factor) if factor_grad else query.new_empty(0)
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), grad_table, grad_factor


def _prior_gradient_setup(ctx, inputs, output) -> None:
    tensors, (_, _, backward_block, last, scaling) = inputs[:8], inputs[8:]
    ctx.save_for_backward(*tensors)
    ctx.block = (backward_block, last, scaling)


def _prior_gradient_backward_rule(ctx, grad_output):
    query, key, value, table, prior_factor, key_mask, query_documents, document_ids = ctx.saved_tensors
    table_grad, factor_grad = ctx.needs_input_grad[3], prior_factor is not None and ctx.needs_input_grad[4]
    grad_query, grad_key, grad_value, grad_table, grad_factor = _prior_gradient_attention_backward(
        grad_output, query, key, value, table, prior_factor, key_mask, query_documents, document_ids, *ctx.block,
        table_grad, factor_grad,
    )
    return (
        grad_query, grad_key, grad_value, grad_table if table_grad else None, grad_factor if factor_grad else None,
        None, None, None, None, None, None, None, None,
    )


_prior_gradient_attention.register_autograd(_prior_gradient_backward_rule, setup_context=_prior_gradient_setup)


def _prior_gradient_backward(
    grad_output, query, key, value, table, prior_factor, key_mask, query_documents, document_ids, block, last,
    scaling, table_grad, factor_grad,
):
    """The backward of `_prior_gradient_attention`: (dQ, dK, dV, d table or None, d factor or None)."""
    masking = (table, prior_factor, key_mask, query_documents, document_ids)
    batch, heads, q_len, head_dim = query.shape
    kv_heads, key_len = key.shape[1], key.shape[2]
    pairs, group = batch * kv_heads, heads // kv_heads  # matmul batches: (B x Hkv), rows: group x block rows
    queries = (query * scaling).view(pairs, group, q_len, head_dim)
    output_grads = grad_output.transpose(1, 2).contiguous().view(pairs, group, q_len, head_dim)
    keys_t = key.view(pairs, key_len, head_dim).transpose(1, 2)
    values_t = value.view(pairs, key_len, head_dim).transpose(1, 2)
    scaled_keys = (key * scaling).view(pairs, key_len, head_dim)
    grad_query = query.new_empty(pairs, group, q_len, head_dim)
    grad_key, grad_value = key.new_zeros(pairs, key_len, head_dim), value.new_zeros(pairs, key_len, head_dim)
    grad_table = torch.zeros_like(table) if table_grad else None
    grad_factor = torch.zeros_like(prior_factor) if factor_grad else None
    workspace = _Workspace(3, batch * heads * block * (last + 1 + block), query)  # block <= q_len
    for start, rows, keys in _blocks(q_len, block, last):
        rows_slice, grouped = slice(start, start + rows), (pairs, group * rows, keys)
        block_query = queries[:, :, rows_slice].reshape(pairs, group * rows, head_dim)
        block_grad = output_grads[:, :, rows_slice].reshape(pairs, group * rows, head_dim)
        scores = _write_block_mask(workspace.take(0, (batch, heads, rows, keys)), *masking, start, rows, keys)
        scores.view(grouped).baddbmm_(block_query, keys_t[:, :, :keys])
        # in place: two (rows x keys) buffers instead of three stay in cache (4-8% faster at 2048-4096 tokens)
        probs = torch.softmax(scores.view(grouped), dim=-1, out=scores.view(grouped))
        grad_value[:, :keys].baddbmm_(probs.transpose(1, 2), block_grad)
        grad_probs = torch.bmm(block_grad, values_t[:, :, :keys], out=workspace.take(1, grouped))
        grad_scores = _softmax_backward(grad_probs, probs, out=grad_probs)
        grad_query[:, :, rows_slice] = torch.bmm(grad_scores, scaled_keys[:, :keys]).view(pairs, group, rows, -1)
        grad_key[:, :keys].baddbmm_(grad_scores.transpose(1, 2), block_query)
        factor = None if prior_factor is None else prior_factor[:, :, rows_slice]
        row_sums = 0.0
        for first, diagonals in _mask_grad_diagonals(grad_scores.view(batch, heads, rows, keys), workspace.take):
            span = slice(start + first, start + first + diagonals.shape[-1])
            if grad_table is not None:
                grad_table[:, span] += _diagonal_sums(diagonals, factor)
            if grad_factor is not None:
                row_sums = row_sums + _window_dots(diagonals, table[:, span])  # (B, H, rows, 1)
        if grad_factor is not None:
            grad_factor[:, :, rows_slice] = row_sums.sum(0, keepdim=True) if grad_factor.shape[0] == 1 else row_sums
    grad_query = grad_query.view(batch, heads, q_len, head_dim)
    return grad_query, grad_key.view(key.shape), grad_value.view(value.shape), grad_table, grad_factor


class _Workspace:
    """Reusable flat buffers for (B, H, rows, keys) blocks, each allocated at its first use: a fresh multi-MiB
    tensor per block would be page-faulted in again every time."""

    def __init__(self, slots: int, size: int, like: torch.Tensor):
        self.buffers, self.size, self.like = [None] * slots, size, like

    def take(self, slot: int, shape: tuple[int, ...]) -> torch.Tensor:
        if self.buffers[slot] is None:
            self.buffers[slot] = self.like.new_empty(self.size)
        return self.buffers[slot][: math.prod(shape)].view(shape)


def _softmax_backward(grad_probs: torch.Tensor, probs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dS = P * (dP - rowsum(P * dP)) in one fused pass, into `out` (all three contiguous; `out` may be
    `grad_probs`: a row's sum is taken before its first write). The row sum of P * dP (not the flash delta
    rowsum(dO * O)) gives dS = 0 exactly on a row that sees a single key."""
    return torch.ops.aten._softmax_backward_data.out(grad_probs, probs, -1, probs.dtype, grad_input=out)


def _mask_grad_diagonals(mask_grad: torch.Tensor, take):
    """(first, view) pairs whose columns are the diagonals of a block's dS, (B, H, R, K) contiguous: column t of a
    view holds the entries r + j = first + t (table entry start + first + t, see `_table_windows`), one per row.
    Sums r + j < R - 1 come from the top-left corner, copied with R zero columns after its R - 1 (into `take(2)`)
    so that no row reads its neighbour's values; R - 1 <= r + j < K are read from dS itself; r + j >= K would be
    future keys of row r (the key after its own position), where dS is 0."""
    batch, heads, rows, keys = mask_grad.shape
    if rows > 1:
        corner = take(2, (batch, heads, rows, 2 * rows - 1))
        corner[..., rows - 1 :].zero_()
        corner[..., : rows - 1].copy_(mask_grad[..., : rows - 1])
        yield 0, _diagonal_windows(corner, 0, rows - 1)
    yield rows - 1, _diagonal_windows(mask_grad, rows - 1, keys - rows + 1)


def _diagonal_windows(values: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """(B, H, R, W) contiguous -> (B, H, R, count) view with out[..., r, t] = values[..., r, first + t - r]: read
    with a row stride one shorter, row r starts r elements earlier, so a column holds one diagonal. Where
    first + t - r leaves 0..W-1, the view reads the neighbouring row instead."""
    batch_stride, head_stride, width = values.stride(0), values.stride(1), values.shape[-1]
    return values.as_strided(
        (*values.shape[:3], count), (batch_stride, head_stride, width - 1, 1), values.storage_offset() + first
    )


def _diagonal_sums(diagonals: torch.Tensor, row_weights: torch.Tensor | None) -> torch.Tensor:
    """(B, H, R, T) diagonals -> (H, T): the sum over batch and rows, each row weighted by w[b, :, r] (a matmul).
    row_weights: (B or 1, H, R, 1), or None for ones."""
    if row_weights is None:
        return diagonals.sum(dim=(0, 2))
    total = None
    for b in range(diagonals.shape[0]):
        weights = row_weights[b if row_weights.shape[0] > 1 else 0].transpose(1, 2)  # (H, 1, R)
        total = torch.bmm(weights, diagonals[b]) if total is None else total.baddbmm_(weights, diagonals[b])
    return total[:, 0]


def _window_dots(diagonals: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Every row of (B, H, R, T) diagonals dotted with the table entries of its columns, table (H, T): (B, H, R, 1),
    one vector-matrix product per batch item."""
    rows = [torch.bmm(table[:, None, :], diagonals[b].transpose(1, 2)) for b in range(diagonals.shape[0])]
    return torch.stack(rows).transpose(2, 3)


class _RecomputedBlock(torch.autograd.Function):
    """`_attend_block` that keeps only its inputs: the backward pass recomputes the block with autograd on,
    replaying the random state for dropout. Gradients come from `torch.autograd.grad`, so `.grad()` works.
    Autocast: the forward runs in `bam_attention_blocked`'s autocast-off region, on inputs in the compute dtype, and
    the replay turns autocast off too (custom_bwd's convention: the backward under the forward's autocast state)."""

    TENSORS = 8  # query, key, value, table, prior_factor, key_mask, query_documents, document_ids

    @staticmethod
    def forward(ctx, *arguments):
        # arguments: the tensors of `_attend_block`, then start, rows, keys, heads, scaling, dropout
        tensors, ctx.block = arguments[: _RecomputedBlock.TENSORS], arguments[_RecomputedBlock.TENSORS :]
        dropout = ctx.block[-1]
        ctx.device = tensors[0].device
        ctx.rng_state = _rng_state(ctx.device) if dropout > 0.0 else None
        ctx.save_for_backward(*tensors)
        detached = [t.detach() if t is not None else None for t in tensors]  # else SDPA avoids its fused kernel
        return _attend_block(*detached, *ctx.block)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        needs_grad = ctx.needs_input_grad[: _RecomputedBlock.TENSORS]
        tensors = [
            t.detach().requires_grad_(wanted) if t is not None else None
            for t, wanted in zip(ctx.saved_tensors, needs_grad)
        ]
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.enable_grad(), autocast_off(ctx.device), torch.random.fork_rng(devices=devices):
            if ctx.rng_state is not None:
                _set_rng_state(ctx.device, ctx.rng_state)
            output = _attend_block(*tensors, *ctx.block)
            wanted = [t for t, flag in zip(tensors, needs_grad) if flag]
            grads = iter(torch.autograd.grad(output, wanted, grad_output))  # the replay's backward: autocast off too
        return tuple(next(grads) if flag else None for flag in needs_grad) + (None,) * len(ctx.block)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _future(rows: int, keys: int, device) -> torch.Tensor:
    """(rows, keys) bool, True where key j lies after the query of reversed row r (position P_block - r)."""
    return torch.arange(keys, device=device)[None, :] + torch.arange(rows, device=device)[:, None] >= keys
