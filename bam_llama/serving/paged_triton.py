"""BAM attention over vLLM's paged KV cache on CUDA: the launches of the Triton kernels of paged_kernels.py.

A chunked-prefill kernel for any batch, split-KV decode for batches of single queries (its splits merged by the
model's combine kernel), and the kernel that writes the step's keys and values into the cache; launched from device
metadata only, so that a decoding step can be captured in a CUDA graph. The head sizes that fit a GPU, the dot
options, the number of splits and the combine kernel are the model's (model/triton_bam.py); the tiles are this
module's. The step, the layer's terms and the shapes: paged_batch.py.
"""

from __future__ import annotations

import torch

from ..model.triton_bam import (
    COMBINE_LAUNCH,
    LaunchConfig,
    combine_block,
    decode_split_count,
    dot_options,
    dot_tile_size,
    head_dim_supported,
)
from ..model.triton_kernels_bam import interpreting
from . import paged_kernels
from .paged_batch import BamTerms, PagedBatch

# Tiles under TRITON_INTERPRET=1: small, so that the tests' short sequences span several key tiles and several
# splits, some of them empty. On CUDA, one fixed configuration per kernel and width (no autotuning: a captured
# step replays one kernel), each compiled ahead of time for sm_90 and sm_80 by benchmarks/gpu_readiness.py.
INTERPRETER_LAUNCH = {"prefill": (32, 16, 4, 1), "decode": (16, 16, 4, 1)}  # as CUDA_LAUNCH
INTERPRETER_DECODE_SPLITS = 3
CUDA_LAUNCH = {  # width -> kernel -> (tile rows: BLOCK_Q x GROUP or ROWS, BLOCK_N, num_warps, num_stages)
    "narrow": {"prefill": (128, 64, 8, 2), "decode": (16, 64, 4, 2)},
    "wide": {"prefill": (64, 32, 8, 2), "decode": (16, 32, 4, 2)},
    "fp32": {"prefill": (32, 32, 8, 2), "decode": (16, 32, 4, 2)},
}


KERNEL_NAMES = {"paged_prefill": "_paged_prefill_kernel", "paged_decode": "_paged_decode_kernel",
                "paged_write": "_write_cache_kernel"}
READINESS_GROUPS = (1, 2, 4, 8, 16)  # query heads per key/value head whose launches gpu_readiness compiles


def cuda_launch_configs(kind: str, head_dim: int, dtype: torch.dtype) -> list[LaunchConfig]:
    """Every launch of a paged kernel (`KERNEL_NAMES`) on CUDA for this head size and dtype, over the groups of
    READINESS_GROUPS: what benchmarks/gpu_readiness.py compiles ahead of time."""
    if kind == "paged_write":
        return [LaunchConfig((), num_warps=4, num_stages=1)]
    launch = {"paged_prefill": prefill_launch, "paged_decode": decode_launch}[kind]
    configs = []
    for group in READINESS_GROUPS:
        meta = launch(head_dim, dtype, group)
        warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
        config = LaunchConfig(tuple(meta.items()), warps, stages)
        if config not in configs:
            configs.append(config)
    return configs


