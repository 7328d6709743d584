"""GGD-BAM's positional terms, in plain PyTorch: the Generalized-Gaussian prior and the baseline prior families beside
it (KERPLE's log kernel, T5's bucketed relative bias), ALiBi's slopes (an init scheme),
Scalable Softmax, and what they read from positions: distances, visibility and visible-key counts.

Shapes: B batch, H query heads, Lq queries, Lk keys. Positions are absolute token positions in the sequence (cache
included): query i sits at `query_positions[i]`, key j at `j` (keys are stored in order from position 0).
"""

import contextlib
import math

import torch

# The parameters the model keeps per head, and the submodules holding them (`modules_to_save=["prior", "ssmax"]`).
THETA_PARAMETERS = ("theta_alpha", "theta_beta", "theta_mu")  # BamPrior of a formula of three scalars a head
BUCKET_BIAS = "bucket_bias"  # BamPrior of T5's buckets: (H, num_buckets)
PRIOR_PARAMETERS = (*THETA_PARAMETERS, BUCKET_BIAS)
SSMAX_PARAMETER = "scale"  # BamScalableSoftmax
PRIOR_MODULES = ("prior", "ssmax")

# The prior's formulas, by the names a config saves in `prior_formula` (saved folders hold them); d = j - i:
# -exp(theta_alpha) * (|d - mu| + eps) ** theta_beta, the scale exp(theta_alpha) outside the power
SCALE_OUTSIDE_POWER = "current"
# -(|(d - mu) * exp(theta_alpha)| + eps) ** theta_beta, the scale inside the power: the reference code before May 2025
SCALE_INSIDE_POWER = "legacy"
# -exp(theta_alpha) * ln(1 + exp(theta_beta) * |d - mu|): KERPLE's logarithmic kernel (Chi et al., 2022), its two
# positive parameters r1 = exp(theta_alpha), r2 = exp(theta_beta); a baseline prior family, not BAM's
KERPLE_LOG = "kerple_log"
THETA_FORMULAS = (SCALE_OUTSIDE_POWER, SCALE_INSIDE_POWER, KERPLE_LOG)  # of theta_alpha, theta_beta, theta_mu
# bucket_bias[h, bucket(i - j)]: T5's bucketed relative bias (Raffel et al., 2020; causal), a learned bias per head
# and bucket of distances, not a formula of the three parameters: a baseline prior family, not BAM's
T5_BUCKETS = "t5_buckets"
PRIOR_FORMULAS = (*THETA_FORMULAS, T5_BUCKETS)
T5_NUM_BUCKETS = 32  # T5's defaults
T5_MAX_DISTANCE = 128
REFERENCE_FORMULAS = (SCALE_OUTSIDE_POWER, SCALE_INSIDE_POWER)  # the ones reference GGD-BAM runs were trained with
# The largest |prior| of the GGD formulas: PRIOR_LIMIT = 2^100 ~ 1.3e30, a penalty no score overcomes
# (exp(-2^100) is 0 in any precision). Uncapped, a negative beta's term at distance 0, exp(theta_alpha) * eps **
# theta_beta, passes float32's 3.4e38 from theta_beta ~ -7.7 (retrieval heads train there), the SSMax factor sooner,
# and the loss turns NaN. Capped (`capped_power`: below the cap the plain formula, bit for bit), the prior and its
# gradients stay finite; a capped entry's gradient is 0, as the exact one is to float precision (its probability is
# 0, or it is its row's only key).
PRIOR_LIMIT = 2.0**100
LOG_PRIOR_LIMIT = math.log(PRIOR_LIMIT)


def is_prior_parameter(name: str) -> bool:
    """True for the qualified name of a prior or SSMax parameter (`model.prior.theta_alpha`,
    `model.layers.0.self_attn.ssmax.scale`, and PEFT's `...prior.modules_to_save.default.theta_beta`)."""
    parts = name.split(".")
    module = next((part for part in reversed(parts[:-1]) if part in PRIOR_MODULES), None)
    return (module == "prior" and parts[-1] in PRIOR_PARAMETERS) or is_ssmax_parameter(name)


def is_ssmax_parameter(name: str) -> bool:
    """True for the qualified name of a Scalable-Softmax scale (`model.layers.0.self_attn.ssmax.scale`, and PEFT's
    `...ssmax.modules_to_save.default.scale`)."""
    parts = name.split(".")
    module = next((part for part in reversed(parts[:-1]) if part in PRIOR_MODULES), None)
    return module == "ssmax" and parts[-1] == SSMAX_PARAMETER


def prior_offset(theta_mu: torch.Tensor) -> torch.Tensor:
    """mu = exp(theta_mu) - exp(-theta_mu) = 2 sinh(theta_mu)."""
    return torch.exp(theta_mu) - torch.exp(-theta_mu)


