import json

import pytest
import torch
from helpers import FIXTURES_DIR, require_reference_fixtures, tiny_config, tiny_model
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    DynamicCache,
    StaticCache,
)

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM, BamLlamaModel
from bam_llama.model.prior_bam import ggd_bias, relative_distance

VARIANTS = {
    "plain": dict(),
    "ssmax": dict(ssmax=True),
    "ssmax_unscaled_prior": dict(ssmax=True, ssmax_prior=False),
    "layer_prior_mha": dict(prior_scope="layer", num_key_value_heads=4),
    "legacy_formula": dict(prior_formula="legacy", ssmax=True),
    "kerple_formula": dict(prior_formula="kerple_log", prior_scope="layer", ssmax=True),
    "t5_buckets": dict(prior_formula="t5_buckets", t5_num_buckets=8, t5_max_distance=12, prior_scope="layer", ssmax=True),
}


def logits(model, input_ids, **kwargs):
    with torch.no_grad():
        return model(input_ids, use_cache=False, **kwargs).logits


# ---------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=30, num_attention_heads=4), "divisible by num_attention_heads"),
        (dict(num_key_value_heads=3), "must divide num_attention_heads"),
        (dict(prior_scope="block"), "prior_scope"),
        (dict(prior_formula="new"), "prior_formula"),
        (dict(theta_alpha_init="slopes"), "theta_alpha_init"),
        (dict(theta_beta_init=None), "theta_beta_init"),
        (dict(prior_eps=0.0), "prior_eps"),
    ],
)
def test_invalid_config_raises_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_config_defaults():
    config = BamLlamaConfig()
    assert config.train_context_length == 512
    assert config.max_position_embeddings == 65536  # the declared serving length: test_context_length.py
    assert config.head_dim == 48  # 768 / 16, the reference model's head size


def test_auto_classes_are_registered():
    values = {k: v for k, v in tiny_config().to_dict().items() if k != "model_type"}
    config = AutoConfig.for_model("bam_llama", **values)
    assert isinstance(AutoModelForCausalLM.from_config(config), BamLlamaForCausalLM)
    assert isinstance(AutoModel.from_config(config), BamLlamaModel)


def test_unsupported_attention_backend_is_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="drop"):
        model.set_attn_implementation("flash_attention_2")


# ---------------------------------------------------------------------------------------------- prior


def test_prior_formula_and_mu_sign_convention():
    distance = relative_distance(torch.tensor([5]), 11)  # j - i for keys 0..10 and a query at 5
    theta_mu = torch.asinh(torch.tensor([1.0]) / 2)  # mu = 2 sinh(theta_mu) = 1
    bias = ggd_bias(distance, torch.tensor([0.5]), torch.tensor([1.5]), theta_mu)[0, 0]
    expected = -torch.exp(torch.tensor(0.5)) * ((distance[0] - 1).abs() + 1e-5) ** 1.5
    torch.testing.assert_close(bias, expected)
    assert bias.argmax().item() == 6  # peak at j - i = mu = +1


def test_prior_init_schemes_and_trainability():
    model = BamLlamaForCausalLM(tiny_config(theta_alpha_init="alibi", theta_beta_init="linear", num_attention_heads=4))
    prior = model.model.prior
    torch.testing.assert_close(prior.theta_alpha.exp(), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8]))
    torch.testing.assert_close(prior.theta_beta, torch.linspace(0, 1, 4))
    assert prior.theta_alpha.requires_grad and prior.theta_beta.requires_grad
    assert not prior.theta_mu.requires_grad  # mu is fixed at 0 by default: a buffer, not a Parameter
    assert "theta_mu" in dict(prior.named_buffers()) and "theta_mu" not in dict(prior.named_parameters())


def paper_alibi_slopes(n: int) -> list[float]:
    """ALiBi's slopes as Press et al. build them: for a power of two n, the geometric sequence that starts at and
    has ratio 2^(-8/n); otherwise the slopes of the closest power of two below n, then every other slope of twice
    that power, as many as are missing."""
    if n & (n - 1) == 0:
        start = 2.0 ** (-8.0 / n)
        return [start * start**i for i in range(n)]
    closest = 1 << (n.bit_length() - 1)
    return paper_alibi_slopes(closest) + paper_alibi_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 7, 12, 20, 24, 40])
