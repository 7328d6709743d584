import json
import os
from contextlib import contextmanager
import re
from pathlib import Path

import pytest
import reference
import torch
from helpers import one_error_line, randomize_prior, torch_threads_in_training
from transformers import LlamaConfig, LlamaForCausalLM
from waiting import run_within

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
from bam_llama.cli.eval import build_parser, main
from bam_llama.data.documents import load_documents
from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.evaluation import retrieval
from bam_llama.evaluation.decoding import greedy_continuation, load_model_and_tokenizer, prefill
from bam_llama.evaluation.passkey import (
    PasskeyResults,
    PasskeyTemplate,
    build_passkey_prompt,
    evaluate_passkey,
)
from bam_llama.evaluation.perplexity import PerplexityResults, evaluate_perplexity
from bam_llama.evaluation.plots import find_priors, plot_prior, prior_curves
from bam_llama.evaluation.costs import Cost, measured
from bam_llama.evaluation.results import load_results
from bam_llama.evaluation.retrieval import DepthPlan

TEMPLATE = PasskeyTemplate()


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
    monkeypatch.setattr(retrieval, "greedy_continuation", fake_continuation(tokenizer, lambda key: f" {key}."))
    perfect = evaluate_passkey(model, tokenizer, [300, 600], num_depths=4, progress=False)
    assert perfect.accuracy_by_length() == {300: 1.0, 600: 1.0}

    wrong = fake_continuation(tokenizer, lambda key: f" {int(key) + 1}.")
    monkeypatch.setattr(retrieval, "greedy_continuation", wrong)
    assert evaluate_passkey(model, tokenizer, [300], num_depths=4, progress=False).accuracy_by_length() == {300: 0.0}


@pytest.mark.parametrize(
    "answer, found",
    [
        (" {key}.", True), ("{key}", True), ("\n {key}\n", True), (" {key} is", True), (" {key}7", False),
        (" 0{key}", False), (" {key_less}", False), ("x{key}", False), (" {key_changed}.", False),
        ("", False), (" {spaced}", False),
    ],
)
def test_what_counts_as_found(tokenizer, monkeypatch, answer, found):
    """The answer, past leading whitespace, starts with the key and no other digit follows it: a longer number, a
    shorter one, one digit off, or the key after something else is not found."""

    def answer_for_key(key):
        changed = key[:2] + str((int(key[2]) + 1) % 10) + key[3:]
        return answer.format(key=key, key_less=key[:-1], key_changed=changed, spaced=" ".join(key))

    monkeypatch.setattr(retrieval, "greedy_continuation", fake_continuation(tokenizer, answer_for_key))
    results = evaluate_passkey(tiny_bam(), tokenizer, [300], num_depths=3, num_digits=5, progress=False)
    assert results.correct == [[found] * 3]


def test_partial_key_is_wrong(tokenizer, monkeypatch):
    monkeypatch.setattr(retrieval, "greedy_continuation", fake_continuation(tokenizer, lambda key: key[:-1]))
    results = evaluate_passkey(tiny_bam(), tokenizer, [300], num_depths=2, progress=False)
    assert results.correct == [[False, False]]


