"""The table of positional variants (bam_llama/positional_variants.py): each name builds, on a tiny config, the
attention its name says, and each prior initialisation starts where its name says. The expectations are written
here, one per variant: a new variant needs its own."""

import pytest
import torch
from transformers import LlamaForCausalLM, MistralForCausalLM

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
from bam_llama.baselines.ssmax_models import LlamaSsmaxForCausalLM, MistralSsmaxForCausalLM
from bam_llama.positional_models import variant_config, variant_model
from bam_llama.positional_variants import POSITIONAL_VARIANTS, PRIOR_INITS

HEADS = 4
TRAIN_LENGTH = 16
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS)
DISTANCES = torch.arange(-40, 1, dtype=torch.float64)  # key minus query, beyond the training length too
ALIBI_SLOPES = torch.tensor([2.0 ** (-8.0 * k / HEADS) for k in range(1, HEADS + 1)], dtype=torch.float64)  # Press et al.

# name -> (model class, label, what its prior is: "learned uniform", "fixed alibi", "fixed flat", or None: no prior)
EXPECTED = {
    "bam": (BamLlamaForCausalLM, "BAM (GGD prior)", "learned uniform"),
    "alibi": (BamLlamaForCausalLM, "ALiBi", "fixed alibi"),
    "nope": (BamLlamaForCausalLM, "NoPE", "fixed flat"),
    "kerple": (BamLlamaForCausalLM, "KERPLE (log)", "learned kerple"),
    "t5": (BamLlamaForCausalLM, "T5 buckets", "learned t5"),
    "rope": (LlamaForCausalLM, "RoPE (Llama)", None),
    "rope-local": (MistralForCausalLM, "RoPE local", None),
    "sinusoidal": (BamLlamaForCausalLM, "Sinusoidal", "fixed flat"),  # position from its embedding (below)
}


def build(name: str):
    torch.manual_seed(0)
    return variant_model(variant_config(name, TRAIN_LENGTH, **SIZES))


def prior_bias(prior) -> torch.Tensor:
    """(H, distances) bias of the model's prior, by the GGD formula: -exp(theta_alpha) * (|d - mu| + eps)^theta_beta."""
    alpha, beta, mu = (getattr(prior, name).detach().double()[:, None] for name in ("theta_alpha", "theta_beta", "theta_mu"))
    offset = torch.exp(mu) - torch.exp(-mu)
    return -torch.exp(alpha) * ((DISTANCES - offset).abs() + 1e-5) ** beta


def trained_prior_parameters(model) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, parameter in model.named_parameters() if "prior" in name and parameter.requires_grad}


