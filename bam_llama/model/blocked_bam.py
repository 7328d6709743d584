"""Blocked SDPA, the "sdpa" attention's PyTorch path: SDPA over blocks of queries whose float mask is a window of
one prior table per head, planned from shapes only. With the queries in reverse order the rows of a block are
consecutive windows of the table: where nothing else is masked the block's mask is a strided VIEW of the table (no
copy); with SSMax scaling the prior, padding or packed documents the block's mask is written out (`block_masks_bam`),
and without gradients past KEY_TILED_AFTER keys a block meets its keys in tiles merged through SDPA's log-sum-exp.
The route (`attention_route_bam`) picks how the blocks are attended: reusing one mask buffer, over key tiles, under
autograd in a traced graph, or replayed under autograd with dropout; the prior-gradient path (`prior_backward_bam`)
plans its blocks here too.

Shapes: B batch, H query heads, Hkv key/value heads, Lq queries, Lk keys, D head size.
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .block_masks_bam import Workspace, block_mask, key_bias, query_blocks, visible_counts, write_block_mask
from .prior_bam import autocast_off, ssmax_factor

VIEW_BLOCK_ROWS = 256  # SDPA's CPU kernel is fastest on 256-query calls (benchmarks/cpu_speed_ab.py --attention)
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


def key_tiles_pay_off(keys: int) -> bool:
    """Whether a block against `keys` keys whose mask is written out runs faster over key tiles (KEY_TILED_AFTER)."""
    return keys > KEY_TILED_AFTER


class QueryBlocks(NamedTuple):
    """One call's queries planned into blocks (`plan_query_blocks`)."""

    tensors: tuple  # query (reversed, SSMax factor in), key, value, table, prior_factor, key_mask, documents (q, k)
    block: int  # queries of a forward block
    head_block: int  # query heads of a forward block
    backward_block: int  # queries of a block of the prior-gradient backward
    last: int  # the last query's position P
    counts: torch.Tensor  # (1 or B, Lq) keys each query sees
    padded: bool  # a padding mask was given: rows that see no key are zeroed


def plan_query_blocks(
    query, key, value, query_positions, prior_table, ssmax_scale, ssmax_prior, key_valid, document_ids, dropout,
    block_rows, block_heads, key_tiled: bool,
) -> QueryBlocks:
    """The blocks of a call on inputs in the compute dtype, planned from shapes only (P is the table's length - 1),
    never from tensor values: a traced graph has no data-dependent branch. A block is `block_rows` queries of
    `block_heads` query heads (a multiple of the heads sharing a key/value head); both default to
    `default_block_shape`, or `key_tile_block_shape` over key tiles."""
    compute_dtype = query.dtype
    batch, heads, q_len, _ = query.shape
    last = prior_table.shape[-1] - 1  # the last query's position, from a shape: no tensor value plans the blocks
    counts = visible_counts(query_positions, key.shape[2], key_valid, document_ids)  # (1 or B, Lq)
    row_factor = None if ssmax_scale is None else ssmax_factor(counts, ssmax_scale)
    scale_prior = row_factor is not None and ssmax_prior
    # dropout runs SDPA's unfused path, which materializes each block's probabilities: keep those bounded too
    mask_is_view = not scale_prior and key_valid is None and document_ids is None and dropout == 0.0
    group = heads // key.shape[1]
    if key_tiled:
        default_rows, default_heads = key_tile_block_shape(batch, heads, group, q_len)
    else:
        default_rows, default_heads = default_block_shape(batch, heads, group, q_len, last + 1, mask_is_view)
    block, head_block = min(q_len, block_rows or default_rows), min(heads, block_heads or default_heads)
    if head_block % group:
        raise ValueError(f"block_heads={head_block} must be a multiple of the {group} query heads of a key/value head")
    backward_block = min(q_len, BACKWARD_BLOCK_ROWS)
    # table[m] = prior at distance m - P; entries past P are future keys: -inf (times a row factor c > 0 still
    # -inf; blocks with a factor c <= 0 are masked again, see `write_block_mask`)
    padding = max(block, backward_block) - 1  # windows of the last row of a block reach this far past distance 0
    table = F.pad(prior_table.to(compute_dtype), (0, padding), value=float("-inf"))

    query = query.flip(2).contiguous() if q_len > 1 else query.contiguous()
    key, value = key.contiguous(), value.contiguous()  # SDPA's CPU kernel is much slower on (B, L, H, D) layouts
    if row_factor is not None:
        row_factor = (row_factor.flip(2) if q_len > 1 else row_factor).to(compute_dtype)
        query = query * row_factor
    key_mask = key_bias(key_valid, compute_dtype)
    key_mask = None if key_mask is None else key_mask[:, None, None, :]
    query_documents = None if document_ids is None else document_ids[:, query_positions.flip(0)]
    prior_factor = row_factor if scale_prior else None
    tensors = (query, key, value, table, prior_factor, key_mask, query_documents, document_ids)
    return QueryBlocks(tensors, block, head_block, backward_block, last, counts, key_valid is not None)


def in_query_order(blocks: QueryBlocks, output: torch.Tensor) -> torch.Tensor:
    """(B, Lq, H, D) reversed rows -> natural order, rows that see no key (queries on padding) zeroed."""
    output = output.flip(1) if output.shape[1] > 1 else output
    if blocks.padded:
        output = output.masked_fill((blocks.counts == 0)[:, :, None, None], 0.0)
    return output