def test_passkeys_are_seeded_and_have_the_requested_digits(tokenizer, monkeypatch):
    monkeypatch.setattr(retrieval, "greedy_continuation", fake_continuation(tokenizer, lambda key: key))
    model = tiny_bam()
    first = evaluate_passkey(model, tokenizer, [300, 400], num_depths=5, num_digits=6, seed=3, progress=False)
    again = evaluate_passkey(model, tokenizer, [300, 400], num_depths=5, num_digits=6, seed=3, progress=False)
    other = evaluate_passkey(model, tokenizer, [300, 400], num_depths=5, num_digits=6, seed=4, progress=False)
    keys = [key for row in first.passkeys for key in row]
    assert first.passkeys == again.passkeys != other.passkeys
    assert all(len(key) == 6 and key[0] != "0" for key in keys)
    assert len(set(keys)) > 1
    assert first.depths == [[0.0, 0.25, 0.5, 0.75, 1.0]] * 2


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
        ours = greedy_continuation(model, prompt, max_new_tokens=7, chunk_size=50)
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
    # 95% Clopper-Pearson intervals (SciPy's beta quantiles): 2/3 -> [0.0943, 0.9916], 1/3 -> [0.0084, 0.9057],
    # printed in whole percent rounded outwards
    assert "| Length | Prompt tokens | Strict (%) | 95% interval |" in table
    assert "| 256 | 240 | 66.7 | 9-100 |" in table and "| 1024 | 1010 | 33.3 | 0-91 |" in table
    assert "| 256 | 240 | 66.7 | 9-100 | ✓ | ✓ | ✗ |" in results.to_markdown(per_depth=True)
    assert PasskeyResults.from_dict(results.to_dict()) == results


def assert_png(path):
    from PIL import Image

    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_heatmap_is_a_png(tmp_path):
    path = tmp_path / "plots" / "passkey.png"
    sample_results().save_heatmap(path)
    assert_png(path)


# ---------------------------------------------------------------------------------------------- perplexity


TEXT = (
    "Bayesian attention adds a prior over positions to every attention logit. "
    "A generalized Gaussian prior lets each head choose its own shape, local or long range. "
) * 6


def direct_token_losses(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]), reduction="none")


@pytest.mark.parametrize("make_model", [tiny_bam, tiny_llama], ids=["bam", "llama"])
def test_perplexity_matches_one_full_forward(tokenizer, make_model):
    model = make_model()
    ids = encode(tokenizer, TEXT)[:201]
    results = evaluate_perplexity(model, tokenizer, TEXT, [200], window=64, chunk_size=29, max_sequences=1,
                                  progress=False)
    losses = direct_token_losses(model, ids)
    assert results.num_sequences == [1]
    assert results.perplexity[0] == pytest.approx(losses.mean().exp().item(), rel=1e-4)
    expected_windows = [chunk.mean().exp().item() for chunk in losses.split(64)]
    assert results.window_perplexity[0] == pytest.approx(expected_windows, rel=1e-4)
    assert results.window_ends(200) == [64, 128, 192, 200]


def test_perplexity_averages_windows_over_sequences(tokenizer):
    model = tiny_bam()
    ids = encode(tokenizer, TEXT)
    results = evaluate_perplexity(model, tokenizer, ids, [40, 100], window=20, chunk_size=16, max_sequences=3,
                                  progress=False)
    assert results.num_sequences == [3, 3]
    losses = torch.stack([direct_token_losses(model, ids[start : start + 41]) for start in (0, 41, 82)]).mean(0)
    assert results.window_perplexity[0] == pytest.approx([chunk.mean().exp().item() for chunk in losses.split(20)],
                                                         rel=1e-4)
    assert all(torch.isfinite(torch.tensor(row)).all() for row in results.window_perplexity)


def test_perplexity_needs_enough_tokens(tokenizer):
    with pytest.raises(ValueError, match="needs 1001"):
        evaluate_perplexity(tiny_bam(), tokenizer, "too short", [1000], progress=False)


def test_perplexity_table_plot_and_round_trip(tmp_path):
    results = PerplexityResults(
        context_lengths=[100, 250], window=100, perplexity=[12.5, 20.25],
        window_perplexity=[[12.5], [11.0, 19.0, 40.5]], num_sequences=[4, 2],
    )
    table = results.to_markdown(per_window=True)
    assert "| 250 | 2 | 20.250 | 40.500 |" in table
    assert "| 200-250 |  | 40.500 |" in table
    results.save_plot(tmp_path / "perplexity.png", train_length=128)
    assert_png(tmp_path / "perplexity.png")
    assert PerplexityResults.from_dict(json.loads(json.dumps(results.to_dict()))) == results


