"""The route of BAM's "sdpa" and "bam_triton" attention: which path runs a call, decided in one place.

`attention_path` reads the facts of a call (the implementation asked for, a custom 4D mask, whether the last query's
position is known as an int, device, dtype, gradients, dropout, compiling or exporting, a single query, packed
documents, explicit block shapes, which kernels are available) and returns the first row of the table below that
holds; `ATTENTION_PATHS` runs it, as Transformers' modeling code looks an implementation up in
ALL_ATTENTION_FUNCTIONS. Each path is a leaf module that only calls downward:

    path                leaf                                   runs when (the first row that holds)
    triton              triton_bam.ggd_attention               "bam_triton", its kernels usable on these tensors,
                                                               no custom 4D mask, no dropout
    traced_decode_step  the operator                           the position unknown in a compiled CPU graph (a
                        bam_llama::traced_decode_step (here),  static cache's step), one query, more than
                        then the decoding step                 TRACED_DECODE_MIN_SLOTS slots, no gradient, dropout or
                                                               documents, not exported
    materialized        reference_bam.bam_attention_sdpa       position unknown (a traced static cache, an exported
                                                               program) or a custom 4D mask
    decode_step_fused   decode_step_bam, the fused CPU kernel  one query, no gradient or dropout, eager, no documents,
                                                               the fused kernel runs (eager float32 CPU, built)
    decode_step         decode_step_bam, three PyTorch calls   the same, otherwise
    compiled_inference  the operator                           no gradient or dropout, compiling, not exporting
                        bam_llama::blocked_attention_inference
                        (here): the rows below, eagerly
    fused_cpu           fused_cpu_path_bam, with its backward  no dropout, no explicit block shape, the fused kernel
                                                               runs (packed documents as runs of keys)
    prior_gradient      prior_backward_bam                     no dropout; the prior trains, or q, k, v train under a
                                                               written mask; not exporting
    key_tiles           blocked_bam.attend_in_key_tiles        no gradient or dropout, a written mask, eager CPU, more
                                                               than KEY_TILED_AFTER keys
    blocks              blocked_bam.attend_reusing_masks       no gradient, or SDPA's own backward over a view mask
    traced_blocks       blocked_bam.attend_block, autograd     compiling (dropout with gradients)
    replayed_blocks     blocked_bam.RecomputedBlock            eager, dropout with gradients

A "written mask" is one that is not a view of the prior table: SSMax scaling the prior, padding, packed documents
or dropout. A prior of T5's buckets (`prior_bam.T5_BUCKETS`) reads its table like any other (a gather of its bucket
biases, through which autograd takes the table's gradient); only "triton" and "traced_decode_step", which compute the
prior from theta_alpha, theta_beta and theta_mu, never run it (`module_attention_call`). Every path that reads a table gets it from the caller (`prior_tables_bam`: the model's, the prior
module's, or the one kept for compiled steps). The planned paths (decode_step and below) run on q, k, v in their
compute dtype (`attention_compute_dtype`) with autocast off and return the query's dtype.

Shapes: B batch, H query heads, Hkv key/value heads, Lq queries, Lk keys, D head size.
"""

from typing import NamedTuple, Optional

import torch
from torch import nn

from .blocked_bam import (
    RecomputedBlock, attend_block, attend_in_key_tiles, attend_query_blocks, attend_reusing_masks, in_query_order,
    key_tiles_pay_off, plan_query_blocks,
)
from .decode_step_bam import attend_single_query
from .fused_cpu_path_bam import attend_fused_cpu, fused_kernel_runs
from .prior_backward_bam import prior_gradient_attention
from .prior_bam import THETA_FORMULAS, attention_compute_dtype, autocast_off, exporting
from .prior_tables_bam import kept_step_table
from .reference_bam import bam_attention_sdpa, materialized_inputs
from .triton_bam import ggd_attention, triton_usable


