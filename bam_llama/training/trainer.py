"""The Trainer set-up shared by `bam-finetune` and `bam-pretrain`: `Trainer` with the prior's own learning rate,
its `TrainingArguments`, and the held-out loss. Kept apart from the commands, which parse their command lines
without importing PyTorch or Transformers' Trainer."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PrinterCallback, Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.trainer import DEFAULT_PROGRESS_CALLBACK  # Trainer's bar: tqdm's, or a notebook's
from transformers.utils import is_torch_bf16_gpu_available
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, rotate_checkpoints

from ..data.packing import IGNORE_INDEX, collate_packed_rows
from ..files.model_folders import check_finite_loss
from ..files.outputs import disk_full_named, move_into_place, signals_deferred
from ..model.prior_bam import is_prior_parameter, is_ssmax_parameter
from .checkpoints import checkpoint_step
from .distributed import parallel_training_arguments
from .output_hold import STAGED_CHECKPOINT


def optimizer_parameter_groups(
    model: torch.nn.Module, decay_names, weight_decay: float, prior_learning_rate: float,
    ssmax_learning_rate: float | None = None,
):
    """Decayed weights, undecayed weights, and the prior / SSMax parameters at their own rate without decay; the
    SSMax scales in a group of their own at `ssmax_learning_rate` when it is given."""
    decayed, undecayed, prior, ssmax = [], [], [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if ssmax_learning_rate is not None and is_ssmax_parameter(name):
            ssmax.append(parameter)
        elif is_prior_parameter(name):
            prior.append(parameter)
        elif name in decay_names:
            decayed.append(parameter)
        else:
            undecayed.append(parameter)
    groups = [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": undecayed, "weight_decay": 0.0},
        {"params": prior, "weight_decay": 0.0, "lr": prior_learning_rate},
        {"params": ssmax, "weight_decay": 0.0, "lr": ssmax_learning_rate},
    ]
    return [group for group in groups if group["params"]]


class BamTrainer(Trainer):
    """`Trainer` whose optimizer gives the prior and SSMax parameters their own learning rate (and no decay; the
    SSMax scales may have one of their own, `ssmax_learning_rate`; None: the prior's), that stops on a loss that is
    not finite, and writes each checkpoint whole or not at all.

    before_saving: called before each checkpoint is written (e.g. `OutputDirHold.ensure_held`).
    progress: shows the run's progress instead of Trainer's bar or printed logs (e.g. `callbacks.StepProgress`).
    """

    def __init__(self, *args, prior_learning_rate: float, ssmax_learning_rate: float | None = None,
                 before_saving=None, progress: TrainerCallback | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if progress is not None:
            self.remove_callback(DEFAULT_PROGRESS_CALLBACK)
            self.remove_callback(PrinterCallback)
            self.add_callback(progress)
        self.prior_learning_rate = prior_learning_rate
        self.ssmax_learning_rate = ssmax_learning_rate
        self.before_saving = before_saving
        self._checkpoint_staging = None

    def train(self, resume_from_checkpoint=None, **kwargs):
        """Trainer's, except from a checkpoint at the run's last step (a run stopped after it, before its summary):
        its weights and state are loaded and nothing is trained, as if the run had not stopped. Trainer would train
        one step more (it compares the step with max_steps only after a step). The training loss of a run that
        trained nothing here is NaN. Sharded runs (FSDP, DeepSpeed) load their checkpoints in Trainer's loop: theirs."""
        if (resume_from_checkpoint is None or self.is_fsdp_enabled or self.is_deepspeed_enabled
                or not 0 < self.args.max_steps <= (checkpoint_step(resume_from_checkpoint) or 0)):
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        self._load_from_checkpoint(resume_from_checkpoint)
        self.state = TrainerState.load_from_json(os.path.join(resume_from_checkpoint, "trainer_state.json"))
        return TrainOutput(self.state.global_step, float("nan"), {})

    def training_step(self, *args, **kwargs):
        """A loss that turned NaN or infinite stops the run here, before the optimizer step and any checkpoint
        (Trainer's own filter would average it away and carry on)."""
        loss = super().training_step(*args, **kwargs)
        check_finite_loss(loss, self.state.global_step + 1)
        return loss

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint-N, written into `.checkpoint-N.staging/` (every rank writes its part there) and
        renamed into place once complete: a full disk, Ctrl-C or a crash leaves no partial checkpoint-N, only the
        staging folder, which the next run holding the folder removes (`training/output_hold.py`)."""
        if self.before_saving is not None:
            self.before_saving()
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging = run_dir / STAGED_CHECKPOINT.format(name)
        self._checkpoint_staging = staging
        try:
            with disk_full_named(run_dir / name):
                super()._save_checkpoint(model, trial)  # into staging / name; rotates nothing there
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                move_into_place(staging / name, run_dir / name)
                staging.rmdir()
                rotate_checkpoints(output_dir=str(run_dir), save_total_limit=self.args.save_total_limit,
                                   best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        except BaseException:
            if self.args.should_save:
                with signals_deferred():
                    shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            self._checkpoint_staging = None
        self.accelerator.wait_for_everyone()

    def _get_output_dir(self, trial) -> str:
        return str(self._checkpoint_staging) if self._checkpoint_staging is not None else super()._get_output_dir(trial)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            model = self.model if model is None else model
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            groups = optimizer_parameter_groups(
                model, set(self.get_decay_parameter_names(model)), self.args.weight_decay, self.prior_learning_rate,
                self.ssmax_learning_rate,
            )
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer


def bf16_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def training_arguments(args, report_to: str | list[str] = "none", merge: bool = False) -> TrainingArguments:
    """`TrainingArguments` from a command's arguments (`FinetuneArguments`, `PretrainArguments`: the fields named
    below and `resolved_learning_rate`); merge: the command merges a LoRA adapter after training."""
    bf16 = bf16_available() if args.bf16 is None else args.bf16
    return TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps if args.max_steps > 0 else -1,
        num_train_epochs=args.num_train_epochs,
        learning_rate=args.resolved_learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.lr_scheduler_type,
        bf16=bf16,
        **checkpointing_arguments(args.gradient_checkpointing or args.reentrant_checkpointing, args.reentrant_checkpointing),
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        logging_steps=args.logging_steps,
        logging_first_step=True,
        report_to=report_to,
        seed=args.seed,
        remove_unused_columns=False,
        label_names=["labels"],
        include_num_input_tokens_seen="non_padding",
        ddp_backend="gloo" if distributed_on_cpu() else None,
        use_cpu=distributed_on_cpu() or cpu_bf16(bf16),
        ddp_find_unused_parameters=False,
        disable_tqdm=args.disable_progress_bars,
        dataloader_pin_memory=torch.cuda.is_available(),
        **parallel_training_arguments(
            fsdp=args.fsdp, deepspeed=args.deepspeed, sp_size=args.sp_size,
            attn_implementation=args.attn_implementation, merge=merge,
        ),
    )


def checkpointing_arguments(enabled: bool, reentrant: bool = False) -> dict:
    """Gradient checkpointing under the name this Transformers release uses (newer ones call it activation_*);
    torch's non-reentrant checkpoint unless `reentrant`."""
    if not enabled:
        return {}
    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    prefix = "activation" if "activation_checkpointing" in fields else "gradient"
    return {f"{prefix}_checkpointing": True, f"{prefix}_checkpointing_kwargs": {"use_reentrant": reentrant}}


