"""`bam-finetune`: extend a BamLlama model's context with a short fine-tune (`training/finetune.py`)."""

import argparse
import sys

from ..training.arguments import FinetuneArguments
from .arguments import (
    add_data_arguments,
    add_dataset_arguments,
    add_parallel_arguments,
    add_run_arguments,
    add_trainer_arguments,
    positive_float,
    positive_int,
    probability,
    run_training,
    show_defaults,
)


def build_parser() -> argparse.ArgumentParser:
    defaults = FinetuneArguments(model="", data="", output_dir="", context_length=0)
    parser = argparse.ArgumentParser(
        prog="bam-finetune",
        description="Extend a BamLlama model's context with a short fine-tune (LoRA + fully trained prior, or full), "
        "on packed documents with per-document masking. Run under torchrun / accelerate launch for DDP.",
    )
    parser.add_argument("--model", required=True, help="BamLlama folder or Hub id (convert Llama first: bam-convert llama)")
    add_data_arguments(parser)
    parser.add_argument("--context-length", type=positive_int, required=True, help="target length (>= the model's train_context_length)")
    add_dataset_arguments(parser, defaults)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lora", dest="lora", action="store_true", default=True, help="LoRA on q/k/v/o (default)")
    mode.add_argument("--full", dest="lora", action="store_false", help="full fine-tuning")
    parser.add_argument("--lora-mlp", action="store_true", help="also put LoRA on the MLP projections")
    parser.add_argument("--lora-rank", type=positive_int, default=defaults.lora_rank)
    parser.add_argument("--lora-alpha", type=positive_float, default=defaults.lora_alpha)
    parser.add_argument("--lora-dropout", type=probability, default=defaults.lora_dropout)
    parser.add_argument("--learning-rate", type=positive_float, default=None, help="default 2e-4 with LoRA, 2e-5 full")
    parser.add_argument("--prior-learning-rate", type=positive_float, default=defaults.prior_learning_rate)
    parser.add_argument("--ssmax-learning-rate", type=positive_float, default=None,
                        help="a model with Scalable Softmax: its scales' learning rate (default: --prior-learning-rate)")
    add_trainer_arguments(parser, defaults)
    parser.add_argument("--merge", action="store_true", help="also write OUTPUT_DIR/merged: LoRA merged into a BamLlama folder")
    add_parallel_arguments(parser, defaults)
    add_run_arguments(parser, defaults)
    return show_defaults(parser)


def main(argv: list[str] | None = None) -> int:
    args = FinetuneArguments(**vars(build_parser().parse_args(argv)))
    from ..training.finetune import finetune

    return run_training("bam-finetune", finetune, args)


if __name__ == "__main__":
    sys.exit(main())
