"""The fused CPU kernel (`fused_cpu_bam`) as a path of the route: whether it can take a call, and the call itself
from the route's inputs (the SSMax row factor folded into the queries and, where it scales the prior, passed per
row; padding as a key bias; packed documents as each query's first key). Forward and backward, O(L) memory.

Shapes: B batch, H query heads, Hkv key/value heads, Lq queries, Lk keys, D head size.
"""

import torch

from .block_masks_bam import key_bias, visible_counts
from .fused_cpu_bam import bam_attention_fused_cpu, fused_cpu_available
from .prior_bam import exporting, ssmax_factor

def fused_kernel_runs(device: torch.device, dtype: torch.dtype, document_ids: torch.Tensor | None) -> bool:
    """Whether queries of `dtype` (the compute dtype) can run the kernel: eager float32 code on the CPU (a traced
    graph reaches it without gradients through the route's operator `bam_llama::blocked_attention_inference`; an
    exported program stays plain ATen), where the kernel could be built, with packed documents only as runs of keys
    (ids that never decrease along a row, as the model's own detection from restarting position_ids makes them): the
    kernel sees each query's keys from its document's first."""
    eager_cpu = device.type == "cpu" and not torch.compiler.is_compiling() and not exporting()
    if not eager_cpu or dtype != torch.float32:
        return False
    if document_ids is not None and not bool((document_ids[:, 1:] >= document_ids[:, :-1]).all()):
        return False
    return fused_cpu_available()


def attend_fused_cpu(
    query, key, value, query_positions, prior_table, scaling, ssmax_scale, ssmax_prior, key_valid, document_ids
) -> torch.Tensor:
    """Queries at positions P - Lq + 1 .. P (P the table's last) against keys 0..P in the fused kernel, on inputs in
    the compute dtype (float32): (B, Lq, H, D), zero for rows that see no key."""
    compute_dtype = query.dtype
    last = prior_table.shape[-1] - 1
    counts = visible_counts(query_positions, key.shape[2], key_valid, document_ids)  # (1 or B, Lq)
    row_factor = None if ssmax_scale is None else ssmax_factor(counts, ssmax_scale)
    scale_prior = row_factor is not None and ssmax_prior
    row_factor = None if row_factor is None else row_factor.to(compute_dtype)
    output = bam_attention_fused_cpu(
        query if row_factor is None else query * row_factor, key, value, last - query.shape[2] + 1,
        prior_table.to(compute_dtype), scaling, row_factor[..., 0] if scale_prior else None,
        key_bias(key_valid, compute_dtype), document_starts(document_ids, query_positions), counts,
    )
    return output if key_valid is None else output.masked_fill((counts == 0)[:, :, None, None], 0.0)


def document_starts(document_ids: torch.Tensor | None, query_positions: torch.Tensor) -> torch.Tensor | None:
    """(B, Lq) index of the first key of each query's document (documents are runs of equal ids), or None."""
    if document_ids is None:
        return None
    keys = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    run_start = torch.where(starts, keys, torch.zeros_like(keys)).cummax(-1).values
    return run_start[:, query_positions]
