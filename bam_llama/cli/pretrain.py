"""`bam-pretrain`: pretrain a BamLlama (or an ALiBi, NoPE or RoPE baseline) from scratch (`training/pretrain.py`)."""

import argparse
import sys

from ..data.special_tokens import BYTE_VOCAB_SIZE
from ..positional_variants import POSITIONAL_VARIANTS, describe_variants
from ..training.arguments import (
    DEFAULT_PRESET,
    PRESETS,
    PRIOR_SCOPES,
    REFERENCE_ROPE_THETA,
    PretrainArguments,
    describe_preset,
)
from .arguments import (
    add_data_arguments,
    add_dataset_arguments,
    add_parallel_arguments,
    add_run_arguments,
    add_trainer_arguments,
    bam_llama_folder,
    positive_float,
    positive_int,
    run_training,
    show_defaults,
)


def build_parser() -> argparse.ArgumentParser:
    defaults = PretrainArguments(data="", output_dir="")
    parser = argparse.ArgumentParser(
        prog="bam-pretrain",
        description="Pretrain a BamLlama (or, for comparison, an ALiBi, NoPE or RoPE model) from scratch on packed "
        "documents with per-document masking. Run under torchrun / accelerate launch for DDP. The defaults train the "
        f"paper's {DEFAULT_PRESET} size ({describe_preset(DEFAULT_PRESET, (BYTE_VOCAB_SIZE, defaults.vocab_size))}: "
        f"the byte tokenizer's and the BPE's) at {defaults.context_length} tokens for {defaults.max_steps} steps of "
        f"{defaults.per_device_train_batch_size} rows: a GPU job. On a CPU choose a small model, e.g. --hidden-size 128 "
        "--layers 4 --heads 4 --context-length 128.",
    )
    add_data_arguments(parser)
    parser.add_argument("--context-length", type=positive_int, default=defaults.context_length, help="training length in tokens")
    parser.add_argument("--positional", choices=tuple(POSITIONAL_VARIANTS), default=defaults.positional,
                        help=describe_variants())
    with_ssmax = ", ".join(name for name, variant in POSITIONAL_VARIANTS.items() if variant.takes_ssmax)
    parser.add_argument("--ssmax", action="store_true",
                        help=f"Scalable Softmax: each query's logits times s*ln(n), n the keys it sees (--positional {with_ssmax})")
    parser.add_argument("--ssmax-prior", action=argparse.BooleanOptionalAction, default=None,
                        help="with --ssmax, a BamLlama variant: the factor s*ln(n) scales the prior too, c*(q.k/sqrt(d) + b), "
                        "the reference's order (default); --no-ssmax-prior gives c*q.k/sqrt(d) + b")
    parser.add_argument("--ssmax-scale-init", type=float, default=None,
                        help="with --ssmax: the initial scale s of every head (default 1.0; 1/ln(context length) makes "
                        "the factor 1 at the training length)")
    parser.add_argument("--ssmax-learning-rate", type=positive_float, default=None,
                        help="with --ssmax: the scales' learning rate (default: --prior-learning-rate)")
    parser.add_argument("--prior-scope", choices=PRIOR_SCOPES, default=defaults.prior_scope,
                        help="global: one prior per head shared by all layers (the reference's default); layer: one per "
                        "layer and head (the paper's parameter count). BamLlama models only")
    parser.add_argument("--frozen-prior-from", metavar="MODEL", type=bam_llama_folder, default=None,
                        help="the second stage of two: the fresh model takes the prior of MODEL (a saved BamLlama "
                        "folder, e.g. a first run's model/ or checkpoint-N/ with the same layers, heads and "
                        "--prior-scope) and trains with it frozen; a variant whose prior trains (bam). See docs/pretraining.md")
    parser.add_argument("--frozen-ssmax", action="store_true",
                        help="with --frozen-prior-from and --ssmax: take MODEL's Scalable-Softmax scales too, frozen")
    parser.add_argument("--rope-theta", type=positive_float, default=None,
                        help=f"RoPE base with --positional rope / rope-local (default {REFERENCE_ROPE_THETA:g}: the reference's RoPE "
                        "baselines; Transformers' Llama default is 10000)")
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None,
                        help=f"the paper's sizes (default {DEFAULT_PRESET}: 768 hidden, 12 layers, 16 heads); size flags override")
    parser.add_argument("--hidden-size", type=positive_int, default=None, help="default: the preset's")
    parser.add_argument("--layers", dest="num_hidden_layers", metavar="N", type=positive_int, default=None,
                        help="default: the preset's")
    parser.add_argument("--heads", dest="num_attention_heads", metavar="N", type=positive_int, default=None,
                        help="default: the preset's")
    parser.add_argument("--kv-heads", dest="num_key_value_heads", metavar="N", type=positive_int, default=None, help="default: --heads (MHA)")
    parser.add_argument("--intermediate-size", type=positive_int, default=None, help="default: 2x --hidden-size (SwiGLU)")
    parser.add_argument("--tokenizer", default=defaults.tokenizer,
                        help="byte (built in), bpe (trained on the training data, digits one per token), or a tokenizer folder / Hub id")
    parser.add_argument("--vocab-size", type=positive_int, default=defaults.vocab_size, help="BPE vocabulary size (with --tokenizer bpe)")
    add_dataset_arguments(parser, defaults)
    parser.add_argument("--learning-rate", type=positive_float, default=defaults.learning_rate)
    parser.add_argument("--prior-learning-rate", type=positive_float, default=None, help="default: --learning-rate")
    add_trainer_arguments(parser, defaults)
    add_parallel_arguments(parser, defaults)
    parser.add_argument("--report-to", default=defaults.report_to, help="none (default), all, or integrations: tensorboard,wandb,...")
    add_run_arguments(parser, defaults)
    return show_defaults(parser)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = PretrainArguments(**vars(parser.parse_args(argv)))
    from ..training.pretrain import check_arguments, pretrain

    try:
        check_arguments(args)
    except ValueError as error:  # one line and exit 2, before any data or weights load
        print(f"bam-pretrain: error: {error}", file=sys.stderr)
        return 2
    return run_training("bam-pretrain", pretrain, args)


if __name__ == "__main__":
    sys.exit(main())
