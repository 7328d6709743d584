"""The needle variants (`bam_llama.evaluation.needles`): prompts read back with regular expressions written here
(the asked values found in the prompt's own text, chains of assignments followed), the exact scoring rule, and runs
end to end through `evaluate_needles` and `bam-eval needles`."""

import json
import random
import re
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import ASSIGNMENT_PATTERN, NEEDLE_PATTERN, asked_values, randomize_prior

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
from bam_llama.cli.eval import main
from bam_llama.data.tokenizers import build_byte_tokenizer, train_bpe_tokenizer
from bam_llama.evaluation import retrieval
from bam_llama.evaluation.needle_tasks import NEEDLE_KINDS, NeedleTask
from bam_llama.evaluation.needles import Haystack, NeedleResults, build_needle_prompt, evaluate_needles, is_exact
from bam_llama.evaluation.results import load_results
from bam_llama.evaluation.retrieval import DepthPlan

LIBRARY = Path(sysconfig.get_paths()["stdlib"])
HAYSTACK_FILES = ("textwrap.py", "bisect.py", "colorsys.py", "fnmatch.py")


@pytest.fixture(scope="module")
def documents():
    return [(LIBRARY / name).read_text(encoding="utf-8") for name in HAYSTACK_FILES]


@pytest.fixture(scope="module")
def haystack(documents):
    return Haystack(documents)


@pytest.fixture(scope="module")
def byte_tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def bpe_tokenizer(documents):
    return train_bpe_tokenizer(documents, 700)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------ a reference reading


def needle_texts(text: str) -> list[str]:
    """Every needle of a prompt, in order."""
    return [match.group(0) for match in re.finditer(f"{NEEDLE_PATTERN.pattern}|{ASSIGNMENT_PATTERN.pattern}", text)]


def find(sequence, part, start=0):
    return next(index for index in range(start, len(sequence) - len(part) + 1) if sequence[index : index + len(part)] == part)


# ------------------------------------------------------------------------------------ prompts


@pytest.mark.parametrize("kind", NEEDLE_KINDS)
@pytest.mark.parametrize("length", [400, 1000, 3000])
def test_prompts_have_the_requested_length_and_ask_what_their_text_holds(kind, length, haystack, byte_tokenizer):
    prompt = build_needle_prompt(byte_tokenizer, haystack, NeedleTask(kind), length, 0.3, random.Random(length), add_bos=True)
    ids = prompt.ids
    assert len(ids) == length + 1 and ids[0] == byte_tokenizer.bos_token_id
    text = byte_tokenizer.decode(ids[1:])
    assert text == prompt.text
    assert asked_values(text) == prompt.question.values
    assert prompt.question.answer == " " + ", ".join(prompt.question.values)


@pytest.mark.parametrize("kind", NEEDLE_KINDS)
def test_labels_and_values_are_distinct_and_every_needle_is_in_the_text(kind, haystack, byte_tokenizer):
    task = NeedleTask(kind, keys=5, values=4, queries=4, chains=3, hops=3, digits=6)
    prompt = build_needle_prompt(byte_tokenizer, haystack, task, 2000, 0.5, random.Random(1))
    needles = needle_texts(prompt.text)
    expected_count = {"multikey": 5, "multivalue": 4, "multiquery": 4, "vartrack": 3 * 4}[kind]
    assert len(needles) == expected_count
    if kind == "vartrack":
        labels = [label for label, _, _ in ASSIGNMENT_PATTERN.findall(prompt.text)]
        values = [value for _, _, value in ASSIGNMENT_PATTERN.findall(prompt.text) if value]
        assert len(values) == 3
    else:
        labels = [label for label, _ in NEEDLE_PATTERN.findall(prompt.text)]
        values = [value for _, value in NEEDLE_PATTERN.findall(prompt.text)]
        if kind == "multivalue":
            labels = labels[:1]
    assert len(set(labels)) == len(labels) and len(set(values)) == len(values)
    assert all(len(value) == 6 and value[0] != "0" for value in values)
    # each needle is a piece of its own, starting where needle_starts says
    for start, needle in zip(prompt.needle_starts, needles):
        assert prompt.ids[start : start + len(encode(byte_tokenizer, needle))] == encode(byte_tokenizer, needle)


