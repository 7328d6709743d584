"""BamLlama behaves like a native Transformers causal LM: what Transformers' ModelTesterMixin,
GenerationTesterMixin, pipeline and training tests exercise for a decoder-only model, written for this package.

References are computed here from the model's weights or from plain forward passes, never taken from the code
under test. Models are tiny (2 layers, hidden 32) so the whole file runs in well under a minute on 2 CPU cores.
"""

import inspect
import logging
import os
import re
import subprocess
import sys
import textwrap
import typing
import warnings

import pytest
import reference
import torch
import torch.nn.functional as F
import transformers
from helpers import randomize_prior, tiny_config, tiny_model
from packaging import version
from transformers import (
    AutoModelForCausalLM,
    CompileConfig,
    DataCollatorWithFlattening,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    pipeline,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    eager_mask,
    sdpa_mask,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from waiting import run_within

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM, BamLlamaModel
from bam_llama.data.tokenizers import BYTE_VOCAB_SIZE, build_byte_tokenizer

VOCAB = 97
NO_EOS = dict(eos_token_id=None, pad_token_id=0)  # generate to max_new_tokens, never stop early


def no_grad_logits(model, input_ids, **kwargs):
    with torch.no_grad():
        return model(input_ids, use_cache=False, **kwargs).logits


def greedy_reference(model, prompt, steps):
    """Greedy decoding by full forward passes and argmax, no cache and no `generate`."""
    sequence = prompt
    for _ in range(steps):
        next_token = no_grad_logits(model, sequence)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    return sequence


def left_padded(rows, pad_id=0):
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, width - len(row) :] = row
        attention_mask[b, width - len(row) :] = 1
    return input_ids, attention_mask


@pytest.fixture
def reset_warning_once():
    """`warning_once` remembers messages process-wide; forget them so a test can see its warning."""
    logging.Logger.warning_once.cache_clear()
    yield


# ---------------------------------------------------------------------------------------------- outputs


def typed_kwargs(forward) -> set[str]:
    """The keywords `forward` declares through `**kwargs: Unpack[SomeTypedDict]`: what Transformers' tooling reads
    to learn, e.g., that a model can return attention weights (untyped **kwargs declare nothing)."""
    annotation = inspect.signature(forward).parameters["kwargs"].annotation
    if typing.get_origin(annotation) is not Unpack:
        return set()
    (typed_dict,) = typing.get_args(annotation)
    return set(typed_dict.__annotations__)


@pytest.mark.parametrize("model_class", [BamLlamaModel, BamLlamaForCausalLM])
def test_forward_kwargs_are_typed_as_in_llama(model_class):
    declared = typed_kwargs(model_class.forward)
    assert {"output_attentions", "output_hidden_states", "num_items_in_batch"} <= declared
    assert declared == typed_kwargs(LlamaForCausalLM.forward)


def test_return_dict_false_gives_tuples_with_and_without_loss():
    model = tiny_model("sdpa")
    input_ids = torch.randint(3, VOCAB, (2, 9))
    reference = model(input_ids, use_cache=False)
    expected_loss = F.cross_entropy(reference.logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))

    with_loss = model(input_ids, labels=input_ids, use_cache=False, return_dict=False)
    assert isinstance(with_loss, tuple) and len(with_loss) == 2
    loss, logits = with_loss
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(logits, reference.logits)

    (logits_only,) = model(input_ids, use_cache=False, return_dict=False)
    torch.testing.assert_close(logits_only, reference.logits)

    logits, cache = model(input_ids, use_cache=True, return_dict=False)
    assert cache.get_seq_length() == 9

    model.config.return_dict = False  # the config-level switch
    assert isinstance(model(input_ids, use_cache=False), tuple)
    base = BamLlamaModel(tiny_config(return_dict=False))
    (last_hidden_state,) = base(input_ids, use_cache=False)
    assert last_hidden_state.shape == (2, 9, 32)