class AttentionCall(NamedTuple):
    """One attention call: the tensors, and what the route reads of them."""

    query: torch.Tensor  # (B, H, Lq, D)
    key: torch.Tensor  # (B, Hkv, Lk, D)
    value: torch.Tensor
    query_positions: torch.Tensor  # (Lq,) consecutive absolute positions
    scaling: float
    prior_table: Optional[torch.Tensor]  # (H, P + 1), P the last query's position; None: P unknown or a custom mask
    ssmax_scale: Optional[torch.Tensor] = None  # (H,)
    ssmax_prior: bool = True
    key_valid: Optional[torch.Tensor] = None  # (B, Lk) False on padding
    document_ids: Optional[torch.Tensor] = None  # (B, Lk) packed sequences
    dropout: float = 0.0
    block_rows: Optional[int] = None
    block_heads: Optional[int] = None
    # the model's attention only (None where `bam_attention_blocked` is called on tensors):
    module: Optional[nn.Module] = None
    prior: Optional[nn.Module] = None
    attention_mask: Optional[torch.Tensor] = None
    custom_mask: bool = False  # a 4D mask
    triton_kernels: bool = False  # "bam_triton" asked for, and its kernels usable on these tensors
    prior_parameters: Optional[tuple] = None  # a compiled step with the position unknown: the prior's parameters


def module_attention_call(
    implementation: str, module, query, key, value, attention_mask, scaling, dropout, query_positions, prior,
    document_ids, prior_table, last_position,
) -> AttentionCall:
    """The call of an attention function of `dispatch_bam` (`module`: the layer's attention, `prior`: its BamPrior).
    The prior table of a planned call (the last position known as an int, no custom 4D mask) is the model's where
    it computed one, else the prior module's; a compiled call with the position unknown reads the prior's parameters
    (a module call: offload hooks run). A prior of T5's buckets (not of THETA_FORMULAS' three parameters) never
    takes the Triton kernels or the traced decoding step, which compute from the three parameters: "bam_triton" runs
    the rows below "triton" and a compiled step with the position unknown the materialized path."""
    custom_mask = attention_mask is not None and attention_mask.dim() == 4
    of_theta = prior.formula in THETA_FORMULAS  # T5's buckets: no Triton kernel, no traced step (see the table)
    triton_kernels = implementation == "bam_triton" and of_theta and triton_usable(query)
    ssmax_scale = None if module.ssmax is None else module.ssmax()
    key_valid, table, prior_parameters = attention_mask, None, None
    if not _triton_takes(triton_kernels, custom_mask, dropout):
        step_mask = not custom_mask or _is_a_step_mask(attention_mask)
        if last_position is None and step_mask and torch.compiler.is_compiling() and of_theta:
            key_valid = attention_mask[:, 0, 0] if custom_mask else attention_mask  # (B, Lk) or None
            prior_parameters = prior()
        elif last_position is not None and not custom_mask:
            table = prior.table(last_position) if prior_table is None else prior_table
    return AttentionCall(
        query, key, value, query_positions, scaling, table, ssmax_scale, module.config.ssmax_prior, key_valid,
        document_ids, dropout, module=module, prior=prior, attention_mask=attention_mask, custom_mask=custom_mask,
        triton_kernels=triton_kernels, prior_parameters=prior_parameters,
    )


def _is_a_step_mask(attention_mask: torch.Tensor) -> bool:
    """Whether a 4D mask is a boolean (B, 1, 1, Lk) one, which `generate` builds for a compiled static-cache step
    (Transformers' own causal mask): the step's visible keys. A decoding step attends to the cache's filled slots
    only: keys after its position are hidden whatever the mask says (they hold no key yet)."""
    return attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1 and attention_mask.shape[2] == 1


# --------------------------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------------------------


def attention_path(call: AttentionCall) -> str:
    """The path that runs `call`: the first row of the module's table whose condition holds. Decided from shapes,
    dtypes, flags and `requires_grad` only (packed documents are checked for runs on the eager CPU path), so a
    traced graph holds no data-dependent branch."""
    if call.triton_kernels and _triton_takes(True, call.custom_mask, call.dropout):
        return "triton"
    if call.prior_table is None:
        return "traced_decode_step" if _traced_decode_step_runs(call) else "materialized"
    query = call.query
    compiling = torch.compiler.is_compiling()
    inference = call.dropout == 0.0 and not needs_gradient(
        query, call.key, call.value, call.prior_table, call.ssmax_scale
    )
    if inference and not compiling and query.shape[2] == 1 and call.document_ids is None:
        fused = fused_kernel_runs(query.device, attention_compute_dtype(query.dtype), None)
        return "decode_step_fused" if fused else "decode_step"
    if inference and compiling and not exporting():
        # Traced, each block's mask would be written by Inductor's generated loops, which took 2.3x the eager
        # blocks' time (BAM + SSMax, 2048 tokens, CPU): the graph calls the eager rows below as one operator.
        return "compiled_inference"
    return query_block_path(call)


