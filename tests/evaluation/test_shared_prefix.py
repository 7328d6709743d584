"""Prompts that open alike share one KV cache (`sharing_prefixes`): each must come out as if it ran from its start,
and only its own tokens may run."""

import functools
from contextlib import contextmanager

import pytest
import torch
from helpers import randomize_prior
from transformers import MistralConfig, MistralForCausalLM

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
from bam_llama.evaluation import retrieval
from bam_llama.evaluation.decoding import greedy_and_teacher_forced, greedy_continuation, prefill, sharing_prefixes
from bam_llama.evaluation.passkey import evaluate_passkey
from bam_llama.data.tokenizers import build_byte_tokenizer

SIZES = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             initializer_range=0.3)


def tiny_bam():
    torch.manual_seed(0)
    model = BamLlamaForCausalLM(BamLlamaConfig(**SIZES, ssmax=True, prior_scope="layer"))
    randomize_prior(model)
    return model.eval()


def prompts_with_keys_at(depths, length=180, seed=0):
    """Prompts of `length` tokens over one filler, a 5-token key of its own at each position in `depths`."""
    generator = torch.Generator().manual_seed(seed)
    filler = torch.randint(3, 259, (length,), generator=generator).tolist()
    keys = torch.randint(3, 259, (len(depths), 5), generator=generator).tolist()
    return [filler[:depth] + key + filler[depth : length - 5] for depth, key in zip(depths, keys)]


def shared_start(first, second):
    """The test's own count of the tokens two prompts share from their start."""
    count = 0
    while count < min(len(first), len(second)) and first[count] == second[count]:
        count += 1
    return count


@pytest.mark.parametrize("chunk_size", [16, 1000])
def test_each_prompt_reads_as_if_run_alone_and_only_its_own_tokens_run(chunk_size):
    """Keys at rising, falling and repeated depths (a prompt that shares all but its last token with the one before,
    a prompt that shares nothing): every prompt's last logits and greedy answer equal a fresh prefill's, at
    chunk boundaries other than the fresh one's; the tokens run are each prompt's own from where it parts from the
    one before (the answer decoded after a prompt is cut off before the next)."""
    model = tiny_bam()
    prompts = prompts_with_keys_at([40, 90, 150, 60, 60, 0])
    prompts.append(list(prompts[-1]))  # the same prompt again: only its last token runs
    with torch.inference_mode():
        alone = [prefill(model, torch.tensor([prompt]), chunk_size=7)[1] for prompt in prompts]
        answers_alone = [greedy_continuation(model, prompt, 6, chunk_size=7) for prompt in prompts]
        with sharing_prefixes(model) as shared:
            together = [prefill(model, torch.tensor([prompt]), chunk_size)[1] for prompt in prompts]
        with sharing_prefixes(model):
            answers_together = [greedy_continuation(model, prompt, 6, chunk_size) for prompt in prompts]
    for index, (expected, actual) in enumerate(zip(alone, together)):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5, msg=f"prompt {index}")
    assert answers_together == answers_alone
    assert (alone[1] - alone[2]).abs().max() > 1e-2  # the last logits depend on the key's place
    starts = [0] + [min(shared_start(before, after), len(after) - 1) for before, after in zip(prompts, prompts[1:])]
    assert starts[1:4] == [40, 90, 60] and starts[-1] == len(prompts[-1]) - 1
    assert shared.tokens_reused == sum(starts)
    assert shared.tokens_run == sum(len(prompt) for prompt in prompts) - sum(starts)


def test_teacher_forced_answers_after_a_shared_prefix_are_a_fresh_prefill_s():
    model = tiny_bam()
    prompts = prompts_with_keys_at([30, 120, 70], seed=1)
    answer = [11, 12, 13, 14]
    with torch.inference_mode():
        alone = [greedy_and_teacher_forced(model, prompt, 5, 1000, answer) for prompt in prompts]
        with sharing_prefixes(model):
            together = [greedy_and_teacher_forced(model, prompt, 5, 1000, answer) for prompt in prompts]
    assert together == alone


