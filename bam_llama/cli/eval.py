"""`bam-eval`: long-context evaluation of BamLlama or any causal LM.

    bam-eval passkey MODEL           passkey retrieval by prompt length and depth (evaluation/passkey.py)
    bam-eval needles MODEL           needle variants: several keys, values, queries; variable tracking (needles.py)
    bam-eval perplexity MODEL ...    perplexity by position (evaluation/perplexity.py)
    bam-eval prior MODEL             the learned GGD prior per head (evaluation/plots.py)
"""

import argparse
import sys
from pathlib import Path

from ..evaluation.needle_tasks import NEEDLE_KINDS, NeedleTask
from ..files.outputs import exit_on_sigterm, staged_files
from .arguments import (
    DistinctLengths, add_threads_argument, depth_plan, device_name, length_list, non_negative_int, positive_int,
)
from .reporting import run_reported

PASSKEY_LENGTHS = "256,512,1024,2048,4096"
DEPTHS = 20


PERPLEXITY_LENGTHS = "1024,4096"


def needle_kinds(text: str) -> list[str]:
    kinds = [kind.strip() for kind in text.split(",") if kind.strip()]
    unknown = [kind for kind in kinds if kind not in NEEDLE_KINDS]
    if not kinds or unknown or len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct tasks among {', '.join(NEEDLE_KINDS)}")
    return kinds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bam-eval", description="Long-context evaluation of BamLlama or any causal LM."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_passkey_command(commands)
    _add_needles_command(commands)
    _add_perplexity_command(commands)
    _add_prior_command(commands)
    return parser


def _add_passkey_command(commands) -> None:
    passkey = commands.add_parser(
        "passkey", help="passkey retrieval accuracy by prompt length and depth",
        description="Passkey retrieval after the GGD-BAM paper: for every length, keys hidden at --depths depths "
        "uniformly spaced from the start to the end of the filler. Strict score: the greedy answer is the key and no "
        "further digit; --teacher-forced adds the reference code's score. Each rate with its 95%% Clopper-Pearson "
        "interval.",
    )
    _add_model_arguments(passkey)
    _add_prompt_lengths(passkey)
    passkey.add_argument("--depths", type=depth_plan, default=str(DEPTHS), metavar="N[,LENGTH=N...]",
                         help=f"depths per length, and fewer (or more) at named lengths: 20,32k=10,64k=4 (default: {DEPTHS})")
    passkey.add_argument("--digits", type=positive_int, default=5, help="digits of the passkey (default: %(default)s)")
    passkey.add_argument("--seed", type=int, default=0, help="seed of the random passkeys, drawn from an evaluation "
                         "stream of their own, none twice (default: %(default)s)")
    passkey.add_argument("--teacher-forced", action="store_true",
                         help="also score the reference code's way, beside the strict score: the key's first digit "
                         "given, every later digit the model's argmax given the true digits before it")
    _add_per_depth(passkey)
    passkey.add_argument(
        "--template", default="model",
        help="the prompt: 'model' (the one the model was trained on, saved in its config; the paper's if it has "
        "none), 'paper', or a JSON file with task, filler, info ({passkey} in it), question and add_bos "
        "(default: %(default)s)",
    )
    passkey.set_defaults(run=run_passkey)


def _add_needles_command(commands) -> None:
    needles = commands.add_parser(
        "needles", help="needle variants (RULER-style) by prompt length and depth, scored exactly",
        description="Needles in a haystack of real text (default: the held-out Python corpus, no download): multikey "
        "(several keys, one asked), multivalue (one key, all its values asked), multiquery (several keys asked at "
        "once), vartrack (follow a chain of VAR assignments to its value). Correct only when the answer is exactly "
        "the asked values, in the asked order, comma separated: a wrong digit, a missing, an extra or a swapped value "
        "is a miss.",
    )
    _add_model_arguments(needles)
    needles.add_argument("--tasks", type=needle_kinds, default=list(NEEDLE_KINDS), metavar="KIND[,KIND...]",
                         help=f"comma-separated subset of {','.join(NEEDLE_KINDS)} (default: all)")
    _add_prompt_lengths(needles)
    needles.add_argument("--depths", type=depth_plan, default=str(DEPTHS), metavar="N[,LENGTH=N...]",
                         help=f"depths of the asked needle per length, and fewer at named lengths: 20,64k=4 (default: {DEPTHS})")
    task = NeedleTask("multikey")
    needles.add_argument("--keys", type=positive_int, default=task.keys, help="multikey: keys in the haystack (default: %(default)s)")
    needles.add_argument("--values", type=positive_int, default=task.values, help="multivalue: values of the key (default: %(default)s)")
    needles.add_argument("--queries", type=positive_int, default=task.queries, help="multiquery: keys asked at once (default: %(default)s)")
    needles.add_argument("--chains", type=positive_int, default=task.chains, help="vartrack: chains of assignments (default: %(default)s)")
    needles.add_argument("--hops", type=positive_int, default=task.hops, help="vartrack: assignments after the value (default: %(default)s)")
    needles.add_argument("--digits", type=positive_int, default=task.digits, help="digits of every value (default: %(default)s)")
    needles.add_argument("--seed", type=int, default=0, help="seed of labels, values, depths of the other needles and haystack (default: %(default)s)")
    needles.add_argument("--haystack", help="text for the haystack, read as --data of perplexity (default: the held-out "
                         "part of the Python corpus: the language reference and standard library of this Python)")
    _add_per_depth(needles)
    needles.set_defaults(run=run_needles)


