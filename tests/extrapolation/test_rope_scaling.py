"""RoPE's scaling at evaluation stretches the training length to the prompt's length: dynamic NTK raises the base to
theta * s ** (d / (d - 2)) with s = prompt length / training length (NTK-aware scaling), and leaves prompts within the
training length unscaled; YaRN is set for s with the training length as its original length."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bam_llama.extrapolation.evaluation import load

TRAIN_LENGTH = 16
HEAD_DIM = 8
THETA = 10000.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=TRAIN_LENGTH,
                         rope_parameters={"rope_type": "default", "rope_theta": THETA})
    path = tmp_path_factory.mktemp("rope")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def inverse_frequencies(base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)


def inv_freq_after_a_prompt(folder, rope_scaling: str, length: int) -> torch.Tensor:
    model = load(folder, rope_scaling, length, TRAIN_LENGTH)
    with torch.no_grad():
        model(torch.zeros(1, length, dtype=torch.long))
    return model.model.rotary_emb.inv_freq.double()


@pytest.mark.parametrize("scale", [4, 64])
def test_dynamic_ntk_stretches_the_base_by_the_prompts_own_scale(folder, scale):
    expected = inverse_frequencies(THETA * scale ** (HEAD_DIM / (HEAD_DIM - 2)))
    got = inv_freq_after_a_prompt(folder, "dynamic", TRAIN_LENGTH * scale)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_dynamic_ntk_leaves_a_prompt_within_the_training_length_unscaled(folder):
    torch.testing.assert_close(inv_freq_after_a_prompt(folder, "dynamic", TRAIN_LENGTH), inverse_frequencies(THETA),
                               rtol=1e-6, atol=0)


def test_yarn_is_set_for_the_prompts_scale_over_the_training_length(folder):
    scale = 8
    model = load(folder, "yarn", TRAIN_LENGTH * scale, TRAIN_LENGTH)
    parameters = model.config.rope_parameters
    assert parameters["rope_type"] == "yarn" and parameters["factor"] == scale
    assert parameters["original_max_position_embeddings"] == TRAIN_LENGTH
    assert model.model.rotary_emb.attention_scaling == pytest.approx(0.1 * math.log(scale) + 1.0)
    # the highest frequency is left as it was, the lowest divided by the scale (YaRN's ramp between them)
    inv_freq = model.model.rotary_emb.inv_freq.double()
    torch.testing.assert_close(inv_freq[0], inverse_frequencies(THETA)[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(inv_freq[-1], inverse_frequencies(THETA)[-1] / scale, rtol=1e-6, atol=0)
