"""The one provider of prior tables: every attention path reads the prior from a table over distances, and every
such table comes from here (the formula itself is `prior_bam.distance_bias`: the GGD or KERPLE of three parameters a
head, `ggd_bias`, or T5's bucket biases gathered by bucket, `t5_bias`; over distances by `prior_bam.prior_table`).
A prior's parameters are the tuple its module returns (`BamPrior.forward`): (theta_alpha, theta_beta, theta_mu), or
(bucket_bias,) under T5's buckets, whose table is a gather of bucket_bias that autograd differentiates.

- `module_table`: a prior module's (H, P + 1) table, kept across calls without gradients on the CPU
  (`BamPrior.table`).
- `layer_tables`: the tables of a prior per layer, without gradients on the CPU, as windows of one kept for all
  layers (`BamLlamaModel._prior_tables`).
- `kept_step_table`: a compiled graph's decoding step, kept for the prior's parameter tensors
  (`attention_route_bam`'s operator `bam_llama::traced_decode_step`).
- `kernel_prior_tables`: the Triton kernels' tables, by distance back from the query, with their derivatives with
  respect to the three parameters (`triton_bam`; not T5's buckets, which the route sends to the other paths).

The serving side's tables (`serving/paged_batch.prior_table`, vLLM's steps) are `prior_bam.prior_table` too.

Which table is kept where: a prior module keeps its own (`KeptPriorTable`); the model keeps one for all its layers'
priors; compiled steps keep one per prior's theta_alpha tensor (weakly: a table goes with its model). Each is used
only while the parameters hold the values it was computed from.
"""

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .prior_bam import PRIOR_LIMIT, T5_MAX_DISTANCE, KeptPriorTable, ggd_bias, prior_table


def module_table(
    parameters: tuple[torch.Tensor, ...], formula: str, eps: float, last_position: int, kept: KeptPriorTable,
    max_distance: int = T5_MAX_DISTANCE,
) -> torch.Tensor:
    """(H, P + 1) float32 prior at distances -P, ..., 0 of one prior's parameters: every row of the bias is a window
    of it. On CPU without gradients (eager code) the table is kept in `kept` for reuse: a decoding step then
    computes no prior at all, where it would compute H x (P + 1) powers a layer."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or parameters[0].device.type != "cpu":
        return prior_table(last_position + 1, parameters, formula, eps, max_distance)
    return kept.window(last_position, parameters, formula, eps, max_distance)


def layer_tables(
    parameters: list[tuple[torch.Tensor, ...]], formula: str, eps: float, last_position: int, kept: KeptPriorTable,
    max_distance: int = T5_MAX_DISTANCE,
) -> list[torch.Tensor] | None:
    """The (H, P + 1) tables of a prior per layer (`parameters`: each layer's), without gradients in eager CPU code:
    every layer's table from one kept for all of them, its parameters checked once a forward, not once a layer (at
    512 tokens the per-layer checks were 5% of a decoding step; benchmarks/results/cpu-speed.md). None elsewhere:
    each layer's attention then asks its own prior module (`module_table`)."""
    if any(layer[0].device.type != "cpu" for layer in parameters):
        return None
    stacked = tuple(torch.cat(values) for values in zip(*parameters))  # each (layers x H, ...)
    tables = kept.window(last_position, stacked, formula, eps, max_distance)
    return list(tables.view(len(parameters), -1, last_position + 1).unbind(0))


# The tables of the priors a compiled decoding step has seen, by their theta_alpha tensor (weakly: a table goes with
# its model); each is used only while the parameters hold its values (`KeptPriorTable`).
_STEP_TABLES = WeakTensorKeyDictionary()


def kept_step_table(last_position: int, theta_alpha, theta_beta, theta_mu, formula: str, eps: float) -> torch.Tensor:
    """(H, P + 1) float32 table of a compiled graph's decoding step at position P, kept for the prior's tensors."""
    kept = _STEP_TABLES.get(theta_alpha)
    if kept is None:
        kept = _STEP_TABLES[theta_alpha] = KeptPriorTable()
    return kept.window(last_position, (theta_alpha, theta_beta, theta_mu), formula, eps)


def _clamped_to_prior_limit(values: torch.Tensor) -> torch.Tensor:
    """NaN as 0, everything else (infinities too) clamped to [-PRIOR_LIMIT, PRIOR_LIMIT]: the prior's own bound,
    which its derivatives can pass."""
    return torch.nan_to_num(values, nan=0.0, posinf=PRIOR_LIMIT, neginf=-PRIOR_LIMIT).clamp(-PRIOR_LIMIT, PRIOR_LIMIT)


def kernel_prior_tables(theta_alpha, theta_beta, theta_mu, table_len, formula, eps, with_derivatives) -> torch.Tensor:
    """(1 or 4, H, table_len) float32: prior b(t) at distance j - p_i = -t, then d b / d theta_{alpha, beta, mu}.

    The derivatives are forward-mode AD of `ggd_bias`, so they follow whatever formula the reference implements.
    """
    params = tuple(p.detach().float() for p in (theta_alpha, theta_beta, theta_mu))
    distance = -torch.arange(table_len, device=params[0].device, dtype=torch.float32)  # (T,)

    def prior(alpha, beta, mu):
        return ggd_bias(distance, alpha, beta, mu, formula, eps)  # (H, T)

    tables = [prior(*params)]
    if with_derivatives:
        for which in range(3):
            tangents = tuple(torch.ones_like(p) if i == which else torch.zeros_like(p) for i, p in enumerate(params))
            tables.append(torch.func.jvp(prior, params, tangents)[1])
    return _clamped_to_prior_limit(torch.stack(tables)).contiguous()
