"""Long-context evaluation of BamLlama (or any causal LM): passkey retrieval, perplexity by position, and the
learned GGD prior per head.

The protocol follows the GGD-BAM reference code: the passkey prompt is the Landmark-attention prompt, built from
separately tokenized pieces; prompts run through the KV cache in chunks so long contexts fit in memory.

Command line: `bam-eval passkey MODEL`, `bam-eval perplexity MODEL --data FILE`, `bam-eval prior MODEL`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..training.arguments import device_name, length_list, non_negative_int, positive_int
from ..outputs import check_model_path, check_safetensors_files, load_tokenizer, read_utf8_text


if TYPE_CHECKING:  # torch and Transformers are imported where used, so that --help does not load them
    import torch
    from transformers import DynamicCache


# --------------------------------------------------------------------------------------------------------
# Passkey retrieval
# --------------------------------------------------------------------------------------------------------


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


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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
    task = _encode(tokenizer, template.task)
    filler = _encode(tokenizer, template.filler)
    info = _encode(tokenizer, template.info.format(passkey=passkey))
    question = _encode(tokenizer, template.question)
    sizing_info = _encode(tokenizer, template.info.format(passkey="9" * len(passkey)))

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
        _save_figure(figure, path)

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


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def _forward_accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _with_cache(model, cache) -> dict:
    """The KV cache as the model's forward names it: `cache` from Transformers 5.24, `past_key_values` before."""
    return {"cache" if _forward_accepts(model, "cache") else "past_key_values": cache}


def prefill(model, input_ids: torch.Tensor, chunk_size: int) -> tuple[DynamicCache, torch.Tensor]:
    """Run a (1, L) prompt through a fresh cache `chunk_size` tokens at a time; returns the cache and the
    logits of the last position. Positions continue across chunks because they are read from the cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    extra = {"logits_to_keep": 1} if _forward_accepts(model, "logits_to_keep") else {}
    extra.update(_with_cache(model, cache))
    logits = None
    for chunk in input_ids.split(chunk_size, dim=1):
        logits = model(input_ids=chunk, use_cache=True, **extra).logits[:, -1]
    return cache, logits


def greedy_continuation(model, prompt_ids: list[int], max_new_tokens: int, chunk_size: int) -> list[int]:
    """Greedy decoding of `max_new_tokens` tokens after a chunked prefill, reusing the cache."""
    import torch

    input_ids = torch.tensor([prompt_ids], device=model_device(model))
    cache, logits = prefill(model, input_ids, chunk_size)
    with_cache = _with_cache(model, cache)
    new_tokens = []
    for step in range(max_new_tokens):
        next_token = logits.argmax(-1, keepdim=True)
        new_tokens.append(next_token.item())
        if step + 1 < max_new_tokens:
            logits = model(input_ids=next_token, use_cache=True, **with_cache).logits[:, -1]
    return new_tokens


def is_correct(continuation: str, passkey: str) -> bool:
    return continuation.lstrip().startswith(passkey)


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
    tokens), stripped of leading whitespace, starts with the key."""
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


# --------------------------------------------------------------------------------------------------------
# Perplexity by position
# --------------------------------------------------------------------------------------------------------


