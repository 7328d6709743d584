import re

import pytest
import torch
from conftest import randomize_prior
from transformers import LlamaConfig, LlamaForCausalLM

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
from bam_llama import evaluation_bam
from bam_llama.evaluation_bam import (
    PasskeyResults,
    PasskeyTemplate,
    build_passkey_prompt,
    evaluate_passkey,
    load_model_and_tokenizer,
    prefill,
)
from bam_llama.tokenization_bam import build_byte_tokenizer


TEMPLATE = PasskeyTemplate()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny models are latency bound; several threads on a shared 2-core machine are 10-50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def tiny_bam(**overrides):
    torch.manual_seed(0)
    config = BamLlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        initializer_range=0.3, **overrides,
    )
    model = BamLlamaForCausalLM(config)
    randomize_prior(model)
    return model.eval()


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        initializer_range=0.3, max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).eval()


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def contains(sequence, part):
    return any(sequence[start : start + len(part)] == part for start in range(len(sequence) - len(part) + 1))


# ---------------------------------------------------------------------------------------------- prompt


@pytest.mark.parametrize("length", [300, 777, 2000])
def test_prompt_length_is_close_to_requested(tokenizer, length):
    prompt = build_passkey_prompt(tokenizer, length, 0.5, "12345")
    filler_tokens = len(encode(tokenizer, TEMPLATE.filler))
    assert length - filler_tokens < len(prompt) <= length


def test_short_request_gives_prompt_without_filler(tokenizer):
    prompt = tokenizer.decode(build_passkey_prompt(tokenizer, 0, 0.3, "12345"))
    assert prompt == TEMPLATE.task + TEMPLATE.info.format(passkey="12345") + TEMPLATE.question


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_passkey_sits_at_requested_depth(tokenizer, depth):
    text = tokenizer.decode(build_passkey_prompt(tokenizer, 3000, depth, "98765"))
    before_info, after_info = text.split(TEMPLATE.info.format(passkey="98765"))
    total_fillers = text.count(TEMPLATE.filler)
    assert total_fillers > 10
    assert before_info.count(TEMPLATE.filler) == round(depth * total_fillers)
    assert before_info.startswith(TEMPLATE.task) and after_info.endswith(TEMPLATE.question)


def test_passkey_digits_are_single_tokens(tokenizer):
    prompt = build_passkey_prompt(tokenizer, 1000, 0.5, "40719")
    digit_tokens = [encode(tokenizer, digit) for digit in "40719"]
    assert all(len(tokens) == 1 for tokens in digit_tokens)
    assert contains(prompt, [tokens[0] for tokens in digit_tokens])


def test_prompt_length_does_not_depend_on_key_value(tokenizer):
    assert len(build_passkey_prompt(tokenizer, 900, 0.5, "10000")) == len(
        build_passkey_prompt(tokenizer, 900, 0.5, "99999")
    )


def test_bos_is_prepended_on_request(tokenizer):
    plain = build_passkey_prompt(tokenizer, 500, 0.5, "12345")
    with_bos = build_passkey_prompt(tokenizer, 500, 0.5, "12345", add_bos=True)
    assert with_bos == [tokenizer.bos_token_id] + plain


# ---------------------------------------------------------------------------------------------- evaluation


def fake_continuation(tokenizer, answer_for_key):
    """Stands in for greedy decoding: reads the key back from the prompt and answers `answer_for_key(key)`."""

    def continuation(model, prompt_ids, max_new_tokens, chunk_size):
        key = re.search(r"The pass key is (\d+)\.", tokenizer.decode(prompt_ids)).group(1)
        return encode(tokenizer, answer_for_key(key))[:max_new_tokens]

    return continuation


def test_retrieving_model_scores_one_and_wrong_model_zero(tokenizer, monkeypatch):
    model = tiny_bam()
    monkeypatch.setattr(evaluation_bam, "greedy_continuation", fake_continuation(tokenizer, lambda key: f" {key}."))
    perfect = evaluate_passkey(model, tokenizer, [300, 600], num_depths=4, progress=False)
    assert perfect.accuracy_by_length() == {300: 1.0, 600: 1.0}

    wrong = fake_continuation(tokenizer, lambda key: f" {int(key) + 1}.")
    monkeypatch.setattr(evaluation_bam, "greedy_continuation", wrong)
    assert evaluate_passkey(model, tokenizer, [300], num_depths=4, progress=False).accuracy_by_length() == {300: 0.0}


def test_partial_key_is_wrong(tokenizer, monkeypatch):
    monkeypatch.setattr(evaluation_bam, "greedy_continuation", fake_continuation(tokenizer, lambda key: key[:-1]))
    results = evaluate_passkey(tiny_bam(), tokenizer, [300], num_depths=2, progress=False)
    assert results.correct == [[False, False]]