def test_hidden_states_from_config_flag_are_the_layer_outputs(tmp_path):
    tiny_model("eager").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, output_hidden_states=True).eval()
    assert model.config.output_hidden_states
    input_ids = torch.randint(3, VOCAB, (2, 8))

    layer_outputs = []  # what each decoder layer returns, seen by plain PyTorch hooks
    hooks = [
        layer.register_forward_hook(lambda module, args, output: layer_outputs.append(output))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        outputs = model(input_ids, use_cache=False)
    for hook in hooks:
        hook.remove()

    hidden_states = outputs.hidden_states
    assert len(hidden_states) == model.config.num_hidden_layers + 1
    torch.testing.assert_close(hidden_states[0], model.model.embed_tokens(input_ids))
    for index, layer_output in enumerate(layer_outputs[:-1]):
        torch.testing.assert_close(hidden_states[index + 1], layer_output)
    final = layer_outputs[-1]  # hidden_states[-1] is the last layer's output after the final norm, as in Llama
    weight, eps = model.model.norm.weight, model.config.rms_norm_eps
    final_norm = weight * final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + eps)
    torch.testing.assert_close(hidden_states[-1], final_norm)

    with torch.no_grad():
        assert model(input_ids, use_cache=False, output_hidden_states=False).hidden_states is None


def expected_attention_probabilities(model, input_ids, layer=0):
    """Layer `layer` = 0 attention probabilities from tests/reference.py, on q and k computed here from the layer's
    weights (RMS norm, then the projections): SSMax on, the prior scaled, keys at positions 0..L-1."""
    config = model.config
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = model.model.layers[layer].self_attn
    norm = model.model.layers[layer].input_layernorm
    x = model.model.embed_tokens(input_ids)
    x = norm.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    batch, length = input_ids.shape
    q = (x @ attention.q_proj.weight.T).view(batch, length, heads, head_dim).transpose(1, 2)
    k = (x @ attention.k_proj.weight.T).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    prior = model.model.prior
    _, probabilities = reference.bam_attention(
        q, k, k, torch.arange(length), prior.theta_alpha, prior.theta_beta, prior.theta_mu, eps=config.prior_eps,
        ssmax_scale=attention.ssmax.scale, return_probs=True,
    )
    return probabilities.float()


def test_config_output_attentions_with_eager_gives_bam_probabilities():
    model = tiny_model("eager", ssmax=True)
    model.config.output_attentions = True  # Transformers allows this only under the name "eager"
    input_ids = torch.randint(3, VOCAB, (2, 10))
    with torch.no_grad():
        attentions = model(input_ids, use_cache=False).attentions
        expected = expected_attention_probabilities(model, input_ids)
    assert len(attentions) == model.config.num_hidden_layers
    assert all(a.shape == (2, 4, 10, 10) for a in attentions)
    torch.testing.assert_close(attentions[0], expected, atol=1e-5, rtol=1e-4)


def test_attentions_of_a_left_padded_batch_sum_to_one_over_visible_keys():
    model = tiny_model("eager", ssmax=True)
    input_ids, attention_mask = left_padded([torch.randint(3, VOCAB, (n,)) for n in (9, 4)])
    with torch.no_grad():
        attentions = model(input_ids, attention_mask=attention_mask, use_cache=False, output_attentions=True).attentions
    future = torch.ones(9, 9, dtype=torch.bool).triu(1)
    for probabilities in attentions:
        for row in range(2):
            real = attention_mask[row].bool()
            visible = real[None, :] & ~future  # (query, key)
            p = probabilities[row]  # (H, Lq, Lk)
            assert (p[:, :, ~real] == 0).all() and (p[:, future] == 0).all()
            torch.testing.assert_close(p[:, real].sum(-1), torch.ones(4, int(real.sum())))
            assert (p[:, visible] > 0).all()


def test_sdpa_with_output_attentions_warns_and_returns_eager_weights(caplog, reset_warning_once):
    model = tiny_model("sdpa", ssmax=True)
    input_ids = torch.randint(3, VOCAB, (1, 7))
    with caplog.at_level(logging.WARNING), torch.no_grad():
        outputs = model(input_ids, use_cache=False, output_attentions=True)
    assert "'sdpa' attention computes no attention weights" in caplog.text
    assert model.config._attn_implementation == "sdpa"
    assert len(outputs.attentions) == 2 and outputs.attentions[0] is not None
    with torch.no_grad():
        expected = expected_attention_probabilities(model, input_ids)
    torch.testing.assert_close(outputs.attentions[0], expected, atol=1e-5, rtol=1e-4)