def test_a_sliding_window_cache_runs_every_prompt_from_its_start():
    """Mistral's sliding-window layers drop the keys that leave the window: cut back, such a cache would miss them,
    so nothing is shared (the prompts run past the window here)."""
    torch.manual_seed(0)
    config = MistralConfig(**SIZES, num_key_value_heads=4, sliding_window=32, max_position_embeddings=512)
    model = MistralForCausalLM(config).eval()
    prompts = prompts_with_keys_at([60, 120], length=150)
    with torch.inference_mode():
        alone = [prefill(model, torch.tensor([prompt]), 1000)[1] for prompt in prompts]
        with sharing_prefixes(model) as shared:
            together = [prefill(model, torch.tensor([prompt]), 1000)[1] for prompt in prompts]
    for expected, actual in zip(alone, together):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert shared.tokens_reused == 0


def test_passkey_evaluation_shares_each_length_s_filler_and_finds_what_it_found_before(monkeypatch):
    """evaluate_passkey's prompts of one length run through one cache per length (the first prompt of a length runs
    whole), with the predictions of prompts run one by one."""
    tokenizer, model = build_byte_tokenizer(), tiny_bam()
    blocks, prompts = [], []
    original, continuation = retrieval.sharing_prefixes, retrieval.greedy_continuation

    @contextmanager
    def recorded(model):
        with original(model) as shared:
            blocks.append(shared)
            prompts.append([])
            yield shared

    def recording_continuation(model, prompt_ids, max_new_tokens, chunk_size):
        prompts[-1].append(prompt_ids)
        return continuation(model, prompt_ids, max_new_tokens, chunk_size)

    lengths = [300, 450]
    with torch.inference_mode():
        shared = evaluate_passkey(model, tokenizer, lengths, num_depths=4, chunk_size=64, progress=False)
    monkeypatch.setattr(retrieval, "sharing_prefixes", recorded)
    monkeypatch.setattr(retrieval, "greedy_continuation", recording_continuation)
    with torch.inference_mode():
        again = evaluate_passkey(model, tokenizer, lengths, num_depths=4, chunk_size=64, progress=False)
    monkeypatch.setattr(retrieval, "sharing_prefixes", lambda model: torch.no_grad())  # no sharing
    monkeypatch.setattr(retrieval, "greedy_continuation", continuation)
    with torch.inference_mode():
        alone = evaluate_passkey(model, tokenizer, lengths, num_depths=4, chunk_size=64, progress=False)
    assert shared.predictions == alone.predictions == again.predictions
    assert len(blocks) == 2 and [len(asked) for asked in prompts] == [4, 4]  # one cache per length
    for block, asked in zip(blocks, prompts):
        reused = [0] + [shared_start(before, after) for before, after in zip(asked, asked[1:])]
        assert block.tokens_reused == sum(reused) and block.tokens_run == sum(map(len, asked)) - sum(reused)
        assert sum(reused) > len(asked[-1])  # the filler before the keys at depths 1/3 and 2/3, and the task


def test_a_prompt_stopped_halfway_leaves_nothing_to_share():
    """A prompt whose prefill raises after its first chunk has written part of itself into the cache: the next
    prompt, sharing more with the one before it than with the stopped one, must not read the stopped one's entries
    as the earlier prompt's."""
    model = tiny_bam()
    first, stopped, last = prompts_with_keys_at([150, 40, 120], seed=2)
    with torch.inference_mode():
        expected = prefill(model, torch.tensor([last]), 1000)[1]
        forward, calls = model.forward, []

        @functools.wraps(forward)  # the same signature: the cache keeps the name the model's forward gives it
        def stopping_forward(*args, **kwargs):
            calls.append(1)
            if len(calls) == 5:  # the second chunk of the second prompt (the first ran as 3 chunks of 64)
                raise RuntimeError("stopped")
            return forward(*args, **kwargs)

        model.forward = stopping_forward
        with sharing_prefixes(model) as shared:
            prefill(model, torch.tensor([first]), 64)
            with pytest.raises(RuntimeError, match="stopped"):
                prefill(model, torch.tensor([stopped]), 64)
            actual = prefill(model, torch.tensor([last]), 64)[1]
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert shared.tokens_reused == 0
