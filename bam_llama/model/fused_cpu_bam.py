"""GGD-BAM's attention as one fused CPU kernel, forward and backward: queries in blocks, keys in tiles, an online
softmax whose logits take the prior from the table and the SSMax factor per row in the same pass that reads the
scores. Nothing of size (Lq x Lk) is written to memory: where SDPA's fused kernel must read a written mask (SSMax
scaling the prior: c_i * b(j - i) differs per row), this kernel reads a window of the (H, P + 1) table, which stays
in cache; and its backward returns the prior's gradient (the diagonal sums of dS) beside dQ, dK, dV, which SDPA's
backward cannot.

The C++ is csrc/fused_cpu.cpp, built ahead of the first forward by `bam-build-kernels` (cpu_kernels_bam.py); this
module is its Python wrapper and autograd. Where it is not built, `fused_cpu_available()` is False and
`blocked_bam` runs blocked SDPA.

float32 on the CPU, eager code (`blocked_bam` routes there; traced graphs with gradients, exported programs,
dropout, and document ids that are not runs keep its blocked SDPA paths). The plain-PyTorch reference it is tested against is
`reference_bam.bam_attention_reference` (and the tests' own float64 formula).

Shapes: B batch, H query heads, Hkv key/value heads, Lq queries, Lk keys, D head size; P = the last query's position.
"""

import functools

import torch

from .cpu_kernels_bam import FUSED_CPU, cpu_kernels_enabled, load_kernel


@functools.cache
def _library() -> str | None:
    """The kernel's operator namespace, or None where this installation has no build (blocked SDPA stays)."""
    return load_kernel(FUSED_CPU)


def fused_cpu_available() -> bool:
    """Whether the kernel runs: the C++ CPU kernels not switched off (read at every call), and this one built."""
    return cpu_kernels_enabled() and _library() is not None


def bam_attention_fused_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    first_position: int,
    prior_table: torch.Tensor,
    scaling: float,
    prior_factor: torch.Tensor | None,
    key_bias: torch.Tensor | None,
    key_start: torch.Tensor | None,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Attention of queries at positions first_position .. P against keys 0 .. P, float32, differentiable in the
    query, key, value, table and prior factor:

        logit_ij = scaling q_i.k_j + prior_factor_i * table[j - p_i + P] + key_bias_j,   key_start_i <= j <= p_i

    Args:
        query: (B, H, Lq, D), the SSMax factor c_i already multiplied in; key, value: (B, Hkv, Lk >= P + 1, D).
        prior_table: (H, P + 1) prior at distances -P .. 0.
        prior_factor: (1 or B, H, Lq) c_i where SSMax scales the prior, or None.
        key_bias: (B, Lk) 0 for a key, a large negative score for padding, or None.
        key_start: (B, Lq) int64 first key each query sees (its document's first: packed sequences), or None (0).
        counts: (1 or B, Lq) keys each query sees (a row that sees one key has no score gradient).
    Returns:
        (B, Lq, H, D).
    """
    tensors = (query, key, value, prior_table, prior_factor, key_bias, key_start)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors[:5]):
        return _FusedAttention.apply(*tensors, counts, scaling, first_position)
    output, _ = _forward(*tensors, scaling, first_position, with_lse=False)
    return output


def _operators():
    return getattr(torch.ops, _library())


def _contiguous(tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0) if tensor is None else tensor.detach().contiguous()


def _dense(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor if tensor is None or tensor.is_contiguous() else tensor.contiguous()


def _table_rows(table: torch.Tensor) -> torch.Tensor:
    """The table as the forward reads it: rows contiguous, each where it lies (a window of a kept table, rows a
    longer table's length apart, is not copied)."""
    return table if table.stride(-1) == 1 else table.contiguous()


def _key_starts(key_start: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.long) if key_start is None else key_start.long().contiguous()


def _forward(query, key, value, table, prior_factor, key_bias, key_start, scaling, first_position, with_lse):
    """The kernel's forward. Never on tensors that record gradients: bam_attention_fused_cpu calls it without
    gradients, or inside `_FusedAttention.forward` (autograd off), so nothing is detached here."""
    return _operators().forward(
        *(_dense(tensor) for tensor in (query, key, value)), _table_rows(table), _dense(prior_factor),
        _dense(key_bias), None if key_start is None else key_start.long().contiguous(), float(scaling),
        int(first_position), with_lse,
    )


class _FusedAttention(torch.autograd.Function):
    """The kernel's forward (keeping each row's log-sum-exp) and its flash-style backward (O(L) memory)."""

    @staticmethod
    def forward(ctx, query, key, value, table, prior_factor, key_bias, key_start, counts, scaling, first_position):
        output, lse = _forward(
            query, key, value, table, prior_factor, key_bias, key_start, scaling, first_position, True
        )
        ctx.save_for_backward(query, key, value, table, prior_factor, key_bias, key_start, counts, output, lse)
        ctx.arguments = (scaling, first_position)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, table, prior_factor, key_bias, key_start, counts, output, lse = ctx.saved_tensors
        scaling, first_position = ctx.arguments
        table_grad, factor_grad = ctx.needs_input_grad[3], prior_factor is not None and ctx.needs_input_grad[4]
        single_key = (counts == 1).to(torch.uint8).contiguous()
        grad_query, grad_key, grad_value, grad_table, grad_factor = _operators().backward(
            grad_output.contiguous(), *(_contiguous(t, query) for t in (query, key, value, output, lse, table)),
            _contiguous(prior_factor, query), _contiguous(key_bias, query), _key_starts(key_start, query), single_key,
            float(scaling), int(first_position), table_grad, factor_grad,
        )
        grad_table = grad_table.sum(0) if table_grad else None
        if factor_grad and prior_factor.shape[0] == 1:
            grad_factor = grad_factor.sum(0, keepdim=True)
        return (
            grad_query, grad_key, grad_value, grad_table, grad_factor if factor_grad else None,
            None, None, None, None, None,
        )
