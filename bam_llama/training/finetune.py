"""Context-extension fine-tuning of a BamLlama model with `transformers.Trainer` (the `bam-finetune` command).

The paper extends a trained BAM model's context with a short fine-tune at a longer length (e.g. 256 steps at 1024
after pretraining at 512). This module runs that on the user's data:

* data: a `.txt` file (documents separated by blank lines), a `.jsonl` file (one JSON object per line, text in
  `--text-field`), a `.json` / `.csv` / `.parquet` file, a folder of `.txt` / `.jsonl` files, a folder written by
  `datasets.save_to_disk`, or a `datasets` name on the Hub;
* packing: documents are tokenized (`<s> ... </s>`) and packed into rows of the target length; `position_ids`
  restart at 0 for every document and there is no `attention_mask`, so the model masks attention per document;
  the first token of each document and padding carry label -100;
* LoRA on q/k/v/o (optionally the MLP) through PEFT, with the prior (and SSMax scale) trained in full through
  `modules_to_save`, or full fine-tuning; the prior has its own learning rate and no weight decay;
* gradient checkpointing, bf16 where the GPU has it, checkpoints and resume, DDP under `torchrun` /
  `accelerate launch` (gloo on CPU).

Output folder: `checkpoint-N/` (Trainer), `adapter/` (LoRA) or `model/` (full fine-tuning), `merged/` (LoRA merged
into a plain BamLlama folder, with `--merge`) and `summary.json`. Final folders are written to a temporary folder
and renamed into place, so a crash never leaves a half-written one.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, PreTrainedModel, TrainingArguments

from ..data.documents import load_documents, tokenize_documents
from ..data.tokenizers import load_tokenizer
from ..files.model_folders import check_finite_model, check_model_path, check_safetensors_files
from ..files.outputs import staged_output_dir
from ..hub.card import write_model_card
from ..model.configuration_bam import BamLlamaConfig
from ..model.modeling_bam import BamLlamaForCausalLM, BamPrior, BamScalableSoftmax
from ..model.prior_bam import SSMAX_PARAMETER
from ..registration import register
from .arguments import FinetuneArguments
from .output_hold import OutputDirHold
from .run import TrainingCommand, TrainingData, packed_training_data, run_training
from .summary import TrainingSummary, format_rows, training_rows
from .trainer import training_arguments

LORA_ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SHOWN_PER_HEAD = ("theta_alpha", "theta_beta", "bucket_bias", "scale")  # in the summary: each prior family's, SSMax's


@dataclasses.dataclass
class FinetuneSummary(TrainingSummary):
    model: str
    mode: str
    train_context_length_before: int
    merged_dir: str | None
    trainable_parameters: int
    prior_before: dict[str, dict[str, list[float]]]
    prior_after: dict[str, dict[str, list[float]]]

    def format_table(self) -> str:
        rows = [
            ("mode", self.mode),
            ("context length", f"{self.train_context_length_before} -> {self.context_length}"),
            *training_rows(self),
            ("saved", self.final_dir + (f", merged: {self.merged_dir}" if self.merged_dir else "")),
        ]
        lines = [format_rows("bam-finetune summary", rows)]
        lines.append("  learned prior per head (before -> after)")
        for module, after in self.prior_after.items():
            before = self.prior_before[module]
            shown = [name for name in SHOWN_PER_HEAD if name in after]
            lines.append(f"    {module}")
            for head in range(len(after[shown[0]])):
                changes = [head_change(name, before[name][head], after[name][head]) for name in shown]
                lines.append(f"      head {head:>3}  " + "   ".join(changes))
        return "\n".join(lines)


def head_change(name: str, before: float | list[float], after: float | list[float]) -> str:
    """One head's value before -> after, or for a head's row of values (T5's bias per bucket) the largest change."""
    if isinstance(after, list):
        return f"{name} largest change {max(abs(new - old) for old, new in zip(before, after)):.4f}"
    return f"{name} {before:+.4f} -> {after:+.4f}"


# --------------------------------------------------------------------------------------------------------
# Model, tokenizer, LoRA
# --------------------------------------------------------------------------------------------------------


def check_arguments(args: FinetuneArguments) -> None:
    """A ValueError naming a combination of settings that cannot run; reads no data and no weights."""
    if args.merge and not args.lora:
        raise ValueError("--merge merges a LoRA adapter; with --full the fine-tuned model is saved whole in "
                         "OUTPUT_DIR/model: drop --merge or --full")


def check_model_config(model: str, context_length: int) -> BamLlamaConfig:
    """Read the config of `model`; refuse models that are not BamLlama and lengths below the training length."""
    register()
    try:
        check_model_path(model)
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read a model config from {model!r}: {error}") from error
    if not isinstance(config, BamLlamaConfig):
        model_type = getattr(config, "model_type", type(config).__name__)
        hint = f"`bam-convert llama {model} BAM_DIR`" if model_type == "llama" else "`bam-convert` (`bam-convert --help`)"
        raise ValueError(
            f"{model!r} is a {model_type!r} model, not BamLlama; convert it first with {hint} and fine-tune the result"
        )
    if context_length < config.train_context_length:
        raise ValueError(
            f"the target context length ({context_length}) is below the length the model was trained at "
            f"(train_context_length={config.train_context_length}); context extension needs a length >= "
            f"{config.train_context_length}"
        )
    return config


def check_tokenizer(tokenizer, config: BamLlamaConfig) -> int:
    """The padding id; a ValueError when the tokenizer's ids do not fit the model's vocabulary."""
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary only {config.vocab_size}")
    for pad_token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id, config.pad_token_id, 0):
        if pad_token_id is not None:
            return pad_token_id


