"""The masks of blocked attention, shared by the blocked SDPA forward (`blocked_bam`) and the prior-gradient
backward (`prior_backward_bam`): a block of reversed query rows, each row a window of one prior table per head
(`table_windows`), with future keys, padding and other documents hidden; the keys each query sees; reusable buffers.

Shapes: B batch, H query heads, Lq queries, Lk keys; a block is `rows` reversed query rows against keys 0..keys-1.
"""

import math

import torch

from .prior_bam import visible_key_counts

# The score of a key a query must not see (padding, another document): a finite "minus infinity", so that a row that
# sees no key stays finite (its output is then zeroed). Future keys get a true -inf.
HIDDEN_KEY_SCORE = -1e30


def visible_counts(query_positions, keys: int, key_valid, document_ids) -> torch.Tensor:
    """(1 or B, Lq) keys each query sees (Scalable Softmax's n): every key up to its own position, unless padding or
    packed documents hide some."""
    if key_valid is None and document_ids is None:
        return (query_positions + 1)[None]
    return visible_key_counts(query_positions, keys, key_valid, document_ids)


def key_bias(key_valid: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """(B, Lk) score added to every key: 0, HIDDEN_KEY_SCORE on padding."""
    if key_valid is None:
        return None
    hidden = ~key_valid.bool()
    return torch.zeros(key_valid.shape, dtype=dtype, device=key_valid.device).masked_fill(hidden, HIDDEN_KEY_SCORE)


class Workspace:
    """Reusable flat buffers for (B, H, rows, keys) blocks, each allocated at its first use: a fresh multi-MiB
    tensor per block would be page-faulted in again every time."""

    def __init__(self, slots: int, size: int, like: torch.Tensor):
        self.buffers, self.size, self.like = [None] * slots, size, like

    def take(self, slot: int, shape: tuple[int, ...]) -> torch.Tensor:
        if self.buffers[slot] is None:
            self.buffers[slot] = self.like.new_empty(self.size)
        return self.buffers[slot][: math.prod(shape)].view(shape)


def query_blocks(q_len: int, block: int, last: int):
    """(start, rows, keys) of every block: reversed rows start..start+rows, whose last query sits at position
    last - start, against keys 0..keys-1."""
    for start in range(0, q_len, block):
        yield start, min(block, q_len - start), last - start + 1


def block_mask(
    table, prior_factor, key_mask, query_documents, document_ids, start, rows, keys, take=None
) -> torch.Tensor:
    """Float mask of reversed rows start..start+rows against keys 0..keys-1: (1 or B, H, rows, keys).

    prior_factor: the SSMax factor (B, H, Lq, 1) where it scales the prior.
    A mask that is not a view of the table is written into `take(shape)` (a reused buffer) if given."""
    windows = table_windows(table, start, rows, keys)[None]  # (1, H, rows, keys) view
    if prior_factor is None and key_mask is None and query_documents is None:
        return windows  # the table's padding hides future keys
    batch = max(t.shape[0] for t in (prior_factor, key_mask, query_documents) if t is not None)
    shape = (batch, *windows.shape[1:])
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (table, prior_factor)):
        mask = windows.new_empty(shape).copy_(windows)  # out= has no autograd
        if prior_factor is not None:  # the factor's gradient sums mask * dS: 0 on future keys, not -inf * 0 = NaN
            mask = hide_future_(mask, rows, keys, 0.0).mul_(prior_factor[:, :, start : start + rows])
        return hide_keys_(mask, key_mask, query_documents, document_ids, start, rows, keys)
    out = windows.new_empty(shape) if take is None else take(shape)
    return write_block_mask(out, table, prior_factor, key_mask, query_documents, document_ids, start, rows, keys)


def write_block_mask(
    out, table, prior_factor, key_mask, query_documents, document_ids, start, rows, keys, first_key=0, future=True
) -> torch.Tensor:
    """`block_mask` written into `out`, a contiguous (B, H, rows, keys - first_key) tensor the scores are then
    added to: the block's keys first_key..keys-1 (a key tile; `future` False where no row has a future key there)."""
    windows = table_windows(table, start + first_key, rows, keys - first_key)[None].expand(out.shape)
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
    return hide_keys_(out, key_mask, query_documents, document_ids, start, rows, keys, future_hidden, first_key)


def hide_keys_(
    scores, key_mask, query_documents, document_ids, start, rows, keys, future_hidden=False, first_key=0
) -> torch.Tensor:
    """In place on a block's (B or 1, H, rows, keys - first_key) scores or mask: -inf on future keys (unless
    `future_hidden` says they already are), HIDDEN_KEY_SCORE on padding and on keys of other documents."""
    if not future_hidden:
        hide_future_(scores, rows, keys - first_key, float("-inf"))
    if key_mask is not None:
        scores.add_(key_mask[..., first_key:keys])
    if query_documents is not None:
        foreign_keys = other_documents(query_documents, document_ids, start, rows, keys, first_key)
        scores.masked_fill_(foreign_keys, HIDDEN_KEY_SCORE)
    return scores


def hide_future_(scores: torch.Tensor, rows: int, keys: int, value: float) -> torch.Tensor:
    """In place: `value` on the future keys of a block's (..., rows, keys) reversed rows."""
    if rows > 1:  # a single query sees every key of its block
        scores[..., keys - rows :].masked_fill_(future_keys(rows, rows, scores.device), value)
    return scores


def table_windows(table: torch.Tensor, start: int, rows: int, keys: int) -> torch.Tensor:
    """(H, rows, keys) view: row r is table[:, start + r : start + r + keys]."""
    return table[:, start : start + rows + keys - 1].unfold(-1, keys, 1)


def other_documents(query_documents, document_ids, start, rows, keys, first_key=0) -> torch.Tensor:
    """(B, 1, rows, keys - first_key) bool, True where the key belongs to another document than the query."""
    return (query_documents[:, start : start + rows, None] != document_ids[:, None, first_key:keys])[:, None]


def future_keys(rows: int, keys: int, device) -> torch.Tensor:
    """(rows, keys) bool, True where key j lies after the query of reversed row r (position P_block - r)."""
    return torch.arange(keys, device=device)[None, :] + torch.arange(rows, device=device)[:, None] >= keys
