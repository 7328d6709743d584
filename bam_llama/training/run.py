"""One training run, shared by `bam-pretrain` and `bam-finetune`: the output folder held, the checkpoint to resume
checked, the held-out loss before and after `BamTrainer`'s training, the final folder saved (the weights gathered
from every rank first where they are sharded) and the summary written and printed.

What differs is a `TrainingCommand`: its checks, data, model, saving and summary fields.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainingArguments, set_seed

from ..data.packing import PackedRows, PackingFill, collate_packed_rows, pack_documents, packing_fill, split_eval_rows
from ..files.model_folders import check_finite_weights
from ..runtime.cpu_threads import use_threads
from .checkpoints import checkpoint_step, resolve_checkpoint
from .distributed import gathered_state_dict, parameters_sharded
from .output_hold import OutputDirHold, hold_output_dir, resumes_in
from .summary import TrainingSummary, write_summary
from .trainer import BamTrainer, mean_token_loss


@dataclasses.dataclass
class TrainingData:
    """A command's tokenizer and packed rows."""

    tokenizer: PreTrainedTokenizerBase
    documents: int
    fill: PackingFill
    train_rows: list[dict]
    eval_rows: list[dict]
    eval_split: str


def packed_training_data(tokenizer: PreTrainedTokenizerBase, tokenized: list[list[int]], context_length: int,
                         pad_token_id: int, eval_rows: int) -> TrainingData:
    """The tokenized documents packed whole into rows (`data.packing`), some held out for the loss before/after."""
    rows = pack_documents(tokenized, context_length, pad_token_id)
    fill = packing_fill(tokenized, len(rows), context_length)
    return TrainingData(tokenizer, len(tokenized), fill, *split_eval_rows(rows, eval_rows))


class TrainingCommand:
    """What one command adds to the run; `args` holds at least `TrainingRunArguments`' fields, `data`, `output_dir`,
    `context_length` and `per_device_train_batch_size`. A command keeps what its summary reports as it goes."""

    name: str  # the command, e.g. "bam-pretrain"
    results: tuple[str, ...]  # what a run leaves in its output folder (`training/output_hold.py`)
    prepared: tuple[str, ...] = ()  # what it writes there before training: no result, a new run replaces it
    summary_class: type[TrainingSummary]

    def __init__(self, args):
        self.args = args

    def check_arguments(self) -> None:
        """A ValueError naming a bad setting; reads no data and no weights."""

    def check_inputs(self, hold: OutputDirHold) -> None:
        """Checks of what the run reads, before the checkpoint and the data load."""

    def training_arguments(self) -> TrainingArguments:
        raise NotImplementedError

    def load_data(self, checkpoint: str | None, training_args: TrainingArguments, hold: OutputDirHold,
                  show_progress: bool) -> TrainingData:
        raise NotImplementedError

    def build_model(self, data: TrainingData) -> PreTrainedModel:
        """The model to train (the seed set just before)."""
        raise NotImplementedError

    def description(self) -> str:
        """What trains, for the log line before training."""
        raise NotImplementedError

    def learning_rates(self) -> dict[str, float | None]:
        """`BamTrainer`'s prior_learning_rate (and ssmax_learning_rate)."""
        raise NotImplementedError

    def summary_fields(self, data: TrainingData, model: PreTrainedModel, state_dict: dict | None,
                       reads_weights: bool) -> dict[str, Any]:
        """The command's own summary fields, read before saving; reads_weights: this process can read the trained
        weights (the main process, or every one where they are not sharded)."""
        raise NotImplementedError

    def final_folders(self) -> dict[str, str | None]:
        """The summary's folder fields (final_dir, ...), as the main process saves them."""
        raise NotImplementedError

    def save(self, model: PreTrainedModel, tokenizer, state_dict: dict | None) -> dict[str, str | None]:
        """Main process only: write the final folders; returns them as `final_folders`. state_dict: a sharded
        model's, gathered."""
        raise NotImplementedError