@pytest.mark.parametrize("kind", NEEDLE_KINDS)
@pytest.mark.parametrize("depth", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_the_asked_needle_sits_at_a_line_end_at_the_requested_depth(kind, depth, haystack, byte_tokenizer, documents):
    length = 4000
    prompt = build_needle_prompt(byte_tokenizer, haystack, NeedleTask(kind), length, depth, random.Random(7))
    ids, text = prompt.ids, prompt.text
    needles = needle_texts(text)
    question = encode(byte_tokenizer, text[text.rindex(" The "):])
    needle_ids = [encode(byte_tokenizer, needle) for needle in needles]
    haystack_tokens = len(ids) - sum(map(len, needle_ids)) - len(question)
    # the asked information: the asked key's needle, the first value, the first asked label, the chain's value
    asked = asked_values(text)[0]
    anchor = next(index for index, needle in enumerate(needles) if re.search(rf"\b{asked}\.$", needle))
    position, starts = 0, []
    for needle in needle_ids:
        position = find(ids, needle, position)
        starts.append(position)
        position += len(needle)
    before = starts[anchor] - sum(len(needle) for needle in needle_ids[:anchor])
    longest_line = max(len(encode(byte_tokenizer, "\n" + line)) for doc in documents for line in doc.splitlines())
    assert abs(before - depth * haystack_tokens) <= longest_line / 2 + 1
    # at a line end (a line's last character before it, a line break after it, other needles aside), or at the
    # end of the haystack (only needles and the question after it)
    for needle in needles:
        after = text[text.index(needle) + len(needle):]
        while after.startswith((" The special", " VAR ")) and "\n" in after:  # needles at the same line end
            after = after[after.index(".") + 1:]
        assert after.startswith("\n") or "\n" not in after
        preceding = text[: text.index(needle)]
        assert "\n" not in after or preceding == "" or preceding[-1] == "\n" or not preceding[-1].isspace()


@pytest.mark.parametrize("kind", ["multivalue", "vartrack"])
def test_the_rest_of_the_asked_needles_follow_the_first(kind, haystack, byte_tokenizer):
    for seed in range(10):
        prompt = build_needle_prompt(byte_tokenizer, haystack, NeedleTask(kind), 3000, 0.6, random.Random(seed))
        first = prompt.text.index(f"{prompt.question.values[0]}.")
        assert first >= 0.4 * len(prompt.text)  # after the first 60% of the haystack (needles are a small share)
        if kind == "multivalue":  # values in the answer's order are in the text's order
            positions = [prompt.text.index(f" is {value}.") for value in prompt.question.values]
            assert positions == sorted(positions)


def test_prompts_are_seeded(haystack, byte_tokenizer):
    def build(seed):
        return build_needle_prompt(byte_tokenizer, haystack, NeedleTask("multikey"), 800, 0.5, random.Random(seed)).ids

    assert build(3) == build(3) != build(4)


@pytest.mark.parametrize("kind", NEEDLE_KINDS)
def test_the_prompt_text_tokenizes_whole_to_the_prompt(kind, haystack, byte_tokenizer, bpe_tokenizer):
    """A training document is the prompt's text and its answer, tokenized whole: it must give the prompt's ids
    and then the answer's (for a byte-level BPE with digits split, and for the byte tokenizer)."""
    for tokenizer in (byte_tokenizer, bpe_tokenizer):
        for seed in range(5):
            prompt = build_needle_prompt(tokenizer, haystack, NeedleTask(kind), 500, random.Random(seed).random(), random.Random(seed))
            document = encode(tokenizer, prompt.text + prompt.question.answer)
            assert document[: len(prompt.ids)] == prompt.ids
            assert tokenizer.decode(document[len(prompt.ids):]) == prompt.question.answer


def test_a_length_below_the_needles_gives_needles_and_question_only(haystack, byte_tokenizer):
    prompt = build_needle_prompt(byte_tokenizer, haystack, NeedleTask("multikey"), 10, 0.5, random.Random(0))
    assert prompt.text == "".join(needle_texts(prompt.text)) + prompt.text[prompt.text.rindex(" The "):]


def test_tasks_refuse_impossible_sizes():
    with pytest.raises(ValueError, match="keys must be at least 2"):
        NeedleTask("multikey", keys=1)
    with pytest.raises(ValueError, match="not one of"):
        NeedleTask("needle")
    with pytest.raises(ValueError, match="labels"):
        NeedleTask("vartrack", chains=30, hops=3)


# ------------------------------------------------------------------------------------ scoring


@pytest.mark.parametrize(
    ("answer", "right"),
    [
        (" 12345, 67890.", True),
        ("12345,67890 and more text", True),
        ("\n 12345 , 67890", True),
        (" 12345, 67891.", False),  # a wrong digit
        (" 12345.", False),  # a missing value
        (" 12345, 67890, 11111.", False),  # an extra value
        (" 12345, 678901", False),  # an extra digit
        (" 67890, 12345.", False),  # swapped
        (" the numbers are 12345, 67890", False),  # not an answer
        ("", False),
    ],
)
def test_scoring_is_exact(answer, right):
    assert is_exact(answer, ["12345", "67890"]) is right


# ------------------------------------------------------------------------------------ evaluation


def answering(tokenizer, answer_for):
    """Stands in for greedy decoding: reads the asked values from the prompt and answers `answer_for(values)`."""

    def continuation(model, prompt_ids, max_new_tokens, chunk_size):
        values = asked_values(tokenizer.decode(prompt_ids, skip_special_tokens=True))
        return encode(tokenizer, answer_for(values))[:max_new_tokens]

    return continuation


def tiny_bam():
    torch.manual_seed(0)
    config = BamLlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, initializer_range=0.3)
    model = BamLlamaForCausalLM(config)
    randomize_prior(model)
    return model.eval()


