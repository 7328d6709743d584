"""What BAM attention over vLLM's paged KV cache reads, on plain tensors (no vLLM import): the step's requests
(`PagedBatch`) and what BAM adds to one layer's attention (`BamTerms`, its prior a table over distances built by
`prior_table`). paged_attention.py picks the path that attends with them.

For query head h of request r, a query at absolute position p (its request's tokens before it, prefix-cache hits
included) and the request's keys j <= p:

    score_pj = c_p * (q_p.k_j * scaling + b_h(j - p))     (SSMax scaling the prior)
             = c_p * q_p.k_j * scaling + b_h(j - p)       (SSMax on q.k only)
             = q_p.k_j * scaling + b_h(j - p)             (no SSMax),      c_p = s_h * ln(p + 1)

b_h is read from one table per head over distances -(T-1), ..., 0 (T: the longest sequence served), built once from
the checkpoint's prior (`prior_table`, the package's own, any formula or T5's buckets). Query head h reads key/value
head h // (H / Hkv).

The cache of one layer is vLLM's (blocks, Hkv, block_size, 2 * D) view: a token's key in the first D channels of its
cell, its value in the last D. The plugin asks vLLM for the head-major layout (every block of one head stored
together), in which a run of consecutive blocks is one strided (tokens, D) matrix per head.

A step's T tokens are its requests' queries back to back: request r owns rows query_start_loc[r]:query_start_loc[r+1]
and holds seq_lens[r] tokens after this step, so its queries sit at the last positions of its sequence.

Shapes: T tokens of the step, R requests, H query heads and Hkv key/value heads (this tensor-parallel rank's), D head
size, L keys of one request, N tokens per cache block.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..model.prior_bam import BUCKET_BIAS, T5_BUCKETS, T5_MAX_DISTANCE, THETA_PARAMETERS
from ..model.prior_bam import prior_table as model_prior_table


@dataclass
class PagedBatch:
    """One step's requests, as every attention layer reads them (vLLM shares one per step between layers)."""

    query_start_loc: torch.Tensor  # (R + 1,) int32 on the device
    seq_lens: torch.Tensor  # (R,) int32 on the device: tokens in the cache after this step
    block_table: torch.Tensor  # (R, max blocks) int32 on the device: cache block of each block of a request
    slot_mapping: torch.Tensor  # (T,) int64: cache slot of every token (block * N + offset); < 0: padding
    num_tokens: int  # tokens that belong to a request (rows past them are padding)
    max_query_len: int
    block_size: int  # N
    query_start_loc_cpu: torch.Tensor  # (R + 1,) on the host

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @cached_property
    def host_requests(self) -> list[tuple[int, int, int]]:
        """(first row, rows, keys) of every request, read on the host (a device sync where the metadata is on a
        GPU: only the CPU and the reference paths use it)."""
        starts = self.query_start_loc_cpu.tolist()
        seq_lens = self.seq_lens.tolist()
        return [(starts[r], starts[r + 1] - starts[r], seq_lens[r]) for r in range(self.num_requests)]

    @cached_property
    def host_block_ids(self) -> list[list[int]]:
        """The cache blocks holding each request's keys, in order."""
        return [self.block_table[r, : -(-keys // self.block_size)].tolist()
                for r, (_, _, keys) in enumerate(self.host_requests)]

    @cached_property
    def key_runs(self) -> list[list[tuple[int, int]]]:
        """Each request's keys as runs of consecutive cache blocks: (first token in the cache's head-major token
        order, block * N + offset; number of keys), in key order."""
        return [_block_runs(block_ids, keys, self.block_size)
                for block_ids, (_, _, keys) in zip(self.host_block_ids, self.host_requests)]


def _block_runs(block_ids: list[int], keys: int, block_size: int) -> list[tuple[int, int]]:
    runs, first = [], 0
    for index in range(1, len(block_ids) + 1):
        if index == len(block_ids) or block_ids[index] != block_ids[index - 1] + 1:
            start, end = first * block_size, min(index * block_size, keys)
            runs.append((block_ids[first] * block_size, end - start))
            first = index
    return runs


@dataclass
class BamTerms:
    """What BAM adds to one layer's attention, for this rank's H query heads."""

    prior_table: torch.Tensor  # (H, T) float32: the prior at distances -(T-1), ..., 0
    ssmax_scale: torch.Tensor | None  # (H,) float32 SSMax scale s_h, or None without SSMax
    ssmax_prior: bool  # whether c_p also scales the prior
    scaling: float  # 1 / sqrt(D)

    @property
    def max_len(self) -> int:
        return self.prior_table.shape[1]

    @cached_property
    def log_counts(self) -> torch.Tensor:
        """(T,) float32 ln(n) for n = 1..T: a query at position p sees n = p + 1 keys."""
        return torch.arange(1, self.max_len + 1, device=self.prior_table.device, dtype=torch.float32).log()

    @property
    def scales_prior(self) -> bool:
        return self.ssmax_scale is not None and self.ssmax_prior

    def prior_window(self, keys: int) -> torch.Tensor:
        """(H, keys) view: the prior of keys 0..keys-1 for the query at position keys - 1."""
        return self.prior_table[:, self.max_len - keys :]

    def logits(self, qk: torch.Tensor, bias: torch.Tensor, log_count: torch.Tensor) -> torch.Tensor:
        """BAM's logits from raw float32 q.k, (H, ...): bias broadcastable to it, log_count ln(n) of each query
        (broadcastable to qk without its head dimension). A new tensor, in as few passes as the formula allows."""
        if self.ssmax_scale is None:
            return torch.add(bias, qk, alpha=self.scaling)
        factor = self.ssmax_scale.view(-1, *(1,) * (qk.dim() - 1)) * log_count
        if self.ssmax_prior:
            return torch.add(bias, qk, alpha=self.scaling).mul_(factor)
        return torch.addcmul(bias, qk, factor * self.scaling)


def prior_parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """A prior module's tensors in the checkpoint, for all heads: theta_alpha, theta_beta, theta_mu (H,), or T5's
    bucket_bias (H, num_buckets)."""
    heads = config.num_attention_heads
    if config.prior_formula == T5_BUCKETS:
        return {BUCKET_BIAS: (heads, config.t5_num_buckets)}
    return {name: (heads,) for name in THETA_PARAMETERS}


def prior_table(
    parameters: tuple[torch.Tensor, ...], formula: str, eps: float, max_len: int, max_distance: int = T5_MAX_DISTANCE
) -> torch.Tensor:
    """(H, max_len) float32 prior at distances -(max_len-1), ..., 0 of a prior module's tensors (in the order of
    `prior_parameter_shapes`): the model's own table (`prior_bam.prior_table`, which every path of the Transformers
    model reads through `prior_tables_bam`), T5's buckets included."""
    return model_prior_table(max_len, parameters, formula, eps, max_distance).contiguous()

