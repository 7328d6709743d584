"""BAM attention over vLLM's paged KV cache, on plain tensors: no vLLM import here (vllm_plugin.py wires it into
vLLM), so that tests/serving/ checks every path without vLLM.

For query head h of request r, a query at absolute position p (its request's tokens before it, prefix-cache hits
included) and the request's keys j <= p:

    score_pj = c_p * (q_p.k_j * scaling + b_h(j - p))     (SSMax scaling the prior)
             = c_p * q_p.k_j * scaling + b_h(j - p)       (SSMax on q.k only)
             = q_p.k_j * scaling + b_h(j - p)             (no SSMax),      c_p = s_h * ln(p + 1)

b_h is read from one table per head over distances -(T-1), ..., 0 (T: the longest sequence served), built once from
the checkpoint's prior (`prior_table`, the package's own `ggd_bias`, either formula). Query head h reads key/value
head h // (H / Hkv).

The cache of one layer is vLLM's (blocks, Hkv, block_size, 2 * D) view: a token's key in the first D channels of its
cell, its value in the last D. The plugin asks vLLM for the head-major layout (every block of one head stored
together), in which a run of consecutive blocks is one strided (tokens, D) matrix per head.

A step's T tokens are its requests' queries back to back: request r owns rows query_start_loc[r]:query_start_loc[r+1]
and holds seq_lens[r] tokens after this step, so its queries sit at the last positions of its sequence.

Paths (`paged_attention` picks one by device):
- CPU (`paged_attention_cpu`): a request with one query (a decoding step) reads its keys in place, run of blocks by
  run of blocks, and attends with one (H x keys) score row; a request with several queries (a prompt or a chunk of
  one) gathers its keys and runs the package's blocked SDPA with the prior table (model/blocked_bam.py), or, where
  SSMax scales the prior (no window of a table can express that mask), FlexAttention compiled for the CPU with the
  prior as a score_mod.
- CUDA (`paged_attention_triton`): Triton kernels over the block table (paged_kernels.py): a chunked-prefill kernel
  for any batch, split-KV decode for batches of single queries; launched from device metadata only, so a decoding
  step can be captured in a CUDA graph.
- Elsewhere (`paged_attention_reference`): plain PyTorch, one request at a time, scores materialized.

Shapes: T tokens of the step, R requests, H query heads and Hkv key/value heads (this tensor-parallel rank's), D head
size, L keys of one request, N tokens per cache block.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from functools import cached_property

import torch

from ..model.blocked_bam import bam_attention_blocked
from ..model.prior_bam import ggd_bias
from ..model.triton_bam import COMBINE_BLOCKS, COMBINE_LAUNCH, MAX_SPLITS, LaunchConfig
from . import paged_kernels

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------
# What a step and a layer bring
# --------------------------------------------------------------------------------------------------------


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


def prior_table(theta_alpha, theta_beta, theta_mu, formula: str, eps: float, max_len: int) -> torch.Tensor:
    """(H, max_len) float32 GGD prior at distances -(max_len-1), ..., 0: the same values, element by element, as
    the Transformers model's `BamPrior.table`."""
    distance = torch.arange(-(max_len - 1), 1, device=theta_alpha.device, dtype=torch.float32)
    return ggd_bias(distance, theta_alpha, theta_beta, theta_mu, formula, eps).contiguous()


# --------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------