def test_alibi_init_gives_the_papers_slopes_for_any_head_count(heads):
    """The `alibi` baseline and converted priors (theta_alpha_init="alibi") start from log slope per head."""
    model = BamLlamaForCausalLM(tiny_config(theta_alpha_init="alibi", num_attention_heads=heads, num_key_value_heads=1,
                                            hidden_size=8 * heads, head_dim=8, num_hidden_layers=1))
    torch.testing.assert_close(model.model.prior.theta_alpha.exp(), torch.tensor(paper_alibi_slopes(heads)),
                               rtol=1e-6, atol=0)


def test_alibi_slopes_for_6_and_12_heads_written_out():
    """The paper's construction by hand: 6 heads take 4 heads' slopes 2^-2, 2^-4, 2^-6, 2^-8, then 8 heads'
    2^-1, 2^-3; 12 heads take 8 heads' 2^-1 .. 2^-8, then 16 heads' 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5."""
    six = BamLlamaForCausalLM(tiny_config(theta_alpha_init="alibi", num_attention_heads=6, num_key_value_heads=2,
                                          hidden_size=48, head_dim=8, num_hidden_layers=1)).model.prior
    torch.testing.assert_close(six.theta_alpha.exp(), 2.0 ** -torch.tensor([2.0, 4, 6, 8, 1, 3]))
    twelve = BamLlamaForCausalLM(tiny_config(theta_alpha_init="alibi", num_attention_heads=12, num_key_value_heads=4,
                                             hidden_size=96, head_dim=8, num_hidden_layers=1)).model.prior
    exponents = torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 8, 0.5, 1.5, 2.5, 3.5])
    torch.testing.assert_close(twelve.theta_alpha.exp(), 2.0 ** -exponents)


