"""Gradient checkpointing gives the gradients of a run without it, on every path users take.

Reentrant checkpointing (`use_reentrant=True`, what many PEFT / QLoRA recipes pass) replays each layer in the
backward pass and backpropagates from its outputs to its inputs; a tensor with a graph that a layer reads without
receiving it as an input (the global prior's table, shared by all layers) is backpropagated once per layer, which
fails on the second. The matrix below covers what changes that graph: global / per-layer prior, prior trained /
frozen, SSMax on / off (its scale is another trained per-layer input), both attention implementations, and LoRA.
"""

import pytest
import torch
from helpers import tiny_model

LAYERS = 3  # the shared table is read by more than one checkpointed layer


def enable_checkpointing(model, use_reentrant: bool) -> None:
    """`activation_checkpointing_enable` (Transformers >= 5.24) or `gradient_checkpointing_enable` (earlier); both
    take the kwargs for `torch.utils.checkpoint.checkpoint` first."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": use_reentrant})


def padded_batch() -> dict[str, torch.Tensor]:
    """Two rows, the second left-padded by 3: padded keys must stay out of every gradient."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 97, (2, 14), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def trained_gradients(model) -> dict[str, torch.Tensor]:
    model.train()
    model(**padded_batch()).loss.backward()
    return {name: parameter.grad for name, parameter in model.named_parameters() if parameter.requires_grad}


def assert_same_gradients(checkpointed: dict, plain: dict) -> None:
    assert checkpointed.keys() == plain.keys()
    for name, gradient in plain.items():
        assert gradient is not None and gradient.abs().sum() > 0, f"{name}: no gradient without checkpointing"
        assert checkpointed[name] is not None, f"{name}: no gradient with checkpointing"
        torch.testing.assert_close(checkpointed[name], gradient, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("ssmax", [False, True], ids=["no_ssmax", "ssmax"])
@pytest.mark.parametrize("prior_trained", [True, False], ids=["trained_prior", "frozen_prior"])
@pytest.mark.parametrize("prior_scope", ["global", "layer"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpointed_gradients_equal_plain_gradients(use_reentrant, prior_scope, prior_trained, ssmax, implementation):
    config = dict(
        num_hidden_layers=LAYERS, prior_scope=prior_scope, ssmax=ssmax,
        train_theta_alpha=prior_trained, train_theta_beta=prior_trained,
    )
    plain = trained_gradients(tiny_model(implementation, **config))
    model = tiny_model(implementation, **config)
    enable_checkpointing(model, use_reentrant)
    checkpointed = trained_gradients(model)
    assert any("theta_alpha" in name for name in plain) == prior_trained
    assert_same_gradients(checkpointed, plain)


@pytest.mark.parametrize("prior_scope", ["global", "layer"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpointed_lora_gradients_equal_plain_gradients(use_reentrant, prior_scope):
    """LoRA via PEFT with the prior and SSMax in `modules_to_save`: only adapters and prior copies train, so under
    reentrant checkpointing the gradient reaches them only through the inputs Transformers makes require grad."""
    from peft import LoraConfig, get_peft_model

    def lora_model():
        model = tiny_model("sdpa", num_hidden_layers=LAYERS, prior_scope=prior_scope, ssmax=True)
        torch.manual_seed(2)
        peft_model = get_peft_model(model, LoraConfig(
            r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["prior", "ssmax"], task_type="CAUSAL_LM",
            init_lora_weights=False,  # random B: the adapters' A matrices get non-zero gradients
        ))
        peft_model.get_base_model().apply_prior_trainability()
        return peft_model

    plain = trained_gradients(lora_model())
    model = lora_model()
    enable_checkpointing(model, use_reentrant)
    checkpointed = trained_gradients(model)
    assert any("lora_A" in name for name in plain) and any("theta_beta" in name for name in plain)
    assert not any("embed_tokens" in name or "original_module" in name for name in plain)
    assert_same_gradients(checkpointed, plain)