def write_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch) -> None:
    """Token t's key and value (T, Hkv * D) into its cache cell slot_mapping[t]; padding (slot < 0) is skipped."""
    if kv_cache.is_cuda and paged_kernels.TRITON_AVAILABLE:
        return launch_write_cache(key, value, kv_cache, batch)
    head_dim = kv_cache.shape[-1] // 2
    tokens = batch.num_tokens
    slots = batch.slot_mapping[:tokens].long()
    valid = slots >= 0
    blocks, offsets = slots[valid] // batch.block_size, slots[valid] % batch.block_size
    heads = kv_cache.shape[1]
    kv_cache[blocks, :, offsets, :head_dim] = key[:tokens].view(tokens, heads, head_dim)[valid].to(kv_cache.dtype)
    kv_cache[blocks, :, offsets, head_dim:] = value[:tokens].view(tokens, heads, head_dim)[valid].to(kv_cache.dtype)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, terms: BamTerms,
                    output: torch.Tensor) -> None:
    """query (T, H * D) -> output (T, H * D), rows of the batch's requests (padding rows are left as they are)."""
    if query.is_cuda and triton_paged_usable(query.dtype, kv_cache.shape[-1] // 2):
        paged_attention_triton(query, kv_cache, batch, terms, output)
    elif query.device.type == "cpu":
        paged_attention_cpu(query, kv_cache, batch, terms, output)
    else:
        paged_attention_reference(query, kv_cache, batch, terms, output)


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
        from torch.nn.attention.flex_attention import flex_attention

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
    from torch.nn.attention.flex_attention import BlockMask

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


# --------------------------------------------------------------------------------------------------------
# CUDA: the Triton kernels of paged_kernels.py
# --------------------------------------------------------------------------------------------------------

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
MAX_HEAD_DIM = {torch.float16: 128, torch.bfloat16: 128, torch.float32: 64}
DECODE_MAX_SPLITS = MAX_SPLITS


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
    return paged_kernels._interpreting() or head_dim <= MAX_HEAD_DIM.get(dtype, 0)


def launch_width(block_d: int, dtype: torch.dtype) -> str:
    """"narrow" tiles for 16-bit inputs up to head size 64, "wide" ones (half the rows and keys) above, "fp32" ones
    (as wide, on half the warps: more registers per thread) for fp32 inputs."""
    if dtype == torch.float32:
        return "fp32"
    return "narrow" if block_d <= 64 else "wide"


def block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


def group_rows(group: int) -> int:
    """Tile rows of one key/value head's query heads: the group padded to a power of two, at least 16 for tl.dot."""
    return max(16, 1 << (group - 1).bit_length())


def prefill_launch(head_dim: int, dtype: torch.dtype, group: int) -> dict:
    """Meta-parameters and launch options of `_paged_prefill_kernel`: BLOCK_Q queries x GROUP heads per tile."""
    rows, block_n, warps, stages = _launch("prefill", head_dim, dtype)
    padded_group = 1 << (group - 1).bit_length()
    return dict(BLOCK_Q=max(1, rows // padded_group), GROUP=padded_group, BLOCK_N=block_n, num_warps=warps,
                num_stages=stages)


def decode_launch(head_dim: int, dtype: torch.dtype, group: int) -> dict:
    """Meta-parameters and launch options of `_paged_decode_kernel`: one key/value head's query heads per tile."""
    _, block_n, warps, stages = _launch("decode", head_dim, dtype)
    return dict(ROWS=group_rows(group), BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def _launch(kernel: str, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    if paged_kernels._interpreting():
        return INTERPRETER_LAUNCH[kernel]
    return CUDA_LAUNCH[launch_width(block_d(head_dim), dtype)][kernel]


def decode_splits(tokens: int, kv_heads: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Splits of each request's keys: enough programs for about two per SM, each split at least 4 key tiles of the
    longest sequence served. From sizes fixed for a captured step only (never the step's sequence lengths)."""
    if paged_kernels._interpreting():
        return INTERPRETER_DECODE_SPLITS
    programs = 2 * _multiprocessors(device)
    wanted = -(-programs // max(1, tokens * kv_heads))
    return max(1, min(wanted, -(-max_len // (4 * block_n)), DECODE_MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernel_options(dtype: torch.dtype) -> dict:
    """fp32 inputs use exact fp32 dots (no tf32); the interpreter computes everything in fp32."""
    fp32 = dtype == torch.float32
    return dict(UPCAST=fp32 or paged_kernels._interpreting(), DOT_PRECISION="ieee" if fp32 else "tf32")


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
        batch.block_size, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
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
        batch.block_size, terms.scaling, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), **_bam_options(terms),
        **_kernel_options(queries.dtype), **meta,
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
        batch.block_size, terms.scaling, HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim), **_bam_options(terms),
        **_kernel_options(queries.dtype), **meta,
    )
    lse = queries.new_empty(rows, dtype=torch.float32)  # the combine kernel writes it; attention does not need it
    kernels["_decode_combine_kernel"][(rows,)](
        out_partial, lse_partial, outputs, lse, 0, outputs.stride(1), outputs.stride(0), outputs.stride(2), splits,
        heads, tokens, rows, HEAD_DIM=head_dim, BLOCK_S=next(size for size in COMBINE_BLOCKS if splits <= size),
        BLOCK_D=block_d(head_dim), **COMBINE_LAUNCH,
    )


def _new_output(tensor: torch.Tensor) -> torch.Tensor:
    """A kernel's output buffer as allocated (tests fill it with NaN, so that an unwritten row fails them)."""
    return tensor