def test_hidden_states_and_attentions_keep_their_gradients():
    model = tiny_model("eager").train()
    input_ids = torch.randint(3, VOCAB, (2, 6))
    outputs = model(input_ids, use_cache=False, output_hidden_states=True, output_attentions=True)
    outputs.hidden_states[0].retain_grad()
    outputs.attentions[0].retain_grad()
    outputs.logits.sum().backward()
    assert outputs.hidden_states[0].grad is not None and outputs.hidden_states[0].grad.abs().sum() > 0
    assert outputs.attentions[0].grad is not None and outputs.attentions[0].grad.abs().sum() > 0


def test_logits_to_keep_keeps_the_last_positions():
    model = tiny_model("sdpa")
    input_ids = torch.randint(3, VOCAB, (2, 9))
    full = no_grad_logits(model, input_ids)
    torch.testing.assert_close(no_grad_logits(model, input_ids, logits_to_keep=1), full[:, -1:])
    torch.testing.assert_close(no_grad_logits(model, input_ids, logits_to_keep=3), full[:, -3:])


def test_inputs_embeds_equal_input_ids():
    model = tiny_model("sdpa", ssmax=True)
    input_ids = torch.randint(3, VOCAB, (2, 8))
    embeds = model.get_input_embeddings()(input_ids)
    with torch.no_grad():
        from_embeds = model(inputs_embeds=embeds, use_cache=False).logits
    torch.testing.assert_close(from_embeds, no_grad_logits(model, input_ids))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids, inputs_embeds=embeds)

    generated = model.generate(input_ids, max_new_tokens=5, do_sample=False, **NO_EOS)
    from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=5, do_sample=False, **NO_EOS)
    assert torch.equal(from_embeds, generated[:, 8:])  # only the new tokens, as for every decoder-only model


# ---------------------------------------------------------------------------------------------- loading / embeddings


