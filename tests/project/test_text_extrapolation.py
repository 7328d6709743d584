"""benchmarks/text_extrapolation.py --quick runs the whole pipeline: six models trained by bam-pretrain, RoPE's
two extensions, perplexity and passkey at every length, results renamed into place."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import checkout_environment

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "text_extrapolation.py"
MODELS = ("bam", "bam-ssmax", "alibi", "nope", "rope", "rope-dynamic", "rope-yarn", "rope-local")


def test_quick_run_writes_every_model_at_every_length(tmp_path):
    output = tmp_path / "results"
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--output-dir", str(output)],
        capture_output=True, text=True, timeout=600, env=checkout_environment(),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((output / "results.json").read_text())
    lengths = [str(report["recipe"]["train_length"] * scale) for scale in report["recipe"]["scales"]]
    assert tuple(report["results"]) == MODELS
    for name, result in report["results"].items():
        assert list(result["perplexity"]) == lengths and list(result["passkey"]) == lengths
        for length in lengths:
            point = result["perplexity"][length]
            documents = report["corpus"]["perplexity_documents"]
            longest = int(lengths[-1])
            assert list(documents.values()) == [longest] * report["recipe"]["perplexity_documents"]
            assert point["sequences"] == len(documents) * longest // int(length)  # the same tokens at every length
            assert 1 < point["perplexity"] < 2 * report["training"]["bam"]["vocab_size"], (name, length, point)
            if length == lengths[0]:
                assert point["past_training_length"] is None
            else:
                assert 1 < point["past_training_length"] < 2 * report["training"]["bam"]["vocab_size"], (name, length)
            assert len(result["passkey"][length]["correct"][0]) == report["recipe"]["num_depths"]
        assert (output / f"passkey-{name}.png").stat().st_size > 0
    for name in ("bam", "alibi", "nope", "rope", "rope-local"):
        assert report["training"][name]["loss_after"] < report["training"][name]["loss_before"]
    assert (output / "perplexity.png").stat().st_size > 0
    assert "| rope-yarn |" in (output / "results.md").read_text()
    assert "positions past the training length" in (output / "results.md").read_text()
    assert not [path for path in tmp_path.iterdir() if path.name.endswith(".partial")]
    assert "text-extrapolation-" not in (output / "results.json").read_text()  # the scratch folder's paths


def load_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("text_extrapolation", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_training_passkey_documents_tokenize_like_the_evaluation_prompts():
    """The evaluation tokenizes the prompt's pieces one by one; a training document is tokenized whole. With a
    byte-level BPE they must give the same tokens, or the models are asked in a form they never saw."""

    from bam_llama.data.corpus import python_documents, split_documents
    from bam_llama.data.tokenizers import train_bpe_tokenizer
    from bam_llama.evaluation.passkey import build_passkey_prompt

    benchmark = load_benchmark()
    recipe = benchmark.QUICK
    texts = benchmark.training_texts(split_documents(python_documents(), 0.05)[0], recipe)
    tokenizer = train_bpe_tokenizer(texts, 1000)
    template = benchmark.TEXT_TEMPLATE
    passkey_texts = [text for text in texts if template.question in text]
    assert passkey_texts
    for text in passkey_texts[:50]:
        prompt_text, passkey = text.rsplit(" ", 1)
        whole = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        before = prompt_text.split(template.info.format(passkey=passkey))[0].count(template.filler)
        total = prompt_text.count(template.filler)
        # the evaluation's prompt with these fillers: its length in tokens and the depth of the key
        length = len(whole)
        depth = before / total if total else 0.0
        prompt = build_passkey_prompt(tokenizer, length, depth, passkey, template)
        assert prompt == whole, (text, tokenizer.convert_ids_to_tokens(prompt), tokenizer.convert_ids_to_tokens(whole))
        answer = tokenizer(text, add_special_tokens=False)["input_ids"][len(whole):]
        assert tokenizer.decode(answer).strip() == passkey and len(answer) == 1 + len(passkey)  # space, then digits
    benchmark.check_passkey_documents(tokenizer, 128)


def test_perplexity_uses_the_same_prefix_of_long_held_out_files_at_every_length():
    from dataclasses import replace

    from bam_llama.data.corpus import Document
    from bam_llama.data.tokenizers import build_byte_tokenizer

    benchmark = load_benchmark()
    recipe = replace(benchmark.QUICK, train_length=8, scales=(1, 2, 4), perplexity_documents=2)
    held_out = [Document("a.py", "x" * 31), Document("b.py", "y" * 40), Document("c.py", "z" * 32), Document("d.py", "w" * 99)]
    documents = benchmark.perplexity_documents(held_out, build_byte_tokenizer(), recipe)
    assert list(documents) == ["b.py", "c.py"] and all(len(tokens) == 32 for tokens in documents.values())
    try:
        benchmark.perplexity_documents(held_out[:1], build_byte_tokenizer(), recipe)
    except ValueError as error:
        assert "32 tokens" in str(error)
    else:
        raise AssertionError("no held-out file is long enough: expected a ValueError")


def test_perplexity_past_the_training_length_counts_only_those_positions():
    """Against per-token losses of plain forwards written here: BOS + each whole sequence, cross-entropy of every
    next token, the whole sequence and the positions past the training length averaged separately."""
    import math

    import torch
    from helpers import tiny_model

    from bam_llama.data.tokenizers import build_byte_tokenizer

    benchmark = load_benchmark()
    tokenizer = build_byte_tokenizer()
    model = tiny_model("eager", vocab_size=len(tokenizer))
    generator = torch.Generator().manual_seed(5)
    documents = {name: torch.randint(3, len(tokenizer), (24,), generator=generator).tolist() for name in ("a", "b")}
    length, train_length = 12, 4
    whole_losses, past_losses = [], []
    with torch.no_grad():
        for tokens in documents.values():
            for start in range(0, len(tokens), length):
                sequence = torch.tensor([[tokenizer.bos_token_id, *tokens[start:start + length]]])
                logits = model(input_ids=sequence).logits[0, :-1]
                losses = torch.nn.functional.cross_entropy(logits.double(), sequence[0, 1:], reduction="none")
                whole_losses += losses.tolist()
                past_losses += losses[train_length:].tolist()
    result = benchmark.sequence_perplexity(model, tokenizer, documents, length, train_length)
    assert math.isclose(result["perplexity"], math.exp(sum(whole_losses) / len(whole_losses)), rel_tol=1e-5)
    assert math.isclose(result["past_training_length"], math.exp(sum(past_losses) / len(past_losses)), rel_tol=1e-5)
    assert benchmark.sequence_perplexity(model, tokenizer, documents, train_length, train_length)["past_training_length"] is None


def test_models_flag_runs_a_subset_and_refuses_unknown_names(tmp_path):
    benchmark = load_benchmark()
    for bad in ("bam,llama", "bam,bam", ""):
        completed = subprocess.run(
            [sys.executable, str(SCRIPT), "--quick", "--models", bad, "--output-dir", str(tmp_path / "refused")],
            capture_output=True, text=True, timeout=120, env=checkout_environment(),
        )
        assert completed.returncode == 2 and "--models" in completed.stderr.strip().splitlines()[-1], completed.stderr
        assert not (tmp_path / "refused").exists()
    output = tmp_path / "nope-only"
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--models", "nope", "--output-dir", str(output)],
        capture_output=True, text=True, timeout=600, env=checkout_environment(),
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((output / "results.json").read_text())
    assert list(report["results"]) == ["nope"] and report["recipe"]["models"] == ["nope"]


def test_targets_are_judged_only_for_the_models_that_ran():
    from dataclasses import replace

    benchmark = load_benchmark()
    recipe = replace(benchmark.Recipe(), train_length=10, scales=(1, 8, 32, 64))

    def model(perplexities, found):  # one perplexity and one share of keys found per scale
        return {
            "perplexity": {10 * scale: {"perplexity": value} for scale, value in zip(recipe.scales, perplexities)},
            "passkey": {10 * scale: {"correct": [[True] * hits + [False] * (10 - hits)]} for scale, hits in zip(recipe.scales, found)},
        }

    nope = model([10, 31, 40, 50], [10, 0, 0, 0])
    assert benchmark.target_lines({"nope": nope}, recipe) == ["nope perplexity 8x / 1x = 3.10 (target >= 3): met"]
    lines = benchmark.target_lines({"bam": model([10, 10, 10, 11.5], [10, 10, 9, 9]), "alibi": model([10] * 4, [10, 5, 5, 7])}, recipe)
    assert lines == [
        "BAM perplexity 64x / 1x = 1.150 (target <= 1.10): MISSED",
        "passkey at 32x: BAM 90%, ALiBi 50% (target BAM >= 90% and >= 30 points above ALiBi): met",
        "passkey at 64x: BAM 90%, ALiBi 70% (target BAM >= 90% and >= 30 points above ALiBi): MISSED",
    ]
