"""Accelerate's offload: a model whose modules (the prior and SSMax included) live on "disk" or in a CPU weights map
and are brought in by Accelerate's hooks gives the logits and greedy tokens of the same model in memory.

On this CPU-only machine the execution device is the CPU: `from_pretrained(device_map=...)` with "disk" entries and
an offload folder, `device_map="auto"` under a `max_memory` budget (the rest goes to disk), and Accelerate's
`cpu_offload`, which hooks every module with weights and keeps those weights in a CPU map, the path a GPU machine
takes with `"cpu"` entries.
"""

import pytest
import torch
from accelerate import cpu_offload
from helpers import tiny_model

from bam_llama import BamLlamaForCausalLM

PROMPT = torch.tensor([[5, 17, 33, 8, 71, 2, 64, 90, 12]])
NEW_TOKENS = 6


def saved_model(folder, implementation: str, **overrides):
    model = tiny_model(implementation, ssmax=True, **overrides)
    model.save_pretrained(folder)
    return model


def assert_same_outputs(offloaded, model):
    with torch.no_grad():
        torch.testing.assert_close(offloaded(PROMPT).logits, model(PROMPT).logits, atol=1e-6, rtol=1e-6)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(offloaded.generate(PROMPT, **settings), model.generate(PROMPT, **settings))


def layer_by_module(layer: int, device: str, ssmax_device: str) -> dict[str, str]:
    """A decoder layer mapped module by module, its SSMax on `ssmax_device`."""
    prefix = f"model.layers.{layer}"
    modules = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp",
               "input_layernorm", "post_attention_layernorm"]
    return {**{f"{prefix}.{name}": device for name in modules}, f"{prefix}.self_attn.ssmax": ssmax_device}


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_prior_ssmax_and_layers_on_disk(tmp_path, implementation):
    model = saved_model(tmp_path / "model", implementation)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.prior": "disk",
        "model.layers.0": "disk",
        **layer_by_module(1, "cpu", ssmax_device="disk"),
        "model.norm": "cpu",
        "lm_head": "disk",
    }
    offloaded = BamLlamaForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload", attn_implementation=implementation
    )
    assert offloaded.model.prior.theta_alpha.device.type == "meta"  # on disk until its own call brings it in
    assert offloaded.model.layers[1].self_attn.ssmax.scale.device.type == "meta"
    assert_same_outputs(offloaded, model)


def test_layer_priors_on_disk(tmp_path):
    model = saved_model(tmp_path / "model", "sdpa", prior_scope="layer")
    device_map = {
        "model.embed_tokens": "cpu",
        **layer_by_module(0, "cpu", ssmax_device="disk"),
        "model.layers.0.self_attn.prior": "disk",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    offloaded = BamLlamaForCausalLM.from_pretrained(
        tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "offload", attn_implementation="sdpa"
    )
    assert offloaded.model.layers[0].self_attn.prior.theta_beta.device.type == "meta"
    assert_same_outputs(offloaded, model)


def test_device_map_auto_under_a_memory_budget(tmp_path):
    """The issue's case: what does not fit the CPU budget, the global prior among it, goes to disk."""
    model = saved_model(tmp_path / "model", "sdpa")
    size = lambda module: sum(parameter.numel() * 4 for parameter in module.parameters())  # noqa: E731
    budget = size(model.model.embed_tokens) + size(model.model.layers[0]) + 4096  # Accelerate keeps a layer's room
    offloaded = BamLlamaForCausalLM.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": budget}, offload_folder=tmp_path / "offload",
    )
    assert offloaded.hf_device_map["model.embed_tokens"] == "cpu" and offloaded.hf_device_map["model.prior"] == "disk"
    assert_same_outputs(offloaded, model)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_accelerate_cpu_offload_hooks_every_module(implementation):
    model = tiny_model(implementation, ssmax=True)
    offloaded = tiny_model(implementation, ssmax=True)  # the same weights (same seed), hooked below
    cpu_offload(offloaded, execution_device=torch.device("cpu"))
    assert offloaded.model.prior.theta_alpha.device.type == "meta"
    assert offloaded.model.layers[0].self_attn.ssmax.scale.device.type == "meta"
    assert_same_outputs(offloaded, model)
