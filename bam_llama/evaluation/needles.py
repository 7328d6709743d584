"""Needle-in-a-haystack variants after RULER (Hsieh et al., 2024), harder than one passkey: several keys compete,
one key has several values, several keys are asked at once, or a value must be followed through a chain of
assignments. The haystack is real text (by default the held-out part of the no-download Python corpus,
`data/corpus.py`), so nothing is downloaded.

* `multikey`: `keys` needles `The special magic number for LABEL is VALUE.`, each with its own label; one is asked.
* `multivalue`: one label with `values` needles of different values; all are asked, in the order they appear.
* `multiquery`: `queries` labels with one value each; all are asked at once, in the order the question names them.
* `vartrack`: `chains` chains of assignments `VAR A = VALUE.`, `VAR B = VAR A.`, ... (`hops` after the value); the
  value at the end of the first chain is asked (RULER asks instead for every variable holding a value).

The asked information starts at the requested depth (the asked needle, the first value, the first asked label, the
first link of the asked chain); the other needles of the same question follow at seeded depths after it, and every
other needle (other keys, other chains) sits at a seeded depth anywhere. Depth d puts a needle at the line end nearest
to d times the haystack's tokens. Labels are distinct words, values distinct numbers of `digits` digits.

**Scoring is exact**: the answer, after leading whitespace, must be the asked values, in the asked order, separated
by commas, and nothing more: a wrong digit, a missing value, an extra value (or an extra digit) or two values
swapped is a miss. What follows the last value (a full stop, other words) is not read.

A prompt is built from separately tokenized pieces (haystack lines, each needle, the question) whose ids are
concatenated, so its length is exact. Needles open on a space, end on a full stop and sit at line ends, before the
line break, so for byte-level BPEs (and the byte tokenizer) the prompt's text tokenizes whole to the same ids: a
training document with the prompt's text and its answer (`NeedlePrompt.text`, `answer`) is what the model is asked.
"""

from __future__ import annotations

import bisect
import random
import re
import sys
from dataclasses import asdict, dataclass, field

from ..data.corpus import python_documents, split_documents
from ..data.tokenizers import encode
from .needle_tasks import LABELS, NeedleTask
from .passkey import random_passkey
from .retrieval import DepthPlan, RetrievalCase, RetrievalResults, run_retrieval

NEEDLE = " The special magic number for {label} is {value}."
ASK_ONE = " The special magic number for {label} is"
ASK_VALUES = " The special magic numbers for {label} are"
ASK_LABELS = " The special magic numbers for {labels} are"
ASSIGN_VALUE = " VAR {label} = {value}."
ASSIGN_VARIABLE = " VAR {label} = VAR {source}."
ASK_VARIABLE = " The value of VAR {label} is"
VALUE_SEPARATOR = ", "
EXTRA_ANSWER_TOKENS = 3  # room past the answer for a separator and a digit: an extra value shows

ANSWER = re.compile(r"\s*(\d+(?:\s*,\s*\d+)*)")


@dataclass
class NeedleQuestion:
    """What a prompt holds besides the haystack: groups of needle texts (group 0 is the asked information and
    starts at the requested depth; a group's needles keep their order), the question, and the asked values."""

    groups: list[list[str]]
    question: str
    values: list[str]

    @property
    def answer(self) -> str:
        """The answer's text as it follows the question: a space, then the values separated by commas."""
        return " " + VALUE_SEPARATOR.join(self.values)


def draw_question(task: NeedleTask, rng: random.Random) -> NeedleQuestion:
    """The needles, question and answer of one prompt of `task`: distinct labels and distinct values, seeded."""
    labels = rng.sample(LABELS, task.labels_needed())
    values = distinct_values(rng, task.values_needed(), task.digits)
    if task.kind == "multikey":
        groups = [[NEEDLE.format(label=label, value=value)] for label, value in zip(labels, values)]
        return NeedleQuestion(groups, ASK_ONE.format(label=labels[0]), values[:1])
    if task.kind == "multivalue":
        groups = [[NEEDLE.format(label=labels[0], value=value) for value in values]]
        return NeedleQuestion(groups, ASK_VALUES.format(label=labels[0]), values)
    if task.kind == "multiquery":
        groups = [[NEEDLE.format(label=label, value=value)] for label, value in zip(labels, values)]
        return NeedleQuestion(groups, ASK_LABELS.format(labels=join_labels(labels)), values)
    chains = [labels[start : start + task.hops + 1] for start in range(0, len(labels), task.hops + 1)]
    groups = [
        [ASSIGN_VALUE.format(label=chain[0], value=value)]
        + [ASSIGN_VARIABLE.format(label=label, source=source) for source, label in zip(chain, chain[1:])]
        for chain, value in zip(chains, values)
    ]
    return NeedleQuestion(groups, ASK_VARIABLE.format(label=chains[0][-1]), values[:1])


