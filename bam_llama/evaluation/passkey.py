"""Passkey retrieval after the GGD-BAM paper: the Landmark-attention prompt (or the one a model was trained on), a
random key hidden at uniformly spaced depths of each length, and the answer scored two ways:

* `strict` (always): the greedy answer, past leading whitespace, is the key and no further digit;
* `teacher_forced` (on request): the reference code's scoring. The answer's first tokens, up to the one holding
  the key's first digit, are given; the prompt counts as found when the model's argmax at every later digit is
  that digit, given the true digits before it. (The reference also shows the key twice in its prompt; here the
  prompt is the template's.)

Keys come from a stream of their own (`PasskeyKeys`: the seed salted with `EVALUATION_SALT`), never twice in one
evaluation, and never one found in the training data when that is given (`keys_in_texts`).

The prompt is built from separately tokenized pieces; it runs through the KV cache in chunks so long contexts fit in
memory (`decoding.py`).
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..data.tokenizers import encode
from .decoding import check_positive
from .retrieval import DepthPlan, RetrievalCase, RetrievalResults, run_retrieval, uniform_depths  # noqa: F401


@dataclass
class PasskeyTemplate:
    """The pieces of a passkey prompt; the defaults are the paper's (Landmark-attention) prompt."""

    task: str = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there. "
    )
    filler: str = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    info: str = "The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    question: str = "What is the pass key? The pass key is"


# A model carries the prompt it was trained on in its config (`config.passkey_template`: the four pieces and
# `add_bos`). The config is the one file every save_pretrained writes, so the template survives reloading,
# bam-finetune's merged copy and a Hub push; a separate file in the folder would be lost by the first re-save.
PASSKEY_TEMPLATE_FIELD = "passkey_template"
TEMPLATE_PIECES = ("task", "filler", "info", "question")


def passkey_template_record(template: PasskeyTemplate, add_bos: bool) -> dict:
    """The JSON form of a prompt format: `{task, filler, info, question, add_bos}`."""
    return {**asdict(template), "add_bos": add_bos}


def passkey_template_from_record(record: dict, source: str) -> tuple[PasskeyTemplate, bool]:
    """`(template, add_bos)` from a record; `source` names where it came from in the error of a bad record."""
    if not isinstance(record, dict) or set(record) - {*TEMPLATE_PIECES, "add_bos"}:
        raise ValueError(f"{source}: a passkey template has the keys {', '.join(TEMPLATE_PIECES)} and add_bos")
    pieces = {name: record[name] for name in TEMPLATE_PIECES if name in record}
    if not all(isinstance(piece, str) for piece in pieces.values()) or "{passkey}" not in pieces.get("info", "{passkey}"):
        raise ValueError(f"{source}: the pieces must be strings and 'info' must contain {{passkey}}")
    return PasskeyTemplate(**pieces), bool(record.get("add_bos", False))


def save_passkey_template(model, template: PasskeyTemplate, add_bos: bool) -> None:
    """Record the prompt format `model` was trained on in its config, so save_pretrained keeps it."""
    setattr(model.config, PASSKEY_TEMPLATE_FIELD, passkey_template_record(template, add_bos))


def choose_passkey_template(choice: str, config) -> tuple[PasskeyTemplate, bool, str]:
    """`(template, add_bos, description)` for `bam-eval passkey --template`: "paper" (the paper's prompt, no BOS),
    "model" (the one the model carries, else the paper's) or the path of a JSON record."""
    if choice == "paper":
        return PasskeyTemplate(), False, "the paper's prompt"
    if choice == "model":
        record = getattr(config, PASSKEY_TEMPLATE_FIELD, None)
        if record is None:
            return PasskeyTemplate(), False, "the paper's prompt (the model carries no passkey template)"
        return *passkey_template_from_record(record, "the model's config"), "the model's own prompt"
    path = Path(choice)
    if not path.is_file():
        raise FileNotFoundError(f"--template is paper, model or a JSON file; no file at {choice}")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{choice} is not JSON: {error}") from None
    return *passkey_template_from_record(record, choice), f"the prompt in {choice}"