def capped_power(base: torch.Tensor, exponent: torch.Tensor, scale=1.0, log_scale=0.0) -> torch.Tensor:
    """-scale * base ** exponent, its magnitude capped at PRIOR_LIMIT: exactly the plain product below the
    cap; above it the cap, with zero gradients (the power is taken of 1 there, so that no inf meets a 0 in the
    backward)."""
    over = log_scale + exponent * torch.log(base) > LOG_PRIOR_LIMIT
    plain = -scale * torch.where(over, torch.ones_like(base), base).pow(exponent)
    return torch.where(over, torch.full_like(plain, -PRIOR_LIMIT), plain)


def ggd_bias(
    distance: torch.Tensor,
    theta_alpha: torch.Tensor,
    theta_beta: torch.Tensor,
    theta_mu: torch.Tensor,
    formula: str = SCALE_OUTSIDE_POWER,
    eps: float = 1e-5,
) -> torch.Tensor:
    """The prior for every head at the given key-minus-query distances: the GGD (formula "current" or "legacy"), or
    KERPLE's log kernel of the same three parameters ("kerple_log"; eps unused).

    Args:
        distance: (...) float, j - i (<= 0 for visible causal keys).
        theta_alpha, theta_beta, theta_mu: (H,) per-head parameters.
    Returns:
        (H, ...) float32 bias; the GGD's magnitude at most PRIOR_LIMIT.
    """
    view = (-1,) + (1,) * distance.dim()
    alpha = theta_alpha.float().view(view)
    beta = theta_beta.float().view(view)
    mu = prior_offset(theta_mu.float()).view(view)
    shifted = distance.float().unsqueeze(0) - mu
    if formula == SCALE_OUTSIDE_POWER:
        return capped_power(shifted.abs() + eps, beta, scale=torch.exp(alpha), log_scale=alpha)
    if formula == SCALE_INSIDE_POWER:
        return capped_power((shifted * torch.exp(alpha)).abs() + eps, beta)
    if formula == KERPLE_LOG:
        return -torch.exp(alpha) * torch.log1p(torch.exp(beta) * shifted.abs())
    if formula == T5_BUCKETS:
        raise ValueError(
            "prior formula 't5_buckets' is a table of bucket biases (bucket_bias), not a formula of theta_alpha, "
            "theta_beta and theta_mu: read it through prior_bam.distance_bias or prior_table"
        )
    raise ValueError(f"unknown prior formula {formula!r}; expected {' or '.join(map(repr, PRIOR_FORMULAS))}")