# ---------------------------------------------------------------------------------------------- prior


def test_prior_curves_follow_the_model_prior():
    model = tiny_bam()
    prior = model.model.prior
    curves = prior_curves(prior, max_distance=50)
    distances = -torch.arange(51, dtype=torch.float32)  # keys 50..0 for a query at 50
    expected = reference.prior(distances, prior.theta_alpha, prior.theta_beta, prior.theta_mu)
    torch.testing.assert_close(curves, expected.float())
    from_model = prior.bias(torch.tensor([50]), 51)[0, :, 0].flip(-1)
    torch.testing.assert_close(curves, from_model)


def test_prior_plot_for_shared_and_per_layer_priors(tmp_path):
    shared, per_layer = tiny_bam(), tiny_bam(prior_scope="layer")
    assert [name for name, _ in find_priors(shared)] == ["model.prior"]
    assert len(find_priors(per_layer)) == 2
    plot_prior(shared, tmp_path / "shared.png", max_distance=100)
    plot_prior(per_layer, tmp_path / "layers.png", max_distance=100)
    plot_prior(per_layer, tmp_path / "layer1.png", max_distance=100, layer=1)
    for name in ("shared", "layers", "layer1"):
        assert_png(tmp_path / f"{name}.png")
    with pytest.raises(ValueError, match="no prior for layer 5"):
        plot_prior(per_layer, tmp_path / "none.png", layer=5)


def test_prior_plot_refuses_a_model_without_prior(tmp_path):
    with pytest.raises(ValueError, match="no GGD-BAM prior"):
        plot_prior(tiny_llama(), tmp_path / "llama.png")


# ---------------------------------------------------------------------------------------------- command line


def test_lengths_may_be_comma_or_space_separated_with_k_for_1024():
    args = build_parser().parse_args(["passkey", "model", "--lengths", "256,512", "1k", "2K,"])
    assert args.lengths == [256, 512, 1024, 2048]


@pytest.mark.parametrize("command", ["passkey", "needles", "perplexity"])
@pytest.mark.parametrize("lengths, length", [(["300", "300"], 300), (["512,1k", "1024"], 1024), (["2k,2048"], 2048)])
def test_a_length_named_twice_is_refused_in_one_line(command, lengths, length, tmp_path, capsys):
    """`--lengths 300 300` evaluated the same length twice and reported both rows (issue 47): refused, naming the
    length in tokens (1k and 1024 are the same), before any weights load."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(tmp_path / "no-such-model"), "--lengths", *lengths])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    error = stderr.strip().splitlines()[-1]
    assert error.startswith(f"bam-eval {command}: error: argument --lengths: ") and "Traceback" not in stderr
    assert f"length {length} is given twice" in error and "no-such-model" not in stderr


@pytest.mark.parametrize("command", ["passkey", "perplexity", "prior"])
def test_subcommand_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"bam-eval {command}" in capsys.readouterr().out


def test_console_script_help():
    completed = run_within(["bam-eval", "--help"], 60)
    assert completed.returncode == 0 and "passkey" in completed.stdout


@pytest.mark.parametrize("argv", [["passkey", "{missing}"], ["prior", "{missing}"]])
def test_a_missing_model_folder_is_a_clear_error(argv, tmp_path, capsys):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(missing=missing) for arg in argv])
    assert exit_info.value.code == 2
    assert f"bam-eval {argv[0]}: error: no model folder at {missing}" in capsys.readouterr().err


def test_a_missing_data_file_is_a_clear_error(saved_model, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["perplexity", str(saved_model), "--data", str(tmp_path / "missing.txt"), "--lengths", "64", "--quiet"])
    assert exit_info.value.code == 2
    assert "missing.txt" in capsys.readouterr().err


def test_lengths_below_the_template_are_flagged(saved_model, capsys):
    main(["passkey", str(saved_model), "--lengths", "8", "--depths", "1", "--quiet"])
    assert "length 8 is below the passkey template's minimum" in capsys.readouterr().err


def test_a_prompt_that_fills_its_length_behind_bos_is_not_flagged(tokenizer, capsys):
    """`length` counts the prompt's text; a BOS in front of an exactly filled prompt is no reason to warn."""
    from bam_llama.evaluation.passkey import (
        PasskeyTemplate,
        build_passkey_prompt,
        evaluate_passkey,
    )

    template = PasskeyTemplate(task="", filler="ab", info="k{passkey}.", question="?")  # bytes: 2, 7, 1
    assert len(build_passkey_prompt(tokenizer, 12, 0.0, "12345", template, add_bos=True)) == 13
    evaluate_passkey(tiny_bam(), tokenizer, [12], num_depths=1, template=template, add_bos=True, progress=False)
    assert "below the passkey template" not in capsys.readouterr().err