def build_passkey_prompt(
    tokenizer,
    length: int,
    depth: float,
    passkey: str,
    template: PasskeyTemplate = PasskeyTemplate(),
    add_bos: bool = False,
) -> list[int]:
    """Token ids of `task + filler * k_prefix + info + filler * k_suffix + question`.

    `k = max((length - |task| - |info| - |question|) // |filler|, 0)` fillers in total, `k_prefix = round(depth * k)`
    of them before the info line. Every piece is tokenized on its own (no special tokens) and the ids are
    concatenated, so a piece never merges with its neighbours. The info line is sized with a key of nines, so
    the prompt length does not depend on the key's value. With `add_bos`, the tokenizer's BOS (if any) goes first.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    task = encode(tokenizer, template.task)
    filler = encode(tokenizer, template.filler)
    info = encode(tokenizer, template.info.format(passkey=passkey))
    question = encode(tokenizer, template.question)
    sizing_info = encode(tokenizer, template.info.format(passkey="9" * len(passkey)))

    total_fillers = max((length - len(task) - len(sizing_info) - len(question)) // len(filler), 0)
    prefix_fillers = round(depth * total_fillers)
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    return (
        bos
        + task
        + filler * prefix_fillers
        + info
        + filler * (total_fillers - prefix_fillers)
        + question
    )


def random_passkey(rng: random.Random, num_digits: int) -> str:
    """A key of `num_digits` digits whose first digit is not zero."""
    return str(rng.randint(10 ** (num_digits - 1), 10**num_digits - 1))


# Evaluation keys are drawn from `random.Random(f"{EVALUATION_SALT}:{seed}")`: a stream no training set draws from
# with the same seed (a training set drawing from `random.Random(seed)` shared 9 of 20 evaluation keys before).
EVALUATION_SALT = "bam-llama evaluation passkeys"
MAX_REDRAWS = 10_000  # consecutive draws that found only used or excluded keys: the key space is spent


class PasskeyKeys:
    """The keys of one evaluation, drawn in order: from the salted stream of `seed`, none twice (not across
    lengths, not across depths), none in `excluded` (the keys found in the training data, `keys_in_texts`): such a
    key is redrawn and counted in `redrawn`. `excluded` None: the training data is unknown."""

    def __init__(self, seed: int, num_digits: int, excluded: Collection[str] | None = None):
        check_positive(num_digits=num_digits)
        self.rng = random.Random(f"{EVALUATION_SALT}:{seed}")
        self.num_digits = num_digits
        self.excluded = excluded
        self.drawn: set[str] = set()
        self.redrawn = 0

    def draw(self) -> str:
        for _ in range(MAX_REDRAWS):
            key = random_passkey(self.rng, self.num_digits)
            if self.excluded is not None and key in self.excluded:
                self.redrawn += 1
            elif key not in self.drawn:
                self.drawn.add(key)
                return key
        raise ValueError(f"no unused {self.num_digits}-digit key left outside the training data's: use more digits")

    def count_in_training(self, keys: Iterable[str]) -> int | None:
        """How many of `keys` the training data holds (None where it is unknown)."""
        return None if self.excluded is None else sum(key in self.excluded for key in keys)


def keys_in_texts(texts: Iterable[str], num_digits: int) -> set[str]:
    """Every string of `num_digits` digits that occurs in `texts`, inside longer runs of digits too: the keys an
    evaluation must not use (a training passkey is among them, as it occurs in its document)."""
    found = set()
    for text in texts:
        for run in re.findall(rf"\d{{{num_digits},}}", text):
            found.update(run[start : start + num_digits] for start in range(len(run) - num_digits + 1))
    return found


@dataclass
class PasskeyResults(RetrievalResults):
    passkeys: list[list[str]] = field(default_factory=list)  # [length][depth]
    keys_in_training: int | None = None  # evaluation keys the training data holds (0); None: not checked
    keys_redrawn: int = 0  # draws that found a key of the training data, and were drawn again

    KIND = "passkey"
    DEPTH_LABEL = "depth of the key"
    SCORE_LABEL = "Strict (%)"

    def describe_keys(self) -> str:
        """One line on where the keys came from and how many the training data held."""
        keys = sum(map(len, self.passkeys))
        if self.keys_in_training is None:
            return f"{keys} keys, all different; not checked against training data"
        return (f"{keys} keys, all different; {self.keys_in_training} of them in the training data "
                f"({self.keys_redrawn} drawn again for being there)")


def is_correct(continuation: str, passkey: str) -> bool:
    """Found: the answer, past leading whitespace, starts with the key's digits and no further digit follows (a
    longer number is another number)."""
    answer = continuation.lstrip()
    return answer.startswith(passkey) and not answer[len(passkey) : len(passkey) + 1].isdigit()


def forced_answer(tokenizer, template: PasskeyTemplate, passkey: str) -> tuple[list[int], int]:
    """(token ids of the answer, how many of them are given) for teacher-forced scoring: the answer is the key,
    behind a space unless the question ends with one, tokenized on its own; given are its tokens up to the one that
    holds the key's first digit (one digit with a tokenizer that gives each digit a token of its own)."""
    answer = encode(tokenizer, passkey if template.question[-1:].isspace() else " " + passkey)
    given = next(count for count in range(1, len(answer) + 1) if tokenizer.decode(answer[:count]).strip())
    if given == len(answer):
        raise ValueError(f"the tokenizer holds the key {passkey} in one token: no digit is left to teacher-force")
    return answer, given