def test_passkeys_are_seeded_and_have_the_requested_digits(tokenizer, monkeypatch):
    monkeypatch.setattr(evaluation_bam, "greedy_continuation", fake_continuation(tokenizer, lambda key: key))
    model = tiny_bam()
    first = evaluate_passkey(model, tokenizer, [300, 400], num_depths=5, num_digits=6, seed=3, progress=False)
    again = evaluate_passkey(model, tokenizer, [300, 400], num_depths=5, num_digits=6, seed=3, progress=False)
    other = evaluate_passkey(model, tokenizer, [300, 400], num_depths=5, num_digits=6, seed=4, progress=False)
    keys = [key for row in first.passkeys for key in row]
    assert first.passkeys == again.passkeys != other.passkeys
    assert all(len(key) == 6 and key[0] != "0" for key in keys)
    assert len(set(keys)) > 1
    assert first.depths == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("make_model", [tiny_bam, tiny_llama], ids=["bam", "llama"])
def test_chunked_cache_gives_same_predictions_as_one_chunk(tokenizer, make_model):
    model = make_model()
    prompt = torch.tensor([build_passkey_prompt(tokenizer, 400, 0.5, "24680")])
    with torch.inference_mode():
        cache, chunked_logits = prefill(model, prompt, chunk_size=37)
        _, full_logits = prefill(model, prompt, chunk_size=10**6)
    assert cache.get_seq_length() == prompt.shape[1]
    torch.testing.assert_close(chunked_logits, full_logits, rtol=1e-4, atol=1e-4)

    chunked = evaluate_passkey(model, tokenizer, [300, 450], num_depths=2, chunk_size=37, progress=False)
    whole = evaluate_passkey(model, tokenizer, [300, 450], num_depths=2, chunk_size=10**6, progress=False)
    assert chunked.predictions == whole.predictions
    assert len({p for row in whole.predictions for p in row}) > 1  # the model is not constant


def test_greedy_continuation_matches_generate(tokenizer):
    model = tiny_bam()
    prompt = build_passkey_prompt(tokenizer, 300, 0.5, "13579")
    with torch.inference_mode():
        ours = evaluation_bam.greedy_continuation(model, prompt, max_new_tokens=7, chunk_size=50)
        reference = model.generate(torch.tensor([prompt]), max_new_tokens=7, min_new_tokens=7, do_sample=False)
    assert ours == reference[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------------------------------- results


def sample_results():
    return PasskeyResults(
        lengths=[256, 1024],
        depths=[0.0, 0.5, 1.0],
        correct=[[True, True, False], [False, False, True]],
        prompt_lengths=[240, 1010],
        passkeys=[["11111", "22222", "33333"], ["44444", "55555", "66666"]],
        predictions=[[" 11111.", " 22222.", " 1"], [" 0", " 0", " 66666."]],
    )


def test_results_table_and_round_trip():
    results = sample_results()
    assert results.accuracy_by_length() == pytest.approx({256: 2 / 3, 1024: 1 / 3})
    table = results.to_markdown()
    assert "| 256 | 240 | 66.7 |" in table and "| 1024 | 1010 | 33.3 |" in table
    assert "| 256 | 240 | 66.7 | ✓ | ✓ | ✗ |" in results.to_markdown(per_depth=True)
    assert PasskeyResults.from_dict(results.to_dict()) == results


def test_heatmap_is_a_png_of_the_grid(tmp_path):
    from PIL import Image

    path = tmp_path / "plots" / "passkey.png"
    sample_results().save_heatmap(path)
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 100


# ---------------------------------------------------------------------------------------------- loading


def test_load_model_with_and_without_tokenizer(tmp_path, tokenizer, capsys):
    model = tiny_bam()
    model.save_pretrained(tmp_path / "bare")
    loaded, fallback = load_model_and_tokenizer(tmp_path / "bare", device="cpu")
    assert "byte tokenizer" in capsys.readouterr().err
    assert fallback.encode("7", add_special_tokens=False) == tokenizer.encode("7", add_special_tokens=False)
    torch.testing.assert_close(loaded.lm_head.weight, model.lm_head.weight)

    tokenizer.save_pretrained(tmp_path / "with_tokenizer")
    model.save_pretrained(tmp_path / "with_tokenizer")
    _, found = load_model_and_tokenizer(tmp_path / "with_tokenizer", device="cpu")
    assert "byte tokenizer" not in capsys.readouterr().err
    assert found.bos_token == "<s>"
