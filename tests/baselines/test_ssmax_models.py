"""Transformers' Llama and Mistral with Scalable Softmax (bam_llama/baselines/): each layer's attention output against a
float64 reference written here, softmax(c_i * q.k / sqrt(d)) with c_i = s_h * ln(n_i) and n_i counted here from the
case's own rule (causal, no padded key, the query's own document, inside the sliding window), for plain causal rows,
left padding, packed documents, a window shorter than the sequence and decoding through a cache; the attention names a
user may ask for; saving and loading the scales."""

import json
import math
import sys

import pytest
import torch
from helpers import checkout_environment
from waiting import run_within
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, StaticCache

from bam_llama.baselines.ssmax_configs import LlamaSsmaxConfig, MistralSsmaxConfig
from bam_llama.baselines.ssmax_models import LlamaSsmaxForCausalLM, MistralSsmaxForCausalLM

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
SIZES = dict(vocab_size=48, hidden_size=HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
             rope_parameters={"rope_type": "default", "rope_theta": 100.0})
SCALES = torch.tensor([0.4, 1.3, 2.1, 0.7], dtype=torch.float64)  # one per query head, none the init (1.0)
WINDOW = 4
IMPLEMENTATIONS = ["sdpa", "eager"]  # what a user asks for: the model runs Scalable Softmax around each


def ssmax_model(kind: str, attn_implementation: str = "sdpa", seed: int = 0):
    """A one-layer float64 model whose heads have the scales SCALES."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaSsmaxForCausalLM(LlamaSsmaxConfig(**SIZES, attn_implementation=attn_implementation))
    else:
        model = MistralSsmaxForCausalLM(MistralSsmaxConfig(**SIZES, sliding_window=WINDOW, attn_implementation=attn_implementation))
    model = model.double().eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.ssmax.scale.copy_(SCALES)
    return model


def rotate(x, cos, sin):
    """RoPE as Llama applies it: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1) of its two halves."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def attention_inputs_and_output(model, **inputs):
    """Layer 0's attention: its input (hidden states, RoPE's cos and sin) and its output before o_proj, from one
    forward with `inputs`."""
    attention = model.model.layers[0].self_attn
    seen = {}
    hooks = [
        attention.register_forward_pre_hook(lambda module, args, kwargs: seen.update(
            hidden=kwargs["hidden_states"], rope=kwargs["position_embeddings"]), with_kwargs=True),
        attention.o_proj.register_forward_pre_hook(lambda module, args: seen.update(output=args[0])),
    ]
    try:
        with torch.no_grad():
            outputs = model(**inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen, outputs


def reference_attention(model, hidden, rope, visible):
    """(B, L, H * D) float64 Scalable-Softmax attention of layer 0 for hidden states (B, L, hidden) at RoPE's
    (cos, sin) with `visible` (B, L, L) the keys each query may see; rows that see nothing are 0."""
    attention = model.model.layers[0].self_attn
    batch, length, _ = hidden.shape

    def heads(projection, count):
        return projection(hidden).view(batch, length, count, HEAD_DIM).transpose(1, 2)

    cos, sin = rope
    query = rotate(heads(attention.q_proj, HEADS), cos, sin)
    key = rotate(heads(attention.k_proj, KV_HEADS), cos, sin).repeat_interleave(HEADS // KV_HEADS, dim=1)
    value = heads(attention.v_proj, KV_HEADS).repeat_interleave(HEADS // KV_HEADS, dim=1)
    counts = visible.sum(-1).clamp(min=1).double()  # n_i; a row that sees nothing: ln 1 = 0
    factor = SCALES[None, :, None, None] * counts.log()[:, None, :, None]
    logits = factor * (query @ key.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    logits = logits.masked_fill(~visible[:, None], float("-inf"))
    weights = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return (weights @ value).transpose(1, 2).reshape(batch, length, HEADS * HEAD_DIM)


def causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def check_rows(model, seen, visible, rows=None):
    """The model's attention output equals the reference per element, on `rows` (B, L) (default: all)."""
    expected = reference_attention(model, seen["hidden"], seen["rope"], visible)
    rows = torch.ones(visible.shape[:2], dtype=torch.bool) if rows is None else rows
    torch.testing.assert_close(seen["output"][rows], expected[rows], atol=1e-8, rtol=1e-6)


IDS = torch.tensor([[5, 9, 3, 17, 40, 2, 8, 33, 21, 7, 11], [12, 4, 4, 30, 6, 19, 25, 1, 14, 44, 3]])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_causal_rows_scale_by_the_log_of_the_keys_before_them(kind, implementation):
    """Mistral's window (WINDOW) is shorter than the rows: a query sees at most WINDOW keys, n_i = min(i + 1, WINDOW)."""
    model = ssmax_model(kind, implementation)
    seen, _ = attention_inputs_and_output(model, input_ids=IDS, use_cache=False)
    length = IDS.shape[1]
    visible = causal(length)
    if kind == "mistral":
        distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        visible = visible & (distance < WINDOW)
    check_rows(model, seen, visible.expand(2, -1, -1))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_left_padding_is_never_counted(kind, implementation):
    model = ssmax_model(kind, implementation)
    padding = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 11])
    positions = (padding.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers them
    seen, _ = attention_inputs_and_output(model, input_ids=IDS, attention_mask=padding, position_ids=positions,
                                          use_cache=False)
    length = IDS.shape[1]
    visible = causal(length)[None] & padding.bool()[:, None, :]
    if kind == "mistral":
        distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        visible = visible & (distance < WINDOW)
    check_rows(model, seen, visible, rows=padding.bool())
    assert visible[0, 5].sum() == 3  # keys 3, 4, 5: the padded ones not counted


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_packed_documents_count_only_their_own_keys(kind, implementation):
    """Positions restarting at 0 (`bam-pretrain`'s packed rows, no attention mask, no cache) start a document."""
    model = ssmax_model(kind, implementation)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 0, 1], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7]])
    seen, _ = attention_inputs_and_output(model, input_ids=IDS, position_ids=positions, use_cache=False)
    documents = (positions == 0).cumsum(-1)
    length = IDS.shape[1]
    visible = causal(length)[None] & (documents[:, :, None] == documents[:, None, :])
    if kind == "mistral":
        distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        visible = visible & (distance < WINDOW)
    check_rows(model, seen, visible)
    assert visible[0, 7].sum() == 2  # the third document's second token: itself and its first


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_decoding_through_a_cache_scales_as_the_full_forward(kind, implementation, cache_kind):
    """A prefill, a chunk of three tokens and single tokens through the cache: each step's attention equals the
    reference's rows at those absolute positions (n_i from the position, the window for Mistral), and its next-token
    logits equal the full forward's. A static cache's prefill runs SDPA's own causal mask over keys cut to the
    queries; its decoding steps a mask over every slot, the empty ones hidden."""
    model = ssmax_model(kind, implementation)
    ids = IDS[:1]
    length = ids.shape[1]
    full_seen, full = attention_inputs_and_output(model, input_ids=ids, use_cache=False)
    visible = causal(length)
    if kind == "mistral":
        distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        visible = visible & (distance < WINDOW)
    expected = reference_attention(model, full_seen["hidden"], full_seen["rope"], visible[None])
    cache, start = (StaticCache(config=model.config, max_cache_len=16) if cache_kind == "static" else None), 0
    for end in (5, 8, 9, 10, 11):
        seen, step = attention_inputs_and_output(model, input_ids=ids[:, start:end], cache=cache, use_cache=True)
        torch.testing.assert_close(seen["output"][0], expected[0, start:end], atol=1e-8, rtol=1e-6)
        torch.testing.assert_close(step.logits[0], full.logits[0, start:end], atol=1e-8, rtol=1e-6)
        cache, start = step.cache, end