def test_every_variant_has_its_expectation_here():
    assert list(POSITIONAL_VARIANTS) == list(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_variant_builds_the_attention_its_name_says(name):
    model_class, label, prior = EXPECTED[name]
    model = build(name)
    assert type(model) is model_class
    assert POSITIONAL_VARIANTS[name].label == label
    assert model.config.train_context_length == TRAIN_LENGTH
    if prior is None:  # Transformers' rotary model: no prior anywhere, RoPE in every layer
        assert not [module_name for module_name, _ in model.named_modules() if "prior" in module_name]
        assert hasattr(model.model, "rotary_emb")
        assert getattr(model.config, "sliding_window", None) == (TRAIN_LENGTH if name == "rope-local" else None)
        return
    assert not hasattr(model.model, "rotary_emb")
    if prior == "learned t5":  # T5's 32 buckets to 128 tokens, each bias 0 at the start (every distance alike), trained
        assert (model.config.prior_formula, model.config.t5_num_buckets, model.config.t5_max_distance) == (
            "t5_buckets", 32, 128)
        assert torch.equal(model.model.prior.bucket_bias, torch.zeros(HEADS, 32))
        assert trained_prior_parameters(model) == {"bucket_bias"}
        return
    bias = prior_bias(model.model.prior)
    if prior == "learned kerple":  # -ln(1 + |d|) at the start, computed by the model's own prior; both trained
        positions = torch.tensor([40])
        model_bias = model.model.prior.bias(positions, 41)[0, :, 0].double()
        torch.testing.assert_close(model_bias, -torch.log1p(DISTANCES.abs()).expand(HEADS, -1), atol=1e-5, rtol=1e-6)
        assert trained_prior_parameters(model) == {"theta_alpha", "theta_beta"}
    elif prior == "learned uniform":  # the paper's init: bias -1 at every distance, alpha and beta trained
        torch.testing.assert_close(bias, torch.full_like(bias, -1.0))
        assert trained_prior_parameters(model) == {"theta_alpha", "theta_beta"}
    elif prior == "fixed alibi":  # -slope_h * |d|, nothing of the prior trained
        assert torch.equal(model.model.prior.theta_beta, torch.ones(HEADS))
        torch.testing.assert_close(bias, -ALIBI_SLOPES[:, None] * DISTANCES.abs(), atol=1e-5, rtol=1e-6)
        assert trained_prior_parameters(model) == set()
    else:  # flat and fixed: the same bias at every distance, so no position at all
        torch.testing.assert_close(bias, bias[:, :1].expand_as(bias), atol=0, rtol=0)
        assert trained_prior_parameters(model) == set()


def test_a_prior_carries_position_only_where_it_can_tell_distances_apart():
    carries = {name for name, variant in POSITIONAL_VARIANTS.items() if variant.prior_carries_position}
    assert carries == {"bam", "alibi", "kerple", "t5"}


@pytest.mark.parametrize("init", ["uniform", "alibi"])
def test_each_prior_initialisation_starts_where_its_name_says_and_trains(init):
    """`bam-convert llama --prior`: the prior a converted Llama starts fine-tuning from."""
    assert list(PRIOR_INITS) == ["uniform", "alibi"]
    model = BamLlamaForCausalLM(BamLlamaConfig(**SIZES, **PRIOR_INITS[init].config))
    bias = prior_bias(model.model.prior)
    expected = torch.full_like(bias, -1.0) if init == "uniform" else -ALIBI_SLOPES[:, None] * DISTANCES.abs()
    torch.testing.assert_close(bias, expected, atol=1e-5, rtol=1e-6)
    assert trained_prior_parameters(model) == {"theta_alpha", "theta_beta"}


@pytest.mark.parametrize("ssmax", [False, True])
def test_sinusoidal_alone_adds_the_absolute_position_embedding_with_or_without_ssmax(ssmax):
    """`bam-pretrain --positional sinusoidal [--ssmax]`: the flat fixed prior of `nope` plus the embedding; no other
    BamLlama variant has one."""
    config = variant_config("sinusoidal", TRAIN_LENGTH, ssmax=ssmax, **SIZES)
    assert config.absolute_positions == "sinusoidal" and config.ssmax is ssmax
    others = [name for name, variant in POSITIONAL_VARIANTS.items() if variant.is_bam_llama and name != "sinusoidal"]
    assert all(variant_config(name, TRAIN_LENGTH, **SIZES).absolute_positions is None for name in others)


# name -> the model class `bam-pretrain --ssmax` trains (BamLlama: its config's `ssmax`)
EXPECTED_WITH_SSMAX = {"rope": LlamaSsmaxForCausalLM, "rope-local": MistralSsmaxForCausalLM}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_variant_with_scalable_softmax_adds_a_scale_per_head_to_every_layer(name):
    model = variant_model(variant_config(name, TRAIN_LENGTH, ssmax=True, **SIZES))
    assert type(model) is EXPECTED_WITH_SSMAX.get(name, BamLlamaForCausalLM)
    assert POSITIONAL_VARIANTS[name].takes_ssmax
    for layer in model.model.layers:
        assert torch.equal(layer.self_attn.ssmax.scale.detach(), torch.ones(HEADS)) and layer.self_attn.ssmax.scale.requires_grad
    if name in EXPECTED_WITH_SSMAX:  # the same Transformers model as without, RoPE and the window included
        plain = build(name)
        assert {key for key in model.state_dict() if ".ssmax." not in key} == set(plain.state_dict())
        assert getattr(model.config, "sliding_window", None) == getattr(plain.config, "sliding_window", None)
        assert model.config.train_context_length == TRAIN_LENGTH