# ---------------------------------------------------------------------------------------------- attention paths


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_eager_and_sdpa_agree_with_gradients(variant):
    input_ids = torch.randint(0, 97, (2, 19))
    outputs, grads = {}, {}
    for implementation in ("eager", "sdpa"):
        model = tiny_model(implementation, **VARIANTS[variant]).train()
        model.config.train_theta_mu = True
        model.apply_prior_trainability()
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        outputs[implementation] = loss.detach()
        grads[implementation] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(outputs["eager"], outputs["sdpa"], atol=1e-5, rtol=1e-5)
    assert grads["eager"].keys() == grads["sdpa"].keys()
    assert any(name.endswith(("theta_mu", "bucket_bias")) for name in grads["eager"])  # every prior tensor trains
    for name in grads["eager"]:
        torch.testing.assert_close(grads["eager"][name], grads["sdpa"][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("ssmax", [False, True])
def test_frozen_prior_trains_the_rest_on_a_padded_batch_of_several_query_blocks(ssmax):
    """Fine-tuning with the prior (and SSMax scales) frozen, as PEFT does without modules_to_save: 80 left-padded
    tokens are 3 query blocks, whose masks SDPA keeps for the q/k/v gradients. Same gradients as eager."""
    input_ids = torch.randint(0, 97, (2, 80))
    attention_mask = torch.ones(2, 80, dtype=torch.long)
    attention_mask[1, :23] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    grads = {}
    for implementation in ("eager", "sdpa"):
        model = tiny_model(implementation, ssmax=ssmax).train()
        for name, parameter in model.named_parameters():
            parameter.requires_grad_("prior" not in name and "ssmax" not in name)
        model(input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
        grads[implementation] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["eager"].keys() == grads["sdpa"].keys()
    assert not any("prior" in name or "ssmax" in name for name in grads["sdpa"])
    for name in grads["eager"]:
        torch.testing.assert_close(grads["eager"][name], grads["sdpa"][name], atol=1e-5, rtol=1e-4, msg=name)


def test_triton_implementation_falls_back_off_gpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor without the interpreter: the SDPA path runs
    input_ids = torch.randint(0, 97, (2, 11))
    reference = logits(tiny_model("sdpa", ssmax=True), input_ids)
    fused = logits(tiny_model("bam_triton", ssmax=True), input_ids)
    torch.testing.assert_close(fused, reference)


# ---------------------------------------------------------------------------------------------- caches


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
def test_step_by_step_decoding_equals_full_forward(implementation, cache_class):
    model = tiny_model(implementation, ssmax=True)
    input_ids = torch.randint(0, 97, (2, 13))
    full = logits(model, input_ids)
    if cache_class == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=20)
    steps = []
    with torch.no_grad():
        for t in range(input_ids.shape[1]):
            steps.append(model(input_ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
@pytest.mark.parametrize("ssmax_prior", [True, False])
def test_left_padded_ssmax_prefill_then_cached_steps_equal_the_uncached_model(implementation, cache_class, ssmax_prior):
    """SSMax counts the keys a query sees: padding excluded, at prefill and at every cached decoding step (one query
    against the cache). Logits of a left-padded batch (prefill, then 5 steps with given tokens) against the uncached
    forward of the whole padded sequence, and each row against itself alone, unpadded."""
    model = tiny_model(implementation, ssmax=True, ssmax_prior=ssmax_prior)
    rows = [torch.randint(3, 97, (n,)) for n in (11, 4)]  # 7 padded keys in row 1: a count off by them shows
    steps = torch.randint(3, 97, (2, 5))
    width = max(len(r) for r in rows)
    prompt = torch.zeros(2, width, dtype=torch.long)
    prompt_mask = torch.zeros(2, width, dtype=torch.long)
    for b, row in enumerate(rows):
        prompt[b, width - len(row) :], prompt_mask[b, width - len(row) :] = row, 1
    full_ids = torch.cat([prompt, steps], dim=1)
    full_mask = torch.cat([prompt_mask, torch.ones_like(steps)], dim=1)
    uncached = logits(model, full_ids, attention_mask=full_mask)
    if cache_class == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=24)
    with torch.no_grad():
        cached = [model(prompt, attention_mask=prompt_mask, past_key_values=cache, use_cache=True).logits]
        for t in range(steps.shape[1]):
            mask = full_mask[:, : width + t + 1]
            cached.append(model(steps[:, t : t + 1], attention_mask=mask, past_key_values=cache, use_cache=True).logits)
    cached = torch.cat(cached, dim=1)
    real = full_mask.bool()
    torch.testing.assert_close(cached[real], uncached[real], atol=1e-5, rtol=1e-5)
    for b, row in enumerate(rows):
        alone = logits(model, torch.cat([row, steps[b]])[None])[0]
        torch.testing.assert_close(uncached[b, width - len(row) :], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_static_cache_gives_what_a_dynamic_one_gives_with_left_padding(dtype):
    """16-bit weights, attention computed in float32 on the keys filled so far (a static cache's slots past them
    are neither converted nor read, nor its padding mask's columns for them): a left-padded batch's prefill and
    decoding steps over a StaticCache give the logits they give over a DynamicCache."""
    model = tiny_model("sdpa", ssmax=True).to(dtype)
    prompt = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    prompt_mask = torch.ones_like(prompt)
    prompt_mask[1, :7] = 0
    steps = torch.randint(3, 97, (2, 4), generator=torch.Generator().manual_seed(5))
    outputs = []
    for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=40)):
        with torch.no_grad():
            logits = [model(prompt, attention_mask=prompt_mask, past_key_values=cache, use_cache=True).logits]
            for t in range(steps.shape[1]):
                mask = torch.cat([prompt_mask, torch.ones_like(steps[:, : t + 1])], dim=1)
                step = model(steps[:, t : t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
                logits.append(step.logits)
        outputs.append(torch.cat(logits, dim=1).float())
    real = torch.cat([prompt_mask, torch.ones_like(steps)], dim=1).bool()
    torch.testing.assert_close(outputs[1][real], outputs[0][real], atol=1e-3, rtol=1e-3)


def test_chunked_prefill_equals_full_forward():
    model = tiny_model("sdpa", ssmax=True, prior_scope="layer")
    input_ids = torch.randint(0, 97, (1, 23))
    full = logits(model, input_ids)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        chunks = [model(chunk, past_key_values=cache, use_cache=True).logits for chunk in input_ids.split(8, dim=1)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_cached_greedy_generate_equals_uncached(implementation):
    model = tiny_model(implementation, ssmax=True)
    prompt = torch.randint(3, 97, (2, 7))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert torch.equal(cached, static)


@pytest.mark.parametrize(
    "implementation, variant", [("sdpa", "plain"), ("sdpa", "ssmax"), ("eager", "ssmax"), ("bam_triton", "ssmax")]
)
def test_left_padded_batch_equals_rows_alone(implementation, variant):
    model = tiny_model(implementation, **VARIANTS[variant])
    rows = [torch.randint(3, 97, (n,)) for n in (9, 5)]
    width = max(len(r) for r in rows)
    input_ids = torch.zeros(2, width, dtype=torch.long)
    attention_mask = torch.zeros(2, width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row) :] = row
        attention_mask[b, width - len(row) :] = 1
    batched = logits(model, input_ids, attention_mask=attention_mask)
    for b, row in enumerate(rows):
        alone = logits(model, row[None])[0]
        torch.testing.assert_close(batched[b, width - len(row) :], alone, atol=1e-5, rtol=1e-5)

    generated = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    for b, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(generated[b, width:], alone[0, len(row) :])


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "bam_triton"])
def test_packed_documents_equal_documents_alone(implementation):
    model = tiny_model(implementation, ssmax=True)
    lengths = (6, 9, 4)
    documents = [torch.randint(3, 97, (n,)) for n in lengths]
    packed = torch.cat(documents)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    packed_logits = logits(model, packed, position_ids=position_ids)[0]
    for document, chunk in zip(documents, packed_logits.split(lengths)):
        torch.testing.assert_close(chunk, logits(model, document[None])[0], atol=1e-5, rtol=1e-5)
    unpacked_logits = logits(model, packed)[0]
    assert not torch.allclose(unpacked_logits[lengths[0] :], packed_logits[lengths[0] :], atol=1e-3)


# ---------------------------------------------------------------------------------------------- save / load


def test_public_names_import_from_where_they_always_did():
    """The attention dispatch lives in dispatch_bam.py; what users imported from modeling_bam still comes from there."""
    import bam_llama
    from bam_llama.model import modeling_bam

    for name in ["BamLlamaForCausalLM", "BamLlamaModel", "BamLlamaPreTrainedModel", "BamPrior", "BamScalableSoftmax",
                 "register_bam_attention", "CACHE_NAME", "REMOTE_CODE_AUTO_MAP"]:
        assert hasattr(modeling_bam, name), name
    assert bam_llama.register_bam_attention is modeling_bam.register_bam_attention


def test_save_and_load_round_trip_is_exact(tmp_path):
    model = tiny_model("sdpa", ssmax=True, prior_scope="layer")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "modeling_bam.BamLlamaModel"
    assert auto_map["AutoModelForCausalLM"] == "modeling_bam.BamLlamaForCausalLM"

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert all(parameter.requires_grad for parameter in loaded.parameters())
    frozen = {name for name, _ in loaded.named_buffers()}  # what the config freezes is not a Parameter
    assert frozen == {name for name in original if name.endswith("theta_mu")} and len(frozen) == 2
    input_ids = torch.randint(0, 97, (1, 10))
    assert torch.equal(logits(loaded, input_ids), logits(model, input_ids))


# ---------------------------------------------------------------------------------------------- reference fixtures


REFERENCE_TO_HF = [
    ("tok_embeddings", "embed_tokens"),
    ("output.weight", "lm_head.weight"),
    ("attention.wq", "self_attn.q_proj"),
    ("attention.wk", "self_attn.k_proj"),
    ("attention.wv", "self_attn.v_proj"),
    ("attention.wo", "self_attn.o_proj"),
    ("feed_forward.w1", "mlp.gate_proj"),
    ("feed_forward.w2", "mlp.down_proj"),
    ("feed_forward.w3", "mlp.up_proj"),
    ("attention_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attention.seq_scale", "self_attn.ssmax.scale"),
    ("prior.shape", "prior.theta_beta"),
    ("prior.scale", "prior.theta_alpha"),
    ("prior.loc", "prior.theta_mu"),
]


def load_reference_fixture(variant):
    require_reference_fixtures()
    run_dir = FIXTURES_DIR / "logs" / "l6" / variant / "version_00"
    model_args = json.loads((run_dir / "args.json").read_text())["model_args"]
    config = BamLlamaConfig(
        vocab_size=model_args["vocab_size"],
        hidden_size=model_args["dim"],
        intermediate_size=int(model_args["ffn_dim_multiplier"] * model_args["dim"]),
        num_hidden_layers=model_args["n_layers"],
        num_attention_heads=model_args["n_heads"],
        rms_norm_eps=model_args["norm_eps"],
        ssmax=variant == "bam_ssmax",
    )
    state_dict = {}
    for name, tensor in torch.load(run_dir / "model.pt", weights_only=True).items():
        for old, new in REFERENCE_TO_HF:
            name = name.replace(old, new)
        if not name.startswith("lm_head"):
            name = "model." + name
        state_dict[name] = tensor.reshape(-1) if tensor.dim() == 4 else tensor
    model = BamLlamaForCausalLM(config)
    model.load_state_dict(state_dict, strict=True)
    return model.eval(), torch.load(FIXTURES_DIR / f"{variant}_io.pt", weights_only=True)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", ["bam", "bam_ssmax"])
def test_reference_fixture_logits(variant, implementation):
    model, io = load_reference_fixture(variant)
    model.set_attn_implementation(implementation)
    torch.testing.assert_close(logits(model, io["input_ids"]), io["logits"], atol=1e-4, rtol=0)

    position_ids = torch.stack(
        [torch.cat([torch.arange(n) for n in torch.unique_consecutive(row, return_counts=True)[1]]) for row in io["seq_codes"]]
    )
    packed = logits(model, io["input_ids"], position_ids=position_ids)
    torch.testing.assert_close(packed, io["logits_packed"], atol=1e-4, rtol=0)

    bias = model.model.prior.bias(torch.arange(48), 48)
    torch.testing.assert_close(bias, io["prior_bias_T48"], atol=1e-4, rtol=1e-5)


def test_reference_fixture_token_by_token_cache():
    model, io = load_reference_fixture("bam_ssmax")
    for row in range(io["input_ids"].shape[0]):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            steps = [
                model(io["input_ids"][row : row + 1, t : t + 1], past_key_values=cache, use_cache=True).logits
                for t in range(io["input_ids"].shape[1])
            ]
        torch.testing.assert_close(torch.cat(steps, 1)[0], io["inference_tbt_logits"][row], atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("ssmax", [False, True])
def test_a_head_whose_prior_at_distance_zero_passes_float32_trains(attention, ssmax):
    """theta_beta = -9 in every head (a retrieval head trains towards it): exp(theta_alpha) * 1e-5 ** 9 ~ 1e45 at
    distance 0, past float32's 3.4e38. The loss and every gradient stay finite, and the model keeps attending: the
    first token's attention output is its own value (it sees only itself), as with a mild prior."""
    config = tiny_config(ssmax=ssmax, prior_scope="layer", attn_implementation=attention)
    torch.manual_seed(0)
    model = BamLlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("theta_beta"):
                parameter.fill_(-9.0)
            if name.endswith("theta_alpha"):
                parameter.fill_(0.5)
    input_ids = torch.randint(3, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    outputs = model(input_ids, labels=input_ids)
    outputs.loss.backward()
    assert torch.isfinite(outputs.loss)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    seen = {}
    attention_layer = model.model.layers[0].self_attn
    handle = attention_layer.o_proj.register_forward_hook(lambda module, args, output: seen.update(attended=args[0]))
    with torch.no_grad():
        model(input_ids)
    handle.remove()
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(input_ids))
    first_value = attention_layer.v_proj(hidden)[:, 0]  # (B, Hkv * D): the first token's value of every head
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    per_head = first_value.view(2, kv_heads, -1).repeat_interleave(heads // kv_heads, dim=1).flatten(1)
    torch.testing.assert_close(seen["attended"][:, 0].detach(), per_head.detach(), atol=1e-5, rtol=1e-5)