def test_the_heads_scale_with_their_own_scale():
    """Each head's output moves only with its own scale: a scale read for the wrong head changes another head."""
    model = ssmax_model("llama")
    before, _ = attention_inputs_and_output(model, input_ids=IDS, use_cache=False)
    with torch.no_grad():
        model.model.layers[0].self_attn.ssmax.scale[2] += 0.5
    after, _ = attention_inputs_and_output(model, input_ids=IDS, use_cache=False)
    moved = (after["output"] - before["output"]).view(2, -1, HEADS, HEAD_DIM).abs().amax(dim=(0, 1, 3))
    assert moved[2] > 1e-3 and torch.all(moved[[0, 1, 3]] == 0), moved


@pytest.mark.parametrize("requested", [None, "sdpa", "eager"])
def test_asking_for_sdpa_or_eager_keeps_scalable_softmax(requested):
    model = LlamaSsmaxForCausalLM._from_config(LlamaSsmaxConfig(**SIZES), attn_implementation=requested)
    assert model.config._attn_implementation == {None: "ssmax_sdpa", "sdpa": "ssmax_sdpa", "eager": "ssmax_eager"}[requested]
    model.set_attn_implementation("eager" if requested != "eager" else "sdpa")
    assert model.config._attn_implementation in ("ssmax_sdpa", "ssmax_eager")