def _add_perplexity_command(commands) -> None:
    perplexity = commands.add_parser(
        "perplexity", help="perplexity by position for several context lengths",
        description="Perplexity by position as in the GGD-BAM reference: non-overlapping sequences of each context "
        "length, one chunked KV-cache forward each, losses averaged in windows of --window positions.",
    )
    _add_model_arguments(perplexity)
    data = perplexity.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", help="local text, read as bam-finetune reads --data: .txt (documents separated by "
                      "blank lines), .jsonl, .json, .csv, .parquet or a folder of .txt/.jsonl files; documents run together")
    data.add_argument("--dataset", help="a datasets name or local path (load_dataset / save_to_disk folder)")
    perplexity.add_argument("--dataset-config", help="the dataset's configuration name, e.g. 20231101.en")
    perplexity.add_argument("--split", default="test", help="dataset split (default: %(default)s)")
    perplexity.add_argument("--text-column", default="text", help="dataset column with text (default: %(default)s)")
    perplexity.add_argument("--max-documents", type=positive_int, default=1000,
                            help="documents read from the dataset (default: %(default)s)")
    perplexity.add_argument("--lengths", nargs="+", type=length_list, action=DistinctLengths,
                            default=length_list(PERPLEXITY_LENGTHS),
                            help=f"context lengths in tokens, e.g. 1k,4k,16k (default: {PERPLEXITY_LENGTHS})")
    perplexity.add_argument("--window", type=positive_int, default=1024, help="positions per window (default: %(default)s)")
    perplexity.add_argument("--max-sequences", type=positive_int, default=8,
                            help="sequences per context length (default: %(default)s)")
    perplexity.set_defaults(run=run_perplexity)


def _add_prior_command(commands) -> None:
    prior = commands.add_parser(
        "prior", help="plot each head's learned prior over distance",
        description="Plot each head's GGD prior b_h over distance (the paper's Figure 1 style) from a BamLlama folder.",
    )
    prior.add_argument("model", help="BamLlama folder or Hub id")
    prior.add_argument("--out", default="prior.png", help="PNG file, or a folder to write prior.png in")
    prior.add_argument("--max-distance", type=positive_int, default=1024, help="largest distance (default: %(default)s)")
    prior.add_argument("--layer", type=non_negative_int, help="plot only this layer's prior (per-layer priors)")
    prior.set_defaults(run=run_prior)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hub id (BamLlama or any causal LM)")
    parser.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: the model's, else the byte tokenizer)")
    parser.add_argument("--chunk-size", type=positive_int, default=1024, help="prompt tokens per forward (default: %(default)s)")
    parser.add_argument("--add-bos", action="store_true", help="start every sequence with the tokenizer's BOS")
    parser.add_argument("--device", type=device_name, help="e.g. cuda, cuda:1, cpu (default: CUDA if available)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weights' dtype")
    parser.add_argument("--attn-implementation", help="sdpa, eager or bam_triton (default: the model's)")
    add_threads_argument(parser)
    parser.add_argument("--out", help="folder for the table (.md), results (.json) and plot (.png)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_prompt_lengths(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lengths", nargs="+", type=length_list, action=DistinctLengths,
                        default=length_list(PASSKEY_LENGTHS),
                        help=f"requested prompt lengths in tokens, e.g. 512,1k,2k (default: {PASSKEY_LENGTHS})")