def cpu_bf16(bf16: bool) -> bool:
    """bf16 asked for on a machine with no GPU to run it: Accelerate's CPU bf16 autocast, which Transformers runs
    only with `use_cpu` (a CUDA GPU without bf16 keeps Transformers' refusal rather than falling back to the CPU)."""
    return bf16 and not torch.cuda.is_available() and not is_torch_bf16_gpu_available()


def distributed_on_cpu() -> bool:
    """Launched by torchrun / accelerate with several processes and no GPU: DDP needs the gloo backend, and
    `use_cpu` (else Accelerate sees several CPU processes but no distributed run)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()


@torch.no_grad()
def mean_token_loss(model: torch.nn.Module, rows: list[dict], batch_size: int, device, bf16: bool, show_progress: bool) -> float:
    """Mean next-token loss over the target tokens of `rows`."""
    was_training = model.training
    model.eval()
    total_loss, total_tokens = 0.0, 0
    for start in tqdm(range(0, len(rows), batch_size), desc="evaluating", unit="batch", disable=not show_progress):
        batch = {key: value.to(device) for key, value in collate_packed_rows(rows[start : start + batch_size]).items()}
        labels = batch.pop("labels")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(**batch).logits.float()
        targets = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        total_loss += loss.item()
        total_tokens += int((targets != IGNORE_INDEX).sum())
    model.train(was_training)
    return total_loss / max(total_tokens, 1)