def t5_bucket(distance_back: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's causal bucket (int64) of distances n = i - j >= 0 back from the query (int64): n itself below
    exact = num_buckets // 2, then exact + floor(ln(n / exact) / ln(max_distance / exact) * (num_buckets - exact)),
    capped at num_buckets - 1. The logarithm is computed in float32, as T5 computes it."""
    exact = num_buckets // 2
    far = distance_back.clamp(min=exact).float()  # the log only where it is read: n >= exact
    scaled = torch.log(far / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    far_bucket = (exact + scaled.to(torch.int64)).clamp(max=num_buckets - 1)
    return torch.where(distance_back < exact, distance_back, far_bucket)


def t5_bias(distance: torch.Tensor, bucket_bias: torch.Tensor, max_distance: int) -> torch.Tensor:
    """(H, ...) float32 T5 bias at key-minus-query distances (...), float or int, j - i <= 0 for visible keys (a
    future key reads bucket 0, as in T5's causal attention): bucket_bias (H, num_buckets) gathered by bucket."""
    distance_back = (-distance).round().to(torch.int64).clamp(min=0)
    buckets = t5_bucket(distance_back, bucket_bias.shape[-1], max_distance)
    return bucket_bias.float()[:, buckets.flatten()].view(-1, *distance.shape)


def distance_bias(
    distance: torch.Tensor, parameters: tuple[torch.Tensor, ...], formula: str, eps: float,
    max_distance: int = T5_MAX_DISTANCE,
) -> torch.Tensor:
    """(H, ...) float32 prior of any family at key-minus-query distances (...): `parameters` are a prior module's
    (`BamPrior.forward`): (theta_alpha, theta_beta, theta_mu) of a formula of THETA_FORMULAS, or (bucket_bias,)
    of T5_BUCKETS, whose buckets reach `max_distance`."""
    if formula == T5_BUCKETS:
        (bucket_bias,) = parameters
        return t5_bias(distance, bucket_bias, max_distance)
    return ggd_bias(distance, *parameters, formula, eps)


def prior_table(
    length: int, parameters: tuple[torch.Tensor, ...], formula: str, eps: float, max_distance: int = T5_MAX_DISTANCE
) -> torch.Tensor:
    """(H, length) float32 prior at distances -(length - 1), ..., 0: row i of the bias of queries at positions
    <= length - 1 is a window of it (the prior depends on j - i only). `parameters`: see `distance_bias`."""
    distance = torch.arange(1 - length, 1, device=parameters[0].device, dtype=torch.float32)
    return distance_bias(distance, parameters, formula, eps, max_distance)


KEPT_TABLE_MIN = 1024  # the shortest table `KeptPriorTable` keeps: 4 KiB a head


class KeptPriorTable:
    """One prior's table kept across calls without gradients: a table to a power of two of at least KEPT_TABLE_MIN
    entries, whose last P + 1 entries are the (H, P + 1) table a query at position P needs (a view). It is used only
    while the parameters hold the values it was computed from (compared, not trusted to version counters or
    addresses, which ZeRO-3 or FSDP may reuse for new values), under the same formula, eps and inference mode (a
    table made under inference mode is an inference tensor); it costs H x 4 bytes a position kept."""

    def __init__(self):
        self._kept: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (setting, parameter values, table)

    def window(
        self, last_position: int, parameters: tuple[torch.Tensor, ...], formula: str, eps: float,
        max_distance: int = T5_MAX_DISTANCE,
    ) -> torch.Tensor:
        """(H, P + 1) float32, P = last_position; computed again only when the kept one does not hold it.
        `parameters`: see `distance_bias` (T5's whole bucket_bias table is compared)."""
        with torch.no_grad():
            values = torch.stack(parameters)  # (3, H), or (1, H, num_buckets)
            setting = (formula, eps, max_distance, values.device, torch.is_inference_mode_enabled())
            kept = self._kept
            stale = kept is None or kept[0] != setting or kept[2].shape[-1] <= last_position
            if stale or not torch.equal(kept[1], values):
                length = max(KEPT_TABLE_MIN, 1 << last_position.bit_length())  # > P: the next power of two
                table = prior_table(length, parameters, formula, eps, max_distance)
                kept = self._kept = (setting, values, table)
        table = kept[2]
        return table[:, table.shape[-1] - 1 - last_position :]


def relative_distance(query_positions: torch.Tensor, key_length: int) -> torch.Tensor:
    """(Lq, Lk) float32 distances j - i, from absolute query positions (Lq,) and keys at 0..Lk-1."""
    keys = torch.arange(key_length, device=query_positions.device, dtype=torch.float32)
    return keys[None, :] - query_positions.to(torch.float32)[:, None]


def visibility_from_positions(
    query_positions: torch.Tensor,
    key_length: int,
    key_valid: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean (B or 1, 1, Lq, Lk) mask: causal, minus padded keys, minus keys of other documents.

    Args:
        query_positions: (Lq,) int absolute positions.
        key_valid: (B, Lk) bool, False for padding.
        document_ids: (B, Lk) int document index of every key position (packed sequences). Queries take the
            document of the key slot at their own position.
    """
    keys = torch.arange(key_length, device=query_positions.device)
    visible = (keys[None, :] <= query_positions[:, None])[None, None]
    if key_valid is not None:
        visible = visible & key_valid[:, None, None, :].bool()
    if document_ids is not None:
        query_documents = document_ids[:, query_positions]
        visible = visible & (query_documents[:, None, :, None] == document_ids[:, None, None, :])
    return visible


def visible_key_counts(
    query_positions: torch.Tensor,
    key_length: int,
    key_valid: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B or 1, Lq) int64 number of keys each query sees, without materializing the mask.

    Equals `visibility_from_positions(...).sum(-1)` for contiguous documents.
    """
    device = query_positions.device
    if key_valid is None:
        key_valid = torch.ones(1 if document_ids is None else document_ids.shape[0], key_length, device=device)
    valid_count = key_valid.long().cumsum(-1)
    if document_ids is not None:
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        count_before = valid_count - key_valid.long()
        base = torch.where(starts, count_before, torch.zeros_like(count_before)).cummax(-1).values
        valid_count = valid_count - base
    return valid_count[:, query_positions.clamp(max=key_length - 1)] * (query_positions < key_length)


def ssmax_factor(counts: torch.Tensor, ssmax_scale: torch.Tensor) -> torch.Tensor:
    """Scalable-Softmax row factor c_i = s_h * ln(n_i): counts (B, Lq) -> (B, H, Lq, 1) float32.

    n_i = 0 (a row that sees nothing) is clamped to 1, so the factor is 0 there instead of -inf.
    """
    log_counts = counts.clamp(min=1).to(torch.float32).log()
    return ssmax_scale.float()[None, :, None, None] * log_counts[:, None, :, None]



def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes (Press et al.): 2^(-8k/n) for a power of two n, interleaved otherwise."""

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (k + 1) for k in range(n)]

    if math.log2(num_heads).is_integer():
        return torch.tensor(power_of_two_slopes(num_heads))
    closest = 2 ** math.floor(math.log2(num_heads))
    extra = power_of_two_slopes(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(power_of_two_slopes(closest) + extra)


def autocast_off(device: torch.device):
    """A region where autocast changes no dtype (`torch.autocast(..., enabled=False)` for the device): BAM's SDPA
    paths pick their compute dtype themselves (`attention_compute_dtype`), since under autocast SDPA and the
    matmuls would run, and the prior's float mask be rounded, in 16 bits. A no-op where autocast is off (so a
    traced graph holds no autocast region then)."""
    if not torch.amp.is_autocast_available(device.type) or not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def exporting() -> bool:
    """Whether `torch.export` is tracing (torch >= 2.6 tells; older releases never say so)."""
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return is_exporting is not None and is_exporting()


def attention_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit inputs: the prior needs float32's range and precision, and SDPA's float mask must
    have the query's dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
