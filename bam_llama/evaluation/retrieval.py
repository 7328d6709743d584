"""What passkey retrieval and the needle tasks share: how many depths each length is tested at (`DepthPlan`), the
loop that prompts a model at every (length, depth) and scores its greedy answer (and, where a case asks, its
teacher-forced answer), timing each length and measuring its peak memory, and the results (found or missed by
length and depth) with their table, 95% intervals and heatmap."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import numpy
import torch
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from ..runtime.progress import progress_bar
from . import plots
from .costs import measured
from .decoding import check_positive, greedy_and_teacher_forced, greedy_continuation, model_device, sharing_prefixes
from .depth_plan import DepthPlan, uniform_depths
from .intervals import interval_text
from .memory_needs import check_lengths_fit


@dataclass
class RetrievalCase:
    """One prompt: its token ids, the answer it expects, and how many tokens the model may answer in. With
    `forced_answer` (token ids of the answer), it is also scored teacher-forced: its first `given_tokens` tokens are
    given, and it counts as found when the model's argmax equals each later token given the true ones before it."""

    prompt: list[int]
    expected: str
    max_new_tokens: int
    forced_answer: list[int] | None = None
    given_tokens: int = 0


@dataclass
class RetrievalRows:
    """A finished run, per length: depths, found or missed, expected answers, predictions, the longest prompt, and
    the cost of the length."""

    depths: list[list[float]] = field(default_factory=list)
    correct: list[list[bool]] = field(default_factory=list)
    expected: list[list[str]] = field(default_factory=list)
    predictions: list[list[str]] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    peak_rss_mib: list[float | None] = field(default_factory=list)
    peak_gpu_mib: list[float | None] = field(default_factory=list)
    teacher_forced: list[list[bool]] = field(default_factory=list)  # empty where no case asked for it

    def measures(self) -> dict:
        """The fields every results class takes as they are."""
        names = ("depths", "correct", "predictions", "prompt_lengths", "seconds", "peak_rss_mib", "peak_gpu_mib",
                 "teacher_forced")
        return {name: getattr(self, name) for name in names}


def run_retrieval(
    model,
    tokenizer,
    lengths: list[int],
    plan: DepthPlan,
    make_case: Callable[[int, float], RetrievalCase],
    is_correct: Callable[[str, RetrievalCase], bool],
    chunk_size: int,
    progress: bool,
    description: str,
) -> RetrievalRows:
    """For every length and every depth of `plan`, in that order: `make_case(length, depth)`, greedy decoding after
    a chunked prefill, and `is_correct(decoded answer, case)`; a case with a `forced_answer` is also scored
    teacher-forced after the same prefill. The prompts of one length share one KV cache: each runs from where it
    parts from the one before (`sharing_prefixes`). Each length is timed and its peak memory measured."""
    check_positive(lengths=min(lengths, default=0), chunk_size=chunk_size)
    check_lengths_fit(model, lengths, chunk_size)  # before any prompt is built
    model.eval()
    rows = RetrievalRows()
    bar = progress_bar(sum(plan.count(length) for length in lengths), description, "prompts", disable=not progress)
    with torch.inference_mode():
        for length in lengths:
            depths = plan.depths(length)
            found, forced, expected, predictions, longest = [], [], [], [], 0
            with measured(model_device(model)) as cost, sharing_prefixes(model):
                for depth in depths:
                    case = make_case(length, depth)
                    if case.forced_answer is None:
                        new_tokens = greedy_continuation(model, case.prompt, case.max_new_tokens, chunk_size)
                    else:
                        new_tokens, argmax = greedy_and_teacher_forced(
                            model, case.prompt, case.max_new_tokens, chunk_size, case.forced_answer
                        )
                        forced.append(argmax[case.given_tokens :] == case.forced_answer[case.given_tokens :])
                    prediction = tokenizer.decode(new_tokens, skip_special_tokens=True)
                    found.append(is_correct(prediction, case))
                    expected.append(case.expected)
                    predictions.append(prediction)
                    longest = max(longest, len(case.prompt))
                    bar.update()
            rows.depths.append(depths)
            rows.correct.append(found)
            rows.expected.append(expected)
            rows.predictions.append(predictions)
            rows.prompt_lengths.append(longest)
            rows.seconds.append(cost.seconds)
            rows.peak_rss_mib.append(cost.peak_rss_mib)
            rows.peak_gpu_mib.append(cost.peak_gpu_mib)
            if forced:
                rows.teacher_forced.append(forced)
            bar.set_postfix(length=length, accuracy=f"{sum(found) / len(found):.2f}")
    bar.close()
    return rows


