"""BAM attention over vLLM's paged KV cache in PyTorch (no vLLM, no Triton): the CPU path, the plain reference for
other devices, and writing the step's keys and values into the cache.

- `paged_attention_cpu`: a request with one query (a decoding step) reads its keys in place, run of blocks by run of
  blocks, and attends with one (H x keys) score row; a request with several queries (a prompt or a chunk of one)
  gathers its keys and runs the package's blocked SDPA with the prior table (model/blocked_bam.py), or, where SSMax
  scales the prior (no window of a table can express that mask), FlexAttention compiled for the CPU with the prior
  as a score_mod.
- `paged_attention_reference`: one request at a time, every score materialized.

The step, the layer's terms and the shapes: paged_batch.py.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..model.blocked_bam import bam_attention_blocked
from .paged_batch import BamTerms, PagedBatch

logger = logging.getLogger(__name__)


def write_cache_torch(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> None:
    """Token t's key and value (T, Hkv * D) into its cache cell slot_mapping[t]; padding (slot < 0) is skipped."""
    head_dim = kv_cache.shape[-1] // 2
    tokens = batch.num_tokens
    slots = batch.slot_mapping[:tokens].long()
    valid = slots >= 0
    blocks, offsets = slots[valid] // batch.block_size, slots[valid] % batch.block_size
    heads = kv_cache.shape[1]
    kv_cache[blocks, :, offsets, :head_dim] = key[:tokens].view(tokens, heads, head_dim)[valid].to(kv_cache.dtype)
    kv_cache[blocks, :, offsets, head_dim:] = value[:tokens].view(tokens, heads, head_dim)[valid].to(kv_cache.dtype)


# --------------------------------------------------------------------------------------------------------
# Plain PyTorch
# --------------------------------------------------------------------------------------------------------


def paged_attention_reference(query, kv_cache, batch: PagedBatch, terms: BamTerms, output) -> None:
    """One request at a time: its keys gathered from its blocks, every (query, key) score materialized."""
    heads, head_dim = terms.prior_table.shape[0], kv_cache.shape[-1] // 2
    for r, (first, rows, keys) in enumerate(batch.host_requests):
        if rows == 0:
            continue
        key, value = _gather_keys(kv_cache, batch.host_block_ids[r], keys)  # (Hkv, L, D)
        group = heads // key.shape[0]
        queries = query[first : first + rows].view(rows, heads, head_dim).transpose(0, 1).float()  # (H, Lq, D)
        positions = torch.arange(keys - rows, keys, device=query.device)
        distance = torch.arange(keys, device=query.device)[None, :] - positions[:, None]  # (Lq, L): j - p
        bias = terms.prior_table[:, terms.max_len - 1 + distance.clamp(max=0)]  # (H, Lq, L)
        qk = queries @ key.repeat_interleave(group, 0).transpose(1, 2)
        scores = terms.logits(qk, bias, terms.log_counts[positions][:, None])
        probs = scores.masked_fill(distance > 0, float("-inf")).softmax(-1)
        attended = probs @ value.repeat_interleave(group, 0)  # (H, Lq, D)
        output[first : first + rows] = attended.transpose(0, 1).reshape(rows, -1).to(output.dtype)


