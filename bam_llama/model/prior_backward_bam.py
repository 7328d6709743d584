"""The prior-gradient path of blocked attention: every block of queries through SDPA's fused kernel forward, and a
flash-style backward that recomputes each block's probabilities once and returns the gradients of the prior table
and of the SSMax row factor beside dQ, dK, dV (SDPA has no gradient for its mask). Both passes are custom operators
(`bam_llama::blocked_prior_attention` and its backward). The route (`attention_route_bam`) sends a call here where
the prior trains, or where q, k, v train under a mask that is written out.

Shapes: B batch, H query heads, Hkv key/value heads, Lq queries, Lk keys, D head size; rows are reversed (see
`block_masks_bam.table_windows`).
"""

from typing import Optional

import torch

from .block_masks_bam import Workspace, query_blocks, write_block_mask
from .blocked_bam import attend_blocks, attend_reusing_masks
from .prior_bam import autocast_off

@torch.library.custom_op("bam_llama::blocked_prior_attention", mutates_args=())
def prior_gradient_attention(
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
    table, see `table_windows`) and, where SSMax scales the prior, to the row factor. Key/value heads are shared
    by groups of query heads: (B, H, R, .) is viewed as (B * Hkv, group * R, .), so the matmuls sum over a group.

    Both passes are custom operators (`bam_llama::blocked_prior_attention` and its backward), opaque to
    torch.compile like a fused kernel: a compiled model runs this same code. Autocast, as torch.amp.custom_fwd /
    custom_bwd would have it, for any device: the floating inputs come in the compute dtype with autocast off
    (`bam_attention_blocked`; a compiled graph runs with autocast off too), the backward turns it off itself, so
    SDPA and the matmuls keep that dtype; each gradient is returned in its input's dtype."""
    tensors = (query, key, value, table, prior_factor, key_mask, query_documents, document_ids)
    tensors = [t.detach() if t is not None else None for t in tensors]  # else SDPA avoids its fused kernel
    attend = attend_reusing_masks(query, block, head_block, last)
    output = attend_blocks(attend, query.shape[2], block, query.shape[1], head_block, last, scaling, 0.0, *tensors)
    return output.contiguous()


@prior_gradient_attention.register_fake
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


prior_gradient_attention.register_autograd(_prior_gradient_backward_rule, setup_context=_prior_gradient_setup)


def _prior_gradient_backward(
    grad_output, query, key, value, table, prior_factor, key_mask, query_documents, document_ids, block, last,
    scaling, table_grad, factor_grad,
):
    """The backward of `prior_gradient_attention`: (dQ, dK, dV, d table or None, d factor or None)."""
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
    workspace = Workspace(3, batch * heads * block * (last + 1 + block), query)  # block <= q_len
    for start, rows, keys in query_blocks(q_len, block, last):
        rows_slice, grouped = slice(start, start + rows), (pairs, group * rows, keys)
        block_query = queries[:, :, rows_slice].reshape(pairs, group * rows, head_dim)
        block_grad = output_grads[:, :, rows_slice].reshape(pairs, group * rows, head_dim)
        scores = write_block_mask(workspace.take(0, (batch, heads, rows, keys)), *masking, start, rows, keys)
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


def _softmax_backward(grad_probs: torch.Tensor, probs: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """dS = P * (dP - rowsum(P * dP)) in one fused pass, into `out` (all three contiguous; `out` may be
    `grad_probs`: a row's sum is taken before its first write). The row sum of P * dP (not the flash delta
    rowsum(dO * O)) gives dS = 0 exactly on a row that sees a single key."""
    return torch.ops.aten._softmax_backward_data.out(grad_probs, probs, -1, probs.dtype, grad_input=out)


def _mask_grad_diagonals(mask_grad: torch.Tensor, take):
    """(first, view) pairs whose columns are the diagonals of a block's dS, (B, H, R, K) contiguous: column t of a
    view holds the entries r + j = first + t (table entry start + first + t, see `table_windows`), one per row.
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