def load_model(args: FinetuneArguments) -> BamLlamaForCausalLM:
    check_safetensors_files(args.model)
    model = BamLlamaForCausalLM.from_pretrained(
        args.model, dtype=torch.float32, attn_implementation=args.attn_implementation
    )
    check_finite_model(model, args.model)
    model.config.use_cache = False  # no cache while training; restored before saving
    return model


def prepare_model(model: BamLlamaForCausalLM, args: FinetuneArguments):
    """Wrap `model` for training: LoRA with the prior / SSMax in `modules_to_save`, or everything trainable.

    Either way the prior and SSMax parameters train exactly as the config says (theta_mu frozen by default).
    """
    config = model.config
    if args.lora:
        targets = list(LORA_ATTENTION_MODULES) + (list(LORA_MLP_MODULES) if args.lora_mlp else [])
        lora_config = LoraConfig(
            r=args.lora_rank,
            lora_alpha=args.lora_alpha,
            lora_dropout=args.lora_dropout,
            target_modules=targets,
            modules_to_save=["prior"] + (["ssmax"] if config.ssmax else []),
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora_config)  # what the config freezes is a buffer: never copied as trainable
    else:
        model.requires_grad_(True)
    return model


def prior_values(model: torch.nn.Module, state_dict: dict | None = None) -> dict[str, dict[str, list[float]]]:
    """The prior / SSMax values the model computes with, by BamLlama module name (PEFT's wrapping removed); read
    from `state_dict` when given (a sharded model's, gathered)."""
    values: dict[str, dict[str, list[float]]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (BamPrior, BamScalableSoftmax)) or ".original_module" in name:
            continue
        parameters = module.names if isinstance(module, BamPrior) else (SSMAX_PARAMETER,)
        read = (lambda key: getattr(module, key)) if state_dict is None else (lambda key: state_dict[f"{name}.{key}"])
        values[re.sub(r"\.modules_to_save\.[^.]+$", "", name).removeprefix("base_model.model.")] = {
            key: read(key).detach().float().cpu().tolist() for key in parameters
        }
    return values


# --------------------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------------------


def save_final(
    model, tokenizer, args: FinetuneArguments, train_context_length_before: int, state_dict: dict | None = None
) -> tuple[str, str | None]:
    """Save the adapter (LoRA) or the model (full), and the merged model on request; rank 0 only. state_dict: the
    gathered one of a sharded model (FSDP, ZeRO-3)."""
    output_dir = Path(args.output_dir)
    final_dir = output_dir / ("adapter" if args.lora else "model")
    base_config = model.get_base_model().config if args.lora else model.config
    base_config.use_cache = True
    if not args.lora:
        record_extension(model.config, args)
    with staged_output_dir(final_dir, force=True) as staging:
        model.save_pretrained(staging, state_dict=state_dict)
        tokenizer.save_pretrained(staging)
        if not args.lora:
            write_finetuned_card(staging, args, train_context_length_before)
    if not (args.lora and args.merge):
        return str(final_dir), None
    merged = model.merge_and_unload()
    record_extension(merged.config, args)
    merged_dir = output_dir / "merged"
    with staged_output_dir(merged_dir, force=True) as staging:
        merged.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        write_finetuned_card(staging, args, train_context_length_before)
    return str(final_dir), str(merged_dir)


def check_no_stale_merged_model(args: FinetuneArguments, replaced: list[str]) -> None:
    """A merged/ folder that this run will not rewrite (nor delete: `replaced`, see `training/output_hold.py`) belongs to an
    earlier run and would not match the new adapter: refuse before training rather than leave the two side by side."""
    merged_dir = Path(args.output_dir) / "merged"
    if (merged_dir.exists() or merged_dir.is_symlink()) and not (args.lora and args.merge) and "merged" not in replaced:
        raise ValueError(
            f"{merged_dir} holds a merged model from an earlier run, which this run would leave out of date: pass "
            "--merge to replace it, or move it away"
        )