def attend_query_blocks(blocks: QueryBlocks, attend, scaling: float, dropout: float) -> torch.Tensor:
    """`attend` (`attend_block`, or what `attend_reusing_masks` / `attend_in_key_tiles` / `RecomputedBlock.apply`
    give) over every block of the plan: (B, Lq, H, D), natural order."""
    q_len, heads = blocks.tensors[0].shape[2], blocks.tensors[0].shape[1]
    output = attend_blocks(
        attend, q_len, blocks.block, heads, blocks.head_block, blocks.last, scaling, dropout, *blocks.tensors
    )
    return in_query_order(blocks, output)


def attend_reusing_masks(query: torch.Tensor, block: int, head_block: int, last: int):
    """`attend_block` writing every materialized block mask into one buffer, allocated at the first (the largest:
    it sees every key) block: a fresh multi-MiB mask per block would be page-faulted in every time. A single block
    (a decoding step) has nothing to reuse. Never under autograd with a materialized mask: SDPA would keep each
    block's mask for its backward (the route sends those blocks to `prior_backward_bam`). Nor in a
    traced graph: its buffers are the compiler's to plan (and a view of a reused buffer written with `out=` does
    not trace)."""
    batch, heads, q_len, _ = query.shape
    if (q_len <= block and heads <= head_block) or torch.compiler.is_compiling():
        return attend_block
    workspace = Workspace(1, batch * head_block * block * (last + 1), query)
    return functools.partial(attend_block, take=functools.partial(workspace.take, 0))


def attend_blocks(attend, q_len, block, heads, head_block, last, scaling, dropout, *tensors) -> torch.Tensor:
    """`attend(*tensors, start, rows, keys, head_slice, scaling, dropout)` over every block of rows and heads (None:
    every head), joined into (B, Lq, H, D), reversed rows."""
    head_slices = [slice(first, min(first + head_block, heads)) for first in range(0, heads, head_block)]
    head_slices = head_slices if len(head_slices) > 1 else [None]
    outputs = []
    for start, rows, keys in query_blocks(q_len, block, last):
        parts = [attend(*tensors, start, rows, keys, head_slice, scaling, dropout) for head_slice in head_slices]
        outputs.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]


def attend_block(
    query, key, value, table, prior_factor, key_mask, query_documents, document_ids,
    start, rows, keys, heads, scaling, dropout, take=None,
) -> torch.Tensor:
    """Reversed query rows start..start+rows of query heads `heads` (a slice of whole key/value groups, or None for
    all) against keys 0..keys-1: (B, rows, heads, D). take: see `block_mask`."""
    if heads is not None:
        query, key, value, table, prior_factor = _select_heads(query, key, value, table, prior_factor, heads)
    mask = block_mask(table, prior_factor, key_mask, query_documents, document_ids, start, rows, keys, take)
    output = F.scaled_dot_product_attention(
        query[:, :, start : start + rows], key[:, :, :keys], value[:, :, :keys], attn_mask=mask,
        dropout_p=dropout, scale=scaling, enable_gqa=True,
    )
    return output.transpose(1, 2)


def attend_in_key_tiles(query, block: int, head_block: int):
    """`_attend_block_in_key_tiles` writing every tile's mask into one buffer of the largest tile."""
    workspace = Workspace(1, query.shape[0] * head_block * block * (KEY_TILE + block), query)
    return functools.partial(_attend_block_in_key_tiles, take=functools.partial(workspace.take, 0))


def _attend_block_in_key_tiles(
    query, key, value, table, prior_factor, key_mask, query_documents, document_ids,
    start, rows, keys, heads, scaling, dropout, take,
) -> torch.Tensor:
    """`attend_block` (no gradient, no dropout) over tiles of the block's keys: each tile's mask is written into
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
        mask = write_block_mask(mask, *masking, start, rows, end_key, first_key, future)
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


class RecomputedBlock(torch.autograd.Function):
    """`attend_block` that keeps only its inputs: the backward pass recomputes the block with autograd on,
    replaying the random state for dropout. Gradients come from `torch.autograd.grad`, so `.grad()` works.
    Autocast: the forward runs in the route's autocast-off region (`attention_route_bam`), on inputs in the compute
    dtype, and the replay turns autocast off too (custom_bwd's convention: the backward under the forward's
    autocast state)."""

    TENSORS = 8  # query, key, value, table, prior_factor, key_mask, query_documents, document_ids

    @staticmethod
    def forward(ctx, *arguments):
        # arguments: the tensors of `attend_block`, then start, rows, keys, heads, scaling, dropout
        tensors, ctx.block = arguments[: RecomputedBlock.TENSORS], arguments[RecomputedBlock.TENSORS :]
        dropout = ctx.block[-1]
        ctx.device = tensors[0].device
        ctx.rng_state = _rng_state(ctx.device) if dropout > 0.0 else None
        ctx.save_for_backward(*tensors)
        detached = [t.detach() if t is not None else None for t in tensors]  # else SDPA avoids its fused kernel
        return attend_block(*detached, *ctx.block)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        needs_grad = ctx.needs_input_grad[: RecomputedBlock.TENSORS]
        tensors = [
            t.detach().requires_grad_(wanted) if t is not None else None
            for t, wanted in zip(ctx.saved_tensors, needs_grad)
        ]
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with torch.enable_grad(), autocast_off(ctx.device), torch.random.fork_rng(devices=devices):
            if ctx.rng_state is not None:
                _set_rng_state(ctx.device, ctx.rng_state)
            output = attend_block(*tensors, *ctx.block)
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