def test_output_loading_info_returns_model_and_info(tmp_path):
    tiny_model("sdpa", ssmax=True).save_pretrained(tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(model, BamLlamaForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    assert trainable["model.prior.theta_alpha"] and "model.prior.theta_mu" not in trainable  # the config's choice
    assert "model.prior.theta_mu" in dict(model.named_buffers())  # frozen: loaded, but not a Parameter
    base, base_info = BamLlamaModel.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(base, BamLlamaModel) and not base_info["missing_keys"]


def test_lowered_max_position_embeddings_saves_and_reloads(tmp_path):
    model = tiny_model("sdpa")
    model.config.max_position_embeddings = 8  # below train_context_length=16: only a limit for generation tools
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.max_position_embeddings == 8
    input_ids = torch.randint(3, VOCAB, (1, 12))  # longer than the stated limit: the model itself has none
    torch.testing.assert_close(no_grad_logits(reloaded, input_ids), no_grad_logits(model, input_ids))
    assert BamLlamaConfig(max_position_embeddings=8, train_context_length=16).max_position_embeddings == 8


def test_tied_embeddings_share_storage_and_survive_save_load(tmp_path):
    model = tiny_model("sdpa", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    input_ids = torch.randint(3, VOCAB, (1, 9))
    torch.testing.assert_close(no_grad_logits(reloaded, input_ids), no_grad_logits(model, input_ids))

    untied = tiny_model("sdpa", tie_word_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("tied", [False, True])
def test_resize_token_embeddings_keeps_old_tokens(tied):
    model = tiny_model("sdpa", tie_word_embeddings=tied)
    input_ids = torch.randint(3, VOCAB, (2, 7))
    before = no_grad_logits(model, input_ids)
    old_embeddings = model.get_input_embeddings().weight.detach().clone()

    model.resize_token_embeddings(VOCAB + 13)
    assert model.config.vocab_size == VOCAB + 13
    assert model.get_input_embeddings().weight.shape == (VOCAB + 13, 32)
    assert model.get_output_embeddings().weight.shape == (VOCAB + 13, 32)
    torch.testing.assert_close(model.get_input_embeddings().weight[:VOCAB], old_embeddings)
    after = no_grad_logits(model, input_ids)
    assert after.shape == (2, 7, VOCAB + 13)
    torch.testing.assert_close(after[..., :VOCAB], before)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    new_token = torch.tensor([[VOCAB + 12]])
    assert no_grad_logits(model, torch.cat([input_ids[:1], new_token], 1)).isfinite().all()

    model.resize_token_embeddings(VOCAB - 10)  # shrinking works too
    assert no_grad_logits(model, input_ids.clamp(max=VOCAB - 11)).shape == (2, 7, VOCAB - 10)


# ---------------------------------------------------------------------------------------------- training


def enable_checkpointing(model):
    """`activation_checkpointing_enable` since Transformers 5.2x, `gradient_checkpointing_enable` before."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def test_gradient_checkpointing_gives_same_gradients_and_hidden_states():
    input_ids = torch.randint(3, VOCAB, (2, 10))
    runs = []
    for checkpointing in (False, True):
        model = tiny_model("eager", ssmax=True).train()
        if checkpointing:
            enable_checkpointing(model)
        outputs = model(input_ids, labels=input_ids, output_hidden_states=True, output_attentions=True)
        outputs.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
        runs.append((outputs, grads))
    (plain, plain_grads), (checkpointed, checkpointed_grads) = runs
    assert checkpointed.past_key_values is None  # use_cache is turned off under checkpointing, as in Llama
    assert plain_grads.keys() == checkpointed_grads.keys() and any("theta_beta" in name for name in plain_grads)
    for name in plain_grads:
        torch.testing.assert_close(checkpointed_grads[name], plain_grads[name], msg=name)
    for name in ("hidden_states", "attentions"):
        for ours, expected in zip(getattr(checkpointed, name), getattr(plain, name)):
            torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("flash_kwargs", [False, True])
def test_flattened_batch_gives_every_document_its_own_logits_and_loss(flash_kwargs):
    model = tiny_model("sdpa", ssmax=True)
    documents = [torch.randint(3, VOCAB, (n,)) for n in (5, 8, 3)]
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs, return_seq_idx=flash_kwargs)
    batch = collator([{"input_ids": document.tolist()} for document in documents])
    assert batch["input_ids"].shape == (1, 16)
    with torch.no_grad():
        outputs = model(**batch, use_cache=False)

    token_losses = []
    for document, chunk in zip(documents, outputs.logits[0].split([5, 8, 3])):
        alone = no_grad_logits(model, document[None])[0]
        torch.testing.assert_close(chunk, alone, atol=1e-5, rtol=1e-5)
        token_losses.append(F.cross_entropy(alone[:-1], document[1:], reduction="none"))
    torch.testing.assert_close(outputs.loss, torch.cat(token_losses).mean())


# ---------------------------------------------------------------------------------------------- generation


def test_greedy_generation_equals_argmax_of_full_forwards():
    model = tiny_model("sdpa", ssmax=True)
    prompt = torch.randint(3, VOCAB, (2, 6))
    generated = model.generate(prompt, max_new_tokens=7, do_sample=False, **NO_EOS)
    assert torch.equal(generated, greedy_reference(model, prompt, 7))


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_kv_cache_under_either_name_gives_the_uncached_logits(name):
    """Transformers 5.24 renamed `past_key_values` to `cache` (generate and pipelines pass the installed version's
    name); a cache under a name the model ignored would leave every decoding step without its context."""
    model = tiny_model("sdpa", ssmax=True)
    input_ids = torch.randint(3, VOCAB, (2, 9))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        steps = [model(input_ids[:, :5], use_cache=True, **{name: cache}).logits]
        steps += [model(input_ids[:, t : t + 1], use_cache=True, **{name: cache}).logits for t in range(5, 9)]
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(torch.cat(steps, dim=1), no_grad_logits(model, input_ids), atol=1e-5, rtol=1e-5)


CACHE_RENAMED = version.parse(transformers.__version__) >= version.parse("5.24")  # `past_key_values` -> `cache`


def past_key_values_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message)]


@pytest.mark.parametrize("model_class", [BamLlamaForCausalLM, BamLlamaModel])
def test_past_key_values_warns_as_deprecated_only_where_cache_is_its_name(model_class):
    """Transformers 5.24's models warn (FutureWarning, `deprecate_kwarg`) when the cache comes as `past_key_values`,
    and their common tests look for it; before 5.24 it is the only name, and a warning would be wrong."""
    model = model_class(tiny_config()).eval()
    input_ids = torch.randint(3, VOCAB, (1, 4))
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids, use_cache=True, past_key_values=DynamicCache(config=model.config))
    messages = past_key_values_warnings(caught)
    if CACHE_RENAMED:
        assert messages == [f"`past_key_values` is deprecated and will be removed in version 5.40.0 for "
                            f"`{model_class.__name__}.forward`. Use `cache` instead."]
    else:
        assert messages == []
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids, use_cache=True, **({"cache": DynamicCache(config=model.config)} if CACHE_RENAMED else {}))
        if isinstance(model, BamLlamaForCausalLM):
            model.generate(input_ids, max_new_tokens=3, do_sample=False, **NO_EOS)
    assert past_key_values_warnings(caught) == []


def test_kv_cache_under_both_names():
    """From 5.24 as Transformers' models do: a warning, and `cache` is used; before, BamLlama refuses it."""
    model = tiny_model("sdpa")
    input_ids = torch.randint(3, VOCAB, (1, 4))
    caches = dict(cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))
    if not CACHE_RENAMED:
        with pytest.raises(ValueError, match="`cache` or as `past_key_values`"):
            model(input_ids, **caches)
        return
    with pytest.warns(FutureWarning, match="Both `past_key_values` and `cache` are set"), torch.no_grad():
        model(input_ids, use_cache=True, **caches)
    assert caches["cache"].get_seq_length() == 4 and caches["past_key_values"].get_seq_length() == 0


def test_checkpointed_layers_leave_a_passed_cache_as_llama_does():
    """Gradient checkpointing recomputes each layer in backward: the layer must get the cache under the name the
    installed GradientCheckpointingLayer clears, or the recompute writes the keys into it a second time."""
    input_ids = torch.randint(3, VOCAB, (1, 6))
    llama_config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    lengths = {}
    for name, model in [("bam", tiny_model("sdpa")), ("llama", LlamaForCausalLM(llama_config))]:
        model.train()
        enable_checkpointing(model)
        cache = DynamicCache(config=model.config)
        model(input_ids, labels=input_ids, use_cache=True, past_key_values=cache).loss.backward()
        lengths[name] = cache.get_seq_length()
    assert lengths["bam"] == lengths["llama"]


def test_seeded_sampling_is_reproducible_and_top_k_one_is_greedy():
    model = tiny_model("sdpa")
    prompt = torch.randint(3, VOCAB, (2, 5))
    runs = []
    for seed in (11, 11, 12):
        torch.manual_seed(seed)
        runs.append(model.generate(prompt, max_new_tokens=10, do_sample=True, top_k=0, **NO_EOS))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])
    top_one = model.generate(prompt, max_new_tokens=6, do_sample=True, top_k=1, **NO_EOS)
    assert torch.equal(top_one, greedy_reference(model, prompt, 6))


def test_beam_search_scores_are_the_sequences_log_probabilities():
    model = tiny_model("eager", ssmax=True)
    prompt = torch.randint(3, VOCAB, (1, 5))
    greedy = model.generate(prompt, max_new_tokens=6, do_sample=False, **NO_EOS)
    assert torch.equal(model.generate(prompt, max_new_tokens=6, num_beams=1, do_sample=False, **NO_EOS), greedy)

    beams = model.generate(
        prompt, max_new_tokens=6, num_beams=3, num_return_sequences=3, length_penalty=0.0, do_sample=False,
        return_dict_in_generate=True, output_scores=True, **NO_EOS,
    )
    sequences = beams.sequences
    assert sequences.shape == (3, 11) and len({tuple(row.tolist()) for row in sequences}) == 3
    log_probs = no_grad_logits(model, sequences).log_softmax(-1)
    generated_log_prob = log_probs[:, 4:-1].gather(-1, sequences[:, 5:, None]).squeeze(-1).sum(-1)
    torch.testing.assert_close(beams.sequences_scores, generated_log_prob, atol=1e-4, rtol=1e-4)
    assert (beams.sequences_scores[:-1] >= beams.sequences_scores[1:]).all()
    greedy_log_prob = no_grad_logits(model, greedy).log_softmax(-1)[0, 4:-1].gather(-1, greedy[0, 5:, None]).sum()
    assert beams.sequences_scores[0] >= greedy_log_prob - 1e-5  # the best beam is at least as likely as greedy


def test_assisted_and_prompt_lookup_decoding_equal_greedy():
    model = tiny_model("sdpa", ssmax=True)
    assistant = tiny_model("sdpa", seed=3, num_hidden_layers=1)  # another, smaller BamLlama
    prompt = torch.randint(3, VOCAB, (1, 6))
    prompt = torch.cat([prompt, prompt[:, :3]], dim=1)  # a repeat for prompt lookup to find
    greedy = model.generate(prompt, max_new_tokens=8, do_sample=False, **NO_EOS)
    assisted = model.generate(prompt, assistant_model=assistant, max_new_tokens=8, do_sample=False, **NO_EOS)
    assert torch.equal(assisted, greedy)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=3, max_new_tokens=8, do_sample=False, **NO_EOS)
    assert torch.equal(lookup, greedy)


