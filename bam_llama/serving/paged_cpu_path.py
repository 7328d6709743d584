"""BAM attention over vLLM's paged KV cache without vLLM or Triton: the CPU path (paged_cpu.py's C++ kernels where
they are built, PyTorch where not), the plain-PyTorch reference for other devices, and writing the step's keys and
values into the cache in PyTorch.

- `paged_attention_cpu`: every request with one query (a decoding step) reads its keys in place, all of them in
  one call of paged_cpu.py's C++ decode (where it is not built or BAM_CPU_KERNELS=0: run of blocks by run of
  blocks, one (H x keys) score row per request, in PyTorch); a request with several queries (a prompt or a chunk of
  one) gathers its keys (paged_cpu.py again) and runs the package's attention with the prior table
  (model/attention_route_bam.py: the fused CPU kernel, or blocked SDPA), with or without SSMax. Compiled FlexAttention with
  the prior as a score_mod took 1.4-2.2x blocked SDPA's CPU time with SSMax scaling the prior, from 100 queries to
  4096 x 64K keys, and tied at 128 x 128 (benchmarks/results/cpu-attention-serving.md).
- `paged_attention_reference`: one request at a time, every score materialized.

The step, the layer's terms and the shapes: paged_batch.py.
"""

from __future__ import annotations

import torch

from ..model.attention_route_bam import bam_attention_blocked
from .paged_batch import BamTerms, PagedBatch
from .paged_cpu import decode_cpu, gather_cpu, paged_cpu_available


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
    """Decoding requests read their keys in place (all of them in one C++ call where the kernels are built:
    paged_cpu.py); prompts and chunks gather theirs (in C++ there too) and run a fused attention."""
    heads, head_dim = terms.prior_table.shape[0], kv_cache.shape[-1] // 2
    kernels = paged_cpu_available() and query.dtype == kv_cache.dtype == output.dtype
    if kernels:
        decode_cpu(query, kv_cache, batch, terms, output)
        if batch.max_query_len <= 1:
            return
    tokens = _head_major_tokens(kv_cache)
    for r, (first, rows, keys) in enumerate(batch.host_requests):
        if rows == 0 or (rows == 1 and kernels):
            continue
        queries = query[first : first + rows].view(rows, heads, head_dim)
        if rows == 1 and tokens is not None:
            attended = _decode_in_place(queries[0], tokens, batch.key_runs[r], keys, terms)[None]
        else:
            key, value = (gather_cpu(kv_cache, batch.block_table[r], keys) if kernels
                          else _gather_keys(kv_cache, batch.host_block_ids[r], keys))
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
    positions = torch.arange(keys - rows, keys, device=query.device)
    output = bam_attention_blocked(query, key[None], value[None], positions, terms.prior_window(keys),
                                   terms.scaling, terms.ssmax_scale, terms.ssmax_prior)
    return output[0].transpose(0, 1)
