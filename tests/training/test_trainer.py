"""The held-out loss `bam-finetune` and `bam-pretrain` report (training/trainer.mean_token_loss): which positions
count, against a loss written out token by token here."""

import math

import pytest
import torch
from helpers import tiny_model

from bam_llama.data.packing import pack_documents
from bam_llama.training.trainer import mean_token_loss

IGNORED = -100


def packed_rows():
    """5 rows of 8 tokens: two documents cut into pieces, rows holding two documents, a padded row."""
    generator = torch.Generator().manual_seed(5)
    lengths = [3, 11, 2, 6, 9, 4]
    documents = [torch.randint(3, 97, (length,), generator=generator).tolist() for length in lengths]
    rows = pack_documents(documents, context_length=8, pad_token_id=0)
    assert len(rows) == 5 and any(row["labels"][-1] == IGNORED for row in rows)
    return rows


def loss_token_by_token(model, rows) -> float:
    """The mean of -log p(token t | tokens before t in its row) over the tokens whose label is not ignored, each
    row run alone, in float64."""
    losses = []
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]]),
                           position_ids=torch.tensor([row["position_ids"]])).logits[0].double()
            for position, label in enumerate(row["labels"]):
                if label != IGNORED:
                    assert position > 0  # packing never makes a row's first token a target
                    losses.append(-torch.log_softmax(logits[position - 1], -1)[label].item())
    return sum(losses) / len(losses)


@pytest.mark.parametrize("batch_size", [1, 2, 5])
def test_the_held_out_loss_is_the_mean_over_target_tokens(batch_size):
    """Every target token weighs the same, whatever the batch it falls in (5 rows in batches of 2 leave one of 1);
    a row's first token, document starts and padding are not targets."""
    rows = packed_rows()
    model = tiny_model("sdpa", attention_dropout=0.5).train()  # dropout would change the loss: it must be off
    expected = loss_token_by_token(model.eval(), rows)
    model.train()
    got = mean_token_loss(model, rows, batch_size, torch.device("cpu"), bf16=False, show_progress=False)
    assert math.isclose(got, expected, rel_tol=1e-5)
    assert model.training  # left as it was


def test_rows_without_targets_do_not_count():
    rows = packed_rows()
    model = tiny_model("sdpa")
    padding = {"input_ids": [0] * 8, "position_ids": list(range(8)), "labels": [IGNORED] * 8}
    with_padding = mean_token_loss(model, rows + [padding, padding], 2, torch.device("cpu"), False, False)
    assert math.isclose(with_padding, loss_token_by_token(model, rows), rel_tol=1e-5)