def evaluate_passkey(
    model,
    tokenizer,
    lengths,
    num_depths: int | DepthPlan = 20,
    num_digits: int = 5,
    seed: int = 0,
    chunk_size: int = 1024,
    template: PasskeyTemplate = PasskeyTemplate(),
    progress: bool = True,
    add_bos: bool = False,
    keys: PasskeyKeys | None = None,
    teacher_forced: bool = False,
    description: str = "passkey",
) -> PasskeyResults:
    """Passkey retrieval accuracy for each requested prompt length, at `num_depths` depths uniformly spaced in
    [0, 1] (a number for every length, or a `DepthPlan` with fewer at some). One key per (length, depth), drawn in
    that order from `keys` (default: `PasskeyKeys(seed, num_digits)`; pass one shared drawer to calls of several
    lengths so that none repeats a key, and its `excluded` keys to keep the training data's out). Strict: correct
    iff the greedy continuation (num_digits + 2 new tokens), stripped of leading whitespace, starts with the key and
    goes on with something else than a digit. With `teacher_forced`, also the reference's score (`forced_answer`),
    after the same prefill. Each length's seconds and peak memory are recorded. `description`: the progress's label."""
    lengths = [int(length) for length in lengths]
    keys = keys or PasskeyKeys(seed, num_digits)
    redrawn_before = keys.redrawn

    def make_case(length: int, depth: float) -> RetrievalCase:
        passkey = keys.draw()
        prompt = build_passkey_prompt(tokenizer, length, depth, passkey, template, add_bos=add_bos)
        answer, given = forced_answer(tokenizer, template, passkey) if teacher_forced else (None, 0)
        return RetrievalCase(prompt, passkey, len(passkey) + 2, answer, given)

    rows = run_retrieval(
        model, tokenizer, lengths, DepthPlan.of(num_depths), make_case,
        lambda prediction, case: is_correct(prediction, case.expected), chunk_size, progress, description,
    )
    bos = int(add_bos and tokenizer.bos_token_id is not None)  # BOS is not counted in a length
    for length, prompt_length in zip(lengths, rows.prompt_lengths):
        if prompt_length - bos > length:
            print(
                f"Warning: length {length} is below the passkey template's minimum; its prompts have "
                f"{prompt_length} tokens (see the 'Prompt tokens' column).",
                file=sys.stderr,
            )
    return PasskeyResults(
        lengths=lengths, passkeys=rows.expected, keys_in_training=keys.count_in_training(sum(rows.expected, [])),
        keys_redrawn=keys.redrawn - redrawn_before, **rows.measures(),
    )