def run_training(command: TrainingCommand) -> tuple[TrainingSummary, PreTrainedModel, PreTrainedTokenizerBase]:
    """Train as `command` says; returns (summary, trained model, tokenizer), and on the main process writes and
    prints the summary. Every argument is checked, and the output folder held (a second live run into it, or a new
    run over an earlier run's results, refused), before anything loads."""
    started = time.perf_counter()
    command.check_arguments()
    args = command.args
    continuing = resumes_in(args.output_dir, args.resume_from_checkpoint)
    with hold_output_dir(args.output_dir, command.name, command.results, continuing, args.overwrite_output_dir,
                         command.prepared) as hold:
        return _run_training(command, hold, started)


def _log_start(command: TrainingCommand, data: TrainingData, device: torch.device, threads: int):
    logger = logging.getLogger(type(command).__module__)  # the log names the command's module
    logger.info("%s at %d tokens: %d documents, %d train rows, %d %s eval rows; %s, %d torch thread(s)",
                command.description(), command.args.context_length, data.documents, len(data.train_rows),
                len(data.eval_rows), data.eval_split, device, threads)


def _trainer(command: TrainingCommand, model: PreTrainedModel, data: TrainingData, training_args: TrainingArguments,
             hold: OutputDirHold) -> BamTrainer:
    """The Trainer of one run: packed rows, the command's learning rates, the folder re-checked before each save."""
    return BamTrainer(
        model=model,
        args=training_args,
        train_dataset=PackedRows(data.train_rows),
        data_collator=collate_packed_rows,
        processing_class=data.tokenizer,
        before_saving=hold.ensure_held,
        **command.learning_rates(),
    )


def _run_training(command: TrainingCommand, hold: OutputDirHold, started: float):
    args = command.args
    command.check_inputs(hold)
    checkpoint = resolve_checkpoint(args)
    if checkpoint is not None:
        check_finite_weights(checkpoint)
    resumed_from_step = 0 if checkpoint is None else checkpoint_step(checkpoint)  # rotation may delete it later
    training_args = command.training_arguments()
    is_main = training_args.process_index == 0
    threads = use_threads(args.threads, training_args.device.type)  # after the distributed set-up (it may set them)
    show_progress = is_main and not args.disable_progress_bars

    data = command.load_data(checkpoint, training_args, hold, show_progress)
    set_seed(args.seed)
    model = command.build_model(data)
    if is_main:
        _log_start(command, data, training_args.device, threads)
    trainer = _trainer(command, model, data, training_args, hold)
    evaluate = lambda: mean_token_loss(  # noqa: E731
        model, data.eval_rows, args.per_device_train_batch_size, training_args.device, training_args.bf16, show_progress
    )
    loss_before = evaluate() if is_main else math.nan
    hold.clear_earlier_results()  # --overwrite-output-dir: only now that every input has loaded
    train_output = trainer.train(resume_from_checkpoint=checkpoint)
    sharded = parameters_sharded(trainer)  # FSDP / ZeRO-3: forward and state dict need every rank
    loss_after = evaluate() if is_main or sharded else math.nan
    state_dict = gathered_state_dict(trainer)

    own_fields = command.summary_fields(data, model, state_dict, reads_weights=is_main or not sharded)
    folders = command.final_folders()
    if is_main:
        hold.ensure_held()
        folders = command.save(model, data.tokenizer, state_dict)
    summary = command.summary_class(
        data=args.data,
        output_dir=args.output_dir,
        context_length=args.context_length,
        documents=data.documents,
        train_rows=len(data.train_rows),
        eval_rows=len(data.eval_rows),
        eval_split=data.eval_split,
        steps=trainer.state.global_step,
        resumed_from_step=resumed_from_step,
        tokens_seen=int(trainer.state.num_input_tokens_seen),
        train_loss=train_output.training_loss,
        loss_before=loss_before,
        loss_after=loss_after,
        world_size=training_args.world_size,
        runtime_seconds=time.perf_counter() - started,
        **data.fill._asdict(),
        **own_fields,
        **folders,
    )
    if is_main:
        write_summary(summary, args.output_dir)
        print(summary.format_table(), flush=True)
    trainer.accelerator.wait_for_everyone()
    return summary, model, data.tokenizer
