"""Packing tokenized documents into fixed-length training rows with per-document masking.

`position_ids` restart at 0 for every document and rows carry no `attention_mask`: from the restarts the model
masks attention per document (a query sees only keys of its own document). The first token of each document
piece and the padding carry label -100. Shared by `bam-finetune` and `bam-pretrain`; PyTorch loads only where a
batch is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


IGNORE_INDEX = -100


def pack_documents(documents: list[list[int]], context_length: int, pad_token_id: int) -> list[dict[str, list[int]]]:
    """Pack documents end to end into rows of `context_length` tokens.

    A document that does not fit continues in the next row. `position_ids` restart at 0 for every document (and
    every row), which is what makes the model mask attention per document. The first token of each piece is not a
    target: it must not be predicted from the previous document. The last row is padded (label -100).
    """
    rows = []
    row = _empty_row()
    for tokens in documents:
        start = 0
        while start < len(tokens):
            piece = tokens[start : start + context_length - len(row["input_ids"])]
            _append_piece(row, piece, piece[1:])
            start += len(piece)
            if len(row["input_ids"]) == context_length:
                rows.append(row)
                row = _empty_row()
    if row["input_ids"]:
        padding = [pad_token_id] * (context_length - len(row["input_ids"]))
        _append_piece(row, padding, padding[1:], targets=False)
        rows.append(row)
    return rows


def _empty_row() -> dict[str, list[int]]:
    return {"input_ids": [], "position_ids": [], "labels": []}


def _append_piece(row: dict[str, list[int]], piece: list[int], next_tokens: list[int], targets: bool = True) -> None:
    row["input_ids"] += piece
    row["position_ids"] += range(len(piece))
    row["labels"] += [IGNORE_INDEX] + (list(next_tokens) if targets else [IGNORE_INDEX] * len(next_tokens))


def collate_packed_rows(rows: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Stack packed rows: input_ids, position_ids and labels, and deliberately no attention_mask."""
    import torch

    return {key: torch.tensor([row[key] for row in rows], dtype=torch.long) for key in ("input_ids", "position_ids", "labels")}


class PackedRows:
    """The packed rows as a map-style dataset for `Trainer`'s data loader."""

    def __init__(self, rows: list[dict[str, list[int]]]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]

    def tokens(self) -> int:
        return sum(sum(label != IGNORE_INDEX for label in row["labels"]) for row in self.rows)


def split_eval_rows(rows: list[dict], eval_rows: int) -> tuple[list[dict], list[dict], str]:
    """Hold out up to `eval_rows` rows (at most a tenth, at least one) for the loss before/after.

    With a single row nothing can be held out, and the loss is measured on the training row.
    """
    if len(rows) < 2 or eval_rows <= 0:
        return rows, rows, "train"
    held_out = min(eval_rows, max(1, len(rows) // 10))
    return rows[:-held_out], rows[-held_out:], "held-out"