def write_finetuned_card(model_dir: str, args: FinetuneArguments, train_context_length_before: int) -> None:
    """The BAM model card of a fine-tuned folder: base model, data and what the fine-tune did."""
    mode = "LoRA (merged) with the prior trained in full" if args.lora else "full fine-tuning"
    description = (
        f"Context extension of `{args.model}` with `bam-finetune` ({mode}): trained at "
        f"{train_context_length_before} tokens, fine-tuned at {args.context_length} tokens on `{args.data}`."
    )
    hub_dataset = not Path(args.data).exists()
    write_model_card(
        model_dir,
        base_model=args.model,
        datasets=[args.data] if hub_dataset else [],
        model_name=Path(args.output_dir).name,
        description=description,
    )


def record_extension(config: BamLlamaConfig, args: FinetuneArguments) -> None:
    config.train_context_length = args.context_length
    config.max_position_embeddings = max(config.max_position_embeddings, args.context_length)  # what tools plan for
    config.base_model = args.model


# --------------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------------


class Finetuning(TrainingCommand):
    """`bam-finetune`'s part of the run: the base model's config and tokenizer checked, LoRA (or everything) made
    trainable, the adapter or model saved (and merged), and the prior before and after in the summary."""

    name = "bam-finetune"
    # What a run leaves in --output-dir: a later run continues it (--resume-from-checkpoint) or replaces it
    # (--overwrite-output-dir), never writes over it silently (see `training/output_hold.py`).
    results = ("checkpoint-*", "adapter", "model", "merged", "summary.json")
    summary_class = FinetuneSummary

    def check_arguments(self) -> None:
        check_arguments(self.args)

    def check_inputs(self, hold: OutputDirHold) -> None:
        self.base_config = check_model_config(self.args.model, self.args.context_length)
        if self.args.ssmax_learning_rate is not None and not self.base_config.ssmax:
            raise ValueError(f"--ssmax-learning-rate: {self.args.model!r} has no Scalable Softmax to train")
        check_no_stale_merged_model(self.args, hold.replaced)

    def training_arguments(self) -> TrainingArguments:
        return training_arguments(self.args, merge=self.args.lora and self.args.merge)

    def load_data(self, checkpoint: str | None, training_args: TrainingArguments, hold: OutputDirHold,
                  show_progress: bool) -> TrainingData:
        args = self.args
        tokenizer = load_tokenizer(args.model, self.base_config)
        pad_token_id = check_tokenizer(tokenizer, self.base_config)
        documents = load_documents(args.data, args.text_field, args.dataset_split, args.dataset_config)
        tokenized = tokenize_documents(documents, tokenizer, show_progress)
        return packed_training_data(tokenizer, tokenized, args.context_length, pad_token_id, args.eval_rows)

    def build_model(self, data: TrainingData) -> PreTrainedModel:
        model = load_model(self.args)
        self.prior_before = prior_values(model)
        model = prepare_model(model, self.args)
        self.trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
        return model

    def description(self) -> str:
        return f"fine-tuning {self.args.model} ({'LoRA' if self.args.lora else 'full'}, {self.trainable} trainable parameters)"

    def learning_rates(self) -> dict[str, float | None]:
        return {"prior_learning_rate": self.args.prior_learning_rate,
                "ssmax_learning_rate": self.args.ssmax_learning_rate}

    def summary_fields(self, data: TrainingData, model: PreTrainedModel, state_dict: dict | None,
                       reads_weights: bool) -> dict:
        return dict(
            model=self.args.model,
            mode="lora" if self.args.lora else "full",
            train_context_length_before=self.base_config.train_context_length,
            trainable_parameters=self.trainable,
            prior_before=self.prior_before,
            prior_after=prior_values(model, state_dict) if reads_weights else {},
        )

    def final_folders(self) -> dict[str, str | None]:
        return {"final_dir": str(Path(self.args.output_dir) / ("adapter" if self.args.lora else "model")), "merged_dir": None}

    def save(self, model: PreTrainedModel, tokenizer, state_dict: dict | None) -> dict[str, str | None]:
        final_dir, merged_dir = save_final(model, tokenizer, self.args, self.base_config.train_context_length, state_dict)
        return {"final_dir": final_dir, "merged_dir": merged_dir}


def finetune(args: FinetuneArguments) -> FinetuneSummary:
    """Fine-tune `args.model` at `args.context_length` on `args.data`; returns (and on rank 0 writes and prints)
    the summary. The output folder is held for the run: a second live run into it, or a new run over an earlier
    run's results, is refused before anything loads."""
    summary, _, _ = run_training(Finetuning(args))
    return summary