def _gather_keys(kv_cache: torch.Tensor, block_ids: list[int], keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first `keys` keys and values from its blocks: two (Hkv, L, D) float32 copies."""
    head_dim = kv_cache.shape[-1] // 2
    ids = torch.tensor(block_ids, device=kv_cache.device)
    by_head = kv_cache.transpose(0, 1)  # (Hkv, blocks, N, 2D)
    cells = by_head[:, ids].flatten(1, 2)[:, :keys]  # (Hkv, L, 2D)
    return cells[..., :head_dim].float().contiguous(), cells[..., head_dim:].float().contiguous()


# --------------------------------------------------------------------------------------------------------
# CPU
# --------------------------------------------------------------------------------------------------------


def paged_attention_cpu(query, kv_cache, batch: PagedBatch, terms: BamTerms, output) -> None:
    """Decoding steps read their keys in place; prompts and chunks gather theirs and run a fused attention."""
    heads, head_dim = terms.prior_table.shape[0], kv_cache.shape[-1] // 2
    tokens = _head_major_tokens(kv_cache)
    for r, (first, rows, keys) in enumerate(batch.host_requests):
        if rows == 0:
            continue
        queries = query[first : first + rows].view(rows, heads, head_dim)
        if rows == 1 and tokens is not None:
            attended = _decode_in_place(queries[0], tokens, batch.key_runs[r], keys, terms)[None]
        else:
            key, value = _gather_keys(kv_cache, batch.host_block_ids[r], keys)
            attended = _attend_prompt(queries, key, value, terms)
        output[first : first + rows] = attended.reshape(rows, -1).to(output.dtype)


def _head_major_tokens(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """(Hkv, blocks * N, 2D) view of a head-major cache (token block * N + offset of a head is one row), or None
    where the layout is another."""
    by_head = kv_cache.transpose(0, 1)
    return by_head.flatten(1, 2) if by_head.is_contiguous() else None


def _decode_in_place(query: torch.Tensor, tokens: torch.Tensor, runs: list[tuple[int, int]], keys: int,
                     terms: BamTerms) -> torch.Tensor:
    """One query (H, D) at position keys - 1 against its keys, read run by run from the cache -> (H, D).

    Copying the keys out of their blocks first would cost more than the attention itself; a handful of operations
    per request keeps the step's Python cost down."""
    heads, head_dim = query.shape
    kv_heads = tokens.shape[0]
    grouped = query.float().view(kv_heads, heads // kv_heads, head_dim)  # (Hkv, group, D)
    cells = [tokens[:, start : start + length] for start, length in runs]  # (Hkv, run, 2D) views
    parts = [grouped @ cell[..., :head_dim].float().transpose(1, 2) for cell in cells]
    qk = (parts[0] if len(parts) == 1 else torch.cat(parts, -1)).view(heads, keys)
    probs = terms.logits(qk, terms.prior_window(keys), terms.log_counts[keys - 1]).softmax(-1)
    probs = probs.view(kv_heads, -1, keys)
    output, offset = None, 0
    for cell in cells:
        length = cell.shape[1]
        part = probs[..., offset : offset + length] @ cell[..., head_dim:].float()
        output = part if output is None else output.add_(part)
        offset += length
    return output.view(heads, head_dim)


def _attend_prompt(queries: torch.Tensor, key: torch.Tensor, value: torch.Tensor, terms: BamTerms) -> torch.Tensor:
    """The last Lq positions of a request, queries (Lq, H, D), against its keys (Hkv, L, D) -> (Lq, H, D)."""
    rows, keys = queries.shape[0], key.shape[1]
    query = queries.transpose(0, 1)[None].float().contiguous()  # (1, H, Lq, D)
    if terms.scales_prior and flex_prefill_usable():
        output = _flex_prefill(query, key[None], value[None], terms)
    else:
        positions = torch.arange(keys - rows, keys, device=query.device)
        output = bam_attention_blocked(query, key[None], value[None], positions, terms.prior_window(keys),
                                       terms.scaling, terms.ssmax_scale, terms.ssmax_prior)
    return output[0].transpose(0, 1)


# FlexAttention on the CPU, for SSMax scaling the prior: the row factor times a window of the prior table is no
# window of one table (blocked SDPA would write every mask block out; FlexAttention computes it in registers).
FLEX_BLOCK = 128  # query and key block of the block mask
FLEX_PADDING = 2 * FLEX_BLOCK
_FLEX = {"compiled": None, "failed": False}


def flex_prefill_usable() -> bool:
    """FlexAttention compiles for this machine (checked once, by `warm_up_flex`; False after a failure)."""
    return not _FLEX["failed"]


def _compiled_flex():
    if _FLEX["compiled"] is None:
        # dynamic: one compiled kernel for every prompt and chunk length (`_causal_block_mask` keeps the sizes that
        # Dynamo would specialize on, 1, out of its shapes)
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=True)
    return _FLEX["compiled"]


def _flex_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, terms: BamTerms) -> torch.Tensor:
    """query (1, H, Lq, D) at positions L - Lq .. L - 1, key / value (1, Hkv, L, D), SSMax scaling the prior."""
    rows, keys = query.shape[2], key.shape[2]
    offset = keys - rows  # position of query 0
    table, log_counts = _flex_tables(terms)
    scale = terms.ssmax_scale
    for captured in (table, log_counts, scale):  # fixed per layer; symbolic sizes for them make Inductor's CPU
        torch._dynamo.mark_static(captured)  # template emit C++ that does not compile (torch 2.13)
    # table index of (query i, key j): distance j - (i + offset) past the first entry, distance -(T-1), and the
    # padding; one integer per call (Inductor's CPU template takes single symbols, not expressions of them)
    shift = terms.max_len - 1 + FLEX_PADDING - offset

    def score_mod(score, batch, head, q_index, k_index):
        return (scale[head] * log_counts[q_index + offset]) * (score + table[head, k_index - q_index + shift])

    block_mask = _causal_block_mask(rows, keys, query.device)
    return _compiled_flex()(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=terms.scaling,
                            enable_gqa=True)