@dataclass
class RetrievalResults:
    """Found or missed by length and depth. `depths` is per length; a flat list means the same depths at every
    length. `seconds`, `peak_rss_mib` and `peak_gpu_mib` are per length (empty in results from before they were
    measured)."""

    lengths: list[int]
    depths: list[list[float]]  # [length][depth]
    correct: list[list[bool]]  # [length][depth]
    prompt_lengths: list[int]  # the longest prompt of each length, BOS included
    predictions: list[list[str]] = field(default_factory=list)  # decoded continuations, [length][depth]
    seconds: list[float] = field(default_factory=list)
    peak_rss_mib: list[float | None] = field(default_factory=list)
    peak_gpu_mib: list[float | None] = field(default_factory=list)
    teacher_forced: list[list[bool]] = field(default_factory=list)  # [length][depth], where scored so too

    KIND = "retrieval"  # `to_dict()["kind"]`, by which `results.results_from_dict` finds the class
    DEPTH_LABEL = "depth"
    SCORE_LABEL = "Accuracy (%)"  # the table's name of `correct`'s rate

    def __post_init__(self):
        if self.depths and not isinstance(self.depths[0], (list, tuple)):
            self.depths = [list(self.depths) for _ in self.lengths]

    def accuracy_by_length(self) -> dict[int, float]:
        return {length: sum(row) / len(row) for length, row in zip(self.lengths, self.correct)}

    def teacher_forced_by_length(self) -> dict[int, float]:
        return {length: sum(row) / len(row) for length, row in zip(self.lengths, self.teacher_forced)}

    def mean_accuracy(self) -> float:
        cells = [cell for row in self.correct for cell in row]
        return sum(cells) / len(cells)


    def depth_counts(self) -> list[int]:
        return [len(row) for row in self.depths]

    def describe_depths(self) -> str:
        """"20 depths", or "20 depths (4 at 65536 tokens)" where some lengths have other counts."""
        counts = self.depth_counts()
        usual = max(counts, key=counts.count)  # the most common; a tie goes to the first length's
        others = ", ".join(f"{count} at {length} tokens" for length, count in zip(self.lengths, counts) if count != usual)
        return f"{usual} depths" + (f" ({others})" if others else "")

    def to_markdown(self, per_depth: bool = False) -> str:
        """A table `length | prompt tokens | accuracy (%) | 95% interval`, with the depths of each length where they
        differ, the teacher-forced rate and its interval where scored, and the seconds and peak memory of each
        length where measured; with `per_depth`, one ✓/✗ column per depth (one ✓/✗ string where the lengths have
        different depths). The intervals are Clopper-Pearson's, in whole percent rounded outwards."""
        uniform = len({tuple(row) for row in self.depths}) <= 1
        columns = [("Length", self.lengths), ("Prompt tokens", self.prompt_lengths)]
        if not uniform:
            columns.append(("Depths", self.depth_counts()))
        scores = [(self.SCORE_LABEL, self.correct)] + ([("Teacher-forced (%)", self.teacher_forced)] * bool(self.teacher_forced))
        for title, rows in scores:
            columns.append((title, [f"{100 * sum(row) / len(row):.1f}" for row in rows]))
            columns.append(("95% interval", [interval_text(sum(row), len(row)) for row in rows]))
        if self.seconds:
            columns.append(("Seconds", [f"{value:.1f}" for value in self.seconds]))
        for title, values in (("Peak RSS (MiB)", self.peak_rss_mib), ("Peak GPU (MiB)", self.peak_gpu_mib)):
            if any(value is not None for value in values):
                columns.append((title, ["" if value is None else f"{value:.0f}" for value in values]))
        header = [title for title, _ in columns]
        marks = [["✓" if hit else "✗" for hit in row] for row in self.correct]
        if per_depth and uniform:
            header += [f"{depth:.2f}" for depth in self.depths[0]]
        elif per_depth:
            header.append("Found by depth")
            marks = [["".join(row)] for row in marks]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for index in range(len(self.lengths)):
            cells = [str(values[index]) for _, values in columns] + (marks[index] if per_depth else [])
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def save_heatmap(self, path, title: str = "Passkey retrieval") -> None:
        """Length (x, the table's lengths) by depth (y, 0% = the start of the context) PNG, green where the answer
        was right, with a colour legend. Lengths with fewer depths have taller cells."""
        figure = Figure(figsize=(max(4.5, 0.6 * len(self.lengths) + 3), 4.5))
        axes = figure.subplots()
        colours = dict(cmap=ListedColormap(["#d7301f", "#1a9850"]), vmin=0, vmax=1)
        if len({tuple(row) for row in self.depths}) <= 1:
            grid = numpy.array(self.correct, dtype=numpy.float32).T  # (depth, length)
            image = axes.imshow(grid, aspect="auto", origin="upper", **colours)
            axes.set_yticks(*_depth_ticks(len(self.depths[0])))
        else:  # one column per length, its depths splitting [0, 1]
            for column, row in enumerate(self.correct):
                edges = numpy.linspace(0.0, 1.0, len(row) + 1)
                image = axes.pcolormesh([column - 0.5, column + 0.5], edges, numpy.array(row, dtype=float)[:, None], **colours)
            axes.set_xlim(-0.5, len(self.lengths) - 0.5)
            axes.set_ylim(1.0, 0.0)
            fractions = (0.0, 0.25, 0.5, 0.75, 1.0)
            axes.set_yticks(fractions, [f"{fraction:.0%}" for fraction in fractions])
        axes.set_xticks(range(len(self.lengths)), [str(length) for length in self.lengths], rotation=45)
        axes.set_xlabel("prompt length (tokens)")
        axes.set_ylabel(self.DEPTH_LABEL)
        cells = [cell for row in self.correct for cell in row]
        axes.set_title(f"{title}\n{100 * self.mean_accuracy():.1f}% retrieved overall (95% interval "
                       f"{interval_text(sum(cells), len(cells))}%)", fontsize=10)
        legend = figure.colorbar(image, ax=axes, ticks=[0.25, 0.75], fraction=0.08, pad=0.03)
        legend.ax.set_yticklabels(["missed", "retrieved"])
        plots.save_figure(figure, path)

    def to_dict(self) -> dict:
        return {
            "kind": self.KIND,
            **asdict(self),
            "accuracy_by_length": {str(length): value for length, value in self.accuracy_by_length().items()},
        }

    @classmethod
    def from_dict(cls, values: dict):
        names = {field.name for field in fields(cls)}
        return cls(**{name: value for name, value in values.items() if name in names})

    @classmethod
    def concatenate(cls, parts: list):
        """One result of the lengths of several (in order): every per-length list joined, the rest from the first."""
        joined = {}
        for name in (field.name for field in fields(cls)):
            values = [getattr(part, name) for part in parts]
            joined[name] = [item for value in values for item in value] if isinstance(values[0], list) else values[0]
        return cls(**joined)


def _depth_ticks(num_depths: int) -> tuple[list[float], list[str]]:
    """Heatmap rows are depths i / (num_depths - 1): ticks at 0, 25, 50, 75 and 100% sit at row (num_depths - 1) * d."""
    if num_depths == 1:
        return [0.0], ["0%"]
    fractions = (0.0, 0.25, 0.5, 0.75, 1.0)
    return [fraction * (num_depths - 1) for fraction in fractions], [f"{fraction:.0%}" for fraction in fractions]
