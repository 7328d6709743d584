"""BamLlamaConfig refuses bad fields at construction, with a ValueError naming the field."""

import math

import pytest
import torch
from helpers import tiny_config, tiny_model


@pytest.mark.parametrize(
    "field, value",
    [
        ("theta_alpha_init", math.nan),
        ("theta_beta_init", math.nan),
        ("theta_mu_init", math.nan),
        ("theta_alpha_init", math.inf),
        ("theta_beta_init", -math.inf),
        ("ssmax_scale_init", math.nan),
        ("ssmax_scale_init", math.inf),
        ("ssmax_scale_init", "large"),
        ("ssmax_scale_init", None),
        ("head_dim", 0),
        ("head_dim", -8),
        ("head_dim", 8.0),
        ("hidden_act", "swishy"),
        ("hidden_act", None),
        ("train_context_length", "512"),
        ("train_context_length", 0),
        ("prior_eps", math.inf),
    ],
)
def test_bad_field_is_named(field, value):
    with pytest.raises(ValueError, match=field):
        tiny_config(**{field: value})


@pytest.mark.parametrize("ssmax", [False, True])
@pytest.mark.parametrize("max_positions", [None, 1 << 22])
def test_theta_alpha_init_is_bounded_where_the_prior_would_overflow_float32(ssmax, max_positions):
    # Uniform prior (beta 0): |b| = exp(theta_alpha); with SSMax (scale 1) times ln(n), n up to the longest length
    # the model may see: 2^20 tokens (generation runs past max_position_embeddings), or max_position_embeddings
    # when longer.
    longest = max(1 << 20, max_positions or 0)
    log_float32_max = math.log(torch.finfo(torch.float32).max)
    bound = log_float32_max - (math.log(math.log(longest)) if ssmax else 0.0)
    tiny_config(theta_alpha_init=bound - 0.01, ssmax=ssmax, max_position_embeddings=max_positions)
    with pytest.raises(ValueError, match=rf"theta_alpha_init.*overflow float32.*below {bound:.2f}"):
        tiny_config(theta_alpha_init=bound + 0.01, ssmax=ssmax, max_position_embeddings=max_positions)


def test_a_negative_beta_lowers_the_bound_by_its_term_at_distance_zero():
    # b(0) = -exp(alpha) * eps ** beta: with beta = -2 and eps = 1e-5, exp(alpha) may be at most float32 max / 1e10.
    bound = math.log(torch.finfo(torch.float32).max) - (-2) * math.log(1e-5)
    tiny_config(theta_beta_init=-2.0, theta_alpha_init=bound - 0.05)
    with pytest.raises(ValueError, match="theta_alpha_init"):
        tiny_config(theta_beta_init=-2.0, theta_alpha_init=bound + 0.05)


def test_the_largest_accepted_theta_alpha_init_gives_finite_logits():
    bound = math.log(torch.finfo(torch.float32).max)
    model = tiny_model(theta_alpha_init=bound - 0.05)
    with torch.no_grad():
        for layer_prior in [model.model.prior]:
            layer_prior.theta_alpha.fill_(bound - 0.05)
            layer_prior.theta_beta.zero_()
            layer_prior.theta_mu.zero_()
        logits = model(torch.arange(12).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()
