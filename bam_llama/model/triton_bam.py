"""Launcher and autograd of the fused GGD-BAM attention kernels (`triton_kernels_bam.py`): the L x L prior is never
materialized.

`ggd_attention` computes, per query head h, query i at absolute position p_i and key j (stored from 0):

    b_ij   = GGD prior of the distance j - p_i          (`prior_bam.ggd_bias`, formula "current" or "legacy")
    s_ij   = c_i * (q_i.k_j * scaling + b_ij)           (SSMax, ssmax_prior=True)
           = c_i * q_i.k_j * scaling + b_ij             (SSMax, ssmax_prior=False)
           = q_i.k_j * scaling + b_ij                   (no SSMax)
    out_i  = softmax_j(s_ij over visible keys) @ v      (0 for a row that sees no key)

with c_i = ssmax_scale_h * ln(max(n_i, 1)), n_i the number of keys query i sees, and j visible to i when
j <= p_i, key_valid[b, j] and document_ids[b, j] == document_ids[b, p_i].

Prior: every kernel (prefill, split-KV decode, backward) looks it up in one per-head 1-D table over distances
t = p_i - j (0 <= t < Lk), built by `prior_tables_bam.kernel_prior_tables` from `prior_bam.ggd_bias` itself:
O(H * Lk) work, negligible next to the O(Lq * Lk) attention. A per-element analytic prior costs a log2 and an exp2 on the special-function unit,
about as much as the tensor-core work of a tile at head size 128 and twice it at 64. The backward uses three
more tables, the derivatives of the prior w.r.t. theta_alpha, theta_beta and theta_mu (forward-mode AD of the
same `ggd_bias`), so the parameter gradients need no special functions either. One table for every path means
the backward recomputes exactly the scores whose log-sum-exp the forward saved.

This module holds the host side: problem preparation (counts, SSMax factors, document bounds), launch
configurations (autotune lists on CUDA, fixed tiles under TRITON_INTERPRET=1), the custom ops that make
the kernels opaque to torch.compile, and autograd.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .prior_bam import PRIOR_FORMULAS, SCALE_OUTSIDE_POWER, ssmax_factor, visible_key_counts
from .prior_tables_bam import kernel_prior_tables
from .triton_kernels_bam import TRITON_AVAILABLE, activate_kernels, import_triton, interpreting


DECODE_MAX_QUERIES = 16  # automatic split-KV decode for at most this many queries...
DECODE_MAX_ROWS = 64  # ...when (query heads per kv head) x queries fits one tile


def triton_usable(tensor: torch.Tensor) -> bool:
    """Whether the fused kernels can run on `tensor` (B, H, L, D): triton is installed and it is interpreted, or on
    a GPU with a head size and dtype whose tiles fit (see MAX_HEAD_DIM; e.g. fp32 above 64 does not)."""
    if not TRITON_AVAILABLE:
        return False
    if interpreting():
        return True
    return tensor.is_cuda and head_dim_supported(tensor.shape[-1], tensor.dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def dot_tile_size(n: int) -> int:
    """The smallest tile side that holds n rows or channels: a power of two, at least 16 (`tl.dot`'s least)."""
    return max(16, _next_power_of_2(n))


# ----------------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------------

# Tile sizes under the interpreter: small enough that the test lengths (up to 133) span several tiles and
# BLOCK_M != BLOCK_N, large enough to keep the interpreter's per-operation cost down.
INTERPRETER_BLOCKS = {
    "forward": dict(BLOCK_M=64, BLOCK_N=32),
    "dkdv": dict(BLOCK_M=32, BLOCK_N=64),
    "dq": dict(BLOCK_M=64, BLOCK_N=32),
}
INTERPRETER_DECODE_BLOCK_N = 32

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner on CUDA, for "narrow" tiles (16-bit inputs, head
# size padded to <= 64) and "wide" ones (16-bit at 128, or fp32: twice the bytes per element). For dk/dv, BLOCK_N
# is the key block a program owns (its k, v, dk, dv stay in registers) and BLOCK_M the query block it streams.
# Every entry compiles for sm_80 and sm_90 without register spills and within shared memory, with padding,
# documents and every gradient on (benchmarks/gpu_readiness.py, benchmarks/results/gpu-readiness.md).
CUDA_CONFIGS = {
    "narrow": {
        "forward": [(128, 64, 8, 3), (128, 32, 8, 2), (64, 32, 4, 3)],
        "dkdv": [(16, 32, 8, 2), (16, 32, 4, 2)],
        "dq": [(32, 32, 8, 2), (16, 64, 4, 2), (32, 32, 4, 2)],
    },
    "wide": {
        "forward": [(128, 32, 8, 3), (128, 32, 8, 2), (64, 32, 8, 2)],
        "dkdv": [(16, 64, 8, 2), (32, 32, 8, 2), (16, 32, 8, 2)],
        "dq": [(32, 64, 8, 2), (32, 32, 4, 2)],
    },
}
AUTOTUNE_KEY = ["HEAD_DIM", "length_bucket", "HAS_KEY_VALID", "HAS_DOCS", "UPCAST"]
KERNEL_NAMES = {
    "forward": "_attention_forward_kernel",
    "dkdv": "_attention_backward_dkdv_kernel",
    "dq": "_attention_backward_dq_kernel",
    "decode_split": "_decode_split_kernel",
    "decode_combine": "_decode_combine_kernel",
}
COMBINE_LAUNCH = dict(num_warps=4, num_stages=1)
# Largest head size whose every configuration compiles without spills into the shared memory of sm_80 and sm_90
# (benchmarks/results/gpu-readiness.md): fp32 tiles take twice the registers and shared memory of 16-bit ones.
MAX_HEAD_DIM = {torch.float16: 128, torch.bfloat16: 128, torch.float32: 64}
MAX_SPLITS = 128  # the combine kernel holds (splits x head size) fp32 partials in registers
COMBINE_BLOCKS = (8, 32, MAX_SPLITS)  # its split blocks: few compiled variants
_AUTOTUNED = {}


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes (constexpr meta-parameters) and launch options of one compiled variant of a kernel."""

    meta: tuple  # ((name, value), ...)
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        tiles = " ".join(f"{name}={value}" for name, value in self.meta)
        return f"{tiles} warps={self.num_warps} stages={self.num_stages}"


def cuda_launch_configs(kind: str, block_d: int, dtype: torch.dtype) -> list[LaunchConfig]:
    """Every configuration the launcher can pick on CUDA for a kernel (`KERNEL_NAMES`), head size padded to block_d.

    The autotuner chooses among the prefill lists; decode tiles follow the query rows of a GQA group (up to
    DECODE_MAX_ROWS) and the combine kernel's split block the number of splits (up to MAX_SPLITS).
    `benchmarks/gpu_readiness.py` compiles each of them ahead of time.
    """
    if kind in ("forward", "dkdv", "dq"):
        width = "narrow" if block_d <= 64 and dtype != torch.float32 else "wide"
        return [LaunchConfig((("BLOCK_M", m), ("BLOCK_N", n)), warps, stages)
                for m, n, warps, stages in CUDA_CONFIGS[width][kind]]
    if kind == "decode_split":
        return [LaunchConfig((("BLOCK_M", rows), ("BLOCK_N", _decode_block_n(rows))), **_decode_launch(rows))
                for rows in _powers_of_2(16, DECODE_MAX_ROWS)]
    if kind == "decode_combine":
        return [LaunchConfig((("BLOCK_S", splits),), **COMBINE_LAUNCH) for splits in COMBINE_BLOCKS]
    raise ValueError(f"unknown kernel {kind!r}; expected one of {list(KERNEL_NAMES)}")


def head_dim_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether every configuration of the kernels fits a GPU (sm_80, sm_90) for this head size and dtype."""
    return head_dim <= MAX_HEAD_DIM.get(dtype, 0)


def _powers_of_2(low: int, high: int) -> list[int]:
    return [1 << exponent for exponent in range(low.bit_length() - 1, high.bit_length())]


def _attention_kernel(kind: str, grid_rows: int, grid_programs: int, block_rows: str, block_d: int,
                      dtype: torch.dtype):
    """(kernel, grid, fixed meta-parameters) for one of the prefill kernels.

    Under the interpreter the tile sizes are fixed; on CUDA the autotuner picks them per length bucket among
    `cuda_launch_configs`.
    """
    kernels = activate_kernels()
    if interpreting():
        meta = INTERPRETER_BLOCKS[kind]
        return kernels[KERNEL_NAMES[kind]], (_cdiv(grid_rows, meta[block_rows]), grid_programs), meta
    if (kind, block_d, dtype) not in _AUTOTUNED:
        triton = import_triton()
        configs = [triton.Config(dict(config.meta), num_warps=config.num_warps, num_stages=config.num_stages)
                   for config in cuda_launch_configs(kind, block_d, dtype)]
        _AUTOTUNED[kind, block_d, dtype] = triton.autotune(configs=configs, key=AUTOTUNE_KEY)(
            kernels[KERNEL_NAMES[kind]])
    return _AUTOTUNED[kind, block_d, dtype], lambda meta: (_cdiv(grid_rows, meta[block_rows]), grid_programs), {}


def combine_block(num_splits: int) -> int:
    """The combine kernel's split block (BLOCK_S) for this many splits."""
    return next(block for block in COMBINE_BLOCKS if num_splits <= block)


def _decode_launch(block_m: int) -> dict:
    """4 warps for a tile of up to 16 query rows, 8 above (the fp32 accumulator grows with the rows)."""
    return dict(num_warps=4 if block_m <= 16 else 8, num_stages=3)


def _decode_block_n(block_m: int) -> int:
    """Keys per tile of the split-KV kernel: 64 for up to 16 query rows, 32 above (registers)."""
    if interpreting():
        return INTERPRETER_DECODE_BLOCK_N
    return 64 if block_m <= 16 else 32


def decode_split_count(programs_per_split: int, k_len: int, block_n: int, device: torch.device) -> int:
    """Splits of the keys for split-KV decode: enough to give every SM about two programs (`programs_per_split`
    programs run each split), each split at least 4 key tiles long, at most MAX_SPLITS."""
    if device.type != "cuda":
        return 1
    wanted = _cdiv(2 * multiprocessor_count(device), max(1, programs_per_split))
    return max(1, min(wanted, _cdiv(k_len, 4 * block_n), MAX_SPLITS))


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------------


@dataclass
class _Problem:
    """Shapes and the O(B * L) side inputs derived once per call (counts, scales, document bounds)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    positions: torch.Tensor  # (Lq,) int64
    qk_scale: torch.Tensor  # (B, H, Lq) float32: c_i * scaling
    bias_scale: torch.Tensor  # (B, H, Lq) float32: c_i (ssmax_prior) or 1
    counts: Optional[torch.Tensor]  # (B or 1, Lq) int64 visible keys n_i, with SSMax or when asked for
    key_valid: Optional[torch.Tensor]  # (B, Lk) uint8
    document_ids: Optional[torch.Tensor]  # (B, Lk) int32
    document_start: Optional[torch.Tensor]  # (B, Lk) int32: first key of the document of each key
    document_end: Optional[torch.Tensor]  # (B, Lk) int32: one past its last key
    padding_end: Optional[torch.Tensor]  # (B,) int32: one past the last padded key of each row (0 if none)

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    @property
    def block_d(self) -> int:
        return dot_tile_size(self.head_dim)

    @property
    def length_bucket(self) -> int:
        return _next_power_of_2(max(self.q_len, self.k_len))

    def or_placeholder(self, tensor: Optional[torch.Tensor]) -> torch.Tensor:
        """`tensor`, or where it is absent a placeholder the kernels never read (a constexpr flag is off)."""
        return self.positions if tensor is None else tensor


def _document_bounds(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Lk) ids -> first key of each key's document and one past its last key, both (B, Lk) int32."""
    length = document_ids.shape[-1]
    index = torch.arange(length, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    document_start = torch.where(starts, index, 0).cummax(-1).values
    document_end = torch.where(ends, index + 1, length).flip(-1).cummin(-1).values.flip(-1)
    return document_start.to(torch.int32).contiguous(), document_end.to(torch.int32).contiguous()


def _prepare_problem(query, key, query_positions, key_valid, document_ids, ssmax_scale, scaling, ssmax_prior,
                     with_counts=False):
    batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    device = query.device
    positions = query_positions.to(device=device, dtype=torch.int64).contiguous()

    counts = None
    if ssmax_scale is not None or with_counts:
        counts = visible_key_counts(positions, k_len, key_valid, document_ids)  # (B or 1, Lq)
    if ssmax_scale is None:
        factor = torch.ones(1, 1, 1, device=device)  # (1, 1, 1)
    else:
        factor = ssmax_factor(counts, ssmax_scale.detach())[..., 0]  # (B or 1, H, Lq)
    qk_scale = (factor * scaling).expand(batch, heads, q_len).contiguous()
    bias_scale = (factor if ssmax_prior else torch.ones_like(factor)).expand(batch, heads, q_len).contiguous()

    padding_end = None
    if key_valid is not None:
        key_valid = key_valid.to(device=device, dtype=torch.bool).expand(batch, k_len).contiguous()
        key_index = torch.arange(1, k_len + 1, device=device, dtype=torch.int32)
        padding_end = torch.where(key_valid, 0, key_index).amax(-1).to(torch.int32).contiguous()
        key_valid = key_valid.view(torch.uint8)
    document_start = document_end = None
    if document_ids is not None:
        document_ids = document_ids.to(device=device, dtype=torch.int32).expand(batch, k_len).contiguous()
        document_start, document_end = _document_bounds(document_ids)
    return _Problem(
        batch, heads, kv_heads, q_len, k_len, head_dim, positions, qk_scale, bias_scale, counts,
        key_valid, document_ids, document_start, document_end, padding_end,
    )


def dot_options(dtype: torch.dtype) -> dict:
    """fp32 inputs use exact fp32 dots (no tf32); the interpreter computes everything in fp32."""
    fp32 = dtype == torch.float32
    return dict(UPCAST=fp32 or interpreting(), DOT_PRECISION="ieee" if fp32 else "tf32")


def _prefill_forward(query, key, value, problem: _Problem, prior_table: torch.Tensor, out, lse) -> None:
    kernel, grid, meta = _attention_kernel("forward", problem.q_len, problem.batch * problem.heads, "BLOCK_M",
                                           problem.block_d, query.dtype)
    kernel[grid](
        query, key, value, out, lse, prior_table, problem.positions, problem.qk_scale, problem.bias_scale,
        problem.or_placeholder(problem.key_valid), problem.or_placeholder(problem.document_ids),
        problem.or_placeholder(problem.document_start), problem.or_placeholder(problem.padding_end),
        *query.stride(), *key.stride(), *value.stride(), *out.stride(),
        problem.heads, problem.group_size, problem.q_len, problem.k_len, problem.length_bucket,
        HEAD_DIM=problem.head_dim, BLOCK_D=problem.block_d,
        HAS_KEY_VALID=problem.key_valid is not None, HAS_DOCS=problem.document_ids is not None,
        **dot_options(query.dtype), **meta,
    )


def _split_kv_forward(query, key, value, problem: _Problem, prior_table: torch.Tensor, num_splits: Optional[int],
                      out, lse) -> None:
    kernels = activate_kernels()
    rows_per_group = problem.group_size * problem.q_len
    block_m = dot_tile_size(rows_per_group)
    block_n = _decode_block_n(block_m)
    if num_splits is None:
        num_splits = decode_split_count(problem.batch * problem.kv_heads, problem.k_len, block_n, query.device)
    keys_per_split = _cdiv(_cdiv(problem.k_len, num_splits), block_n) * block_n
    num_rows = problem.batch * problem.heads * problem.q_len
    out_partial = _new_output(query.new_empty(num_splits, num_rows, problem.head_dim, dtype=torch.float32))
    lse_partial = _new_output(query.new_empty(num_splits, num_rows, dtype=torch.float32))
    launch = {} if interpreting() else _decode_launch(block_m)

    kernels["_decode_split_kernel"][(num_splits, problem.batch * problem.kv_heads)](
        query, key, value, out_partial, lse_partial, prior_table, problem.positions, problem.qk_scale,
        problem.bias_scale, problem.or_placeholder(problem.key_valid), problem.or_placeholder(problem.document_ids),
        *query.stride(), *key.stride(), *value.stride(),
        problem.heads, problem.group_size, problem.q_len, problem.k_len, keys_per_split, num_rows,
        HEAD_DIM=problem.head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=problem.block_d, HAS_KEY_VALID=problem.key_valid is not None,
        HAS_DOCS=problem.document_ids is not None, **dot_options(query.dtype), **launch,
    )
    kernels["_decode_combine_kernel"][(num_rows,)](
        out_partial, lse_partial, out, lse, *out.stride(),
        num_splits, problem.heads, problem.q_len, num_rows,
        HEAD_DIM=problem.head_dim, BLOCK_S=combine_block(num_splits), BLOCK_D=problem.block_d,
        **({} if interpreting() else COMBINE_LAUNCH),
    )


def _use_split_kv(problem: _Problem, num_splits: Optional[int]) -> bool:
    """num_splits: None picks automatically, 0 forces the prefill kernel, n >= 1 forces n splits."""
    if num_splits is not None:
        return num_splits > 0
    return problem.q_len <= DECODE_MAX_QUERIES and problem.group_size * problem.q_len <= DECODE_MAX_ROWS


def _attention_forward(query, key, value, theta_alpha, theta_beta, theta_mu, query_positions, key_valid,
                       document_ids, ssmax_scale, scaling, formula, eps, ssmax_prior, num_splits):
    """(out (B, H, Lq, D) in the query dtype, lse (B, H, Lq) float32 in log2 units, -inf for empty rows)."""
    problem = _prepare_problem(query, key, query_positions, key_valid, document_ids, ssmax_scale, scaling,
                               ssmax_prior)
    out = _new_output(torch.empty_like(query))
    lse = _new_output(query.new_empty(problem.batch, problem.heads, problem.q_len, dtype=torch.float32))
    if problem.q_len == 0:
        return out, lse
    # the one prior definition of every path: the backward recomputes scores from this same table
    prior_table = kernel_prior_tables(theta_alpha, theta_beta, theta_mu, problem.k_len, formula, eps, False)
    if _use_split_kv(problem, num_splits):
        _split_kv_forward(query, key, value, problem, prior_table, num_splits, out, lse)
    else:
        _prefill_forward(query, key, value, problem, prior_table, out, lse)
    return out, lse


def _attention_backward(grad_out, query, key, value, out, lse, theta_alpha, theta_beta, theta_mu, query_positions,
                        key_valid, document_ids, ssmax_scale, scaling, formula, eps, ssmax_prior, prior_grads,
                        ssmax_grad):
    problem = _prepare_problem(query, key, query_positions, key_valid, document_ids, ssmax_scale, scaling,
                               ssmax_prior,
                               with_counts=prior_grads)
    tables = kernel_prior_tables(theta_alpha, theta_beta, theta_mu, problem.k_len, formula, eps, prior_grads)
    delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # (B, H, Lq): sum_j P_ij dP_ij
    grad_q, grad_k, grad_v = (_new_output(torch.empty_like(tensor)) for tensor in (query, key, value))
    num_rows = problem.batch * problem.heads * problem.q_len
    row_grads = _new_output(query.new_empty(4, num_rows, dtype=torch.float32))  # (4, B * H * Lq)
    flags = dict(
        HEAD_DIM=problem.head_dim, BLOCK_D=problem.block_d, HAS_KEY_VALID=problem.key_valid is not None,
        HAS_DOCS=problem.document_ids is not None, **dot_options(query.dtype),
    )
    side_inputs = (problem.positions, problem.qk_scale, problem.bias_scale,
                   problem.or_placeholder(problem.key_valid), problem.or_placeholder(problem.document_ids))

    kernel, grid, meta = _attention_kernel("dkdv", problem.k_len, problem.batch * problem.kv_heads, "BLOCK_N",
                                           problem.block_d, query.dtype)
    kernel[grid](
        query, key, value, grad_out, grad_k, grad_v, lse, delta, tables, *side_inputs,
        problem.or_placeholder(problem.document_end),
        *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *grad_k.stride(), *grad_v.stride(),
        problem.heads, problem.group_size, problem.q_len, problem.k_len, problem.length_bucket, **flags, **meta,
    )
    kernel, grid, meta = _attention_kernel("dq", problem.q_len, problem.batch * problem.heads, "BLOCK_M",
                                           problem.block_d, query.dtype)
    kernel[grid](
        query, key, value, grad_out, grad_q, lse, delta, tables, *side_inputs,
        problem.or_placeholder(problem.document_start), problem.or_placeholder(problem.padding_end), row_grads,
        *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *grad_q.stride(),
        problem.heads, problem.group_size, problem.q_len, problem.k_len, num_rows, scaling, problem.length_bucket,
        PRIOR_GRADS=prior_grads, SSMAX_GRAD=ssmax_grad, SSMAX_PRIOR=ssmax_prior, **flags, **meta,
    )
    grad_alpha, grad_beta, grad_mu = _prior_gradients(row_grads, problem, prior_grads)
    grad_scale = _ssmax_gradient(row_grads, problem, ssmax_grad)
    grad_scale = grad_scale.to(ssmax_scale.dtype) if ssmax_scale is not None else theta_alpha.new_zeros(0)
    return (grad_q, grad_k, grad_v, grad_alpha.to(theta_alpha.dtype), grad_beta.to(theta_beta.dtype),
            grad_mu.to(theta_mu.dtype), grad_scale)


def _prior_gradients(row_grads: torch.Tensor, problem: _Problem, needed: bool) -> list[torch.Tensor]:
    """(H,) gradients of theta_alpha, theta_beta, theta_mu: the per-row partials summed over batch and queries.

    d loss / d b_ij = dS_ij * c_i with ssmax_prior, dS_ij otherwise (c_i is BiasScale). A row that sees a single
    key has probability 1 whatever its score, so its gradients are exactly 0; but its dS is rounding noise
    (dP - Delta summed in two orders), which a derivative table entry of eps ** beta ~ 1e10 (negative beta,
    mu ~ 0, the first token of every sequence) would amplify. Those rows are left out.
    """
    if not needed:
        return [row_grads.new_zeros(problem.heads) for _ in range(3)]
    row_grads = row_grads.view(4, problem.batch, problem.heads, problem.q_len)
    several_keys = (problem.counts > 1)[:, None, :]  # (B or 1, 1, Lq)
    weights = torch.where(several_keys, problem.bias_scale, 0.0)  # (B, H, Lq)
    return [(row_grads[kind] * weights).sum(dim=(0, 2)) for kind in range(3)]


def _ssmax_gradient(row_grads: torch.Tensor, problem: _Problem, needed: bool) -> torch.Tensor:
    """(H,) gradient of the SSMax scale: d loss / d s_h = sum over batch and queries of ln(n_i) d loss / d c_i."""
    if not needed:
        return row_grads.new_zeros(problem.heads)
    row_grads = row_grads.view(4, problem.batch, problem.heads, problem.q_len)
    log_counts = problem.counts.clamp(min=1).to(torch.float32).log()  # (B or 1, Lq); 0 for single-key rows
    return (row_grads[3] * log_counts[:, None, :]).sum(dim=(0, 2))


def _new_output(tensor: torch.Tensor) -> torch.Tensor:
    """Every buffer a kernel must fully write passes here; the tests fill them with NaN to catch missed tiles."""
    return tensor


# ----------------------------------------------------------------------------------------------------------
# Custom ops (opaque to torch.compile) and autograd
# ----------------------------------------------------------------------------------------------------------


@torch.library.custom_op("bam_llama::ggd_attention_forward", mutates_args=())
def _ggd_attention_forward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    theta_alpha: torch.Tensor,
    theta_beta: torch.Tensor,
    theta_mu: torch.Tensor,
    query_positions: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    document_ids: Optional[torch.Tensor],
    ssmax_scale: Optional[torch.Tensor],
    scaling: float,
    formula: str,
    eps: float,
    ssmax_prior: bool,
    num_splits: Optional[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    return _attention_forward(query, key, value, theta_alpha, theta_beta, theta_mu, query_positions, key_valid,
                              document_ids, ssmax_scale, scaling, formula, eps, ssmax_prior, num_splits)


@_ggd_attention_forward_op.register_fake
def _ggd_attention_forward_fake(query, key, value, theta_alpha, theta_beta, theta_mu, query_positions, key_valid, document_ids, ssmax_scale,
      scaling, formula, eps, ssmax_prior, num_splits):
    batch, heads, q_len, _ = query.shape
    return torch.empty_like(query), query.new_empty((batch, heads, q_len), dtype=torch.float32)


@torch.library.custom_op("bam_llama::ggd_attention_backward", mutates_args=())
def _ggd_attention_backward_op(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    theta_alpha: torch.Tensor,
    theta_beta: torch.Tensor,
    theta_mu: torch.Tensor,
    query_positions: torch.Tensor,
    key_valid: Optional[torch.Tensor],
    document_ids: Optional[torch.Tensor],
    ssmax_scale: Optional[torch.Tensor],
    scaling: float,
    formula: str,
    eps: float,
    ssmax_prior: bool,
    prior_grads: bool,
    ssmax_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _attention_backward(grad_out, query, key, value, out, lse, theta_alpha, theta_beta, theta_mu,
                               query_positions, key_valid, document_ids, ssmax_scale, scaling, formula, eps,
                               ssmax_prior, prior_grads, ssmax_grad)


@_ggd_attention_backward_op.register_fake
def _ggd_attention_backward_fake(grad_out, query, key, value, out, lse, theta_alpha, theta_beta, theta_mu, query_positions, key_valid,
      document_ids, ssmax_scale, scaling, formula, eps, ssmax_prior, prior_grads, ssmax_grad):
    grad_scale = torch.empty_like(ssmax_scale) if ssmax_scale is not None else theta_alpha.new_empty(0)
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), torch.empty_like(theta_alpha),
            torch.empty_like(theta_beta), torch.empty_like(theta_mu), grad_scale)


def _setup_context(ctx, inputs, output):
    (query, key, value, theta_alpha, theta_beta, theta_mu, query_positions, key_valid, document_ids, ssmax_scale,
     scaling, formula, eps, ssmax_prior, _) = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, theta_alpha, theta_beta, theta_mu, query_positions,
                          key_valid, document_ids, ssmax_scale)
    ctx.options = dict(scaling=scaling, formula=formula, eps=eps, ssmax_prior=ssmax_prior)


def _backward(ctx, grad_out, grad_lse):
    """grad_lse is ignored: the log-sum-exp is an internal output, never returned by `ggd_attention`."""
    (query, key, value, out, lse, theta_alpha, theta_beta, theta_mu, query_positions, key_valid, document_ids,
     ssmax_scale) = ctx.saved_tensors
    needs = ctx.needs_input_grad
    ssmax_grad = ssmax_scale is not None and needs[9]
    grads = _ggd_attention_backward_op(
        grad_out, query, key, value, out, lse, theta_alpha, theta_beta, theta_mu, query_positions, key_valid,
        document_ids, ssmax_scale, prior_grads=any(needs[3:6]), ssmax_grad=ssmax_grad, **ctx.options,
    )
    grad_q, grad_k, grad_v, grad_alpha, grad_beta, grad_mu, grad_scale = grads
    return (grad_q, grad_k, grad_v, grad_alpha, grad_beta, grad_mu, None, None, None,
            grad_scale if ssmax_grad else None, None, None, None, None, None)


_ggd_attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def ggd_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    theta_alpha: torch.Tensor,
    theta_beta: torch.Tensor,
    theta_mu: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    scaling: float,
    formula: str = SCALE_OUTSIDE_POWER,
    eps: float = 1e-5,
    key_valid: Optional[torch.Tensor] = None,
    document_ids: Optional[torch.Tensor] = None,
    ssmax_scale: Optional[torch.Tensor] = None,
    ssmax_prior: bool = True,
    num_splits: Optional[int] = None,
) -> torch.Tensor:
    """GGD-BAM attention with the fused kernels; same result as `reference_bam.bam_attention_reference`.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D), H a multiple of Hkv; fp16, bf16 or fp32, any strides.
        theta_alpha, theta_beta, theta_mu: (H,) prior parameters.
        query_positions: (Lq,) int, strictly increasing absolute positions < Lk (Lk - Lq + arange(Lq) for a
            chunk against a cache).
        key_valid: (B, Lk) bool, False for padding.
        document_ids: (B, Lk) int ids of packed documents (contiguous runs); a query belongs to the document of
            the key slot at its own position.
        ssmax_scale: (H,) Scalable-Softmax scale s_h, or None for plain softmax.
        ssmax_prior: whether the SSMax factor also multiplies the prior.
        num_splits: None chooses; 0 forces the single-pass kernel; n >= 1 forces split-KV decode with n splits.
    Returns:
        (B, H, Lq, D) in the query dtype (autocast's under autocast), differentiable w.r.t. query, key, value, the
        theta parameters and ssmax_scale; each gradient comes in its input's dtype.

    Autocast: like SDPA, a "lower precision" operation: query, key and value are cast to autocast's dtype (the
    kernels take 16-bit inputs and accumulate in float32); the prior and SSMax parameters stay as they are (the
    kernels read them through float32 tables, and their gradients are summed in float32).
    """
    query, key, value = _autocast_inputs(query, key, value)
    _check_inputs(query, key, value, theta_alpha, query_positions, formula, num_splits)
    out, _ = _ggd_attention_forward_op(
        query, key, value, theta_alpha, theta_beta, theta_mu, query_positions, key_valid, document_ids,
        ssmax_scale, float(scaling), formula, float(eps), bool(ssmax_prior), num_splits,
    )
    return out


def _autocast_inputs(query, key, value) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """query, key, value in autocast's dtype where autocast is on for their device, else as they are."""
    device_type = query.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _check_inputs(query, key, value, theta_alpha, query_positions, formula, num_splits=None) -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("ggd_attention needs the `triton` package, which is not installed")
    if formula not in PRIOR_FORMULAS:
        raise ValueError(f"unknown prior formula {formula!r}; expected one of {PRIOR_FORMULAS}")
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        raise ValueError(f"expected query (B, H, Lq, D) and key/value (B, Hkv, Lk, D); got {query.shape}, "
                         f"{key.shape}, {value.shape}")
    batch, heads, q_len, head_dim = query.shape
    if key.shape[0] != batch or key.shape[3] != head_dim or heads % key.shape[1] != 0:
        raise ValueError(f"key/value {tuple(key.shape)} do not match query {tuple(query.shape)}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or key.dtype != query.dtype \
            or value.dtype != query.dtype:
        raise ValueError(f"expected fp16/bf16/fp32 query, key and value of one dtype; got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}")
    if not interpreting() and not head_dim_supported(head_dim, query.dtype):  # the interpreter has no such limit
        raise ValueError(f"head size {head_dim} is not supported for {query.dtype} inputs: the kernels' tiles "
                         f"would not fit a GPU's registers and shared memory (up to {MAX_HEAD_DIM[query.dtype]})")
    if num_splits is not None and num_splits > 0:
        rows = heads // key.shape[1] * q_len
        if rows > DECODE_MAX_ROWS or num_splits > MAX_SPLITS:
            raise ValueError(f"split-KV decode takes at most {DECODE_MAX_ROWS} (query heads per kv head x queries) "
                             f"rows and {MAX_SPLITS} splits; got {rows} rows and num_splits={num_splits}")
    if theta_alpha.shape != (heads,):
        raise ValueError(f"expected ({heads},) prior parameters, got {tuple(theta_alpha.shape)}")
    if query_positions.shape != (q_len,):
        raise ValueError(f"expected query_positions of shape ({q_len},), got {tuple(query_positions.shape)}")


__all__ = ["TRITON_AVAILABLE", "ggd_attention", "triton_usable"]