def test_generation_continues_from_returned_past_key_values():
    model = tiny_model("sdpa", ssmax=True, prior_scope="layer")
    input_ids, attention_mask = left_padded([torch.randint(3, VOCAB, (n,)) for n in (7, 4)])
    kwargs = dict(do_sample=False, return_dict_in_generate=True, output_scores=True, **NO_EOS)
    one_shot = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, **kwargs)

    first = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, **kwargs)
    longer_mask = F.pad(attention_mask, (0, 3), value=1)
    second = model.generate(
        first.sequences, attention_mask=longer_mask, past_key_values=first.past_key_values, max_new_tokens=2, **kwargs
    )
    assert torch.equal(second.sequences, one_shot.sequences)
    for ours, expected in zip(first.scores + second.scores, one_shot.scores):
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    for ours, expected in zip(second.past_key_values.layers, one_shot.past_key_values.layers):
        torch.testing.assert_close(ours.keys, expected.keys)
        torch.testing.assert_close(ours.values, expected.values)


def test_generate_returns_scores_attentions_and_hidden_states_per_step():
    model = tiny_model("eager", ssmax=True)
    prompt = torch.randint(3, VOCAB, (2, 6))
    out = model.generate(
        prompt, max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_scores=True,
        output_logits=True, output_attentions=True, output_hidden_states=True, **NO_EOS,
    )
    assert len(out.scores) == len(out.attentions) == len(out.hidden_states) == 4
    full = no_grad_logits(model, out.sequences)
    for step in range(4):
        torch.testing.assert_close(out.logits[step], full[:, 5 + step], atol=1e-5, rtol=1e-5)
        queries, keys = (6, 6) if step == 0 else (1, 6 + step)
        assert len(out.attentions[step]) == 2 and out.attentions[step][0].shape == (2, 4, queries, keys)
        assert len(out.hidden_states[step]) == 3 and out.hidden_states[step][0].shape == (2, queries, 32)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_static_cache_generation_of_a_left_padded_batch_equals_dynamic(implementation):
    model = tiny_model(implementation, ssmax=True)
    input_ids, attention_mask = left_padded([torch.randint(3, VOCAB, (n,)) for n in (8, 3)])
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=6, do_sample=False, **NO_EOS)
    dynamic = model.generate(input_ids, **kwargs)
    static = model.generate(input_ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, dynamic)
    for b, length in enumerate((8, 3)):  # and every row equals its generation alone
        alone = model.generate(input_ids[b : b + 1, 8 - length :], max_new_tokens=6, do_sample=False, **NO_EOS)
        assert torch.equal(dynamic[b, 8:], alone[0, length:])