@pytest.mark.parametrize("kind", NEEDLE_KINDS)
def test_right_answers_score_one_and_near_misses_zero(kind, haystack, byte_tokenizer, monkeypatch):
    model, task = tiny_bam(), NeedleTask(kind)

    def run(answer_for):
        monkeypatch.setattr(retrieval, "greedy_continuation", answering(byte_tokenizer, answer_for))
        return evaluate_needles(model, byte_tokenizer, task, [300, 500], num_depths=3, haystack=haystack, progress=False)

    right = run(lambda values: " " + ", ".join(values) + ". The")
    assert right.accuracy_by_length() == {300: 1.0, 500: 1.0}
    asked = {"multikey": 1, "multivalue": task.values, "multiquery": task.queries, "vartrack": 1}[kind]
    assert all(len(answer.split(", ")) == asked for row in right.answers for answer in row)
    one_more = run(lambda values: " " + ", ".join(values + ["4"]))  # fits in the answer's token budget
    assert one_more.mean_accuracy() == 0.0
    last_digit = run(lambda values: " " + ", ".join(values[:-1] + [values[-1][:-1] + str((int(values[-1][-1]) + 1) % 10)]))
    assert last_digit.mean_accuracy() == 0.0


def test_depth_plans_and_seeds(haystack, byte_tokenizer, monkeypatch):
    monkeypatch.setattr(retrieval, "greedy_continuation", answering(byte_tokenizer, lambda values: " " + ", ".join(values)))
    task, model = NeedleTask("multiquery"), tiny_bam()
    results = evaluate_needles(model, byte_tokenizer, task, [300, 600], num_depths=DepthPlan(4, {600: 2}), seed=5,
                               haystack=haystack, progress=False)
    assert results.depths == [[0.0, 1 / 3, 2 / 3, 1.0], [0.0, 1.0]]
    assert results.depth_counts() == [4, 2] and len(results.answers[1]) == 2
    again = evaluate_needles(model, byte_tokenizer, task, [300], num_depths=4, seed=5, haystack=haystack, progress=False)
    assert again.answers[0] == results.answers[0]  # the same seed draws the same questions
    assert len(results.seconds) == 2 and all(seconds > 0 for seconds in results.seconds)
    assert all(peak > 0 for peak in results.peak_rss_mib)
    assert NeedleResults.from_dict(json.loads(json.dumps(results.to_dict()))) == results
    assert "| Depths |" in results.to_markdown() and "Found by depth" in results.to_markdown(per_depth=True)