def query_block_path(call: AttentionCall) -> str:
    """The rows of the table from "fused_cpu" on: the paths over blocks of queries (and the fused kernel)."""
    query, dropout = call.query, call.dropout
    explicit_blocks = bool(call.block_rows or call.block_heads)
    if not explicit_blocks and dropout == 0.0 and fused_kernel_runs(
        query.device, attention_compute_dtype(query.dtype), call.document_ids
    ):
        return "fused_cpu"
    scale_prior = call.ssmax_scale is not None and call.ssmax_prior
    written_mask = scale_prior or call.key_valid is not None or call.document_ids is not None or dropout != 0.0
    prior_trains = torch.is_grad_enabled() and (
        call.prior_table.requires_grad or (scale_prior and call.ssmax_scale.requires_grad)
    )
    inputs_train = needs_gradient(query, call.key, call.value, call.ssmax_scale)  # SSMax's factor is folded into q
    # Training a prior: SDPA has no gradient for its mask, so the blocks run without autograd and a flash-style
    # backward recomputes each block's probabilities once for every gradient (O(L) memory). A frozen prior keeps
    # SDPA's own fused backward where the mask is a view of the table; a written mask would be kept by SDPA for every
    # block (O(L^2) a layer), so those take the same path. An exported program is plain ATen: no custom operator.
    own_backward = (prior_trains or (inputs_train and written_mask)) and not exporting()
    if own_backward and dropout == 0.0:
        return "prior_gradient"
    if (  # the op that returns SDPA's log-sum-exp is the CPU kernel's
        written_mask and not (prior_trains or inputs_train or dropout > 0.0) and query.device.type == "cpu"
        and key_tiles_pay_off(call.prior_table.shape[-1]) and not torch.compiler.is_compiling() and not exporting()
    ):
        return "key_tiles"
    if not own_backward:
        return "blocks"
    if torch.compiler.is_compiling():  # a traced graph cannot replay a block in its backward: autograd keeps it
        return "traced_blocks"
    return "replayed_blocks"  # with dropout: each block replayed under autograd


def _triton_takes(triton_kernels: bool, custom_mask: bool, dropout: float) -> bool:
    """The "triton" row: the fused Triton kernels take no custom 4D mask and no dropout."""
    return triton_kernels and not custom_mask and dropout == 0.0


# A static cache of at most this many slots keeps the materialized step in a compiled graph: Inductor fuses the
# prior over every slot into a few loops, cheaper there than the operator's fixed cost (host code, about 0.1 ms a
# layer on the Intel Xeon of benchmarks/results/cpu-speed-compiled.md: 1.12-1.23x compiled Llama's step at 577
# slots, against 1.03-1.05x materialized; at 1,089 slots the operator is ahead).
TRACED_DECODE_MIN_SLOTS = 1024


def _traced_decode_step_runs(call: AttentionCall) -> bool:
    """The "traced_decode_step" row: a decoding step in a compiled graph on the CPU (one query, no gradients, no
    dropout, no packed documents: a static cache's step, over more than TRACED_DECODE_MIN_SLOTS slots). Exported
    programs stay plain ATen; on a GPU the materialized path stays (the operator reads the position on the host,
    which would sync the device in every layer). Decided from shapes only: one graph for every step."""
    query, key = call.query, call.key
    return (
        call.prior_parameters is not None and torch.compiler.is_compiling() and not exporting()
        and query.device.type == "cpu" and query.shape[2] == 1 and key.shape[2] > TRACED_DECODE_MIN_SLOTS
        and call.dropout == 0.0 and call.document_ids is None
        and not needs_gradient(query, key, call.value, call.ssmax_scale, *call.prior_parameters)
    )


