"""`absolute_positions="sinusoidal"`: Vaswani et al.'s fixed embedding of each token's absolute position, added to its
token embedding. The reference is written here in float64, PE[p, 2k] = sin(p / 10000^(2k/d)), PE[p, 2k + 1] =
cos(p / 10000^(2k/d)), at the positions the test states: position_ids where given, else the real tokens before a token
in the padding mask, else the cache length plus its index. Then every consumer: cached decoding, left padding, packed
documents, saving, and what cannot carry the embedding refusing it."""

import json
import math

import pytest
import torch
from helpers import tiny_config, tiny_model
from transformers import DynamicCache

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
from bam_llama.conversion.common import ConversionError
from bam_llama.conversion.reference import convert_bam_to_reference
from bam_llama.model.absolute_positions_bam import sinusoidal_position_embedding

SINUSOIDAL = dict(absolute_positions="sinusoidal")
FAR = [0, 1, 2, 7, 511, 4_097, 65_535, 100_000, 131_071, 250_000]


def vaswani(positions: list[int], dim: int) -> torch.Tensor:
    """(len(positions), dim) float64, element by element."""
    table = torch.empty(len(positions), dim, dtype=torch.float64)
    for row, p in enumerate(positions):
        for i in range(dim):
            angle = p / 10000 ** (2 * (i // 2) / dim)
            table[row, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
    return table


def float32_tolerance(positions: list[int], dim: int) -> torch.Tensor:
    """Per element: the angle p * 10000^(-2k/d) in float32 (the frequency and the product each rounded, 2^-24
    relative), plus the rounding of sin / cos."""
    frequencies = torch.tensor([10000 ** (-2 * (i // 2) / dim) for i in range(dim)], dtype=torch.float64)
    return 1e-6 + 2 * 2.0**-24 * torch.tensor(positions, dtype=torch.float64)[:, None] * frequencies * 1.5


def assert_vaswani(actual: torch.Tensor, positions: list[int]):
    dim = actual.shape[-1]
    error = (actual.double() - vaswani(positions, dim)).abs()
    excess = error - float32_tolerance(positions, dim)
    assert excess.max() <= 0, f"off by {error.max():.2e} at {divmod(int(excess.argmax()), dim)}"


@pytest.mark.parametrize("dim", [10, 7, 32])
def test_the_embedding_is_vaswanis_formula_far_past_any_training_length(dim):
    embedding = sinusoidal_position_embedding(torch.tensor(FAR), dim, torch.float32)
    assert embedding.shape == (len(FAR), dim) and embedding.dtype == torch.float32
    assert_vaswani(embedding, FAR)
    assert sinusoidal_position_embedding(torch.tensor(FAR), dim, torch.bfloat16).dtype == torch.bfloat16


def first_layer_inputs(model, **inputs) -> torch.Tensor:
    """What the first decoder layer receives: the embeddings the model built."""
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    try:
        with torch.no_grad():
            model(use_cache=False, **inputs)
    finally:
        hook.remove()
    return seen[0]


def token_embeddings(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model.model.embed_tokens.weight.detach()[input_ids]


@pytest.mark.parametrize(
    "case", ["numbered by the model", "position_ids far out", "left padding mask", "packed position_ids"]
)
def test_the_first_layer_gets_token_embedding_plus_the_embedding_of_each_tokens_position(case):
    model = tiny_model("sdpa", **SINUSOIDAL)
    input_ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    inputs = dict(input_ids=input_ids)
    expected_positions = [list(range(6))] * 2
    if case == "position_ids far out":
        expected_positions = [[100_000 + i for i in range(6)], [250_000 + 3 * i for i in range(6)]]
        inputs["position_ids"] = torch.tensor(expected_positions)
    elif case == "left padding mask":
        inputs["attention_mask"] = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        expected_positions = [[0, 0, 0, 0, 1, 2], list(range(6))]  # a row's first real token at 0
    elif case == "packed position_ids":
        inputs["position_ids"] = torch.tensor([[0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0]])
        expected_positions = inputs["position_ids"].tolist()
    hidden = first_layer_inputs(model, **inputs)
    for row in range(2):
        real = slice(3, 6) if case == "left padding mask" and row == 0 else slice(0, 6)
        positional = hidden[row, real] - token_embeddings(model, input_ids[row, real])
        assert_vaswani(positional, expected_positions[row][real])


def test_inputs_embeds_get_the_embedding_too_and_none_is_added_without_the_field():
    model = tiny_model("sdpa", **SINUSOIDAL)
    embeds = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(2))
    assert_vaswani((first_layer_inputs(model, inputs_embeds=embeds) - embeds)[0], list(range(5)))
    plain = tiny_model("sdpa")
    input_ids = torch.randint(3, 97, (1, 5))
    assert torch.equal(first_layer_inputs(plain, input_ids=input_ids), token_embeddings(plain, input_ids))


def logits(model, input_ids, **kwargs):
    with torch.no_grad():
        return model(input_ids, use_cache=False, **kwargs).logits


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_decoding_through_a_cache_equals_the_full_forward(implementation):
    """Token by token, then in chunks: the cache length gives each new token its position."""
    model = tiny_model(implementation, ssmax=True, **SINUSOIDAL)
    input_ids = torch.randint(3, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    full = logits(model, input_ids)
    for chunk in (1, 5):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            steps = [model(part, cache=cache, use_cache=True).logits for part in input_ids.split(chunk, dim=1)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(input_ids, use_cache=True, **kwargs),
                       model.generate(input_ids, use_cache=False, **kwargs))


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row):], mask[b, width - len(row):] = row, 1
    return input_ids, mask


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_left_padded_row_equals_the_row_alone_in_a_forward_in_cached_steps_and_in_generate(implementation):
    model = tiny_model(implementation, ssmax=True, **SINUSOIDAL)
    generator = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, 97, (n,), generator=generator) for n in (10, 4)]
    steps = torch.randint(3, 97, (2, 4), generator=generator)
    input_ids, mask = left_padded(rows)
    width = input_ids.shape[1]
    batched = logits(model, input_ids, attention_mask=mask)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids, attention_mask=mask, cache=cache, use_cache=True)
        cached = []
        for t in range(steps.shape[1]):
            step_mask = torch.cat([mask, torch.ones(2, t + 1, dtype=torch.long)], dim=1)
            cached.append(model(steps[:, t:t + 1], attention_mask=step_mask, cache=cache, use_cache=True).logits)
    cached = torch.cat(cached, dim=1)
    for b, row in enumerate(rows):
        alone = logits(model, torch.cat([row, steps[b]])[None])[0]
        torch.testing.assert_close(batched[b, width - len(row):], alone[: len(row)], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cached[b], alone[len(row):], atol=1e-5, rtol=1e-5)
    generated = model.generate(input_ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for b, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(generated[b, width:], alone[0, len(row):])


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_packed_documents_equal_documents_alone(implementation):
    model = tiny_model(implementation, ssmax=True, **SINUSOIDAL)
    lengths = (6, 9, 4)
    generator = torch.Generator().manual_seed(5)
    documents = [torch.randint(3, 97, (n,), generator=generator) for n in lengths]
    packed = torch.cat(documents)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    packed_logits = logits(model, packed, position_ids=position_ids)[0]
    for document, chunk in zip(documents, packed_logits.split(lengths)):
        torch.testing.assert_close(chunk, logits(model, document[None])[0], atol=1e-5, rtol=1e-5)


def test_the_embedding_moves_the_logits_where_the_prior_is_flat():
    """A flat, fixed prior (the Sinusoidal baseline's) carries no position: the same tokens at other positions give
    other logits only through the embedding."""
    flat = dict(theta_alpha_init=0.0, theta_beta_init=0.0, train_theta_alpha=False, train_theta_beta=False)
    torch.manual_seed(0)
    model = BamLlamaForCausalLM(tiny_config(**flat, **SINUSOIDAL)).eval()
    input_ids = torch.randint(3, 97, (1, 6))
    shifted = logits(model, input_ids, position_ids=torch.arange(6)[None] + 40)
    assert (shifted - logits(model, input_ids)).abs().max() > 1e-3


def test_the_field_saves_and_reloads_and_an_older_config_reads_none(tmp_path):
    model = tiny_model("sdpa", **SINUSOIDAL)
    model.save_pretrained(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["absolute_positions"] == "sinusoidal"
    reloaded = BamLlamaForCausalLM.from_pretrained(tmp_path / "saved").eval()
    assert reloaded.config.absolute_positions == "sinusoidal"
    input_ids = torch.randint(3, 97, (1, 9))
    torch.testing.assert_close(logits(reloaded, input_ids), logits(model, input_ids), atol=0, rtol=0)
    assert not [name for name in reloaded.state_dict() if "position" in name]  # nothing saved: computed each call
    older = {k: v for k, v in tiny_config().to_dict().items() if k != "absolute_positions"}
    assert BamLlamaConfig.from_dict(older).absolute_positions is None
    assert BamLlamaConfig().absolute_positions is None


@pytest.mark.parametrize("value", ["rope", "Sinusoidal", True, 1])
def test_a_bad_value_is_refused_with_one_clear_error(value):
    with pytest.raises(ValueError, match=r"absolute_positions must be None .* or one of \('sinusoidal',\), got"):
        tiny_config(absolute_positions=value)


def test_conversion_to_the_reference_code_refuses_it_and_writes_nothing(tmp_path):
    tiny_model("sdpa", **SINUSOIDAL).save_pretrained(tmp_path / "bam")
    with pytest.raises(ConversionError, match="absolute_positions 'sinusoidal' .*no absolute position embedding"):
        convert_bam_to_reference(tmp_path / "bam", tmp_path / "run", verbose=False)
    assert not (tmp_path / "run").exists()
