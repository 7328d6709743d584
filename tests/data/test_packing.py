"""Packing (data/packing.pack_documents) read back row by row: documents of known tokens (document d's token i is
d * 1000 + i, so every token says where it comes from), cut into segments where the model sees a new document
(a position that is not the previous one plus 1), and every rule checked against the documents themselves."""

import random
from collections import Counter

import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

from bam_llama.data.packing import pack_documents, packing_fill

IGNORED = -100
PAD = 7  # no document token: those are d * 1000 + i with d >= 1


def known_documents(lengths: list[int]) -> list[list[int]]:
    return [[document * 1000 + index for index in range(length)] for document, length in enumerate(lengths, start=1)]


def where(token: int) -> tuple[int, int]:
    """(document, index) of a document token."""
    return divmod(token, 1000)


def segments(row: dict) -> list[tuple[int, int]]:
    """(start, end) of each run the model reads as one document: a new one wherever a position is not the
    previous position plus 1 (Transformers' packed-sequence rule, written out here)."""
    positions = row["position_ids"]
    starts = [0] + [i for i in range(1, len(positions)) if positions[i] != positions[i - 1] + 1]
    return list(zip(starts, starts[1:] + [len(positions)]))


def pieces_by_document(rows: list[dict]) -> dict[int, list[tuple[int, list[int]]]]:
    """Document -> [(row, the document indices of one segment)], every segment checked to be one run of one
    document's consecutive tokens at positions 0, 1, ..., or padding closing its row."""
    found = {}
    for number, row in enumerate(rows):
        runs = segments(row)
        for run, (start, end) in enumerate(runs):
            tokens, positions = row["input_ids"][start:end], row["position_ids"][start:end]
            assert positions == list(range(end - start)), (number, positions)
            if tokens[0] == PAD:
                assert run == len(runs) - 1 and set(tokens) == {PAD}, f"row {number}: padding not at the row's end"
                assert set(row["labels"][start:end]) == {IGNORED}
                continue
            document, first = where(tokens[0])
            assert [where(token) for token in tokens] == [(document, first + i) for i in range(end - start)], tokens
            found.setdefault(document, []).append((number, list(range(first, first + end - start))))
    return found


def check_rows(documents: list[list[int]], rows: list[dict], context_length: int) -> None:
    """Every rule of the packing, each against the documents."""
    assert all(len(row[key]) == context_length for row in rows for key in ("input_ids", "position_ids", "labels"))
    found = pieces_by_document(rows)
    assert sorted(found) == [d for d, tokens in enumerate(documents, start=1) if tokens]
    for document, tokens in enumerate(documents, start=1):
        if not tokens:
            continue
        pieces = sorted(found[document], key=lambda piece: piece[1][0])
        if len(tokens) <= context_length:  # whole, in one row, once
            assert [indices for _, indices in pieces] == [list(range(len(tokens)))], (document, pieces)
            continue
        spans = [indices for _, indices in pieces]
        assert spans[0][0] == 0 and spans[-1][-1] == len(tokens) - 1, (document, spans)
        assert all(len(span) == context_length for span in spans[:-1]), (document, [len(span) for span in spans])
        assert all(later[0] == earlier[-1] for earlier, later in zip(spans, spans[1:])), "pieces must overlap by one"
        assert 2 <= len(spans[-1]) <= context_length
        rows_of = [row for row, _ in pieces]
        assert rows_of[:-1] == sorted(rows_of[:-1]), "full pieces in order"
    targets = Counter()
    for row in rows:
        for position, label in enumerate(row["labels"]):
            if label == IGNORED:
                continue
            assert position > 0 and row["position_ids"][position] > 0, "a target is predicted from its own document"
            assert label == row["input_ids"][position]
            document, index = where(label)
            assert where(row["input_ids"][position - 1]) == (document, index - 1), "the target follows its own token"
            targets[where(label)] += 1
    expected = Counter((d, i) for d, tokens in enumerate(documents, start=1) for i in range(1, len(tokens)))
    assert targets == expected, "every token but a document's first is a target exactly once"


def fill(rows: list[dict]) -> float:
    return sum(token != PAD for row in rows for token in row["input_ids"]) / sum(len(row["input_ids"]) for row in rows)