def test_left_padding_with_generation_position_ids_equals_unpadded():
    """Generation passes position_ids = cumsum(mask) - 1 with pads set to 1; they must not read as packing."""
    model = tiny_model("sdpa", ssmax=True)
    rows = [torch.randint(3, VOCAB, (n,)) for n in (9, 5)]
    input_ids, attention_mask = left_padded(rows)
    position_ids = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
    padded = no_grad_logits(model, input_ids, attention_mask=attention_mask, position_ids=position_ids)
    for b, row in enumerate(rows):
        torch.testing.assert_close(padded[b, 9 - len(row) :], no_grad_logits(model, row[None])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("implementation, min_slots", [("sdpa", None), ("sdpa", 4), ("eager", None)])
def test_compiled_static_cache_generation_equals_eager(implementation, min_slots, monkeypatch):
    """Fullgraph compilation (no graph break allowed) through `generate`'s own auto-compile path on CPU. The
    backend records the graphs and runs them unoptimized, which keeps the test fast. `min_slots`: the cache size
    past which a compiled step is BAM's operator, lowered to this small cache (else it stays materialized)."""
    from bam_llama.model import attention_route_bam

    if min_slots is not None:
        monkeypatch.setattr(attention_route_bam, "TRACED_DECODE_MIN_SLOTS", min_slots)
    assert BamLlamaForCausalLM._can_compile_fullgraph
    graphs = []

    def recording_backend(graph_module, example_inputs, **options):
        graphs.append(graph_module)
        return graph_module.forward

    model = tiny_model(implementation, ssmax=True)
    prompt = torch.randint(3, VOCAB, (2, 7))
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static", **NO_EOS)
    reference = model.generate(prompt, **kwargs)
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=recording_backend)
    compile_config._compile_all_devices = True  # generate compiles on CUDA only unless told
    compiled = model.generate(prompt, compile_config=compile_config, **kwargs)
    assert graphs, "generate did not compile the decoding step"
    assert torch.equal(compiled, reference)
    operator = torch.ops.bam_llama.traced_decode_step.default
    calls = [node.target for graph in graphs for node in graph.graph.nodes if node.op == "call_function"]
    assert (operator in calls) == (min_slots is not None)


