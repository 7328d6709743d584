"""BAM attention over vLLM's paged KV cache, on plain tensors: no vLLM import here (vllm_plugin.py wires it into
vLLM), so that tests/serving/ checks every path without vLLM. `write_cache` and `paged_attention` pick a path by
device:

- CUDA (paged_triton.py): Triton kernels over the block table (paged_kernels.py): a chunked-prefill kernel for any
  batch, split-KV decode for batches of single queries; launched from device metadata only, so a decoding step can
  be captured in a CUDA graph.
- CPU (paged_cpu_path.py, `paged_attention_cpu`): decoding requests read their keys in place (one C++ call for all of
  them, paged_cpu.py); prompts and chunks of them gather theirs and run the fused CPU attention with the prior
  table. The step's keys and values go into the cache in C++ too.
- Elsewhere (paged_cpu_path.py, `paged_attention_reference`): plain PyTorch, one request at a time, scores
  materialized.

What a step and a layer bring (`PagedBatch`, `BamTerms`), the formula and the shapes: paged_batch.py.
"""

from __future__ import annotations

import torch

from . import paged_kernels
from .paged_batch import BamTerms, PagedBatch
from .paged_cpu import paged_cpu_available, write_cache_cpu
from .paged_cpu_path import paged_attention_cpu, paged_attention_reference, write_cache_torch
from .paged_triton import launch_write_cache, paged_attention_triton, triton_paged_usable


def write_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> None:
    """Token t's key and value (T, Hkv * D) into its cache cell slot_mapping[t]; padding (slot < 0) is skipped."""
    if kv_cache.is_cuda and paged_kernels.TRITON_AVAILABLE:
        launch_write_cache(key, value, kv_cache, batch)
    elif kv_cache.device.type == "cpu" and paged_cpu_available():
        write_cache_cpu(key, value, kv_cache, batch)
    else:
        write_cache_torch(key, value, kv_cache, batch)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, terms: BamTerms,
                    output: torch.Tensor) -> None:
    """query (T, H * D) -> output (T, H * D), rows of the batch's requests (padding rows are left as they are)."""
    if query.is_cuda and triton_paged_usable(query.dtype, kv_cache.shape[-1] // 2):
        paged_attention_triton(query, kv_cache, batch, terms, output)
    elif query.device.type == "cpu":
        paged_attention_cpu(query, kv_cache, batch, terms, output)
    else:
        paged_attention_reference(query, kv_cache, batch, terms, output)