def test_a_small_case_packs_as_worked_out_by_hand():
    """Lengths 3, 11, 5, 2 at 8 tokens. Pieces: 3, (8, 4: 11 cut at 8, the second piece opening on token 7), 5, 2.
    Longest first into the fullest row that holds it: [11a] [5] [11b] opened, the 3 joins the 5 (room 3), the 2
    joins 11b (room 4). Rows in data order of their first piece."""
    documents = known_documents([3, 11, 5, 2])
    rows = pack_documents(documents, context_length=8, pad_token_id=PAD)
    one, two, three, four = documents
    assert [row["input_ids"] for row in rows] == [one + three, two[:8], two[7:] + four + [PAD, PAD]]
    assert [row["position_ids"] for row in rows] == [
        [0, 1, 2, 0, 1, 2, 3, 4], list(range(8)), [0, 1, 2, 3, 0, 1, 0, 1],
    ]
    assert [row["labels"] for row in rows] == [
        [IGNORED, *one[1:], IGNORED, *three[1:]],
        [IGNORED, *two[1:8]],
        [IGNORED, *two[8:], IGNORED, four[1], IGNORED, IGNORED],
    ]
    check_rows(documents, rows, 8)


@pytest.mark.parametrize("context_length", [8, 16, 128])
def test_every_row_of_a_random_mix_keeps_documents_whole_and_trains_each_token_once(context_length):
    rng = random.Random(context_length)
    lengths = [rng.choice([rng.randint(1, context_length), rng.randint(1, 4 * context_length)]) for _ in range(300)]
    lengths += [0, 1, context_length, context_length + 1, context_length + 2, 2 * context_length - 1, 2 * context_length]
    documents = known_documents(lengths)
    rows = pack_documents(documents, context_length, PAD)
    check_rows(documents, rows, context_length)
    assert fill(rows) >= 0.95
    assert pack_documents(documents, context_length, PAD) == rows  # the same rows every time


def test_a_piece_longer_than_what_is_left_is_cut_at_the_row_length_with_a_one_token_overlap():
    """At 8 tokens: 9 tokens are a full piece and one of 2 (tokens 7 and 8); 15 are two full pieces (the second
    opening on token 7); 16 need a third piece of 2."""
    for length, pieces in [(15, [8, 8]), (16, [8, 8, 2]), (9, [8, 2])]:
        documents = known_documents([length])
        rows = pack_documents(documents, context_length=8, pad_token_id=PAD)
        check_rows(documents, rows, 8)
        assert sorted((len(indices) for _, indices in pieces_by_document(rows)[1]), reverse=True) == pieces


def test_rows_keep_the_data_order_where_lengths_tie():
    documents = known_documents([4, 4, 4, 4, 2, 2])
    rows = pack_documents(documents, context_length=8, pad_token_id=PAD)
    assert [[where(token)[0] for token in row["input_ids"][::2]] for row in rows] == [[1, 1, 2, 2], [3, 3, 4, 4], [5, 6, 0, 0]]


def test_adjacent_documents_of_the_same_length_are_separate_documents_for_the_model():
    """Two documents of 3 tokens side by side (positions 0 1 2 0 1 2), a one-token document, padding: the model's
    packed-sequence detection gives each its own index."""
    documents = known_documents([3, 3, 1])
    rows = pack_documents(documents, context_length=9, pad_token_id=PAD)
    assert rows[0]["position_ids"] == [0, 1, 2, 0, 1, 2, 0, 0, 1]
    indices = find_packed_sequence_indices(torch.tensor([rows[0]["position_ids"]]))
    assert indices[0].tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 3]


def test_packing_fill_counts_split_documents_and_padding():
    documents = known_documents([3, 11, 5, 2])
    rows = pack_documents(documents, context_length=8, pad_token_id=PAD)
    assert packing_fill(documents, len(rows), 8) == (1, pytest.approx(2 / 24))
    assert packing_fill([], 0, 8) == (0, 0.0)


@pytest.mark.parametrize("context_length", [2, 3, 8, 16])
def test_packing_fill_reads_what_the_rows_hold_at_the_row_length(context_length):
    """Documents around the row length (empty, one token, a row less one, exactly a row, a row and one, two rows
    less one, exactly two, two and one): the split documents and the padding share `packing_fill` reports are those
    of the packed rows read back here, a split document being one whose tokens lie in more than one segment (a
    document of exactly one row is whole)."""
    row = context_length
    documents = known_documents([0, 1, row - 1, row, row + 1, 2 * row - 1, 2 * row, 2 * row + 1, row])
    rows = pack_documents(documents, context_length, pad_token_id=PAD)
    check_rows(documents, rows, context_length)
    split = sum(len(pieces) > 1 for pieces in pieces_by_document(rows).values())
    padding = sum(token == PAD for packed in rows for token in packed["input_ids"])
    assert packing_fill(documents, len(rows), context_length) == (split, pytest.approx(padding / (len(rows) * row)))


def test_a_row_must_hold_a_token_and_its_target():
    with pytest.raises(ValueError, match="at least 2"):
        pack_documents([[1, 2, 3]], context_length=1, pad_token_id=0)
