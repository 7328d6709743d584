"""Passkey retrieval as in the GGD-BAM paper: the Landmark-attention prompt (or the one a model was trained on), a
random key hidden at uniformly spaced depths of each length, and the greedy answer scored against it.

The prompt is built from separately tokenized pieces; it runs through the KV cache in chunks so long contexts fit in
memory (`decoding.py`).
"""

from __future__ import annotations

import json
import random
import sys
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


@dataclass
class PasskeyResults(RetrievalResults):
    passkeys: list[list[str]] = field(default_factory=list)  # [length][depth]

    KIND = "passkey"
    DEPTH_LABEL = "depth of the key"


def is_correct(continuation: str, passkey: str) -> bool:
    """Found: the answer, past leading whitespace, starts with the key's digits and no further digit follows (a
    longer number is another number)."""
    answer = continuation.lstrip()
    return answer.startswith(passkey) and not answer[len(passkey) : len(passkey) + 1].isdigit()


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
) -> PasskeyResults:
    """Passkey retrieval accuracy for each requested prompt length, at `num_depths` depths uniformly spaced in
    [0, 1] (a number for every length, or a `DepthPlan` with fewer at some). One seeded random key per (length,
    depth), drawn in that order; correct iff the greedy continuation (num_digits + 2 new tokens), stripped of leading
    whitespace, starts with the key and goes on with something else than a digit. Each length's seconds and peak
    memory are recorded."""
    lengths = [int(length) for length in lengths]
    check_positive(num_digits=num_digits)
    rng = random.Random(seed)

    def make_case(length: int, depth: float) -> RetrievalCase:
        passkey = random_passkey(rng, num_digits)
        prompt = build_passkey_prompt(tokenizer, length, depth, passkey, template, add_bos=add_bos)
        return RetrievalCase(prompt, passkey, num_digits + 2)

    rows = run_retrieval(
        model, tokenizer, lengths, DepthPlan.of(num_depths), make_case,
        lambda prediction, case: is_correct(prediction, case.expected), chunk_size, progress, "passkey",
    )
    bos = int(add_bos and tokenizer.bos_token_id is not None)  # BOS is not counted in a length
    for length, prompt_length in zip(lengths, rows.prompt_lengths):
        if prompt_length - bos > length:
            print(
                f"Warning: length {length} is below the passkey template's minimum; its prompts have "
                f"{prompt_length} tokens (see the 'Prompt tokens' column).",
                file=sys.stderr,
            )
    return PasskeyResults(lengths=lengths, passkeys=rows.expected, **rows.measures())