@pytest.fixture
def saved_model(tmp_path, tokenizer):
    folder = tmp_path / "model"
    tiny_bam().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_passkey_command_writes_table_results_and_heatmap(saved_model, tmp_path, capsys):
    out = tmp_path / "passkey"
    main(["passkey", str(saved_model), "--lengths", "300,400", "--depths", "3", "--chunk-size", "64",
          "--device", "cpu", "--quiet", "--out", str(out), "--teacher-forced"])
    printed = capsys.readouterr().out
    assert "| Length | Prompt tokens | Strict (%) | 95% interval | Teacher-forced (%) | 95% interval |" in printed
    results = load_results(out / "passkey.json")
    assert isinstance(results, PasskeyResults) and results.lengths == [300, 400] and results.depth_counts() == [3, 3]
    assert [len(row) for row in results.teacher_forced] == [3, 3]
    assert "6 keys, all different; not checked against training data" in printed
    assert (out / "passkey.md").read_text() in printed
    assert_png(out / "passkey.png")


def test_threads_of_the_evaluation_are_one_on_a_cpu_unless_asked(saved_model, tmp_path, monkeypatch):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    argv = ["perplexity", str(saved_model), "--data", str(data), "--lengths", "100", "--window", "50", "--device", "cpu",
            "--quiet"]
    with torch_threads_in_training(monkeypatch):  # OMP_NUM_THREADS unset, torch on 4 threads
        main(argv)
        assert torch.get_num_threads() == 1
        main([*argv, "--threads", "2"])
        assert torch.get_num_threads() == 2


