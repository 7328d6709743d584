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


def points_by_scale(jobs: dict, study: Study, name: str, point) -> list[tuple]:
    """(scale, *point(results, length)) at every scale where each of the encoding's test seeds has a result."""
    results = [result for _, result in test_results(jobs, study, name)]
    points = []
    for scale in study.scales + study.long_scales:
        length = study.train_length * scale
        if results and all(length in result["passkey"] for result in results):
            points.append((scale, *point(results, length)))
    return points


def passkey_point(results: list[dict], length: int) -> tuple[float, float, float]:
    """The mean of the seeds' strict rates, and its distance to the pooled count's exact interval's ends."""
    counts = [found(result["passkey"][length]) for result in results]
    low, high = clopper_pearson(sum(hits for hits, _ in counts), sum(prompts for _, prompts in counts))
    mean = sum(hits / prompts for hits, prompts in counts) / len(counts)
    return 100 * mean, 100 * (mean - low), 100 * (high - mean)


def perplexity_point(results: list[dict], length: int) -> tuple[float]:
    return (sum(last_window(result, length) for result in results) / len(results),)


def plot_passkey(jobs: dict, study: Study, names: list[str], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(9, 5))
    for name in names:
        points = points_by_scale(jobs, study, name, passkey_point)
        if points:
            scales, means, below, above = zip(*points)
            axes.errorbar(scales, means, yerr=[below, above], marker="o", capsize=3, label=ENCODINGS[name].label)
    finish(axes, "passkey found, strict (%)", f"passkey retrieval, trained at {study.train_length} tokens (test seeds)")
    axes.set_ylim(-3, 103)
    save(figure, axes, path)


def plot_perplexity(jobs: dict, study: Study, names: list[str], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(9, 5))
    for name in names:
        points = points_by_scale(jobs, study, name, perplexity_point)
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
