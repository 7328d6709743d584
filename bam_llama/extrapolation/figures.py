"""The results page's figures: passkey retrieval by length (the paper's Figure 3: each encoding's mean over the test
seeds with the pooled count's exact 95% interval) and last-window perplexity by length (its Figure 2)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..evaluation.intervals import clopper_pearson  # noqa: E402
from .encodings import ENCODINGS  # noqa: E402
from .selection import found, last_window, test_results  # noqa: E402
from .settings import Study  # noqa: E402


def plot_passkey(jobs: dict, study: Study, names: list[str], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(9, 5))
    for name in names:
        results = [result for _, result in test_results(jobs, study, name)]
        points = []
        for scale in study.scales + study.long_scales:
            length = study.train_length * scale
            counts = [found(result["passkey"][length]) for result in results if length in result["passkey"]]
            if counts and len(counts) == len(results):
                hits, prompts = sum(c[0] for c in counts), sum(c[1] for c in counts)
                low, high = clopper_pearson(hits, prompts)
                mean = sum(c[0] / c[1] for c in counts) / len(counts)
                points.append((scale, mean, mean - low, high - mean))
        if points:
            scales, means, below, above = zip(*points)
            axes.errorbar(scales, [100 * m for m in means], yerr=[[100 * b for b in below], [100 * a for a in above]],
                          marker="o", capsize=3, label=ENCODINGS[name].label)
    finish(axes, "passkey found, strict (%)", f"passkey retrieval, trained at {study.train_length} tokens (test seeds)")
    axes.set_ylim(-3, 103)
    save(figure, axes, path)


def plot_perplexity(jobs: dict, study: Study, names: list[str], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(9, 5))
    for name in names:
        results = [result for _, result in test_results(jobs, study, name)]
        points = []
        for scale in study.scales + study.long_scales:
            length = study.train_length * scale
            values = [last_window(result, length) for result in results if length in result["perplexity"]]
            if values and len(values) == len(results):
                points.append((scale, sum(values) / len(values)))
        if points:
            axes.plot(*zip(*points), marker="o", label=ENCODINGS[name].label)
    finish(axes, "perplexity of the last training-length window", "position-matched perplexity (test seeds)")
    axes.set_yscale("log")
    save(figure, axes, path)


def finish(axes, ylabel: str, title: str) -> None:
    axes.set_xscale("log", base=2)
    axes.set_xlabel("prompt length / training length")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)


def save(figure, axes, path: Path) -> None:
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