# ---------------------------------------------------------------------------------------------- attention names


@pytest.mark.parametrize(
    "requested, kept",
    [("eager", "eager"), ("sdpa", "sdpa"), ("bam_triton", "bam_triton"), ("bam_eager", "eager"), ("bam_sdpa", "sdpa")],
)
def test_config_keeps_the_attention_name_users_pass(tmp_path, requested, kept):
    tiny_model("sdpa").save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=requested)
    assert loaded.config._attn_implementation == kept
    model = tiny_model("sdpa")
    model.set_attn_implementation(requested)
    assert model.config._attn_implementation == kept
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"  # the CPU default


def test_output_attentions_in_config_is_accepted_under_eager(tmp_path):
    model = tiny_model("sdpa")
    model.set_attn_implementation("eager")
    model.config.output_attentions = True
    assert len(model(torch.randint(3, VOCAB, (1, 5)), use_cache=False).attentions) == 2
    model.config.output_attentions = False
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, output_attentions=True)  # Transformers selects "eager"
    assert loaded.config._attn_implementation == "eager" and loaded.config.output_attentions


def test_bam_attention_names_do_not_leak_into_other_models():
    bam = tiny_model("sdpa", ssmax=True)
    input_ids = torch.randint(3, VOCAB, (1, 6))
    no_grad_logits(bam, input_ids)
    bam.set_attn_implementation("eager")
    no_grad_logits(bam, input_ids, output_attentions=True)

    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
    assert "eager" not in ALL_ATTENTION_FUNCTIONS._global_mapping  # Transformers' eager is each model's own
    assert ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is sdpa_mask and ALL_MASK_ATTENTION_FUNCTIONS["eager"] is eager_mask

    llama_config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    llama = LlamaForCausalLM(llama_config).eval()
    assert llama.config._attn_implementation == "sdpa"
    calls = []
    llama.model.layers[0].self_attn.register_forward_hook(lambda module, args, output: calls.append(output[1]))
    sdpa_logits = no_grad_logits(llama, input_ids)
    assert calls == [None]  # Transformers' sdpa returns no weights; BAM's eager would have
    llama.set_attn_implementation("eager")
    assert llama.config._attn_implementation == "eager"
    torch.testing.assert_close(no_grad_logits(llama, input_ids), sdpa_logits, atol=1e-5, rtol=1e-5)
    assert calls[-1].shape == (1, 4, 6, 6)
    with pytest.raises(ValueError, match="bam_sdpa"):  # BAM's functions need the prior: no other model gets them
        llama.set_attn_implementation("bam_sdpa")