def needs_gradient(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --------------------------------------------------------------------------------------------------------
# The paths
# --------------------------------------------------------------------------------------------------------


def run_attention(call: AttentionCall) -> torch.Tensor:
    """`call` through the path the route picks: (B, Lq, H, D) in the query's dtype (not always contiguous)."""
    if call.prior_table is not None:
        _refuse_a_dynamic_export(call)
    return ATTENTION_PATHS[attention_path(call)](call)


def bam_attention_blocked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    prior_table: torch.Tensor,
    scaling: float,
    ssmax_scale: torch.Tensor | None = None,
    ssmax_prior: bool = True,
    key_valid: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    dropout: float = 0.0,
    block_rows: int | None = None,
    block_heads: int | None = None,
) -> torch.Tensor:
    """Same result as `bam_attention_reference` without any (Lq x Lk) tensor, through the route's planned paths
    (the decoding step, the fused CPU kernel, blocked SDPA, its prior-gradient backward, compiled operators).

    Precision: 16-bit inputs are computed in float32 (`attention_compute_dtype`), with autocast off inside: under
    autocast SDPA would run, and the prior's mask be rounded, in 16 bits. The output comes in the query's dtype.

    Args:
        query: (B, H, Lq, D); key, value: (B, Hkv, Lk, D).
        query_positions: (Lq,) consecutive absolute positions p_0, p_0 + 1, ..., P.
        prior_table: (H, P + 1) float32 prior at distances j - i = -P, ..., 0 (the keys of the last query).
        ssmax_scale: (H,) Scalable-Softmax scale s (c_i = s ln n_i), or None for plain softmax.
        key_valid: (B, Lk) bool/int, False for padding; document_ids: (B, Lk) int (packed sequences).
        block_rows, block_heads: the blocks' queries and query heads (default: `blocked_bam.default_block_shape`).
    Returns:
        (B, H, Lq, D) in the query dtype, zero for rows that see no key (a view of a (B, Lq, H, D) tensor).
    """
    call = AttentionCall(
        query, key, value, query_positions, scaling, prior_table, ssmax_scale, ssmax_prior, key_valid, document_ids,
        dropout, block_rows, block_heads,
    )
    return run_attention(call).transpose(1, 2)


def _refuse_a_dynamic_export(call: AttentionCall) -> None:
    lengths = (call.query.shape[2], call.key.shape[2], call.prior_table.shape[-1])
    if exporting() and not all(isinstance(length, int) for length in lengths):  # (torch.compile recompiles instead)
        raise NotImplementedError(
            "bam_attention_blocked plans its query blocks in Python from the sequence length: exported with a "
            "dynamic length, the program would be fixed to the example's length. An exported BamLlama model "
            "takes the materialized SDPA path instead (bam_attention_sdpa)."
        )


def _in_compute_dtype_of(attend):
    """The runner of a planned path: `attend` in the compute dtype (`_in_compute_dtype`)."""

    def run(call: AttentionCall) -> torch.Tensor:
        return _in_compute_dtype(call, attend)

    return run


def _in_compute_dtype(call: AttentionCall, attend) -> torch.Tensor:
    """A planned path: `attend(call, query, key, value, key_valid, document_ids)` on q, k, v in the compute dtype,
    autocast off; (B, Lq, H, D) in the query's dtype. Keys past the table's (a static cache's empty slots) are cut
    before a conversion, so that only the keys that are read are converted."""
    query, key, value, key_valid, document_ids = call.query, call.key, call.value, call.key_valid, call.document_ids
    input_dtype = query.dtype
    compute_dtype = attention_compute_dtype(input_dtype)
    keys = call.prior_table.shape[-1]  # keys 0 .. P are read: a static cache's slots past P hold no key yet
    if key.shape[2] > keys and key.dtype != compute_dtype:
        key, value = key[:, :, :keys], value[:, :, :keys]
        key_valid = None if key_valid is None else key_valid[:, :keys]
        document_ids = None if document_ids is None else document_ids[:, :keys]
    with autocast_off(query.device):
        if query.dtype != compute_dtype or key.dtype != compute_dtype or value.dtype != compute_dtype:
            query, key, value = (tensor.to(compute_dtype) for tensor in (query, key, value))
        output = attend(call, query, key, value, key_valid, document_ids)
    return output if output.dtype == input_dtype else output.to(input_dtype)


def _run_triton(call: AttentionCall) -> torch.Tensor:
    prior = call.prior
    output = ggd_attention(
        call.query, call.key, call.value, *prior(), call.query_positions,
        scaling=call.scaling, formula=prior.formula, eps=prior.eps, key_valid=call.key_valid,
        document_ids=call.document_ids, ssmax_scale=call.ssmax_scale, ssmax_prior=call.ssmax_prior,
    )
    return output.transpose(1, 2)


