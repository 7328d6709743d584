"""Long-context evaluation of BamLlama (or any causal LM): passkey retrieval, perplexity by position, and the
learned GGD prior per head.

The protocol follows the GGD-BAM reference code: the passkey prompt is the Landmark-attention prompt, built from
separately tokenized pieces; prompts run through the KV cache in chunks so long contexts fit in memory.

Command line: `bam-eval passkey MODEL`, `bam-eval perplexity MODEL --data FILE`, `bam-eval prior MODEL`.
"""

import argparse
import inspect
import json
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


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
        """Length (x) by depth (y) PNG, green where the key was retrieved."""
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure

        grid = torch.tensor(self.correct, dtype=torch.float32).T.numpy()  # (depth, length)
        figure = Figure(figsize=(max(4.0, 0.6 * len(self.lengths) + 2), 4.5))
        axes = figure.subplots()
        axes.imshow(grid, cmap=ListedColormap(["#d7301f", "#1a9850"]), vmin=0, vmax=1, aspect="auto", origin="upper")
        axes.set_xticks(range(len(self.lengths)), [str(length) for length in self.prompt_lengths], rotation=45)
        depth_ticks = sorted({0, len(self.depths) // 2, len(self.depths) - 1})
        axes.set_yticks(depth_ticks, [f"{self.depths[index]:.0%}" for index in depth_ticks])
        axes.set_xlabel("prompt length (tokens)")
        axes.set_ylabel("depth of the key")
        axes.set_title(f"{title}: {100 * self.mean_accuracy():.1f}% overall")
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


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def _forward_accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def prefill(model, input_ids: torch.Tensor, chunk_size: int) -> tuple[DynamicCache, torch.Tensor]:
    """Run a (1, L) prompt through a fresh cache `chunk_size` tokens at a time; returns the cache and the
    logits of the last position. Positions continue across chunks because they are read from the cache."""
    cache = DynamicCache(config=model.config)
    extra = {"logits_to_keep": 1} if _forward_accepts(model, "logits_to_keep") else {}
    logits = None
    for chunk in input_ids.split(chunk_size, dim=1):
        logits = model(input_ids=chunk, past_key_values=cache, use_cache=True, **extra).logits[:, -1]
    return cache, logits


def greedy_continuation(model, prompt_ids: list[int], max_new_tokens: int, chunk_size: int) -> list[int]:
    """Greedy decoding of `max_new_tokens` tokens after a chunked prefill, reusing the cache."""
    input_ids = torch.tensor([prompt_ids], device=model_device(model))
    cache, logits = prefill(model, input_ids, chunk_size)
    new_tokens = []
    for step in range(max_new_tokens):
        next_token = logits.argmax(-1, keepdim=True)
        new_tokens.append(next_token.item())
        if step + 1 < max_new_tokens:
            logits = model(input_ids=next_token, past_key_values=cache, use_cache=True).logits[:, -1]
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
    from tqdm.auto import tqdm

    lengths = [int(length) for length in lengths]
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
            bar.set_postfix(length=length, accuracy=f"{sum(row_correct) / len(row_correct):.2f}")
    bar.close()
    return results


# --------------------------------------------------------------------------------------------------------
# Loading and plotting helpers
# --------------------------------------------------------------------------------------------------------


def load_model_and_tokenizer(path, tokenizer=None, device=None, dtype=None, attn_implementation=None):
    """A causal LM from a folder or Hub id (BamLlama or any other), on `device` (default: CUDA if available).

    The tokenizer comes from `tokenizer` (an object or a path) when given, else from `path`; when `path` has
    none, the built-in byte tokenizer is used and a note is printed.
    """
    import bam_llama  # noqa: F401  (registers bam_llama with the Auto classes)

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kwargs = {"dtype": _parse_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
    return model, _load_tokenizer(path, tokenizer, model.config)


def _load_tokenizer(model_path, tokenizer, config):
    from .tokenization_bam import BYTE_VOCAB_SIZE, build_byte_tokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    try:
        return AutoTokenizer.from_pretrained(tokenizer if tokenizer is not None else model_path)
    except (OSError, ValueError, TypeError):
        if tokenizer is not None:
            raise
    print(f"No tokenizer found in {model_path}; using the built-in byte tokenizer.", file=sys.stderr)
    if getattr(config, "vocab_size", BYTE_VOCAB_SIZE) != BYTE_VOCAB_SIZE:
        print(
            f"Warning: the model's vocab_size is {config.vocab_size}, the byte tokenizer's {BYTE_VOCAB_SIZE}; "
            "pass --tokenizer if the model was trained with another tokenizer.",
            file=sys.stderr,
        )
    return build_byte_tokenizer()


def _parse_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    return getattr(torch, dtype)


def _save_figure(figure, path) -> None:
    """Figures are built with `matplotlib.figure.Figure` (no pyplot), so no GUI backend is ever touched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
