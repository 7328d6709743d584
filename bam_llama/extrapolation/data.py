"""A seed's data: the training texts (the no-download Python corpus with synthetic passkey documents mixed in), the
BPE trained on them, and what every model of the seed is evaluated on (never-trained documents for perplexity, the
keys the training texts hold, which no evaluation key may be).

A passkey document is the evaluation's prompt at 1x with its answer, 0 to as many fillers as fit a training row, the
key at a uniformly drawn depth; packing keeps every document that fits a row whole (`data.packing`), so each answer is
trained with its key in view. Where the study asks (`Study.extension_passkeys`), the context extension trains on texts
of its own whose passkey documents fill its longer rows: keys farther from the question than training ever put them.
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..data.corpus import Document
from ..data.tokenizers import train_bpe_tokenizer
from ..evaluation.passkey import PasskeyTemplate, keys_in_texts, random_passkey
from .settings import Study

PASSKEY_DIGITS = 5
# bam-demo's prompt with each piece opening on a space: a byte-level BPE splits words with their leading space, so
# the pieces tokenized one by one (as the evaluation builds its prompts) give the tokens of the documents tokenized whole.
TEXT_TEMPLATE = PasskeyTemplate(
    task="", filler=" The sky is blue.", info=" The pass key is {passkey}.", question=" The pass key is",
)
# Token counts in the study's BPE (digits one per token): BOS, info line 11, question 4, answer 6, EOS, one to spare;
# a filler is 5 (' The', ' sky', ' is', ' blue', '.').
PASSKEY_OVERHEAD_TOKENS = 24
FILLER_TOKENS = 5
# A file is a generated table (a codec's mapping) rather than text when more than this share of its non-blank lines
# open with a literal: the codec tables `encodings/cp*.py` have 85-93%, code files at most 25%.
GENERATED_TABLE_SHARE = 0.5
LITERAL_LINE = re.compile(r"\s*[\d'\"(\[{-]")


def max_passkey_fillers(train_length: int) -> int:
    """The most fillers a passkey document can hold and still fit in one training row."""
    return max((train_length - PASSKEY_OVERHEAD_TOKENS) // FILLER_TOKENS, 0)


def passkey_document(rng: random.Random, max_fillers: int) -> str:
    template = TEXT_TEMPLATE
    passkey = random_passkey(rng, PASSKEY_DIGITS)
    total = rng.randint(0, max_fillers)
    before = rng.randint(0, total)
    info = template.info.format(passkey=passkey)
    return template.filler * before + info + template.filler * (total - before) + template.question + " " + passkey


def check_passkey_documents(tokenizer, train_length: int) -> None:
    """The passkey pieces tokenize the same one by one (evaluation prompts) as whole (training documents), and the
    longest passkey document fits one training row with BOS and EOS: a ValueError otherwise."""
    template = TEXT_TEMPLATE
    fillers = max_passkey_fillers(train_length)
    pieces = [template.info.format(passkey="12345"), *[template.filler] * fillers, template.question, " 12345"]
    whole = tokenizer("".join(pieces), add_special_tokens=False)["input_ids"]
    one_by_one = [token for piece in pieces for token in tokenizer(piece, add_special_tokens=False)["input_ids"]]
    if whole != one_by_one:
        raise ValueError(f"the tokenizer merges passkey pieces across their boundaries: {whole} != {one_by_one}")
    if len(whole) + 2 > train_length:
        raise ValueError(f"a passkey document of {fillers} fillers has {len(whole)} tokens plus BOS and EOS, more than "
                         f"the training length {train_length}: packing would train its answer without its key")


def first_documents(documents: list[Document], max_characters: int | None) -> list[Document]:
    """Whole documents in name order until `max_characters` is reached (all of them with None)."""
    kept, characters = [], 0
    for document in documents:
        if max_characters is not None and characters >= max_characters:
            break
        kept.append(document)
        characters += len(document.text)
    return kept


def training_texts(train: list[Document], study: Study, seed: int, row_length: int | None = None) -> list[str]:
    """The training split (cut to `max_train_characters`) with passkey documents inserted at random places until they
    make `passkey_share` of the characters; the seed's own stream. The passkey documents fit rows of the training
    length, or of `row_length` (the context extension's own texts, drawn from a stream of their own)."""
    rng = random.Random(seed if row_length is None else f"extension {row_length}:{seed}")
    texts = [document.text for document in first_documents(train, study.max_train_characters)]
    passkey_characters = study.passkey_share / (1 - study.passkey_share) * sum(map(len, texts))
    max_fillers = max_passkey_fillers(row_length or study.train_length)
    while passkey_characters > 0:
        document = passkey_document(rng, max_fillers)
        texts.insert(rng.randint(0, len(texts)), document)
        passkey_characters -= len(document)
    return texts


def is_generated_table(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and sum(bool(LITERAL_LINE.match(line)) for line in lines) > GENERATED_TABLE_SHARE * len(lines)


def python_test_suites() -> list[Document]:
    """The standard library's test suites (`test/`, name order), which the corpus leaves out, so never trained on:
    the only never-trained Python files long enough for 512x. Empty on a Python shipped without them."""
    folder = Path(sysconfig.get_paths()["stdlib"]) / "test"
    return [Document("test/" + path.relative_to(folder).as_posix(), path.read_text(encoding="utf-8", errors="replace"))
            for path in sorted(folder.rglob("*.py"))]


def perplexity_documents(candidates: list[Document], tokenizer, count: int, length: int) -> dict[str, list[int]]:
    """The first `count` of `candidates` with at least `length` tokens, generated tables left out, each cut to
    `length` tokens: every length and every model of a phase is measured on these."""
    documents = {}
    for document in candidates:
        if len(documents) == count:
            break
        if len(document.text) < length or is_generated_table(document.text):
            continue  # a token holds at least one character
        tokens = tokenizer(document.text, add_special_tokens=False)["input_ids"]
        if len(tokens) >= length:
            documents[document.name] = tokens[:length]
    if len(documents) < count:
        raise ValueError(f"only {len(documents)} never-trained documents have {length} tokens, {count} asked")
    return documents


@dataclass
class SeedData:
    """What one seed's models train and are evaluated on, written in `work`."""

    work: Path
    documents: dict[str, list[int]]  # never-trained documents for position-matched perplexity
    training_keys: frozenset[str]  # every 5-digit string of the training texts: no evaluation key is one of them
    counts: dict  # the training texts' and perplexity documents' sizes, for results.json

    @property
    def texts(self) -> Path:
        return self.work / "train.jsonl"

    @property
    def tokenizer(self) -> Path:
        return self.work / "tokenizer"

    @property
    def extension_texts(self) -> Path:
        """The context extension's texts: its own where the study asks for longer passkey documents, else the
        training texts."""
        own = self.work / "extension.jsonl"
        return own if own.is_file() else self.texts


def seed_data(train: list[Document], never_trained: list[Document], study: Study, seed: int, documents: int,
              work: Path) -> SeedData:
    """The seed's training texts and BPE, written in `work`, and its evaluation data: `documents` never-trained
    documents of the phase's longest length."""
    texts = training_texts(train, study, seed)
    tokenizer = train_bpe_tokenizer(texts, study.vocab_size)
    check_passkey_documents(tokenizer, study.train_length)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(work / "tokenizer")
    write_texts(work / "train.jsonl", texts)
    keys = set(keys_in_texts(texts, PASSKEY_DIGITS))
    if study.extension_passkeys is not None:
        extension = training_texts(train, study, seed, study.extension_passkeys)
        check_passkey_documents(tokenizer, study.extension_passkeys)
        write_texts(work / "extension.jsonl", extension)
        keys |= set(keys_in_texts(extension, PASSKEY_DIGITS))
    longest = study.train_length * max(study.scales + study.long_scales)
    evaluation = perplexity_documents(never_trained, tokenizer, documents, longest)
    counts = {"texts": len(texts), "characters": sum(map(len, texts)),
              "perplexity_documents": {name: len(tokens) for name, tokens in evaluation.items()}}
    return SeedData(work, evaluation, frozenset(keys), counts)


def write_texts(path: Path, texts: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
