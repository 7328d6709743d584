"""Transformers' quantized KV cache (`cache_implementation="quantized"`, the `fp8` backend: keys and values rounded to
float8 with one scale per tensor, frozen at the prompt) moves a BamLlama's decoding logits further than a same-size
Llama's on random models, and why: the rounding of the cached values is what moves them (the keys', which SSMax's
factor scales, adds little), and a head whose prior concentrates it on a few keys averages fewer rounded values than
the near-uniform heads of a random Llama. With the prior flattened, SSMax on, BamLlama moves as Llama does.

The rounding is also written here (`RoundedCache`: a `DynamicCache` that returns keys, values or both through
float8 with the prompt's scale), so that keys and values can be rounded apart; it is checked against Transformers'
own cache first."""

import pytest
import torch
from helpers import tiny_llama, tiny_model
from transformers import cache_utils
from transformers.cache_utils import DynamicCache

if not hasattr(cache_utils, "Fp8QuantizedLayer"):
    pytest.skip("this Transformers has no fp8 backend for QuantizedCache", allow_module_level=True)

PROMPT, STEPS = 64, 8
SEEDS = (0, 1, 2)
FLOAT8_MAX = 448.0  # largest finite float8_e4m3fn


def rounded(tensor: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return ((tensor.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(tensor.dtype)


class RoundedCache(DynamicCache):
    """Keeps exact states; after the prompt returns keys and/or values rounded to float8 with the prompt's scale."""

    def __init__(self, config, keys: bool, values: bool):
        super().__init__(config=config)
        self.rounds = (keys, values)
        self.scales = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        prompt = layer_idx not in self.scales
        if prompt:
            self.scales[layer_idx] = [states.abs().amax().float() / FLOAT8_MAX for states in (key_states, value_states)]
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if prompt:  # the prompt's own step attends to its exact states, as Transformers' layer does
            return keys, values
        key_scale, value_scale = self.scales[layer_idx]
        return (rounded(keys, key_scale) if self.rounds[0] else keys,
                rounded(values, value_scale) if self.rounds[1] else values)


def input_ids() -> torch.Tensor:
    return torch.randint(3, 97, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(1))


def step_logits(model, cache) -> torch.Tensor:
    """(STEPS, vocab) logits of each decoding step after the prompt, teacher-forced, through `cache`."""
    ids = input_ids()
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)
        return torch.cat([model(ids[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1]
                          for t in range(PROMPT, PROMPT + STEPS)])


def step_error(model, keys: bool = True, values: bool = True) -> float:
    """Mean over steps of the largest logit difference between a rounded cache and the exact one."""
    exact = step_logits(model, DynamicCache(config=model.config))
    return (step_logits(model, RoundedCache(model.config, keys, values)) - exact).abs().amax(-1).mean().item()


def concentration(model) -> float:
    """Mean over steps, layers and heads of sqrt(sum_j p_j^2) of a step's attention: 1/sqrt(n) for a uniform head
    over n keys, 1 for a head on one key; the spread of a weighted mean of n independent rounding errors."""
    ids = input_ids()
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    spreads = []
    with torch.no_grad():
        model(ids[:, :PROMPT], cache=cache, use_cache=True)
        for t in range(PROMPT, PROMPT + STEPS):
            attentions = model(ids[:, t:t + 1], cache=cache, use_cache=True, output_attentions=True).attentions
            spreads += [layer[0, :, -1].pow(2).sum(-1).sqrt() for layer in attentions]
    return torch.stack(spreads).mean().item()


def flat_prior(model):
    with torch.no_grad():
        model.model.prior.theta_alpha.fill_(-40.0)  # exp(alpha) * |d|^beta ~ 0 at every distance
    return model


@pytest.mark.parametrize("ssmax", [False, True], ids=["plain", "ssmax"])
def test_the_rounded_cache_here_is_transformers_fp8_cache(ssmax):
    model = tiny_model("eager", ssmax=ssmax)
    ours = step_logits(model, RoundedCache(model.config, keys=True, values=True))
    theirs = step_logits(model, cache_utils.QuantizedCache("fp8", model.config))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert (ours - step_logits(model, DynamicCache(config=model.config))).abs().amax() > 1e-4  # it rounds


@pytest.mark.parametrize("seed", SEEDS)
def test_the_values_rounding_moves_the_logits_not_the_keys_that_ssmax_scales(seed):
    model = tiny_model("eager", seed=seed, ssmax=True)
    keys_only, values_only = step_error(model, values=False), step_error(model, keys=False)
    assert keys_only < 0.05 * values_only, f"keys {keys_only:.2e}, values {values_only:.2e}"


@pytest.mark.parametrize("seed", SEEDS)
def test_with_a_flat_prior_bam_llama_moves_as_llama_does(seed):
    llama = step_error(tiny_llama("sdpa", seed=seed))
    bam = step_error(flat_prior(tiny_model("eager", seed=seed, ssmax=True)))
    assert 1 / 1.5 < bam / llama < 1.5, f"BamLlama {bam:.2e}, Llama {llama:.2e}"


@pytest.mark.parametrize("ssmax", [False, True], ids=["plain", "ssmax"])
@pytest.mark.parametrize("seed", SEEDS)
def test_the_difference_follows_how_concentrated_the_heads_are(seed, ssmax):
    """BamLlama's error over Llama's is the ratio of their heads' concentration, within a factor of 2 (measured
    0.7-1.6 over these seeds); the concentration itself is more than Llama's."""
    llama, bam = tiny_llama("eager", seed=seed), tiny_model("eager", seed=seed, ssmax=ssmax)
    error_ratio = step_error(bam) / step_error(llama)
    concentration_ratio = concentration(bam) / concentration(llama)
    assert concentration_ratio > 1.5
    assert 0.5 < error_ratio / concentration_ratio < 2.0, f"error {error_ratio:.2f}x, concentration {concentration_ratio:.2f}x"


def test_greedy_generation_with_the_fp8_cache_gives_the_same_tokens():
    model = tiny_model("sdpa", ssmax=True)
    prompt = input_ids()[:, :PROMPT]
    settings = dict(max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    exact = model.generate(prompt, **settings)
    quantized = model.generate(prompt, cache_implementation="quantized", cache_config={"backend": "fp8"}, **settings)
    assert torch.equal(quantized, exact)