def test_a_length_the_needles_overflow_is_flagged_and_one_they_fill_behind_bos_is_not(haystack, byte_tokenizer,
                                                                                         monkeypatch, capsys):
    """A length counts the prompt's text: a BOS in front of an exactly filled prompt is no reason to warn; needles and
    question longer than the length are, with their own token count (BOS aside)."""
    fed = []
    answer = answering(byte_tokenizer, lambda values: " " + ", ".join(values))

    def continuation(model, prompt_ids, max_new_tokens, chunk_size):
        fed.append(prompt_ids)
        return answer(model, prompt_ids, max_new_tokens, chunk_size)

    monkeypatch.setattr(retrieval, "greedy_continuation", continuation)
    task, model = NeedleTask("multikey"), tiny_bam()
    evaluate_needles(model, byte_tokenizer, task, [300], num_depths=1, haystack=haystack, add_bos=True, progress=False)
    assert len(fed[-1]) == 301 and fed[-1][0] == byte_tokenizer.bos_token_id
    assert "Warning" not in capsys.readouterr().err
    evaluate_needles(model, byte_tokenizer, task, [10], num_depths=1, haystack=haystack, add_bos=True, progress=False)
    text_tokens = len(fed[-1]) - 1
    assert text_tokens > 10
    assert f"needles and question alone take {text_tokens} tokens, more than the length 10" in capsys.readouterr().err


@pytest.fixture
def saved_model(tmp_path, byte_tokenizer):
    folder = tmp_path / "model"
    tiny_bam().save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    return folder


def test_needles_command_writes_a_table_results_and_heatmap_per_task(saved_model, tmp_path, capsys):
    haystack = tmp_path / "haystack.txt"
    haystack.write_text((LIBRARY / "textwrap.py").read_text(encoding="utf-8"))
    out = tmp_path / "needles"
    main(["needles", str(saved_model), "--tasks", "multikey,vartrack", "--lengths", "300,400", "--depths", "2,400=1",
          "--haystack", str(haystack), "--device", "cpu", "--quiet", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "multikey (4 keys, one asked)" in printed and "vartrack (2 chains of 2 hops, the end of one asked)" in printed
    for kind in ("multikey", "vartrack"):
        results = load_results(out / f"needles-{kind}.json")
        assert isinstance(results, NeedleResults) and results.needle_task == NeedleTask(kind)
        assert results.lengths == [300, 400] and results.depth_counts() == [2, 1]
        assert (out / f"needles-{kind}.md").read_text() in printed
        assert (out / f"needles-{kind}.png").stat().st_size > 0
    assert not (out / "needles-multivalue.json").exists()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--tasks", "multikey,haystack"], "--tasks"),
        (["--keys", "1"], "keys must be at least 2"),
        (["--depths", "20,64k=4"], "--depths names 65536"),
        (["--depths", "20,64k"], "--depths"),
    ],
)
def test_bad_needle_arguments_are_named_before_any_weights_load(argv, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["needles", str(tmp_path / "no-model"), "--lengths", "300", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in error and "no-model" not in error