def _add_per_depth(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--per-depth", action="store_true", help="print one column per depth")


def _load_for_cli(args):
    from ..runtime.cpu_threads import use_threads
    from ..evaluation.decoding import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(
        args.model, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
        attn_implementation=args.attn_implementation,
    )
    use_threads(args.threads, model.device.type)
    return model, tokenizer


def run_passkey(args) -> None:
    from ..evaluation.passkey import choose_passkey_template, evaluate_passkey
    from ..evaluation.results import write_outputs

    check_depth_lengths(args.depths, args.lengths)
    model, tokenizer = _load_for_cli(args)
    template, template_bos, description = choose_passkey_template(args.template, model.config)
    print(f"Passkey prompts use {description}.", file=sys.stderr)
    results = evaluate_passkey(
        model, tokenizer, args.lengths, num_depths=args.depths, num_digits=args.digits,
        seed=args.seed, chunk_size=args.chunk_size, progress=not args.quiet, add_bos=args.add_bos or template_bos,
        template=template, teacher_forced=args.teacher_forced,
    )
    table = results.to_markdown(per_depth=args.per_depth)
    print(table)
    print(f"Overall accuracy (strict): {100 * results.mean_accuracy():.1f}%; {results.describe_keys()}")
    if args.out:
        write_outputs(args.out, "passkey", table, results.to_dict(), results.save_heatmap)


def run_needles(args) -> None:
    from ..data.documents import load_documents
    from ..evaluation.needles import Haystack, corpus_haystack, evaluate_needles
    from ..evaluation.results import write_outputs

    tasks = [
        NeedleTask(kind, keys=args.keys, values=args.values, queries=args.queries, chains=args.chains, hops=args.hops,
                   digits=args.digits)
        for kind in args.tasks
    ]
    lengths = args.lengths
    check_depth_lengths(args.depths, lengths)
    haystack = Haystack(load_documents(args.haystack, purpose="haystack")) if args.haystack else corpus_haystack()
    model, tokenizer = _load_for_cli(args)
    for task in tasks:
        results = evaluate_needles(
            model, tokenizer, task, lengths, num_depths=args.depths, seed=args.seed, chunk_size=args.chunk_size,
            haystack=haystack, add_bos=args.add_bos, progress=not args.quiet,
        )
        table = results.to_markdown(per_depth=args.per_depth)
        print(f"{task.kind} ({task.describe()}):\n\n{table}")
        print(f"{task.kind} overall accuracy: {100 * results.mean_accuracy():.1f}%\n")
        if args.out:
            title = f"{task.kind}: {task.describe()}"
            write_outputs(args.out, f"needles-{task.kind}", table, results.to_dict(),
                          lambda path, results=results: results.save_heatmap(path, title=title))


def check_depth_lengths(plan, lengths: list[int]) -> None:
    """Every length --depths names must be evaluated (64k=4 without 64k in --lengths is a slip)."""
    stray = sorted(set(plan.by_length) - set(lengths))
    if stray:
        raise ValueError(f"--depths names {', '.join(map(str, stray))}, which --lengths does not evaluate")


def run_perplexity(args) -> None:
    from ..data.documents import load_documents
    from ..evaluation.perplexity import evaluate_perplexity
    from ..evaluation.results import write_outputs

    model, tokenizer = _load_for_cli(args)
    documents = load_documents(
        args.data or args.dataset, text_field=args.text_column, split=args.split, config_name=args.dataset_config,
        max_documents=None if args.data else args.max_documents, purpose="evaluation",
    )
    results = evaluate_perplexity(
        model, tokenizer, documents, args.lengths, window=args.window, chunk_size=args.chunk_size,
        max_sequences=args.max_sequences, add_bos=args.add_bos, progress=not args.quiet,
    )
    table = results.to_markdown(per_window=True)
    print(table)
    if args.out:
        train_length = getattr(model.config, "train_context_length", None)
        write_outputs(
            args.out, "perplexity", table, results.to_dict(), lambda path: results.save_plot(path, train_length=train_length)
        )


def run_prior(args) -> None:
    from ..evaluation.plots import plot_prior

    path = Path(args.out)
    if path.suffix.lower() != ".png":
        path = path / "prior.png"
    with staged_files(path.parent, path.name) as staging:
        plot_prior(args.model, staging / path.name, max_distance=args.max_distance, layer=args.layer)
    print(f"Wrote {path}")


def main(argv: list[str] | None = None) -> None:
    """Exits with `reporting.run_reported`'s status when something stops the command."""
    args = build_parser().parse_args(argv)
    exit_on_sigterm()
    status = run_reported(f"bam-eval {args.command}", args.run, args)
    if status:
        sys.exit(status)


if __name__ == "__main__":
    main()