@pytest.mark.parametrize("requested", ["flash_attention_2", "flex_attention", "paged|eager"])
def test_a_backend_that_would_drop_the_scales_is_refused(requested):
    with pytest.raises(ValueError, match="would drop its scales"):
        LlamaSsmaxForCausalLM._from_config(LlamaSsmaxConfig(**SIZES), attn_implementation=requested)
    model = LlamaSsmaxForCausalLM(LlamaSsmaxConfig(**SIZES))
    with pytest.raises(ValueError, match="would drop its scales"):
        model.set_attn_implementation(requested)


def test_the_function_refuses_a_model_without_scales():
    llama = LlamaForCausalLM(LlamaConfig(**SIZES, attn_implementation="ssmax_sdpa"))
    with pytest.raises(ValueError, match="has none"):
        llama(input_ids=IDS[:, :4])


def test_the_model_is_transformers_own_plus_one_scale_per_head_and_layer():
    config = LlamaSsmaxConfig(**{**SIZES, "num_hidden_layers": 2}, ssmax_scale_init=0.25)
    model = LlamaSsmaxForCausalLM(config)
    plain = LlamaForCausalLM(LlamaConfig(**{**SIZES, "num_hidden_layers": 2}))
    shapes = {name: tensor.shape for name, tensor in model.state_dict().items()}
    scales = {f"model.layers.{layer}.self_attn.ssmax.scale": torch.Size([HEADS]) for layer in range(2)}
    assert shapes == {**{name: tensor.shape for name, tensor in plain.state_dict().items()}, **scales}
    for layer in model.model.layers:
        assert torch.equal(layer.self_attn.ssmax.scale.detach(), torch.full((HEADS,), 0.25))
        assert layer.self_attn.ssmax.scale.requires_grad
    frozen = LlamaSsmaxForCausalLM(LlamaSsmaxConfig(**SIZES, train_ssmax_scale=False))
    assert not [name for name, _ in frozen.named_parameters() if "ssmax" in name]
    with pytest.raises(ValueError, match="ssmax_scale_init"):
        LlamaSsmaxConfig(**SIZES, ssmax_scale_init=float("inf"))


def test_the_scales_train(tmp_path):
    model = ssmax_model("mistral")
    loss = model(input_ids=IDS, labels=IDS, use_cache=False).loss
    loss.backward()
    assert model.model.layers[0].self_attn.ssmax.scale.grad.abs().min() > 0


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_a_saved_folder_loads_back_with_its_scales(tmp_path, kind):
    model = ssmax_model(kind).float()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == f"{kind}_ssmax" and "ssmax_prior" not in config
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reloaded) is type(model) and reloaded.config._attn_implementation == "ssmax_sdpa"
    assert torch.equal(reloaded.model.layers[0].self_attn.ssmax.scale.detach(), SCALES.float())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=IDS).logits, model(input_ids=IDS).logits, atol=0, rtol=0)
    half = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.model.layers[0].self_attn.ssmax.scale.dtype == torch.float32  # kept, never rounded
    assert half.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_a_plain_llamas_weights_load_with_the_scales_at_their_init(tmp_path):
    """A trained RoPE model given Scalable Softmax: every weight its own, the scales (missing) at ssmax_scale_init."""
    plain = LlamaForCausalLM(LlamaConfig(**SIZES))
    plain.save_pretrained(tmp_path)
    config = LlamaSsmaxConfig.from_pretrained(tmp_path, ssmax_scale_init=0.5)
    model = LlamaSsmaxForCausalLM.from_pretrained(tmp_path, config=config)
    assert torch.equal(model.model.layers[0].self_attn.ssmax.scale.detach(), torch.full((HEADS,), 0.5))
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, plain.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("first_import", ["from transformers import LlamaConfig", "from transformers import MistralConfig",
                                          "from transformers import AutoModelForCausalLM", "pass"])
def test_a_fresh_process_loads_a_saved_folder_whatever_it_imports_first(tmp_path, first_import):
    """Llama's and Mistral's config modules import the Auto classes half-way through their own import: the configs
    that subclass them must still be registered before any Auto class is used."""
    ssmax_model("mistral").float().save_pretrained(tmp_path)
    script = (f"import bam_llama\n{first_import}\nfrom transformers import AutoModelForCausalLM\n"
              f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})\n"
              "print(type(model).__name__, model.model.layers[0].self_attn.ssmax.scale.tolist())\n")
    result = run_within([sys.executable, "-c", script], 300, env=checkout_environment())
    assert result.returncode == 0, result.stderr[-2000:]
    name, scales = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert name == "MistralSsmaxForCausalLM" and json.loads(scales) == pytest.approx(SCALES.tolist())