def refused(backend: str) -> str:
    """The error begins with Transformers' own wording (tools and Transformers' tests match on it), then BAM's why."""
    transformers_wording = re.escape(f'Specified `attn_implementation="{backend}"` is not supported. ')
    return f"^{transformers_wording}.*would drop the positional prior"


@pytest.mark.parametrize(
    "backend",
    ["flash_attention_2", "flash_attention_3", "flex_attention", "paged|flash_attention_2", "paged|bam_triton",
     "kernels-community/flash-attn3", "foo"],
)
def test_backends_that_drop_the_prior_are_refused(tmp_path, backend):
    model = tiny_model("sdpa")
    with pytest.raises(ValueError, match=refused(backend)):
        model.set_attn_implementation(backend)
    assert model.config._attn_implementation == "sdpa"
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=refused(backend)):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=backend)
    with pytest.raises(ValueError, match=refused(backend)):
        BamLlamaForCausalLM._from_config(tiny_config(), attn_implementation=backend)


def test_a_backend_name_written_into_the_config_is_refused_at_the_forward():
    model = tiny_model("sdpa")
    model.config._attn_implementation = "flex_attention"  # bypasses every check Transformers makes
    with pytest.raises(ValueError, match=refused("flex_attention")):
        model(torch.randint(3, VOCAB, (1, 4)))


# ---------------------------------------------------------------------------------------------- pipelines


def save_byte_model(folder):
    """A saved BamLlama folder with the byte tokenizer, as a pipeline needs."""
    torch.manual_seed(0)
    model = BamLlamaForCausalLM(tiny_config(vocab_size=BYTE_VOCAB_SIZE, pad_token_id=0, ssmax=True)).eval()
    randomize_prior(model)
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return model


PROMPT = "BAM attends"


def expected_pipeline_outputs(model):
    tokenizer = build_byte_tokenizer()
    input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    generated = model.generate(input_ids, max_new_tokens=6, do_sample=False, **NO_EOS)
    with torch.no_grad():
        features = model.model(input_ids, use_cache=False).last_hidden_state
    return {"generated": generated[0].tolist(), "features": features[0]}


def test_pipelines_on_a_saved_folder(tmp_path):
    expected = expected_pipeline_outputs(save_byte_model(tmp_path))
    generator = pipeline("text-generation", model=str(tmp_path))
    assert isinstance(generator.model, BamLlamaForCausalLM)
    output = generator(PROMPT, max_new_tokens=6, do_sample=False, return_tensors=True, eos_token_id=None)
    assert output[0]["generated_token_ids"] == expected["generated"]
    text = generator(PROMPT, max_new_tokens=6, do_sample=False, eos_token_id=None)[0]["generated_text"]
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)

    extractor = pipeline("feature-extraction", model=str(tmp_path))
    assert isinstance(extractor.model, BamLlamaModel)
    features = torch.tensor(extractor(PROMPT)[0])
    torch.testing.assert_close(features, expected["features"], atol=1e-5, rtol=1e-5)


def test_pipelines_through_remote_code_without_the_package(tmp_path):
    folder = tmp_path / "model"
    expected = expected_pipeline_outputs(save_byte_model(folder))
    torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["bam_llama"] = None  # as on a machine where bam-llama is not installed
        import torch
        from transformers import pipeline
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        generator = pipeline("text-generation", model={str(folder)!r}, trust_remote_code=True)
        assert type(generator.model).__module__.startswith("transformers_modules"), type(generator.model).__module__
        output = generator({PROMPT!r}, max_new_tokens=6, do_sample=False, return_tensors=True, eos_token_id=None)
        assert output[0]["generated_token_ids"] == expected["generated"], output
        extractor = pipeline("feature-extraction", model={str(folder)!r}, trust_remote_code=True)
        assert type(extractor.model).__name__ == "BamLlamaModel"
        features = torch.tensor(extractor({PROMPT!r})[0])
        torch.testing.assert_close(features, expected["features"], atol=1e-5, rtol=1e-5)
        print("remote pipelines OK")
        """
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = run_within([sys.executable, "-c", script], 300, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote pipelines OK" in result.stdout