def distinct_values(rng: random.Random, count: int, digits: int) -> list[str]:
    values: list[str] = []
    while len(values) < count:
        value = random_passkey(rng, digits)
        if value not in values:
            values.append(value)
    return values


def join_labels(labels: list[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + " and " + labels[-1]


def needle_depths(question: NeedleQuestion, depth: float, rng: random.Random) -> list[list[float]]:
    """A depth per needle, by group: group 0 starts at `depth` and its other needles follow at sorted seeded depths
    in [depth, 1]; every other group lies at sorted seeded depths in [0, 1]."""
    depths = []
    for index, group in enumerate(question.groups):
        if index == 0:
            depths.append([depth] + sorted(rng.uniform(depth, 1.0) for _ in group[1:]))
        else:
            depths.append(sorted(rng.random() for _ in group))
    return depths


# --------------------------------------------------------------------------------------------------- haystack


class Haystack:
    """Lines of real text, trailing whitespace removed, as pieces `"\\n" + line` (a line break opens each piece,
    so a needle put between two pieces sits at a line end), tokenized once per tokenizer. Blank lines open the
    piece of the next line: a needle never sits between two line breaks, which a BPE would merge."""

    def __init__(self, documents: list[str]):
        self.pieces, blank = [], ""
        for line in (line.rstrip() for document in documents for line in document.splitlines()):
            if line:
                self.pieces.append(blank + "\n" + line)
                blank = ""
            else:
                blank += "\n"
        if not self.pieces:
            raise ValueError("the haystack has no text")
        self._tokens: dict[int, tuple[object, list[list[int]]]] = {}  # id(tokenizer): (tokenizer, ids)

    def tokens(self, tokenizer) -> list[list[int]]:
        """The ids of every piece, tokenized on its own (cached per tokenizer)."""
        if id(tokenizer) not in self._tokens:
            ids = tokenizer(self.pieces, add_special_tokens=False)["input_ids"]
            if not all(ids):
                raise ValueError("the tokenizer gives no token for a line break")
            self._tokens[id(tokenizer)] = (tokenizer, ids)
        return self._tokens[id(tokenizer)][1]

    def span(self, tokenizer, start: int, size: int) -> tuple[list[str], list[list[int]]]:
        """Consecutive pieces from piece `start` (wrapping around the end) holding `size` tokens: their texts and
        ids. The last is cut to fit (`cut_piece`): a token or two short where the cut text tokenizes to fewer."""
        tokens = self.tokens(tokenizer)
        texts, ids, total, index = [], [], 0, start
        while total < size:
            piece, piece_ids = self.pieces[index % len(tokens)], tokens[index % len(tokens)]
            if total + len(piece_ids) > size:
                piece, piece_ids = cut_piece(tokenizer, piece_ids, size - total)
                texts.append(piece)
                ids.append(piece_ids)
                break
            texts.append(piece)
            ids.append(piece_ids)
            total += len(piece_ids)
            index += 1
        return texts, ids


def cut_piece(tokenizer, ids: list[int], size: int) -> tuple[str, list[int]]:
    """The start of a piece as (text, ids) of `size` tokens when tokenized on its own. The ids' first `size` decode to
    a text that a BPE may tokenize to fewer (two line breaks merge once the rest is gone): a few more ids are tried
    before settling for fewer tokens."""
    for kept in range(size, min(size + 4, len(ids)) + 1):
        text = tokenizer.decode(ids[:kept])
        retokenized = encode(tokenizer, text)
        if len(retokenized) == size:
            return text, retokenized
    text = tokenizer.decode(ids[:size])
    return text, encode(tokenizer, text)


def corpus_haystack(heldout_fraction: float = 0.05) -> Haystack:
    """The held-out part of the no-download Python corpus (never trained on by the benchmark's models)."""
    _, heldout = split_documents(python_documents(), heldout_fraction)
    return Haystack([document.text for document in heldout])


@dataclass
class NeedlePrompt:
    """A built prompt: its pieces (texts and ids, in order), the question and its answer, and where the asked
    information starts (token index in `ids`)."""

    texts: list[str]
    piece_ids: list[list[int]]
    question: NeedleQuestion
    bos: list[int]
    anchor: int
    needle_starts: list[int] = field(default_factory=list)  # token index of every needle, in context order

    @property
    def ids(self) -> list[int]:
        return self.bos + [token for piece in self.piece_ids for token in piece]

    @property
    def text(self) -> str:
        """The prompt's text (without BOS): with `question.answer` after it, a training document."""
        return "".join(self.texts)


def build_needle_prompt(
    tokenizer, haystack: Haystack, task: NeedleTask, length: int, depth: float, rng: random.Random, add_bos: bool = False
) -> NeedlePrompt:
    """A prompt of `length` tokens (BOS not counted; more only where the needles and question alone are longer):
    haystack from a seeded line on, the needles of a drawn question at their depths, then the question."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    question = draw_question(task, rng)
    depths = needle_depths(question, depth, rng)
    start = rng.randrange(len(haystack.pieces))
    needle_ids = [[encode(tokenizer, text) for text in group] for group in question.groups]
    question_ids = encode(tokenizer, question.question)
    size = max(length - sum(len(ids) for group in needle_ids for ids in group) - len(question_ids), 0)
    texts, ids = haystack.span(tokenizer, start, size) if size else ([], [])
    boundaries = [0]  # token offsets of the places between pieces: 0, after piece 1, ..., the end
    for piece in ids:
        boundaries.append(boundaries[-1] + len(piece))
    placed = sorted(
        (nearest(boundaries, needle_depth * size), group_index, member, question.groups[group_index][member], needle_ids[group_index][member])
        for group_index, group_depths in enumerate(depths) for member, needle_depth in enumerate(group_depths)
    )
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer.bos_token_id is not None else []
    prompt = NeedlePrompt([], [], question, bos, anchor=-1)
    position, cursor = len(bos), 0
    for place, group_index, member, text, piece_ids in placed:
        for index in range(cursor, place):
            prompt.texts.append(texts[index])
            prompt.piece_ids.append(ids[index])
            position += len(ids[index])
        cursor = place
        if group_index == 0 and member == 0:
            prompt.anchor = position
        prompt.needle_starts.append(position)
        prompt.texts.append(text)
        prompt.piece_ids.append(piece_ids)
        position += len(piece_ids)
    prompt.texts += texts[cursor:] + [question.question]
    prompt.piece_ids += ids[cursor:] + [question_ids]
    return prompt


def nearest(boundaries: list[int], position: float) -> int:
    """Index of the boundary nearest to `position` (the earlier one on a tie)."""
    index = bisect.bisect_left(boundaries, position)
    if index == len(boundaries) or (index > 0 and position - boundaries[index - 1] <= boundaries[index] - position):
        return index - 1
    return index


# --------------------------------------------------------------------------------------------------- scoring


def answer_values(continuation: str) -> list[str]:
    """The numbers an answer gives: after leading whitespace, digit groups separated by commas; [] if it does not
    start with a number. What follows the last number is not read."""
    match = ANSWER.match(continuation)
    return re.findall(r"\d+", match.group(1)) if match else []


def is_exact(continuation: str, values: list[str]) -> bool:
    """All asked values, in the asked order, nothing missing, nothing extra, every digit right."""
    return answer_values(continuation) == list(values)


# --------------------------------------------------------------------------------------------------- evaluation


@dataclass
class NeedleResults(RetrievalResults):
    task: dict = field(default_factory=dict)  # the NeedleTask's fields
    answers: list[list[str]] = field(default_factory=list)  # the asked values, comma separated, [length][depth]

    KIND = "needles"
    DEPTH_LABEL = "depth of the asked needle"

    @property
    def needle_task(self) -> NeedleTask:
        return NeedleTask(**self.task)


def evaluate_needles(
    model,
    tokenizer,
    task: NeedleTask,
    lengths,
    num_depths: int | DepthPlan = 20,
    seed: int = 0,
    chunk_size: int = 1024,
    haystack: Haystack | None = None,
    add_bos: bool = False,
    progress: bool = True,
) -> NeedleResults:
    """Exact-answer accuracy of `task` for each prompt length at `num_depths` depths (see the module's text). One
    seeded prompt per (length, depth), drawn in that order; `haystack` defaults to the held-out Python corpus."""
    lengths = [int(length) for length in lengths]
    haystack = corpus_haystack() if haystack is None else haystack
    rng = random.Random(seed)

    def make_case(length: int, depth: float) -> RetrievalCase:
        prompt = build_needle_prompt(tokenizer, haystack, task, length, depth, rng, add_bos=add_bos)
        answer_tokens = len(encode(tokenizer, prompt.question.answer))
        return RetrievalCase(prompt.ids, VALUE_SEPARATOR.join(prompt.question.values), answer_tokens + EXTRA_ANSWER_TOKENS)

    rows = run_retrieval(
        model, tokenizer, lengths, DepthPlan.of(num_depths), make_case,
        lambda prediction, case: is_exact(prediction, case.expected.split(VALUE_SEPARATOR)), chunk_size, progress,
        task.kind,
    )
    bos = int(add_bos and tokenizer.bos_token_id is not None)  # BOS is not counted in a length
    for length, prompt_length in zip(lengths, rows.prompt_lengths):
        if prompt_length - bos > length:
            print(f"Warning: {task.kind}'s needles and question alone take {prompt_length - bos} tokens, more than the "
                  f"length {length}: its prompts hold no haystack", file=sys.stderr)
    return NeedleResults(lengths=lengths, task=asdict(task), answers=rows.expected, **rows.measures())
