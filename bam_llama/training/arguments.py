"""The run settings `bam-finetune` and `bam-pretrain` share (their flags: `cli/arguments.py`)."""

import dataclasses


@dataclasses.dataclass(kw_only=True)
class TrainingRunArguments:
    """The fields `bam-finetune` and `bam-pretrain` share with the same defaults (keyword-only, so each command's
    own arguments dataclass keeps its required fields first); their flags come from `cli.arguments`' `add_*_arguments`."""

    text_field: str = "text"
    dataset_config: str | None = None
    dataset_split: str = "train"
    eval_rows: int = 8
    warmup_steps: int = 0
    lr_scheduler_type: str = "cosine"
    num_train_epochs: float = 1.0
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    reentrant_checkpointing: bool = False  # torch's reentrant variant; implies gradient_checkpointing
    bf16: bool | None = None
    attn_implementation: str | None = None
    save_total_limit: int | None = 2
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = False
    fsdp: bool = False
    deepspeed: str | None = None
    sp_size: int = 1
    seed: int = 42
    disable_progress_bars: bool = False


