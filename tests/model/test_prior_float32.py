"""The prior's and SSMax's per-head tensors stay float32 in a 16-bit model, as Transformers' keep-in-fp32 convention
keeps such parameters (Llama rebuilds its RoPE frequencies in float32): under `from_pretrained(..., dtype=...)` loads
and `model.to(dtype)` / `.half()` / `.bfloat16()` casts, exactly the saved values, while every other weight is
16-bit. Over a long context, a bf16 BamLlama's logits are no further from its float32 logits than a same-size
Llama's bf16 logits are from its own."""

import re

import pytest
import torch
from helpers import tiny_config, tiny_llama, tiny_model
from transformers import AutoModelForCausalLM

from bam_llama import (
    BamLlamaForCausalLM, BamLlamaForQuestionAnswering, BamLlamaForSequenceClassification,
    BamLlamaForTokenClassification, BamLlamaModel,
)

LONG = 2048  # tokens: the tiny Llama's max_position_embeddings
# A bf16 BamLlama's logit error (mean over positions of the per-position max abs error against float32) may exceed
# the same-size Llama's by this factor. Measured at 2048 tokens: BamLlama 0.00156 (eager and sdpa), Llama 0.00146.
ERROR_MARGIN = 1.5


MODEL_CLASSES = [BamLlamaModel, BamLlamaForCausalLM, BamLlamaForSequenceClassification,
                 BamLlamaForTokenClassification, BamLlamaForQuestionAnswering]


def prior_tensors(model) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in model.state_dict().items() if ".prior." in name or ".ssmax." in name}


def names_a_module(module_name: str, state_dict_names) -> bool:
    """Transformers' own check (test_keep_in_fp32_modules_exist): the name is a whole dotted part of some key."""
    return any(re.search(rf"(?:^|\.){module_name}(?:\.|$)", name) for name in state_dict_names)


@pytest.mark.parametrize("model_class", MODEL_CLASSES, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("prior_scope", ["global", "layer"])
@pytest.mark.parametrize("ssmax", [False, True], ids=["plain", "ssmax"])
def test_keep_in_float32_names_exactly_the_modules_the_model_has(model_class, prior_scope, ssmax):
    model = model_class(tiny_config(ssmax=ssmax, prior_scope=prior_scope))
    keys = model.state_dict().keys()
    listed = set(model._keep_in_fp32_modules_strict) | set(model._keep_in_fp32_modules or ())
    assert [name for name in listed if not names_a_module(name, keys)] == []
    expected = {"prior", "ssmax"} if ssmax else {"prior"}
    assert set(model._keep_in_fp32_modules_strict) == expected
    # and every prior or SSMax tensor is covered by one of the names
    kept = [key for key in keys if {"prior", "ssmax"} & set(key.split(".")[:-1])]
    layers = model.config.num_hidden_layers  # theta_alpha, _beta, _mu once or per layer; an SSMax scale per layer
    assert len(kept) == (3 if prior_scope == "global" else 3 * layers) + (layers if ssmax else 0)
    assert all(any(names_a_module(name, [key]) for name in listed) for key in kept)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("prior_scope", ["global", "layer"])
@pytest.mark.parametrize("ssmax", [False, True], ids=["plain", "ssmax"])
def test_a_16_bit_load_keeps_the_prior_and_ssmax_in_float32(dtype, prior_scope, ssmax, tmp_path):
    model = tiny_model("sdpa", ssmax=ssmax, prior_scope=prior_scope)
    saved = prior_tensors(model)
    assert any(name.endswith("theta_mu") for name in saved)  # a frozen one (a buffer) too
    assert any(".ssmax." in name for name in saved) == ssmax
    model.save_pretrained(tmp_path)
    for loader in (BamLlamaForCausalLM, AutoModelForCausalLM):
        loaded = loader.from_pretrained(tmp_path, dtype=dtype)
        assert loaded.model.embed_tokens.weight.dtype == dtype and loaded.lm_head.weight.dtype == dtype
        kept = prior_tensors(loaded)
        assert kept.keys() == saved.keys()
        for name, value in kept.items():
            assert value.dtype == torch.float32 and torch.equal(value, saved[name]), name
        assert loaded(torch.randint(3, 97, (1, 20))).logits.dtype == dtype


@pytest.mark.parametrize("cast", ["to", "half", "bfloat16"])
def test_casting_the_model_keeps_the_prior_and_ssmax_in_float32(cast):
    model = tiny_model("sdpa", ssmax=True, prior_scope="layer")
    saved = {name: value.clone() for name, value in prior_tensors(model).items()}
    dtype = torch.float16 if cast == "half" else torch.bfloat16
    cast_model = model.to(dtype) if cast == "to" else getattr(model, cast)()
    assert cast_model.lm_head.weight.dtype == dtype
    for name, value in prior_tensors(cast_model).items():
        assert value.dtype == torch.float32 and torch.equal(value, saved[name]), name
    assert all(p.dtype == torch.float32 for p in cast_model.to(torch.float32).parameters())


def logit_error_16_bit(model, tmp_path, input_ids) -> float:
    """Mean over positions of the largest absolute logit difference between the bf16 load and the float32 model."""
    model.save_pretrained(tmp_path)
    low = type(model).from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        reference = model(input_ids, use_cache=False).logits
        logits = low(input_ids, use_cache=False).logits.float()
    return (logits - reference).abs().amax(-1).mean().item()


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_long_context_bf16_logits_are_no_further_from_float32_than_llamas(attention, tmp_path):
    input_ids = torch.randint(3, 97, (1, LONG), generator=torch.Generator().manual_seed(5))
    llama = logit_error_16_bit(tiny_llama("sdpa"), tmp_path / "llama", input_ids)
    bam = logit_error_16_bit(tiny_model(attention, ssmax=True), tmp_path / "bam", input_ids)
    assert bam <= ERROR_MARGIN * llama, f"BamLlama bf16 error {bam:.4f}, Llama's {llama:.4f}"