def triton_paged_usable(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the paged kernels run for this dtype and head size: Triton is installed and interpreting, or the
    size is one whose launch configurations fit a GPU (benchmarks/results/gpu-readiness.md)."""
    if not paged_kernels.TRITON_AVAILABLE:
        return False
    return interpreting() or head_dim_supported(head_dim, dtype)


def launch_width(block_d: int, dtype: torch.dtype) -> str:
    """"narrow" tiles for 16-bit inputs up to head size 64, "wide" ones (half the rows and keys) above, "fp32" ones
    (as wide, on half the warps: more registers per thread) for fp32 inputs."""
    if dtype == torch.float32:
        return "fp32"
    return "narrow" if block_d <= 64 else "wide"


def prefill_launch(head_dim: int, dtype: torch.dtype, group: int) -> dict:
    """Meta-parameters and launch options of `_paged_prefill_kernel`: BLOCK_Q queries x GROUP heads per tile."""
    rows, block_n, warps, stages = _launch_entry("prefill", head_dim, dtype)
    padded_group = 1 << (group - 1).bit_length()
    return dict(BLOCK_Q=max(1, rows // padded_group), GROUP=padded_group, BLOCK_N=block_n, num_warps=warps,
                num_stages=stages)


def decode_launch(head_dim: int, dtype: torch.dtype, group: int) -> dict:
    """Meta-parameters and launch options of `_paged_decode_kernel`: one key/value head's query heads per tile."""
    _, block_n, warps, stages = _launch_entry("decode", head_dim, dtype)
    return dict(ROWS=dot_tile_size(group), BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def _launch_entry(kernel: str, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(tile rows, BLOCK_N, num_warps, num_stages) of a kernel: the interpreter's, or CUDA's for this width."""
    if interpreting():
        return INTERPRETER_LAUNCH[kernel]
    return CUDA_LAUNCH[launch_width(dot_tile_size(head_dim), dtype)][kernel]


def decode_splits(tokens: int, kv_heads: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Splits of each request's keys: enough programs for about two per SM, each split at least 4 key tiles of the
    longest sequence served. From sizes fixed for a captured step only (never the step's sequence lengths)."""
    if interpreting():
        return INTERPRETER_DECODE_SPLITS
    return decode_split_count(tokens * kv_heads, max_len, block_n, device)


def _bam_options(terms: BamTerms) -> dict:
    return dict(HAS_SSMAX=terms.ssmax_scale is not None, SSMAX_PRIOR=terms.ssmax_prior)


def _ssmax_scale_operand(terms: BamTerms) -> torch.Tensor:
    """The kernels' SSMax scale argument (not read without SSMax)."""
    return terms.prior_table if terms.ssmax_scale is None else terms.ssmax_scale


def launch_write_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> None:
    """Every token of the step (padding too: its slot is < 0) through `_write_cache_kernel`."""
    kernels = paged_kernels.activate_kernels()
    tokens, kv_heads, head_dim = batch.slot_mapping.shape[0], kv_cache.shape[1], kv_cache.shape[-1] // 2
    kernels["_write_cache_kernel"][(tokens, kv_heads)](
        key, value, kv_cache, batch.slot_mapping, key.stride(0), value.stride(0), *kv_cache.stride()[:3],
        batch.block_size, HEAD_DIM=head_dim, BLOCK_D=dot_tile_size(head_dim),
    )


def paged_attention_triton(query, kv_cache, batch: PagedBatch, terms: BamTerms, output) -> None:
    """Split-KV decode where every request of the step has one query, the chunked-prefill kernel otherwise. Reads
    only device tensors and host sizes fixed for the step (no sync), so that a decoding step can be captured."""
    heads, head_dim = terms.prior_table.shape[0], kv_cache.shape[-1] // 2
    queries, outputs = query.view(-1, heads, head_dim), output.view(-1, heads, head_dim)
    if batch.max_query_len == 1:
        _launch_decode(queries, kv_cache, batch, terms, outputs)
    else:
        _launch_prefill(queries, kv_cache, batch, terms, outputs)


def _launch_prefill(queries, kv_cache, batch: PagedBatch, terms: BamTerms, outputs) -> None:
    kernels = paged_kernels.activate_kernels()
    tokens, heads, head_dim = queries.shape
    kv_heads = kv_cache.shape[1]
    meta = prefill_launch(head_dim, queries.dtype, heads // kv_heads)
    grid = (tokens // meta["BLOCK_Q"] + batch.num_requests, kv_heads)
    kernels["_paged_prefill_kernel"][grid](
        queries, outputs, kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens, terms.prior_table,
        _ssmax_scale_operand(terms), queries.stride(0), queries.stride(1), outputs.stride(0), outputs.stride(1),
        *kv_cache.stride()[:3], batch.block_table.stride(0), batch.num_requests, heads // kv_heads, terms.max_len,
        batch.block_size, terms.scaling, HEAD_DIM=head_dim, BLOCK_D=dot_tile_size(head_dim), **_bam_options(terms),
        **dot_options(queries.dtype), **meta,
    )


def _launch_decode(queries, kv_cache, batch: PagedBatch, terms: BamTerms, outputs) -> None:
    """Partial results per split, merged by the model's combine kernel (rows: head * T + token)."""
    kernels = paged_kernels.activate_kernels()
    tokens, heads, head_dim = queries.shape
    kv_heads = kv_cache.shape[1]
    meta = decode_launch(head_dim, queries.dtype, heads // kv_heads)
    splits = decode_splits(tokens, kv_heads, terms.max_len, meta["BLOCK_N"], queries.device)
    rows = heads * tokens
    out_partial = _new_output(queries.new_empty(splits, rows, head_dim, dtype=torch.float32))
    lse_partial = _new_output(queries.new_empty(splits, rows, dtype=torch.float32))
    kernels["_paged_decode_kernel"][(tokens, kv_heads, splits)](
        queries, out_partial, lse_partial, kv_cache, batch.block_table, batch.query_start_loc, batch.seq_lens,
        terms.prior_table, _ssmax_scale_operand(terms), queries.stride(0), queries.stride(1), *kv_cache.stride()[:3],
        batch.block_table.stride(0), batch.num_requests, tokens, heads, heads // kv_heads, terms.max_len,
        batch.block_size, terms.scaling, HEAD_DIM=head_dim, BLOCK_D=dot_tile_size(head_dim), **_bam_options(terms),
        **dot_options(queries.dtype), **meta,
    )
    lse = queries.new_empty(rows, dtype=torch.float32)  # the combine kernel writes it; attention does not need it
    kernels["_decode_combine_kernel"][(rows,)](
        out_partial, lse_partial, outputs, lse, 0, outputs.stride(1), outputs.stride(0), outputs.stride(2), splits,
        heads, tokens, rows, HEAD_DIM=head_dim, BLOCK_S=combine_block(splits),
        BLOCK_D=dot_tile_size(head_dim), **COMBINE_LAUNCH,
    )


def _new_output(tensor: torch.Tensor) -> torch.Tensor:
    """A kernel's output buffer as allocated (tests fill it with NaN, so that an unwritten row fails them)."""
    return tensor
