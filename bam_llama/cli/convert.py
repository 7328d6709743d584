"""`bam-convert`: checkpoints to and from BamLlama.

    bam-convert reference RUN_DIR OUT_DIR      reference GGD-BAM run (model.pt + args.json) -> BamLlama folder
    bam-convert llama LLAMA_DIR OUT_DIR        Hugging Face LlamaForCausalLM folder -> BamLlama folder (RoPE dropped)
    bam-convert llama MODEL.gguf OUT_DIR       Llama GGUF checkpoint -> BamLlama folder (dequantized)
    bam-convert to-reference BAM_DIR OUT_DIR   BamLlama folder -> reference run (model.pt + args.json)

Inputs are checked completely before anything is written; the output is staged beside OUT_DIR and renamed into place
only once complete, so a failure leaves nothing behind and an existing OUT_DIR is replaced only with --force.
"""

import argparse
import sys
from pathlib import Path

from ..conversion.options import (
    DEFAULT_MAX_SHARD_SIZE,
    DTYPES,
    PRIOR_NAME_GENERATIONS,
    VARIANTS,
    parse_size,
)
from ..files.outputs import exit_on_sigterm
from ..positional_variants import PRIOR_INITS, describe_prior_inits
from .arguments import checked_by
from .reporting import run_reported


def add_bam_output_options(parser: argparse.ArgumentParser) -> None:
    """OUT_DIR, the BamLlama folder `reference` and `llama` create (after their input, as the second positional),
    and its options."""
    parser.add_argument("out_dir", metavar="OUT_DIR", help="BamLlama folder to create")
    add_output_options(parser)


def add_output_options(parser: argparse.ArgumentParser, with_dtype: bool = True) -> None:
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    if with_dtype:
        parser.add_argument(
            "--dtype", choices=list(DTYPES), default="auto",
            help="weights dtype (default: auto, keep the stored one); prior and SSMax parameters keep theirs",
        )
        parser.add_argument(
            "--max-shard-size", type=shard_size, default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
            help=f"largest safetensors shard, e.g. 2GB (default {DEFAULT_MAX_SHARD_SIZE})",
        )


# A size `parse_size` reads (checked before anything runs), passed on as written.
shard_size = checked_by(parse_size)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bam-convert",
        description="Convert reference GGD-BAM runs and Hugging Face Llama models to BamLlama, and back.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    reference = commands.add_parser(
        "reference", help="reference run (model.pt + args.json) -> BamLlama folder",
        description="Convert a reference GGD-BAM run folder (model.pt + args.json) into a BamLlama folder.",
    )
    reference.add_argument("run_dir", metavar="RUN_DIR", help="folder with model.pt and args.json")
    reference.add_argument("--tokenizer", metavar="PATH", help="tokenizer folder or file to copy into OUT_DIR")
    reference.add_argument(
        "--formula",
        help="prior formula the run was trained with: current (default; reference code since May 2025) or legacy "
        "(scale inside the power, older runs); the weights cannot tell",
    )
    reference.add_argument("--variant", choices=VARIANTS, help="needed when args.json has no args.position_encoding")
    add_bam_output_options(reference)

    llama = commands.add_parser(
        "llama", help="Hugging Face LlamaForCausalLM folder -> BamLlama folder (RoPE dropped)",
        description="Convert a LlamaForCausalLM folder (config.json + safetensors) into a BamLlama folder: same "
        "weights, RoPE dropped, a GGD prior added. Fine-tune the result before use.",
    )
    llama.add_argument("llama_dir", metavar="LLAMA_DIR", help="folder with config.json and safetensors weights, or a .gguf file")
    llama.add_argument(
        "--prior", choices=list(PRIOR_INITS), default="uniform",
        help=f"prior initialisation: {describe_prior_inits('uniform')}",
    )
    llama.add_argument(
        "--prior-scope", default="global", help="global: one prior for all layers (default), or layer: one per layer"
    )
    llama.add_argument("--ssmax", action="store_true", help="add Scalable Softmax")
    llama.add_argument("--ssmax-scale-init", type=float, default=1.0, metavar="S", help="initial SSMax scale (default 1)")
    llama.add_argument("--train-context-length", type=int, metavar="N", help="default: the Llama max_position_embeddings")
    llama.add_argument("--base-model", metavar="NAME", help="source recorded in the config and model card, e.g. its Hub id")
    llama.add_argument("--gguf-file", metavar="NAME", help="convert the GGUF checkpoint LLAMA_DIR/NAME (needs the gguf package)")
    add_bam_output_options(llama)

    to_reference = commands.add_parser(
        "to-reference", help="BamLlama folder -> reference run (model.pt + args.json)",
        description="Write a BamLlama folder as a reference GGD-BAM run folder (model.pt + args.json).",
    )
    to_reference.add_argument("bam_dir", metavar="BAM_DIR", help="BamLlama folder")
    to_reference.add_argument("out_dir", metavar="OUT_RUN_DIR", help="reference run folder to create")
    to_reference.add_argument(
        "--prior-names", choices=list(PRIOR_NAME_GENERATIONS), default="shape-scale-loc",
        help="prior parameter names: shape-scale-loc (default, the published reference code) or theta (newer upstream)",
    )
    add_output_options(to_reference, with_dtype=False)
    return parser


def run_command(args: argparse.Namespace) -> Path:
    from ..conversion.llama import convert_llama_checkpoint
    from ..conversion.reference import convert_bam_to_reference, convert_reference_checkpoint

    if args.command == "reference":
        return convert_reference_checkpoint(
            args.run_dir, args.out_dir, tokenizer=args.tokenizer, formula=args.formula, variant=args.variant,
            dtype=args.dtype, force=args.force, max_shard_size=args.max_shard_size,
        )
    if args.command == "llama":
        from ..conversion.gguf import convert_gguf_checkpoint, gguf_source

        gguf_path = gguf_source(args.llama_dir, args.gguf_file)
        return (convert_gguf_checkpoint if gguf_path else convert_llama_checkpoint)(
            gguf_path or args.llama_dir, args.out_dir, prior=args.prior, ssmax=args.ssmax,
            train_context_length=args.train_context_length, prior_scope=args.prior_scope,
            ssmax_scale_init=args.ssmax_scale_init, base_model=args.base_model, dtype=args.dtype, force=args.force,
            max_shard_size=args.max_shard_size,
        )
    return convert_bam_to_reference(args.bam_dir, args.out_dir, prior_names=args.prior_names, force=args.force)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..conversion.common import ConversionError

    exit_on_sigterm()
    return run_reported("bam-convert", run_command, args, bad_input=(ConversionError, ValueError))


if __name__ == "__main__":
    sys.exit(main())