@dataclass
class PerplexityResults:
    context_lengths: list[int]
    window: int
    perplexity: list[float]  # over all positions, per context length
    window_perplexity: list[list[float]]  # [context length][w]: targets at positions [w * window, (w + 1) * window)
    num_sequences: list[int]

    def window_ends(self, context_length: int) -> list[int]:
        """The last position (exclusive) of each window of a context length."""
        return [min(start + self.window, context_length) for start in range(0, context_length, self.window)]

    def to_markdown(self, per_window: bool = False) -> str:
        """A table `context length | sequences | perplexity | last-window perplexity`; with `per_window`, a second
        table of perplexity by position (rows) and context length (columns)."""
        lines = [
            "| Context length | Sequences | Perplexity | Perplexity of the last window |",
            "|---|---|---|---|",
        ]
        for length, count, overall, windows in zip(
            self.context_lengths, self.num_sequences, self.perplexity, self.window_perplexity
        ):
            lines.append(f"| {length} | {count} | {overall:.3f} | {windows[-1]:.3f} |")
        if per_window:
            lines += ["", "| Positions | " + " | ".join(str(length) for length in self.context_lengths) + " |"]
            lines.append("|---|" + "---|" * len(self.context_lengths))
            for index, end in enumerate(self.window_ends(max(self.context_lengths))):
                start = index * self.window
                cells = [f"{windows[index]:.3f}" if index < len(windows) else "" for windows in self.window_perplexity]
                lines.append(f"| {start}-{end} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def save_plot(self, path, title: str = "Perplexity by position", train_length: int | None = None) -> None:
        """Perplexity of each window against its end position, one line per context length (log y)."""
        from matplotlib.figure import Figure

        figure = Figure(figsize=(7, 4.5))
        axes = figure.subplots()
        for length, windows in zip(self.context_lengths, self.window_perplexity):
            axes.plot(self.window_ends(length), windows, marker="o", markersize=3, label=f"context {length}")
        if train_length is not None:
            axes.axvline(train_length, color="gray", linestyle="--", label=f"training length {train_length}")
        axes.set_yscale("log")
        axes.set_xlabel(f"position (end of each {self.window}-token window)")
        axes.set_ylabel("perplexity")
        axes.set_title(title)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
        _save_figure(figure, path)

    def to_dict(self) -> dict:
        return {"kind": "perplexity", **asdict(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "PerplexityResults":
        names = {"context_lengths", "window", "perplexity", "window_perplexity", "num_sequences"}
        return cls(**{name: value for name, value in values.items() if name in names})


def token_stream(tokenizer, text_or_token_ids) -> torch.Tensor:
    """One long 1D stream of token ids from a text, a list of texts (documents run together, as in the reference
    '10B' set) or token ids."""
    import torch

    if isinstance(text_or_token_ids, torch.Tensor):
        return text_or_token_ids.flatten().long().cpu()
    if isinstance(text_or_token_ids, str):
        text_or_token_ids = [text_or_token_ids]
    items = list(text_or_token_ids)
    if items and isinstance(items[0], str):
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to evaluate perplexity on text")
        return torch.tensor([token for text in items for token in _encode(tokenizer, text)], dtype=torch.long)
    return torch.tensor(items, dtype=torch.long)


def token_losses(model, sequence: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Per-token cross-entropy (L,) of a (1, L + 1) sequence, run through one cache `chunk_size` tokens at a time."""
    import torch
    from transformers import DynamicCache

    inputs, targets = sequence[:, :-1], sequence[:, 1:]
    cache = DynamicCache(config=model.config)
    with_cache = _with_cache(model, cache)
    losses = []
    for start in range(0, inputs.shape[1], chunk_size):
        logits = model(input_ids=inputs[:, start : start + chunk_size], use_cache=True, **with_cache).logits
        chunk_targets = targets[0, start : start + chunk_size]
        losses.append(torch.nn.functional.cross_entropy(logits[0].float(), chunk_targets, reduction="none"))
    return torch.cat(losses)


def evaluate_perplexity(
    model,
    tokenizer,
    text_or_token_ids,
    context_lengths,
    window: int = 1024,
    chunk_size: int = 1024,
    max_sequences: int | None = 8,
    add_bos: bool = False,
    progress: bool = True,
) -> PerplexityResults:
    """Perplexity by position for each context length L, as in the reference: the stream is cut into
    non-overlapping sequences of L + 1 tokens (at most `max_sequences`), each goes through one chunked KV-cache
    forward, and the per-token losses are averaged over sequences within windows of `window` positions.

    With `add_bos`, each sequence is the tokenizer's BOS followed by L tokens of the stream.
    """
    import torch
    from tqdm.auto import tqdm

    check_positive(
        context_lengths=min(context_lengths, default=0), window=window, chunk_size=chunk_size,
        max_sequences=1 if max_sequences is None else max_sequences,
    )
    stream = token_stream(tokenizer, text_or_token_ids)
    bos = [tokenizer.bos_token_id] if add_bos and tokenizer is not None and tokenizer.bos_token_id is not None else []
    device = model_device(model)
    model.eval()
    results = PerplexityResults(
        context_lengths=[int(length) for length in context_lengths], window=window,
        perplexity=[], window_perplexity=[], num_sequences=[],
    )
    with torch.inference_mode():
        for length in results.context_lengths:
            sequences = _cut_sequences(stream, length + 1 - len(bos), max_sequences)
            loss_sum = torch.zeros(length, dtype=torch.float64)
            for sequence in tqdm(sequences, desc=f"perplexity @ {length}", disable=not progress):
                sequence = torch.tensor([bos + sequence.tolist()], device=device)
                loss_sum += token_losses(model, sequence, chunk_size).double().cpu()
            mean_loss = loss_sum / len(sequences)
            window_losses = [chunk.mean().item() for chunk in mean_loss.split(window)]
            results.perplexity.append(float(torch.exp(mean_loss.mean())))
            results.window_perplexity.append([float(torch.exp(torch.tensor(loss))) for loss in window_losses])
            results.num_sequences.append(len(sequences))
    return results


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def _cut_sequences(stream: torch.Tensor, size: int, max_sequences: int | None) -> list[torch.Tensor]:
    count = stream.numel() // size
    if count == 0:
        raise ValueError(f"the evaluation data has {stream.numel()} tokens; a sequence needs {size}")
    if max_sequences is not None:
        count = min(count, max_sequences)
    return list(stream[: count * size].view(count, size))


def load_text_documents(name_or_path, config_name=None, split="test", text_column="text", max_documents=None):
    """Texts from a local plain-text file (one document), a folder saved with `Dataset.save_to_disk`, or anything
    `datasets.load_dataset` reads (a Hub name or a local data folder; streamed, so only `max_documents` documents
    are read)."""
    path = Path(name_or_path)
    if path.is_file():
        return [read_utf8_text(path)]
    import datasets

    if path.is_dir() and (path / "state.json").exists():
        rows = datasets.load_from_disk(str(path))
        rows = rows[split] if isinstance(rows, datasets.DatasetDict) else rows
    else:
        rows = datasets.load_dataset(str(name_or_path), config_name, split=split, streaming=True)
    documents = []
    for row in rows:
        if max_documents is not None and len(documents) >= max_documents:
            break
        documents.append(row[text_column])
    return documents


# --------------------------------------------------------------------------------------------------------
# The learned prior
# --------------------------------------------------------------------------------------------------------


def find_priors(model) -> list[tuple[str, torch.nn.Module]]:
    """(label, module) for every GGD prior of a model: the shared one, or one per layer. Duck-typed, so models
    loaded with trust_remote_code (whose classes are not bam_llama's) work too."""
    priors = [
        (name, module)
        for name, module in model.named_modules()
        if name.endswith("prior") and all(hasattr(module, f"theta_{part}") for part in ("alpha", "beta", "mu"))
    ]
    if not priors:
        raise ValueError(f"{type(model).__name__} has no GGD-BAM prior to plot")
    return priors


def prior_curves(prior, max_distance: int) -> torch.Tensor:
    """(H, max_distance + 1) prior b_h at causal distances i - j = 0 .. max_distance."""
    import torch

    from ..model.prior_bam import ggd_bias

    distance = -torch.arange(max_distance + 1, dtype=torch.float32, device=prior.theta_alpha.device)
    formula, eps = getattr(prior, "formula", "current"), getattr(prior, "eps", 1e-5)
    with torch.no_grad():
        return ggd_bias(distance, prior.theta_alpha, prior.theta_beta, prior.theta_mu, formula, eps).cpu()


def plot_prior(model_or_path, path, max_distance: int = 1024, layer: int | None = None) -> None:
    """Each head's penalty -b_h over distances 1 .. max_distance on log-log axes (heads differ by orders of
    magnitude; a power law is a straight line, ALiBi a slope of 1), one line per head with its parameters and its
    value at distance 0 in the legend, one subplot per prior: the shared prior, every layer's, or only `layer`'s."""
    from matplotlib.figure import Figure

    from ..model.prior_bam import prior_offset

    model = model_or_path
    if isinstance(model_or_path, (str, Path)):
        model = load_model(model_or_path, device="cpu")
    priors = _select_priors(find_priors(model), layer)
    train_length = getattr(model.config, "train_context_length", None)
    columns = min(len(priors), 3)
    rows = -(-len(priors) // columns)
    figure = Figure(figsize=(6.5 * columns, 4.5 * rows))
    distances = range(1, max_distance + 1)
    for axes, (label, prior) in zip(figure.subplots(rows, columns, squeeze=False).flat, priors):
        curves = prior_curves(prior, max_distance)
        mu = prior_offset(prior.theta_mu.detach().float()).cpu()
        for head, curve in enumerate(curves):
            alpha, beta = prior.theta_alpha[head].item(), prior.theta_beta[head].item()
            axes.plot(
                distances, -curve[1:],
                label=f"head {head}: θα={alpha:.2f} θβ={beta:.2f} μ={mu[head]:.2f}, b(0)={curve[0].item():.2g}",
            )
        if train_length and train_length <= max_distance:
            axes.axvline(train_length, color="gray", linestyle="--", label=f"training length {train_length}")
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("distance i - j (tokens)")
        axes.set_ylabel("penalty -b_h (log scale)")
        axes.set_title(label)
        axes.grid(True, which="major", alpha=0.3)
        axes.legend(fontsize="x-small", ncol=2 if len(curves) > 8 else 1)
    for axes in list(figure.axes)[len(priors) :]:
        axes.set_visible(False)
    _save_figure(figure, path)


def _select_priors(priors, layer):
    labelled = [(_prior_label(name), prior) for name, prior in priors]
    if layer is None:
        return labelled
    if len(labelled) == 1 and "layers" not in priors[0][0]:
        return labelled  # one prior shared by every layer
    wanted = [(label, prior) for (name, _), (label, prior) in zip(priors, labelled) if f"layers.{layer}." in name]
    if not wanted:
        raise ValueError(f"no prior for layer {layer}; the model has {len(priors)} layer priors")
    return wanted


def _prior_label(module_name: str) -> str:
    parts = module_name.split(".")
    if "layers" in parts:
        return f"layer {parts[parts.index('layers') + 1]}"
    return "prior shared by all layers"


# --------------------------------------------------------------------------------------------------------
# Loading and plotting helpers
# --------------------------------------------------------------------------------------------------------


def load_model(path, device=None, dtype=None, attn_implementation=None):
    """A causal LM from a folder or Hub id (BamLlama or any other), in eval mode on `device` (default: CUDA if
    available)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .. import register

    register()  # BamLlama with the Auto classes

    check_model_path(path)
    check_safetensors_files(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kwargs = {"dtype": _parse_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()


def load_model_and_tokenizer(path, tokenizer=None, device=None, dtype=None, attn_implementation=None):
    """`load_model(path, ...)` and its tokenizer: `tokenizer` (an object or a path) when given, else the one saved
    in `path`; when `path` has none, the built-in byte tokenizer, with a note on stderr."""
    model = load_model(path, device, dtype, attn_implementation)
    return model, load_tokenizer(path, model.config, tokenizer)


def _parse_dtype(dtype):
    import torch

    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    return getattr(torch, dtype)


def _save_figure(figure, path) -> None:
    """Figures are built with `matplotlib.figure.Figure` (no pyplot), so no GUI backend is ever touched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------


PASSKEY_LENGTHS = "256,512,1024,2048,4096"
PERPLEXITY_LENGTHS = "1024,4096"


def parse_lengths(values: list[str] | list[list[int]]) -> list[int]:
    """`["256,512", "1k"]` -> `[256, 512, 1024]`: lists may be comma or space separated, `k` means 1024. Values the
    parser already read (lists of ints) are flattened."""
    return [length for value in values for length in (length_list(value) if isinstance(value, str) else value)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bam-eval", description="Long-context evaluation of BamLlama or any causal LM."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    passkey = commands.add_parser(
        "passkey", help="passkey retrieval accuracy by prompt length and depth",
        description="Passkey retrieval as in the GGD-BAM paper: for every length, keys hidden at --depths depths "
        "uniformly spaced from the start to the end of the filler; accuracy of the greedy answer.",
    )
    _add_model_arguments(passkey)
    passkey.add_argument("--lengths", nargs="+", type=length_list, default=[length_list(PASSKEY_LENGTHS)],
                         help=f"requested prompt lengths in tokens, e.g. 512,1k,2k (default: {PASSKEY_LENGTHS})")
    passkey.add_argument("--depths", type=positive_int, default=20, help="depths per length (default: %(default)s)")
    passkey.add_argument("--digits", type=positive_int, default=5, help="digits of the passkey (default: %(default)s)")
    passkey.add_argument("--seed", type=int, default=0, help="seed of the random passkeys (default: %(default)s)")
    passkey.add_argument("--per-depth", action="store_true", help="print one column per depth")
    passkey.add_argument(
        "--template", default="model",
        help="the prompt: 'model' (the one the model was trained on, saved in its config; the paper's if it has "
        "none), 'paper', or a JSON file with task, filler, info ({passkey} in it), question and add_bos "
        "(default: %(default)s)",
    )
    passkey.set_defaults(run=run_passkey)

    perplexity = commands.add_parser(
        "perplexity", help="perplexity by position for several context lengths",
        description="Perplexity by position as in the GGD-BAM reference: non-overlapping sequences of each context "
        "length, one chunked KV-cache forward each, losses averaged in windows of --window positions.",
    )
    _add_model_arguments(perplexity)
    data = perplexity.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="a local text file")
    data.add_argument("--dataset", help="a datasets name or local path (load_dataset / save_to_disk folder)")
    perplexity.add_argument("--dataset-config", help="the dataset's configuration name, e.g. 20231101.en")
    perplexity.add_argument("--split", default="test", help="dataset split (default: %(default)s)")
    perplexity.add_argument("--text-column", default="text", help="dataset column with text (default: %(default)s)")
    perplexity.add_argument("--max-documents", type=positive_int, default=1000,
                            help="documents read from the dataset (default: %(default)s)")
    perplexity.add_argument("--lengths", nargs="+", type=length_list, default=[length_list(PERPLEXITY_LENGTHS)],
                            help=f"context lengths in tokens, e.g. 1k,4k,16k (default: {PERPLEXITY_LENGTHS})")
    perplexity.add_argument("--window", type=positive_int, default=1024, help="positions per window (default: %(default)s)")
    perplexity.add_argument("--max-sequences", type=positive_int, default=8,
                            help="sequences per context length (default: %(default)s)")
    perplexity.set_defaults(run=run_perplexity)

    prior = commands.add_parser(
        "prior", help="plot each head's learned prior over distance",
        description="Plot each head's GGD prior b_h over distance (the paper's Figure 1 style) from a BamLlama folder.",
    )
    prior.add_argument("model", help="BamLlama folder or Hub id")
    prior.add_argument("--out", default="prior.png", help="PNG file, or a folder to write prior.png in")
    prior.add_argument("--max-distance", type=positive_int, default=1024, help="largest distance (default: %(default)s)")
    prior.add_argument("--layer", type=non_negative_int, help="plot only this layer's prior (per-layer priors)")
    prior.set_defaults(run=run_prior)
    return parser


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hub id (BamLlama or any causal LM)")
    parser.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: the model's, else the byte tokenizer)")
    parser.add_argument("--chunk-size", type=positive_int, default=1024, help="prompt tokens per forward (default: %(default)s)")
    parser.add_argument("--add-bos", action="store_true", help="start every sequence with the tokenizer's BOS")
    parser.add_argument("--device", type=device_name, help="e.g. cuda, cuda:1, cpu (default: CUDA if available)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weights' dtype")
    parser.add_argument("--attn-implementation", help="sdpa, eager or bam_triton (default: the model's)")
    parser.add_argument("--out", help="folder for the table (.md), results (.json) and plot (.png)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _load_for_cli(args):
    return load_model_and_tokenizer(
        args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
        attn_implementation=args.attn_implementation,
    )


def run_passkey(args) -> None:
    model, tokenizer = _load_for_cli(args)
    template, template_bos, description = choose_passkey_template(args.template, model.config)
    print(f"Passkey prompts use {description}.", file=sys.stderr)
    results = evaluate_passkey(
        model, tokenizer, parse_lengths(args.lengths), num_depths=args.depths, num_digits=args.digits,
        seed=args.seed, chunk_size=args.chunk_size, progress=not args.quiet, add_bos=args.add_bos or template_bos,
        template=template,
    )
    table = results.to_markdown(per_depth=args.per_depth)
    print(table)
    print(f"Overall accuracy: {100 * results.mean_accuracy():.1f}%")
    if args.out:
        _write_outputs(args.out, "passkey", table, results.to_dict(), results.save_heatmap)


def run_perplexity(args) -> None:
    model, tokenizer = _load_for_cli(args)
    if args.data:
        documents = [read_utf8_text(Path(args.data))]
    else:
        documents = load_text_documents(
            args.dataset, args.dataset_config, args.split, args.text_column, args.max_documents
        )
    results = evaluate_perplexity(
        model, tokenizer, documents, parse_lengths(args.lengths), window=args.window, chunk_size=args.chunk_size,
        max_sequences=args.max_sequences, add_bos=args.add_bos, progress=not args.quiet,
    )
    table = results.to_markdown(per_window=True)
    print(table)
    if args.out:
        train_length = getattr(model.config, "train_context_length", None)
        _write_outputs(
            args.out, "perplexity", table, results.to_dict(), lambda path: results.save_plot(path, train_length=train_length)
        )


def run_prior(args) -> None:
    path = Path(args.out)
    if path.suffix.lower() != ".png":
        path = path / "prior.png"
    plot_prior(args.model, path, max_distance=args.max_distance, layer=args.layer)
    print(f"Wrote {path}")


def _write_outputs(folder, name: str, table: str, results: dict, save_png) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.md").write_text(table, encoding="utf-8")
    (folder / f"{name}.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    save_png(folder / f"{name}.png")
    print(f"Wrote {folder / name}.md, .json and .png")


def load_results(path) -> "PasskeyResults | PerplexityResults":
    """Results saved by `bam-eval ... --out` (their `kind` says which)."""
    values = json.loads(Path(path).read_text(encoding="utf-8"))
    kinds = {"passkey": PasskeyResults, "perplexity": PerplexityResults}
    if values.get("kind") not in kinds:
        raise ValueError(f"{path} is not a bam-eval results file (kind={values.get('kind')!r})")
    return kinds[values["kind"]].from_dict(values)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (OSError, ValueError) as error:  # a missing model, data file or tokenizer; an invalid setting
        parser.exit(2, f"bam-eval {args.command}: error: {error}\n")


if __name__ == "__main__":
    main()
