"""What a caller adds to BamTrainer's loop (training/callbacks.py): its steps shown on the package's progress display
instead of Trainer's bar and printed logs, and each step's seconds."""

import re

import torch
from helpers import tiny_model
from transformers import TrainingArguments

from bam_llama.training.callbacks import StepProgress, StepSeconds
from bam_llama.training.trainer import BamTrainer

STEPS = 7


class Rows(torch.utils.data.Dataset):
    """14 rows of 6 tokens, each its own labels."""

    def __len__(self):
        return 2 * STEPS

    def __getitem__(self, index):
        ids = torch.arange(3 + index, 9 + index) % 90 + 3
        return {"input_ids": ids, "labels": ids.clone()}


def train(tmp_path, logging_steps: int, progress=None, callbacks=None) -> BamTrainer:
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=STEPS,
                             logging_steps=logging_steps, logging_first_step=True, save_strategy="no", report_to="none", use_cpu=True,
                             disable_tqdm=True, seed=0)
    trainer = BamTrainer(model=tiny_model(), args=args, train_dataset=Rows(), prior_learning_rate=1e-2,
                         progress=progress, callbacks=callbacks)
    trainer.train()
    return trainer


def test_the_steps_show_as_whole_lines_with_the_logged_loss_and_no_trainer_log(tmp_path, capsys):
    """In a log (stderr captured), the first and every 3rd step logging (as bam-pretrain logs): a line at the first step, whose loss is logged, and one
    at the end with the last logged loss (step 6's); Trainer's printed logs and bar are gone."""
    seconds = StepSeconds()
    trainer = train(tmp_path, logging_steps=3, progress=StepProgress("train tiny"), callbacks=[seconds])
    captured = capsys.readouterr()
    losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
    assert sorted(losses) == [1, 3, 6]
    lines = re.findall(r"^train tiny: (\d+)/7 steps, loss (\d+\.\d{3}), \d+\.\d min$", captured.err, re.MULTILINE)
    assert lines[0] == ("1", f"{losses[1]:.3f}") and lines[-1] == ("7", f"{losses[6]:.3f}"), captured.err
    assert "'loss'" not in captured.out + captured.err and "\r" not in captured.err
    assert len(seconds.seconds) == STEPS and all(second > 0 for second in seconds.seconds)


def test_without_a_progress_trainer_prints_its_own_logs(tmp_path, capsys):
    """bam-pretrain's runs (no progress given): Trainer's own printed logs, as before."""
    train(tmp_path, logging_steps=3)
    assert "'loss'" in capsys.readouterr().out