def _run_materialized(call: AttentionCall) -> torch.Tensor:
    visible, bias, row_factor = materialized_inputs(
        call.module, call.key, call.attention_mask, call.query_positions, call.prior, call.document_ids
    )
    output = bam_attention_sdpa(
        call.query, call.key, call.value, visible, bias, call.scaling, row_factor, call.ssmax_prior, call.dropout
    )
    # A copy that stays in exported graphs (`contiguous()` of an SDPA output laid out (B, Lq, H, D) is traced
    # away): torch.onnx's decompositions lay it out (B, H, Lq, D), and the reshape traced as a view would fail.
    return output.transpose(1, 2).clone(memory_format=torch.contiguous_format)


def _run_traced_decode_step(call: AttentionCall) -> torch.Tensor:
    prior = call.prior
    return bam_attention_traced_decode_step(
        call.query, call.key, call.value, call.query_positions, call.prior_parameters, prior.formula, prior.eps,
        call.scaling, ssmax_scale=call.ssmax_scale, ssmax_prior=call.ssmax_prior, key_valid=call.key_valid,
    )


def _attend_decode_step(call, query, key, value, key_valid, document_ids) -> torch.Tensor:
    return attend_single_query(
        query, key, value, call.query_positions, call.prior_table, call.scaling, call.ssmax_scale, call.ssmax_prior,
        key_valid, False,
    )


def _attend_decode_step_fused(call, query, key, value, key_valid, document_ids) -> torch.Tensor:
    return attend_single_query(
        query, key, value, call.query_positions, call.prior_table, call.scaling, call.ssmax_scale, call.ssmax_prior,
        key_valid, True,
    )


def _attend_compiled_inference(call, query, key, value, key_valid, document_ids) -> torch.Tensor:
    return _blocked_inference(
        query, key, value, call.query_positions, call.prior_table, call.scaling, call.ssmax_scale, call.ssmax_prior,
        key_valid, document_ids, call.block_rows or 0, call.block_heads or 0,
    )


def _attend_fused_cpu(call, query, key, value, key_valid, document_ids) -> torch.Tensor:
    return attend_fused_cpu(
        query, key, value, call.query_positions, call.prior_table, call.scaling, call.ssmax_scale, call.ssmax_prior,
        key_valid, document_ids,
    )


def _planned_blocks(call, query, key, value, key_valid, document_ids, key_tiled: bool = False):
    return plan_query_blocks(
        query, key, value, call.query_positions, call.prior_table, call.ssmax_scale, call.ssmax_prior, key_valid,
        document_ids, call.dropout, call.block_rows, call.block_heads, key_tiled,
    )


def _attend_prior_gradient(call, *tensors) -> torch.Tensor:
    blocks = _planned_blocks(call, *tensors)
    output = prior_gradient_attention(
        *blocks.tensors, blocks.block, blocks.head_block, blocks.backward_block, blocks.last, call.scaling
    )
    return in_query_order(blocks, output)


def _attend_key_tiles(call, *tensors) -> torch.Tensor:
    blocks = _planned_blocks(call, *tensors, key_tiled=True)
    attend = attend_in_key_tiles(blocks.tensors[0], blocks.block, blocks.head_block)
    return attend_query_blocks(blocks, attend, call.scaling, call.dropout)


def _attend_blocks(call, *tensors) -> torch.Tensor:
    blocks = _planned_blocks(call, *tensors)
    attend = attend_reusing_masks(blocks.tensors[0], blocks.block, blocks.head_block, blocks.last)
    return attend_query_blocks(blocks, attend, call.scaling, call.dropout)


def _attend_traced_blocks(call, *tensors) -> torch.Tensor:
    return attend_query_blocks(_planned_blocks(call, *tensors), attend_block, call.scaling, call.dropout)


def _attend_replayed_blocks(call, *tensors) -> torch.Tensor:
    return attend_query_blocks(_planned_blocks(call, *tensors), RecomputedBlock.apply, call.scaling, call.dropout)