def test_perplexity_command_on_a_text_file(saved_model, tmp_path, tokenizer, capsys):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    out = tmp_path / "perplexity"
    main(["perplexity", str(saved_model), "--data", str(data), "--lengths", "100,200", "--window", "50",
          "--device", "cpu", "--quiet", "--out", str(out)])
    results = load_results(out / "perplexity.json")
    tokens = len(encode(tokenizer, TEXT))
    assert results.context_lengths == [100, 200]
    assert results.num_sequences == [min(tokens // 101, 8), min(tokens // 201, 8)]
    assert "| Context length |" in capsys.readouterr().out
    assert_png(out / "perplexity.png")


def test_perplexity_data_from_a_saved_dataset(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": [TEXT[:300], TEXT[300:]]}).save_to_disk(str(tmp_path / "dataset"))
    documents = load_documents(str(tmp_path / "dataset"), split="train", max_documents=1)
    assert documents == [TEXT[:300]]


def test_prior_command(saved_model, tmp_path):
    main(["prior", str(saved_model), "--out", str(tmp_path / "plots"), "--max-distance", "64"])
    assert_png(tmp_path / "plots" / "prior.png")


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


# ---------------------------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    "argv, argument",
    [
        (["perplexity", "{model}", "--data", "x.txt", "--max-sequences", "0"], "--max-sequences"),
        (["perplexity", "{model}", "--data", "x.txt", "--window", "0"], "--window"),
        (["perplexity", "{model}", "--data", "x.txt", "--lengths", "-5"], "--lengths"),
        (["perplexity", "{model}", "--data", "x.txt", "--lengths", "0"], "--lengths"),
        (["perplexity", "{model}", "--data", "x.txt", "--lengths", "64,abc"], "--lengths"),
        (["passkey", "{model}", "--chunk-size", "0"], "--chunk-size"),
        (["passkey", "{model}", "--digits", "0"], "--digits"),
        (["passkey", "{model}", "--depths", "0"], "--depths"),
        (["passkey", "{model}", "--lengths", "0"], "--lengths"),
        (["passkey", "{model}", "--lengths", "512,-50"], "--lengths"),
        (["passkey", "{model}", "--device", "nonsense"], "--device"),
        (["prior", "{model}", "--max-distance", "-3"], "--max-distance"),
        (["prior", "{model}", "--layer", "-1"], "--layer"),
    ],
)
def test_a_bad_argument_is_named_before_any_weights_are_loaded(argv, argument, tmp_path, capsys):
    missing_model = str(tmp_path / "no-such-model")  # loading it first would give "no model folder" instead
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(model=missing_model) for arg in argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("bam-eval") and f"argument {argument}" in error and "Traceback" not in error


@pytest.mark.parametrize(
    "command, lengths, depths, length",
    [("needles", "300", "4,300=2,300=5", 300), ("passkey", "512,1k", "4,1k=2,1024=3", 1024),
     ("passkey", "512", "4,512=2,512=2", 512)],
)
def test_a_depth_plan_naming_a_length_twice_is_refused_in_one_line(command, lengths, depths, length, tmp_path, capsys):
    """Which of 300=2 and 300=5 would win is a guess: the parser refuses the plan, naming the length (as a number of
    tokens, so that 1k and 1024 are the same length), before any weights load."""
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(tmp_path / "no-such-model"), "--lengths", lengths, "--depths", depths])
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    error = stderr.strip().splitlines()[-1]
    assert error.startswith(f"bam-eval {command}: error: argument --depths: ") and "Traceback" not in stderr
    assert f"length {length} is given its depths twice" in error and "no-such-model" not in stderr


# ------------------------------------------------------------------------------- lengths that cannot fit in memory

NEVER_FITS = 10**12  # tokens: 512 TB of KV cache for the tiny model below, on any machine


def forbidden(what):
    def build(*args, **kwargs):
        raise AssertionError(f"{what} was built for a length that cannot fit in memory")

    return build


@pytest.mark.parametrize("command", ["passkey", "needles", "perplexity"])
def test_a_length_that_cannot_fit_in_memory_is_refused_in_one_line_before_anything_is_built(
    command, saved_model, tmp_path, monkeypatch, capsys
):
    """bam-eval passkey --lengths 400000000 built its prompt first and died of a MemoryError (issue 47). The tiny
    model's KV cache is 2 (keys, values) x 2 layers x 4 KV heads x 8 dims x 4 bytes = 512 bytes a token."""
    from bam_llama.evaluation import needles, passkey, perplexity

    monkeypatch.setattr(passkey, "build_passkey_prompt", forbidden("a passkey prompt"))
    monkeypatch.setattr(needles, "build_needle_prompt", forbidden("a needle prompt"))
    monkeypatch.setattr(perplexity, "token_stream", forbidden("a token stream"))
    text = tmp_path / "text.txt"
    text.write_text("A line of text. " * 200)
    extra = {"passkey": [], "needles": ["--tasks", "multikey", "--haystack", str(text), "--depths", "2"],
             "perplexity": ["--data", str(text)]}[command]
    with pytest.raises(SystemExit) as exit_info:
        main([command, str(saved_model), "--lengths", f"300,{NEVER_FITS}", *extra, "--device", "cpu", "--quiet"])
    assert exit_info.value.code == 2
    line = one_error_line(capsys.readouterr().err, f"bam-eval {command}")
    assert f"length {NEVER_FITS} cannot fit in memory" in line
    assert f"KV cache {512 * NEVER_FITS:,}" in line and "bytes" in line and "are available" in line


