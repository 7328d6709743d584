"""`bam-demo`: train tiny models at a short context, then measure passkey retrieval far beyond it (`demo.py`)."""

import argparse
import os
import sys

from ..demo.settings import DEFAULT_MODELS, MODEL_NAMES, default_settings
from ..files.outputs import OutputError, exit_on_sigterm
from ..runtime.library_warnings import keep_first_screen_quiet
from .arguments import depth_plan, device_name, length_list, non_negative_int, positive_float, positive_int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODEL_NAMES)
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from {','.join(MODEL_NAMES)}")
    if args.device.startswith("cuda:") and args.device != "cuda:0":
        parser.error(f"argument --device: {args.device!r}: the demo trains through Transformers' Trainer, which trains "
                     f"on the first visible GPU; choose it with CUDA_VISIBLE_DEVICES and give --device cuda")
    if not args.train_ssmax_scale and not args.ssmax:
        parser.error("argument --no-train-ssmax-scale: keeps the Scalable-Softmax scales at 1, so it needs --ssmax")
    if args.digits is not None:
        check_enough_keys(parser, args)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.jobs is None:
        args.jobs = usable_cores() if args.device == "cpu" else 1
    return args


def build_parser() -> argparse.ArgumentParser:
    full, quick = default_settings(quick=False), default_settings(quick=True)
    parser = argparse.ArgumentParser(
        prog="bam-demo",
        description="Train tiny models at a short context, then measure passkey retrieval far beyond it.",
    )
    _add_run_arguments(parser)
    _add_training_arguments(parser, full, quick)
    _add_data_arguments(parser, full, quick)
    _add_evaluation_arguments(parser, full, quick)
    _add_model_arguments(parser, full, quick)
    return parser


def _both_defaults(full_value, quick_value) -> str:
    return f"(default: {full_value}; with --quick: {quick_value})"


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the run writes, which models it trains, and on what."""
    parser.add_argument("--output-dir", default="bam-demo-output", help="(default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="a few seconds for CI; the numbers mean nothing")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated subset of {','.join(MODEL_NAMES)} (default: %(default)s)")
    parser.add_argument("--device", type=device_name, default="cpu", help="e.g. cpu, cuda (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument(
        "--threads", type=positive_int, default=1,
        help="torch threads of each model (default: %(default)s). One thread cannot oversubscribe: with several, "
        "every operation waits for its slowest thread, and where other processes share the cores a step took 3-14 s "
        "instead of 0.3 s. Results depend on the thread count (sums split differently), not on the load",
    )
    parser.add_argument(
        "--jobs", type=positive_int, default=None,
        help="models trained at once, each in its own process (default on a CPU: as many as there are models and "
        f"cores, here {usable_cores()} core(s); on a GPU: 1); the results are those of --jobs 1",
    )


def _add_training_arguments(parser: argparse.ArgumentParser, full, quick) -> None:
    parser.add_argument("--steps", type=positive_int, help=_both_defaults(full.train.steps, quick.train.steps))
    parser.add_argument("--batch-size", type=positive_int, help=_both_defaults(full.train.batch_size, quick.train.batch_size))
    parser.add_argument("--lr", type=positive_float, help=_both_defaults(full.train.lr, quick.train.lr))
    parser.add_argument(
        "--prior-lr", type=positive_float,
        help="learning rate of the prior and SSMax scales " + _both_defaults(full.train.prior_lr, quick.train.prior_lr),
    )
    parser.add_argument(
        "--extension-steps", type=non_negative_int,
        help="steps of the context extension after training, at twice the training length with a tenth of the "
        "learning rates (0: none) " + _both_defaults(full.extension.steps, quick.extension.steps),
    )


def _add_data_arguments(parser: argparse.ArgumentParser, full, quick) -> None:
    parser.add_argument(
        "--train-length", type=positive_int,
        help="training context in tokens " + _both_defaults(full.data.train_length, quick.data.train_length),
    )
    parser.add_argument(
        "--digits", type=positive_int,
        help="digits of every passkey, in training and evaluation " + _both_defaults(full.data.num_digits, quick.data.num_digits),
    )


def _add_evaluation_arguments(parser: argparse.ArgumentParser, full, quick) -> None:
    parser.add_argument(
        "--lengths", type=length_list,
        help="comma-separated evaluation prompt lengths in tokens "
        + _both_defaults(",".join(map(str, full.lengths)), ",".join(map(str, quick.lengths))),
    )
    parser.add_argument("--depths", type=depth_plan, metavar="N[,LENGTH=N...]",
                        help="passkey depths (prompts) per length, and fewer at named lengths "
                        + _both_defaults(describe_plan(full.num_depths), describe_plan(quick.num_depths)))


def _add_model_arguments(parser: argparse.ArgumentParser, full, quick) -> None:
    """The tiny models' size and BAM's options."""
    parser.add_argument("--hidden-size", type=positive_int, help=_both_defaults(full.size.hidden_size, quick.size.hidden_size))
    parser.add_argument("--layers", type=positive_int, help=_both_defaults(full.size.num_hidden_layers, quick.size.num_hidden_layers))
    parser.add_argument("--heads", type=positive_int, help=_both_defaults(full.size.num_attention_heads, quick.size.num_attention_heads))
    parser.add_argument(
        "--prior-scope", choices=("global", "layer"), default="layer",
        help="BAM prior per layer or shared (default: %(default)s)",
    )
    parser.add_argument(
        "--ssmax", action=argparse.BooleanOptionalAction, default=False,
        help="Scalable Softmax in BAM (default: off; on validation seeds it lost keys, trained or with its scales "
        "kept at 1: benchmarks/results/demo-cpu.md)"
    )
    parser.add_argument(
        "--train-ssmax-scale", action=argparse.BooleanOptionalAction, default=True,
        help="with --ssmax, train its per-head scale s_h (at --prior-lr) or keep it at 1, the factor then ln(n_i) "
        "(default: trained)",
    )


def check_enough_keys(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The evaluation draws a different key for every prompt: refuse, before any training, a key length with fewer
    keys than prompts (the keys the training draws are excluded too, so more may be needed)."""
    settings = default_settings(args.quick)
    lengths, plan = args.lengths or settings.lengths, args.depths or settings.num_depths
    prompts = sum(plan.count(length) for length in lengths)
    keys = 9 * 10 ** (args.digits - 1)
    if keys < prompts:
        parser.error(f"argument --digits: {args.digits} digit(s) give {keys} keys, fewer than the evaluation's "
                     f"{prompts} prompts, each of which needs a key of its own")


def describe_plan(plan) -> str:
    """A depth plan as --depths takes it: "20,16384=10,32768=10,65536=10"."""
    return ",".join([str(plan.default), *(f"{length}={count}" for length, count in plan.by_length.items())])


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_demo(argv: list[str] | None = None) -> dict:
    """Train, evaluate and save as the command line says; returns each model's passkey results (`demo.run`)."""
    args = parse_args(argv)
    from ..demo.pipeline import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """bam-demo. Ctrl-C: one line (on a line of its own, after any progress bar) and exit 130 (128 + SIGINT), the staged output already removed; SIGTERM: 143."""
    exit_on_sigterm()
    keep_first_screen_quiet()
    try:
        run_demo(argv)
    except OutputError as error:
        print(f"bam-demo: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nbam-demo: interrupted; nothing was written (an earlier complete result is kept)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
