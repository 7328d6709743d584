"""Perplexity by position, as in the GGD-BAM reference: non-overlapping sequences of each context length, one
chunked KV-cache forward each, the per-token losses averaged over sequences within windows of positions
(`evaluate_perplexity`, documents run together as in the reference's '10B' set); and position-matched perplexity of
whole documents, each its own sequence (`position_matched_perplexity`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..data.tokenizers import encode
from . import plots
from .decoding import check_positive, model_device, with_cache
from .memory_needs import check_lengths_fit


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
        plots.save_figure(figure, path)

    def to_dict(self) -> dict:
        return {"kind": "perplexity", **asdict(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "PerplexityResults":
        names = {"context_lengths", "window", "perplexity", "window_perplexity", "num_sequences"}
        return cls(**{name: value for name, value in values.items() if name in names})


def token_stream(tokenizer, text_or_token_ids) -> torch.Tensor:
    """One long 1D stream of token ids from a text, a list of texts (documents run together, as in the reference
    '10B' set) or token ids."""
    if isinstance(text_or_token_ids, torch.Tensor):
        return text_or_token_ids.flatten().long().cpu()
    if isinstance(text_or_token_ids, str):
        text_or_token_ids = [text_or_token_ids]
    items = list(text_or_token_ids)
    if items and isinstance(items[0], str):
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to evaluate perplexity on text")
        return torch.tensor([token for text in items for token in encode(tokenizer, text)], dtype=torch.long)
    return torch.tensor(items, dtype=torch.long)


def token_losses(model, sequence: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Per-token cross-entropy (L,) of a (1, L + 1) sequence, run through one cache `chunk_size` tokens at a time."""
    inputs, targets = sequence[:, :-1], sequence[:, 1:]
    cache = DynamicCache(config=model.config)
    cache_argument = with_cache(model, cache)
    losses = []
    for start in range(0, inputs.shape[1], chunk_size):
        logits = model(input_ids=inputs[:, start : start + chunk_size], use_cache=True, **cache_argument).logits
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
    check_positive(
        context_lengths=min(context_lengths, default=0), window=window, chunk_size=chunk_size,
        max_sequences=1 if max_sequences is None else max_sequences,
    )
    check_lengths_fit(model, context_lengths, chunk_size)  # before any sequence is cut
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


def _cut_sequences(stream: torch.Tensor, size: int, max_sequences: int | None) -> list[torch.Tensor]:
    count = stream.numel() // size
    if count == 0:
        raise ValueError(f"the evaluation data has {stream.numel()} tokens; a sequence needs {size}")
    if max_sequences is not None:
        count = min(count, max_sequences)
    return list(stream[: count * size].view(count, size))


def position_matched_perplexity(
    model, tokenizer, documents: dict[str, list[int]], length: int, train_length: int, chunk_size: int = 1024
) -> dict:
    """Each document's first `length` tokens as a sequence of its own behind the tokenizer's BOS (as a document
    starts in training; no sequence crosses documents), one chunked KV-cache forward each. The loss of token i
    (0-based, predicted from BOS and tokens < i) is at position i. Two measures, each exp of the mean loss over
    every document's tokens at the positions it names, with its counts:

    * `past_training_length`: positions [train_length, length), the tokens a model trained at `train_length`
      predicts from farther than it ever saw (None at `length` <= `train_length`);
    * `last_window`: positions [length - train_length, length), the last training-length window: the same number of
      tokens at every length, the paper's per-window curve read at the end of each length.

    `by_document` holds each document's mean losses, for paired comparisons across lengths and models."""
    if length < train_length:
        raise ValueError(f"length {length} is shorter than the training length {train_length}")
    short = [name for name, tokens in documents.items() if len(tokens) < length]
    if not documents or short:
        raise ValueError(f"position-matched perplexity at {length} needs documents of {length} tokens: {short or 'none given'}")
    if tokenizer.bos_token_id is None:
        raise ValueError("position-matched perplexity starts every document behind BOS; the tokenizer has none")
    model.eval()
    by_document = {}
    with torch.inference_mode():
        for name, tokens in documents.items():
            sequence = torch.tensor([[tokenizer.bos_token_id, *tokens[:length]]], device=model_device(model))
            losses = token_losses(model, sequence, chunk_size).double().cpu()
            by_document[name] = {
                "past_training_length": losses[train_length:].mean().item() if length > train_length else None,
                "last_window": losses[length - train_length :].mean().item(),
            }

    def measure(key: str, tokens_each: int) -> dict | None:
        if tokens_each == 0:
            return None
        mean = sum(losses[key] for losses in by_document.values()) / len(by_document)  # equal tokens per document
        return {"perplexity": math.exp(mean), "tokens": tokens_each * len(by_document)}

    return {
        "documents": len(by_document),
        "past_training_length": measure("past_training_length", length - train_length),
        "last_window": measure("last_window", train_length),
        "by_document": by_document,
    }
