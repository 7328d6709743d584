"""The end-of-run summary of `bam-finetune` and `bam-pretrain`: the rows both print, the table, and summary.json
written atomically (staged, then renamed into place)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..files.outputs import staged_files


@dataclasses.dataclass
class TrainingSummary:
    """What every training run reports; `FinetuneSummary` and `PretrainSummary` add their own fields."""

    data: str
    output_dir: str
    context_length: int
    documents: int
    split_documents: int  # longer than a row, so cut into pieces (the others are whole in one row)
    train_rows: int
    eval_rows: int
    eval_split: str
    padding_share: float  # of the rows' tokens
    steps: int
    resumed_from_step: int
    tokens_seen: int
    train_loss: float | None
    loss_before: float
    loss_after: float
    world_size: int
    runtime_seconds: float
    final_dir: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def training_rows(summary: TrainingSummary) -> list[tuple[str, str]]:
    """Steps, tokens, data, held-out loss, processes and runtime."""
    resumed = f" (resumed from {summary.resumed_from_step})" if summary.resumed_from_step else ""
    return [
        ("steps", f"{summary.steps}{resumed}"),
        ("tokens seen", f"{summary.tokens_seen:,}"),
        ("documents / rows", f"{summary.documents} documents ({summary.split_documents} longer than a row, cut), "
         f"{summary.train_rows} train + {summary.eval_rows} eval rows, {summary.padding_share:.2%} padding"),
        (f"loss ({summary.eval_split} rows)", f"{summary.loss_before:.4f} -> {summary.loss_after:.4f}"),
        ("train loss", "-" if summary.train_loss is None else f"{summary.train_loss:.4f}"),
        ("processes", str(summary.world_size)),
        ("runtime", f"{summary.runtime_seconds:.1f} s"),
    ]


def format_rows(title: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join([title] + [f"  {name:<{width}}  {value}" for name, value in rows])


def write_summary(summary: TrainingSummary, output_dir: str) -> None:
    """OUTPUT_DIR/summary.json from `summary.to_json()`, never half-written (staged, then renamed)."""
    with staged_files(Path(output_dir), "summary.json") as staging:
        (staging / "summary.json").write_text(summary.to_json() + "\n")