def _flex_tables(terms: BamTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """The prior table and ln(n) padded with FLEX_PADDING zeros on both sides: FlexAttention evaluates the
    score_mod on the hidden keys of a block on the diagonal too (at most 2 FLEX_BLOCK past a query), and may on
    the rows past the end of the last query block, before masking them."""
    if "flex" not in terms.__dict__:
        pad = torch.nn.functional.pad
        terms.__dict__["flex"] = (pad(terms.prior_table, (FLEX_PADDING, FLEX_PADDING)).contiguous(),
                                  pad(terms.log_counts, (0, FLEX_PADDING)).contiguous())
    return terms.__dict__["flex"]


@functools.lru_cache(maxsize=64)  # every layer of a step asks for the same masks
def _causal_block_mask(rows: int, keys: int, device: torch.device):
    """FlexAttention's BlockMask for Lq queries at the last positions of L keys, without evaluating any mask: per
    block of FLEX_BLOCK queries, the key blocks every row sees whole, then those on its diagonal. At least two
    query and two key blocks, so that no dimension of the mask is 1 (Dynamo would compile that size apart)."""
    offset = keys - rows
    query_blocks, key_blocks = max(2, -(-rows // FLEX_BLOCK)), max(2, -(-keys // FLEX_BLOCK))
    first = offset + torch.arange(query_blocks, device=device) * FLEX_BLOCK  # position of each block's first row
    last = (first + FLEX_BLOCK - 1).clamp(max=keys - 1)
    full = ((first + 1) // FLEX_BLOCK).clamp(max=key_blocks)
    partial = (last // FLEX_BLOCK + 1 - full).clamp(min=0)
    columns = torch.arange(key_blocks, device=device)
    full_indices = columns.expand(query_blocks, key_blocks)
    partial_indices = (full[:, None] + columns).clamp(max=key_blocks - 1)

    def causal(batch, head, q_index, k_index):
        return k_index <= q_index + offset

    as_mask = lambda tensor: tensor[None, None].to(torch.int32).contiguous()  # noqa: E731
    return BlockMask.from_kv_blocks(
        as_mask(partial), as_mask(partial_indices), as_mask(full), as_mask(full_indices), BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=causal, seq_lengths=(rows, keys),
    )


def warm_up_flex(terms: BamTerms, kv_heads: int, head_dim: int) -> None:
    """Compile the FlexAttention prefill now (tens of seconds, cached on disk by Inductor afterwards), not in the
    first request; where it cannot compile, warn once and use blocked SDPA instead. The warm-up shape has distinct
    sizes everywhere, so that Dynamo ties none of them together."""
    if not terms.scales_prior or _FLEX["failed"]:
        return
    heads = terms.prior_table.shape[0]
    rows, keys = min(terms.max_len - 1, 3 * FLEX_BLOCK + 7), min(terms.max_len, 5 * FLEX_BLOCK + 11)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, rows, head_dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, keys, head_dim, generator=generator) for _ in range(2))
    try:
        _flex_prefill(query, key, value, terms)
    except Exception as error:  # noqa: BLE001 - an Inductor or compiler failure: blocked SDPA is as exact
        _FLEX["failed"] = True
        logger.warning("BAM: FlexAttention does not compile here (%s: %s); prompts run blocked SDPA instead",
                       type(error).__name__, str(error).splitlines()[0][:200] if str(error) else "")

