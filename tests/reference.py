"""The suite's one float64 reference of GGD-BAM attention, written from the definition (nothing from bam_llama):

    b_h(i, j) = -e^alpha_h (|j - p_i - mu_h| + eps)^beta_h      ("current")
              = -(|(j - p_i - mu_h) e^alpha_h| + eps)^beta_h     ("legacy", the reference code before May 2025)
              = bucket_bias[h, bucket(p_i - j)]                  ("t5_buckets": T5's causal buckets, `t5_bucket`)
    mu_h      = e^theta_mu_h - e^-theta_mu_h
    n_i       = #{j : j <= p_i, key j not padding, same document as the key slot at p_i},   c_i = s_h ln max(n_i, 1)
    s_ij      = c_i (q_i.k_j scaling + b_ij)   (SSMax scaling the prior)
              | c_i q_i.k_j scaling + b_ij     (SSMax on q.k only)
              | q_i.k_j scaling + b_ij         (no SSMax);   softmax over the visible j, 0 for a row that sees none

Query i sits at absolute position p_i (`positions`), key j at j. Query head h reads key/value head h // group.
"""

import math

import torch


def prior(distance, theta_alpha, theta_beta, theta_mu, formula="current", eps=1e-5):
    """(H, *distance.shape) float64 prior at key-minus-query distances `distance`."""
    view = (-1,) + (1,) * distance.dim()
    alpha, beta = theta_alpha.double().view(view), theta_beta.double().view(view)
    mu = (torch.exp(theta_mu.double()) - torch.exp(-theta_mu.double())).view(view)
    shifted = distance.double()[None] - mu
    if formula == "current":
        return -torch.exp(alpha) * (shifted.abs() + eps) ** beta
    if formula == "legacy":
        return -((shifted * torch.exp(alpha)).abs() + eps) ** beta
    if formula == "kerple_log":  # KERPLE's log kernel: -r1 * ln(1 + r2 * |d - mu|), r1 = e^alpha, r2 = e^beta
        return -torch.exp(alpha) * torch.log(1 + torch.exp(beta) * shifted.abs())
    raise ValueError(f"unknown formula {formula!r}")


def t5_bucket(n: int, num_buckets: int = 32, max_distance: int = 128) -> int:
    """T5's causal bucket of a distance n = i - j >= 0 back (Raffel et al. 2020; Mesh TensorFlow's
    `_relative_position_bucket` with bidirectional=False), written from its definition in float64: n itself for the
    first half of the buckets, then logarithmically wider buckets up to max_distance, the last one for all beyond."""
    exact = num_buckets // 2
    if n < exact:
        return n
    wide = exact + math.floor(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return min(wide, num_buckets - 1)


def t5_prior(distance, bucket_bias, max_distance=128):
    """(H, *distance.shape) float64 T5 bias at key-minus-query distances (future keys, distance > 0: bucket 0)."""
    num_buckets = bucket_bias.shape[-1]
    buckets = [t5_bucket(max(-int(d), 0), num_buckets, max_distance) for d in distance.flatten().tolist()]
    index = torch.tensor(buckets, dtype=torch.long, device=bucket_bias.device)
    return bucket_bias.double()[:, index].view(-1, *distance.shape)


def visible(positions, key_length, key_valid=None, document_ids=None, batch=1):
    """(B, Lq, Lk) bool: causal, minus padded keys, minus keys of other documents than the query's slot."""
    keys = torch.arange(key_length, device=positions.device)
    mask = (keys[None, :] <= positions[:, None])[None].expand(batch, -1, -1)
    if key_valid is not None:
        mask = mask & key_valid.bool()[:, None, :]
    if document_ids is not None:
        mask = mask & (document_ids[:, positions][:, :, None] == document_ids[:, None, :])
    return mask


def bam_attention(
    query, key, value, positions, theta_alpha, theta_beta, theta_mu, *, scaling=None, formula="current", eps=1e-5,
    ssmax_scale=None, ssmax_prior=True, key_valid=None, document_ids=None, dropout=0.0, dropout_keep=None,
    return_probs=False, bucket_bias=None, t5_max_distance=128,
):
    """float64 attention: query (B, H, Lq, D), key / value (B, Hkv, Lk, D) -> (B, H, Lq, D) (and the probabilities
    (B, H, Lq, Lk) with `return_probs`). Parameters (H,) may require gradients. Inverted attention dropout takes its
    keep pattern, bool (B, H, Lq, Lk), from the caller (kept probabilities are divided by 1 - dropout). With
    formula "t5_buckets" the prior is `bucket_bias` (H, num_buckets) by `t5_bucket` (the thetas are not read)."""
    batch, heads, q_len, head_dim = query.shape
    key_length, group = key.shape[2], heads // key.shape[1]
    scaling = 1.0 / math.sqrt(head_dim) if scaling is None else scaling
    key = key.double().repeat_interleave(group, dim=1)
    value = value.double().repeat_interleave(group, dim=1)
    distance = torch.arange(key_length, device=positions.device)[None, :] - positions[:, None]  # (Lq, Lk)
    if formula == "t5_buckets":
        bias = t5_prior(distance, bucket_bias, t5_max_distance)[None]  # (1, H, Lq, Lk)
    else:
        bias = prior(distance, theta_alpha, theta_beta, theta_mu, formula, eps)[None]
    seen = visible(positions, key_length, key_valid, document_ids, batch)[:, None]  # (B, 1, Lq, Lk)

    logits = query.double() @ key.transpose(2, 3) * scaling
    if ssmax_scale is None:
        scores = logits + bias
    else:
        factor = ssmax_scale.double()[None, :, None, None] * seen.sum(-1, keepdim=True).clamp(min=1).double().log()
        scores = factor * (logits + bias) if ssmax_prior else factor * logits + bias
    has_keys = seen.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")).masked_fill(~has_keys, 0.0), -1) * has_keys
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - dropout)
    output = probs @ value
    return (output, probs) if return_probs else output
