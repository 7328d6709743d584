"""BAM attention's decoding step over vLLM's paged KV cache on the CPU, in C++ (csrc/paged_cpu.cpp, which includes
model/csrc/'s common header; built ahead by `bam-build-kernels` like the fused kernel, model/cpu_kernels_bam.py),
and the step's keys and values written into the cache:

- `decode_cpu`: every request of the step with one query (a decoding step) in one call, a task per (request,
  key/value head) on PyTorch's threads, each reading its keys and values in place from its blocks through the
  block table (any cache layout whose channels are contiguous), the prior from the table's window and the SSMax
  factor c_p = s_h ln(p + 1) of its position. In PyTorch the same step took a few operations per run of consecutive
  blocks of every request and layer: 2.6x Llama's decoding step with 16 requests, whose blocks interleave.
- `write_cache_cpu`: each token's key and value into its cell (vLLM's reshape_and_cache on its own CPU path).
- `gather_cpu`: a prompt's (or a chunk's) keys and values out of their blocks for the fused attention, in one copy
  (PyTorch's indexing, split and float conversion took three: 4% of a 32K-token prompt's first token).

The formula, the cache layout and the shapes: paged_batch.py. Where they are not built, or BAM_CPU_KERNELS=0,
paged_cpu_path.py decodes in PyTorch (the same numbers up to float32 rounding).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..model.cpu_kernels_bam import COMMON_HEADER, CSRC, CpuKernel, cpu_kernels_enabled, csrc_sources, load_kernel
from .paged_batch import BamTerms, PagedBatch

PAGED_CPU = CpuKernel(
    "bam_paged_cpu",
    csrc_sources(CSRC, (COMMON_HEADER,)) + csrc_sources(Path(__file__).with_name("csrc"), ("paged_cpu.cpp",)),
    "paged decode", "the PyTorch decode",
)


@functools.cache
def _library() -> str | None:
    return load_kernel(PAGED_CPU)


def paged_cpu_available() -> bool:
    """Whether the kernels run: the C++ CPU kernels not switched off (read at every call), and these built."""
    return cpu_kernels_enabled() and _library() is not None


def _int32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.int32).contiguous()


def decode_cpu(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, terms: BamTerms,
               output: torch.Tensor) -> None:
    """The output rows (T, H * D) of every request with one query this step; other rows are left as they are.
    query, cache and output of one dtype (float32, bfloat16 or float16), computed in float32."""
    scale = terms.ssmax_scale if terms.ssmax_scale is not None else terms.prior_table.new_empty(0)
    getattr(torch.ops, _library()).decode(
        query, kv_cache, output, _int32(batch.query_start_loc_cpu), _int32(batch.seq_lens),
        _int32(batch.block_table), terms.prior_table, scale, terms.scales_prior, terms.scaling,
    )


def write_cache_cpu(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> None:
    """Token t's key and value (T, Hkv * D) into its cache cell slot_mapping[t]; padding (slot < 0) is skipped."""
    slots = batch.slot_mapping[: batch.num_tokens].long()
    getattr(torch.ops, _library()).write_cache(key.to(kv_cache.dtype), value.to(kv_cache.dtype), kv_cache, slots)


def gather_cpu(kv_cache: torch.Tensor, block_ids: torch.Tensor, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's first `keys` keys and values from its blocks (block_ids: its row of the block table): two
    (Hkv, keys, D) float32 tensors, copied once (converted from a 16-bit cache)."""
    return getattr(torch.ops, _library()).gather(kv_cache, _int32(block_ids), keys)