def token_need(kv_bytes_per_token: int, length: int, chunk_size: int, vocab_size: int = 259) -> dict:
    """The documented lower bound, written out: KV cache, token ids (a list, two joined copies, an int64 tensor),
    one chunk's float32 logits."""
    return {"kv": kv_bytes_per_token * length, "ids": (3 * 8 + 8) * length, "logits": min(chunk_size, length) * vocab_size * 4}


@pytest.mark.parametrize("dtype, kv_bytes_per_token", [(torch.float32, 2 * 2 * 2 * 8 * 4), (torch.bfloat16, 2 * 2 * 2 * 8 * 2)])
@pytest.mark.parametrize("chunk_size", [64, 1024])
def test_a_length_fits_up_to_the_last_byte_available(monkeypatch, dtype, kv_bytes_per_token, chunk_size):
    """Grouped heads (2 KV heads for 4 query heads), the model's dtype and the chunk's logits, against the host's
    available bytes: exactly enough is accepted, one byte less refused. A length 4,000 times the model's declared
    context stays allowed (extrapolation is what the evaluation measures)."""
    from bam_llama.evaluation import memory_needs
    from bam_llama.evaluation.memory_needs import LengthDoesNotFit, check_lengths_fit

    model = tiny_bam(num_key_value_heads=2, max_position_embeddings=64).to(dtype)
    length = 64 * 4000
    need = token_need(kv_bytes_per_token, length, chunk_size)
    total = sum(need.values())
    monkeypatch.setattr(memory_needs, "available_host_bytes", lambda: total)
    check_lengths_fit(model, [300, length], chunk_size)
    monkeypatch.setattr(memory_needs, "available_host_bytes", lambda: total - 1)
    with pytest.raises(LengthDoesNotFit) as refused:
        check_lengths_fit(model, [300, length, 2 * length], chunk_size)
    message = str(refused.value)
    assert message.startswith(f"length {length} cannot fit in memory: it needs at least {total:,} bytes")
    assert f"KV cache {need['kv']:,}, token ids {need['ids']:,}, logits of a chunk {need['logits']:,}" in message
    assert f"and {total - 1:,} bytes" in message


def test_the_kv_cache_need_reads_the_config_s_head_size_and_kv_heads(monkeypatch):
    """A head size the config sets apart from hidden_size / heads (16, not 32 / 4 = 8) and one KV head: 2 x 2
    layers x 1 x 16 x 4 bytes a token; a need counted with 8 dims, or with 4 heads, would be accepted at one byte
    less than it takes."""
    from bam_llama.evaluation import memory_needs
    from bam_llama.evaluation.memory_needs import LengthDoesNotFit, check_lengths_fit

    model, length = tiny_bam(num_key_value_heads=1, head_dim=16), 10**5
    total = sum(token_need(2 * 2 * 1 * 16 * 4, length, 64).values())
    monkeypatch.setattr(memory_needs, "available_host_bytes", lambda: total)
    check_lengths_fit(model, [length], 64)
    monkeypatch.setattr(memory_needs, "available_host_bytes", lambda: total - 1)
    with pytest.raises(LengthDoesNotFit, match=f"needs at least {total:,} bytes"):
        check_lengths_fit(model, [length], 64)


def test_on_cuda_the_cache_and_logits_are_the_device_s_and_the_ids_the_host_s(monkeypatch):
    from bam_llama.evaluation import memory_needs
    from bam_llama.evaluation.memory_needs import LengthDoesNotFit, check_lengths_fit

    model, length = tiny_bam(num_key_value_heads=2), 10**6
    need = token_need(2 * 2 * 2 * 8 * 4, length, 1024)
    monkeypatch.setattr(memory_needs, "model_device", lambda model: torch.device("cuda", 0))
    room = {"cuda": need["kv"] + need["logits"], "host": need["ids"]}
    monkeypatch.setattr(memory_needs, "available_bytes", lambda place, device: room[place])
    check_lengths_fit(model, [length], 1024)
    for place, less in (("cuda", "the cuda:0"), ("host", "the host")):
        room[place] -= 1
        with pytest.raises(LengthDoesNotFit, match=f"on {less} "):
            check_lengths_fit(model, [length], 1024)
        room[place] += 1