# The planned paths on q, k, v in the compute dtype: (call, query, key, value, key_valid, document_ids) -> output
_PLANNED_PATHS = {
    "decode_step_fused": _attend_decode_step_fused,
    "decode_step": _attend_decode_step,
    "compiled_inference": _attend_compiled_inference,
    "fused_cpu": _attend_fused_cpu,
    "prior_gradient": _attend_prior_gradient,
    "key_tiles": _attend_key_tiles,
    "blocks": _attend_blocks,
    "traced_blocks": _attend_traced_blocks,
    "replayed_blocks": _attend_replayed_blocks,
}
# Every path by the name `attention_path` returns: call -> (B, Lq, H, D) in the query's dtype.
ATTENTION_PATHS = {
    "triton": _run_triton,
    "traced_decode_step": _run_traced_decode_step,
    "materialized": _run_materialized,
    **{name: _in_compute_dtype_of(attend) for name, attend in _PLANNED_PATHS.items()},
}


# --------------------------------------------------------------------------------------------------------
# Compiled graphs: eager rows as one operator
# --------------------------------------------------------------------------------------------------------


@torch.library.custom_op("bam_llama::blocked_attention_inference", mutates_args=())
def _blocked_inference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    prior_table: torch.Tensor,
    scaling: float,
    ssmax_scale: Optional[torch.Tensor],
    ssmax_prior: bool,
    key_valid: Optional[torch.Tensor],
    document_ids: Optional[torch.Tensor],
    block_rows: int,
    block_heads: int,
) -> torch.Tensor:
    """The "compiled_inference" path: the rows from "fused_cpu" on, run eagerly without gradients as one operator
    of a compiled graph: (B, Lq, H, D) contiguous. block_rows / block_heads: 0 for the default block shape."""
    call = AttentionCall(
        query, key, value, query_positions, scaling, prior_table, ssmax_scale, ssmax_prior, key_valid, document_ids,
        0.0, block_rows or None, block_heads or None,
    )
    output = _PLANNED_PATHS[query_block_path(call)](call, query, key, value, key_valid, document_ids)
    return output.contiguous()


@_blocked_inference.register_fake
def _blocked_inference_fake(query, *arguments) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)


def bam_attention_traced_decode_step(
    query, key, value, query_positions, prior_parameters, formula: str, eps: float, scaling: float,
    ssmax_scale=None, ssmax_prior: bool = True, key_valid=None,
) -> torch.Tensor:
    """A static cache's decoding step in a compiled graph: (B, 1, H, D). A traced graph knows the position only as
    a tensor, so the materialized path computed the prior for every slot of the cache in every layer and step
    (H x max_cache_len powers) and attended to every slot. As one operator, the step reads the position, takes the
    prior from a table kept for these parameter values (`prior_tables_bam.kept_step_table`: computed once for all
    steps) and attends to keys 0..P only, through the route as an eager step does (`decode_step_bam`).

    query: (B, H, 1, D); key, value: (B, Hkv, Lk, D), the cache's slots; prior_parameters: theta_alpha,
    theta_beta, theta_mu (H,); key_valid: (B, Lk) bool or None."""
    return _traced_decode_step(
        query, key, value, query_positions, *prior_parameters, formula, eps, scaling, ssmax_scale, ssmax_prior,
        key_valid,
    )


@torch.library.custom_op("bam_llama::traced_decode_step", mutates_args=())
def _traced_decode_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    theta_alpha: torch.Tensor,
    theta_beta: torch.Tensor,
    theta_mu: torch.Tensor,
    formula: str,
    eps: float,
    scaling: float,
    ssmax_scale: Optional[torch.Tensor],
    ssmax_prior: bool,
    key_valid: Optional[torch.Tensor],
) -> torch.Tensor:
    last = int(query_positions[-1])
    if last >= key.shape[2]:
        raise ValueError(f"a decoding step at position {last} past the cache's {key.shape[2]} slots")
    table = kept_step_table(last, theta_alpha, theta_beta, theta_mu, formula, eps)
    if key_valid is not None and bool(key_valid[:, : last + 1].all()):  # nothing padded in the filled slots
        key_valid = None
    output = bam_attention_blocked(  # eager code here: a decoding step (`decode_step_bam`); it converts and reads
        query, key, value, query_positions, table, scaling,  # the filled slots only (keys 0 .. P, P the table's)
        ssmax_scale=ssmax_scale, ssmax_prior=ssmax_prior, key_valid=key_valid,
    )
    return output.transpose(1, 2).contiguous()


@_traced_decode_step.register_fake
def _traced_decode_step_fake(query, *arguments) -> torch.Tensor:
    batch, heads, q_len, head_dim = query.shape
    return query.new_empty(batch, q_len, heads, head_dim)
