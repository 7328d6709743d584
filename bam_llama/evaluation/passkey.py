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
from . import plots
from .decoding import check_positive, greedy_continuation


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


def uniform_depths(num_depths: int) -> list[float]:
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    if num_depths == 1:
        return [0.0]
    return [index / (num_depths - 1) for index in range(num_depths)]


@dataclass
class PasskeyResults:
    lengths: list[int]
    depths: list[float]
    correct: list[list[bool]]  # [length][depth]
    prompt_lengths: list[int]
    passkeys: list[list[str]] = field(default_factory=list)  # [length][depth]
    predictions: list[list[str]] = field(default_factory=list)  # decoded continuations, [length][depth]

    def accuracy_by_length(self) -> dict[int, float]:
        return {length: sum(row) / len(row) for length, row in zip(self.lengths, self.correct)}

    def mean_accuracy(self) -> float:
        cells = [cell for row in self.correct for cell in row]
        return sum(cells) / len(cells)

    def to_markdown(self, per_depth: bool = False) -> str:
        """A table `length | prompt tokens | accuracy (%)`; with `per_depth`, one ✓/✗ column per depth."""
        header = ["Length", "Prompt tokens", "Accuracy (%)"]
        if per_depth:
            header += [f"{depth:.2f}" for depth in self.depths]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        accuracy = self.accuracy_by_length()
        for length, prompt_length, row in zip(self.lengths, self.prompt_lengths, self.correct):
            cells = [str(length), str(prompt_length), f"{100 * accuracy[length]:.1f}"]
            if per_depth:
                cells += ["✓" if hit else "✗" for hit in row]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def save_heatmap(self, path, title: str = "Passkey retrieval") -> None:
        """Length (x, the table's lengths) by depth (y, 0% = key at the start of the filler) PNG, green where the
        key was retrieved, with a colour legend."""
        import torch
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure

        grid = torch.tensor(self.correct, dtype=torch.float32).T.numpy()  # (depth, length)
        figure = Figure(figsize=(max(4.5, 0.6 * len(self.lengths) + 3), 4.5))
        axes = figure.subplots()
        image = axes.imshow(
            grid, cmap=ListedColormap(["#d7301f", "#1a9850"]), vmin=0, vmax=1, aspect="auto", origin="upper"
        )
        axes.set_xticks(range(len(self.lengths)), [str(length) for length in self.lengths], rotation=45)
        axes.set_yticks(*_depth_ticks(len(self.depths)))
        axes.set_xlabel("prompt length (tokens)")
        axes.set_ylabel("depth of the key")
        axes.set_title(f"{title}\n{100 * self.mean_accuracy():.1f}% retrieved overall", fontsize=10)
        legend = figure.colorbar(image, ax=axes, ticks=[0.25, 0.75], fraction=0.08, pad=0.03)
        legend.ax.set_yticklabels(["missed", "retrieved"])
        plots.save_figure(figure, path)

    def to_dict(self) -> dict:
        return {
            "kind": "passkey",
            **asdict(self),
            "accuracy_by_length": {str(length): value for length, value in self.accuracy_by_length().items()},
        }

    @classmethod
    def from_dict(cls, values: dict) -> "PasskeyResults":
        names = {"lengths", "depths", "correct", "prompt_lengths", "passkeys", "predictions"}
        return cls(**{name: value for name, value in values.items() if name in names})


def _depth_ticks(num_depths: int) -> tuple[list[float], list[str]]:
    """Heatmap rows are depths i / (num_depths - 1): ticks at 0, 25, 50, 75 and 100% sit at row (num_depths - 1) * d."""
    if num_depths == 1:
        return [0.0], ["0%"]
    fractions = (0.0, 0.25, 0.5, 0.75, 1.0)
    return [fraction * (num_depths - 1) for fraction in fractions], [f"{fraction:.0%}" for fraction in fractions]


def is_correct(continuation: str, passkey: str) -> bool:
    """Found: the answer, past leading whitespace, starts with the key's digits and no further digit follows (a
    longer number is another number)."""
    answer = continuation.lstrip()
    return answer.startswith(passkey) and not answer[len(passkey) : len(passkey) + 1].isdigit()


def evaluate_passkey(
    model,
    tokenizer,
    lengths,
    num_depths: int = 20,
    num_digits: int = 5,
    seed: int = 0,
    chunk_size: int = 1024,
    template: PasskeyTemplate = PasskeyTemplate(),
    progress: bool = True,
    add_bos: bool = False,
) -> PasskeyResults:
    """Passkey retrieval accuracy for each requested prompt length, at `num_depths` depths uniformly spaced in
    [0, 1]. One seeded random key per (length, depth); correct iff the greedy continuation (num_digits + 2 new
    tokens), stripped of leading whitespace, starts with the key and goes on with something else than a digit."""
    import torch
    from tqdm.auto import tqdm

    lengths = [int(length) for length in lengths]
    check_positive(lengths=min(lengths, default=0), num_digits=num_digits, chunk_size=chunk_size)
    depths = uniform_depths(num_depths)
    rng = random.Random(seed)
    model.eval()
    results = PasskeyResults(lengths=lengths, depths=depths, correct=[], prompt_lengths=[])
    bar = tqdm(total=len(lengths) * len(depths), desc="passkey", disable=not progress)
    with torch.inference_mode():
        for length in lengths:
            row_correct, row_keys, row_predictions = [], [], []
            for depth in depths:
                passkey = random_passkey(rng, num_digits)
                prompt = build_passkey_prompt(tokenizer, length, depth, passkey, template, add_bos=add_bos)
                new_tokens = greedy_continuation(model, prompt, num_digits + 2, chunk_size)
                prediction = tokenizer.decode(new_tokens, skip_special_tokens=True)
                row_correct.append(is_correct(prediction, passkey))
                row_keys.append(passkey)
                row_predictions.append(prediction)
                bar.update()
            results.correct.append(row_correct)
            results.passkeys.append(row_keys)
            results.predictions.append(row_predictions)
            results.prompt_lengths.append(len(prompt))
            if len(prompt) - int(add_bos and tokenizer.bos_token_id is not None) > length:  # BOS is not counted
                print(
                    f"Warning: length {length} is below the passkey template's minimum; its prompts have "
                    f"{len(prompt)} tokens (see the 'Prompt tokens' column).",
                    file=sys.stderr,
                )
            bar.set_postfix(length=length, accuracy=f"{sum(row_correct) / len(row_correct):.2f}")
    bar.close()
    return results