def test_the_host_s_available_memory_is_positive_and_at_most_its_physical_memory():
    from bam_llama.evaluation.memory_needs import available_host_bytes

    available = available_host_bytes()
    if available is None:
        pytest.skip("this system reports no available memory")
    assert 0 < available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["passkey", str(tmp_path / "no-such-model"), "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "argument --device: 'cuda': this PyTorch build" in capsys.readouterr().err


def test_help_shows_the_default_lengths_as_typed(capsys):
    with pytest.raises(SystemExit):
        main(["passkey", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "(default: 256,512,1024,2048,4096)" in usage and "['" not in usage


def test_library_calls_refuse_nonpositive_settings(tokenizer):
    model = tiny_bam()
    with pytest.raises(ValueError, match="max_sequences must be positive"):
        evaluate_perplexity(model, tokenizer, TEXT, [32], window=8, max_sequences=0, progress=False)
    with pytest.raises(ValueError, match="window must be positive"):
        evaluate_perplexity(model, tokenizer, TEXT, [32], window=0, progress=False)
    with pytest.raises(ValueError, match="lengths must be positive"):
        evaluate_passkey(model, tokenizer, [64, -50], num_depths=1, progress=False)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_safetensors_file_is_named(damage, saved_model, capsys):
    weights = saved_model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not safetensors at all")
    with pytest.raises(SystemExit) as exit_info:
        main(["passkey", str(saved_model), "--lengths", "64", "--depths", "1", "--quiet"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error == error.splitlines()[0] and f"{weights} is not a readable safetensors file" in error


def test_a_model_without_tokenizer_and_a_foreign_vocabulary_is_a_clear_error(tmp_path, capsys):
    torch.manual_seed(0)
    config = BamLlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    BamLlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    with pytest.raises(SystemExit) as exit_info:
        main(["passkey", str(tmp_path / "model"), "--lengths", "64", "--depths", "1", "--quiet"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "no tokenizer found" in error and "vocab_size is 97" in error and "Traceback" not in error


def test_a_binary_evaluation_text_is_named(tmp_path):
    binary = tmp_path / "text.txt"
    binary.write_bytes(b"first line\n\x89PNG\r\n")
    with pytest.raises(ValueError, match=re.escape(f"{binary}:2 is not UTF-8 text (byte 0x89 at offset 11)")):
        load_documents(str(binary))


def test_a_depth_plan_gives_some_lengths_fewer_depths_and_the_same_keys(tokenizer, monkeypatch):
    monkeypatch.setattr(retrieval, "greedy_continuation", fake_continuation(tokenizer, lambda key: key))
    model = tiny_bam()
    uniform = evaluate_passkey(model, tokenizer, [300, 400, 500], num_depths=5, seed=2, progress=False)
    again = evaluate_passkey(model, tokenizer, [300, 400, 500], num_depths=DepthPlan(5), seed=2, progress=False)
    assert (again.depths, again.passkeys) == (uniform.depths, uniform.passkeys)
    planned = evaluate_passkey(model, tokenizer, [300, 400, 500], num_depths=DepthPlan(5, {400: 2}), seed=2, progress=False)
    assert planned.depths == [[0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 1.0], [0.0, 0.25, 0.5, 0.75, 1.0]]
    keys = [key for row in uniform.passkeys for key in row]
    assert planned.passkeys == [keys[:5], keys[5:7], keys[7:12]]  # drawn in order, one per (length, depth)
    assert planned.describe_depths() == "5 depths (2 at 400 tokens)"
    table = planned.to_markdown(per_depth=True)
    assert "| Length | Prompt tokens | Depths | Strict (%) | 95% interval | Seconds | Peak RSS (MiB) | Found by depth |" in table
    assert f"| 400 | {uniform.prompt_lengths[1]} | 2 | 100.0 |" in table and table.count("✓✓✓✓✓") == 2
    assert PasskeyResults.from_dict(json.loads(json.dumps(planned.to_dict()))) == planned


def test_each_length_records_its_own_longest_prompt_and_cost_in_the_order_asked(tokenizer, monkeypatch):
    """Per length, in the order the lengths were asked (not sorted): the longest prompt the model was given, BOS
    included, and the seconds and peak memory of the block that ran that length's prompts, not another's."""
    blocks, fed = [], []  # fed: (block number, prompt length) of every prompt the model is given
    answer = fake_continuation(tokenizer, lambda key: key)

    def continuation(model, prompt_ids, max_new_tokens, chunk_size):
        fed.append((len(blocks), len(prompt_ids)))
        return answer(model, prompt_ids, max_new_tokens, chunk_size)

    @contextmanager
    def numbered_block(device=None):
        cost = Cost()
        blocks.append(cost)
        number = len(blocks)
        yield cost
        cost.seconds, cost.peak_rss_mib = float(number), 100.0 * number

    monkeypatch.setattr(retrieval, "greedy_continuation", continuation)
    monkeypatch.setattr(retrieval, "measured", numbered_block)
    lengths = [600, 300, 450]
    results = evaluate_passkey(tiny_bam(), tokenizer, lengths, num_depths=3, add_bos=True, progress=False)
    assert len(blocks) == 3 and sorted({block for block, _ in fed}) == [1, 2, 3]
    longest = [max(size for block, size in fed if block == number) for number in (1, 2, 3)]
    filler_tokens = len(encode(tokenizer, TEMPLATE.filler))
    assert all(length - filler_tokens < size - 1 <= length for size, length in zip(longest, lengths)), longest
    assert results.prompt_lengths == longest
    assert results.seconds == [1.0, 2.0, 3.0] and results.peak_rss_mib == [100.0, 200.0, 300.0]
    row = f"| 300 | {longest[1]} | 100.0 |"
    assert row in results.to_markdown() and results.to_markdown().split("\n")[3].endswith("| 2.0 | 200 |")


def test_a_flat_list_of_depths_is_every_length_s():
    results = PasskeyResults(lengths=[8, 16], depths=[0.0, 1.0], correct=[[True, False]] * 2, prompt_lengths=[8, 16])
    assert results.depths == [[0.0, 1.0], [0.0, 1.0]] and results.describe_depths() == "2 depths"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="the peak RSS can be reset on Linux only")
def test_each_measured_block_reports_its_own_peak_memory():
    with measured() as large:
        block = torch.ones(300 * 2**20 // 4)  # 300 MiB, touched
        del block
    with measured() as small:
        torch.ones(1).add_(1)
    assert large.peak_rss_mib - small.peak_rss_mib > 250
    assert large.seconds > 0 and large.peak_gpu_mib is None


def test_the_uneven_heatmap_draws_every_length_s_depths(tmp_path, monkeypatch):
    from bam_llama.evaluation import plots

    figures = []
    monkeypatch.setattr(plots, "save_figure", lambda figure, path: figures.append(figure))
    correct = [[True, False, True, True], [False, True]]
    PasskeyResults(lengths=[64, 128], depths=[[0, 1 / 3, 2 / 3, 1], [0, 1]], correct=correct, prompt_lengths=[60, 120]).save_heatmap("x")
    axes = figures[0].axes[0]
    meshes = axes.collections
    assert [mesh.get_array().ravel().tolist() for mesh in meshes] == [[1, 0, 1, 1], [0, 1]]
    assert [label.get_text() for label in axes.get_xticklabels()] == ["64", "128"]
