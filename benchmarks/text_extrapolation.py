"""Train short, test long on real text: the paper's comparison of positional encodings (its Figures 2 and 3) on the
CPU, to 512x the training length (`bam_llama.extrapolation`).

Every encoding (BAM, BAM + Scalable Softmax, ALiBi, NoPE, Sinusoidal, RoPE with and without NTK / YaRN scaling, RoPE
local, ...) is trained at 128 tokens on the no-download Python corpus with synthetic passkey documents. Two phases:

    # 1. validation: every trial of each encoding (learning rates, stages or steps; each BamLlama trial also after
    #    the context extension) on the validation seeds, 1x-64x; each encoding's recipe is chosen here
    python benchmarks/text_extrapolation.py --phase validation --encodings bam,bam-ssmax --jobs 2 --resume
    # 2. test: each encoding's chosen recipe on the test seeds, which no choice used; to 512x where it passes 64x
    python benchmarks/text_extrapolation.py --phase test --encodings bam,bam-ssmax --jobs 2 --resume
    # the page again from results.json, nothing run
    python benchmarks/text_extrapolation.py --report-only
    # another study (sizes, steps, rates: `--set FIELD=VALUE`, see settings.Study) in a folder of its own
    python benchmarks/text_extrapolation.py --phase validation --set steps=4000 --output-dir runs/steps-4000 --resume
    # a screen: some trials on seeds of their own (no choice until every trial is done), e.g. BAM's two stages with
    # a uniform head kept in layer 2 of stage one's prior
    python benchmarks/text_extrapolation.py --phase validation --encodings bam --trials two-stage \
        --validation-seeds 102,103 --set uniform_head_layer=2 --output-dir runs/uniform-head-2 --resume

Each job (one trial, one seed: about 20 minutes on one core to 64x, 1-1.5 hours more past it) is published to the
output folder as it ends; a stopped run keeps them, and `--resume` runs the others, each unfinished one on from where
it stopped (its last checkpoint, every 250 steps, and its finished evaluations, kept in `jobs-in-progress/`). `--quick` runs the same pipeline
on tiny models in a minute (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))

from bam_llama.extrapolation.encodings import ENCODINGS  # noqa: E402
from bam_llama.extrapolation.settings import PHASES, QUICK, Study, with_seeds, with_settings  # noqa: E402

OUTPUT = REPOSITORY / "benchmarks" / "results" / "text-extrapolation"


def seed_list(text: str) -> tuple[int, ...]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() for part in parts) or len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"distinct seeds >= 0, comma-separated, got {text!r}")
    return tuple(int(part) for part in parts)


def names_among(allowed: list[str]) -> Callable[[str], list[str]]:
    """An argparse type: distinct comma-separated names, each among `allowed`."""
    def parse(text: str) -> list[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names or any(name not in allowed for name in names) or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"distinct names among {', '.join(allowed)}, got {text!r}")
        return names
    return parse


TRIAL_NAMES = sorted({trial for encoding in ENCODINGS.values() for trial in encoding.trials})


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, got {text!r}")
    return int(text)


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=PHASES, help="validation (choose each recipe) or test (report the choices)")
    parser.add_argument("--report-only", action="store_true", help="write the page again from results.json; run nothing")
    parser.add_argument("--encodings", type=names_among(list(ENCODINGS)), default=list(ENCODINGS),
                        help=f"comma-separated, among {', '.join(ENCODINGS)} (default: all)")
    parser.add_argument("--trials", type=names_among(TRIAL_NAMES), default=None,
                        help="validation: only these trials, comma-separated (a screen; each encoding's choice waits "
                             f"for all of its trials), among {', '.join(TRIAL_NAMES)}")
    parser.add_argument("--jobs", type=positive, default=1, help="jobs at once, each in a process of its own (default 1)")
    parser.add_argument("--threads", type=positive, default=1, help="torch threads of each job (default 1)")
    parser.add_argument("--resume", action="store_true", help="keep the jobs an earlier run of the same settings left in "
                        "--output-dir, continue its unfinished ones from their last checkpoint, and run the others")
    parser.add_argument("--output-dir", type=Path, default=None, help=f"default {OUTPUT.relative_to(REPOSITORY)} "
                        "(with --quick: its -quick sibling)")
    parser.add_argument("--validation-seeds", type=seed_list, default=None, help="default 100,101")
    parser.add_argument("--test-seeds", type=seed_list, default=None, help="default 3,4,5")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="FIELD=VALUE",
                        help="a study setting other than its default (e.g. steps=4000, ssmax_learning_rate=1e-3; "
                        "repeatable): a study of its own, for an --output-dir of its own, recorded in results.json")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps, seconds a job (numbers mean nothing)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser()
    args = parser.parse_args(argv)
    if (args.phase is None) == (not args.report_only):
        parser.error("give --phase validation, --phase test, or --report-only")
    try:
        study = with_seeds(with_settings(QUICK if args.quick else Study(), args.settings), args.validation_seeds,
                           args.test_seeds)
    except ValueError as error:
        parser.error(str(error))
    output_dir = args.output_dir or OUTPUT.with_name(OUTPUT.name + ("-quick" if args.quick else ""))
    from bam_llama.extrapolation.run import RunError, rewrite_report, run
    from bam_llama.extrapolation.report import publish
    from bam_llama.files.outputs import exit_on_sigterm

    exit_on_sigterm()  # like Ctrl-C: the job processes stop, the published results stay
    try:
        if args.report_only:
            print(rewrite_report(output_dir, study))
            return 0
        run(args.phase, args.encodings, study, output_dir, jobs=args.jobs, threads=args.threads, resume=args.resume,
            publish=lambda folder, report: publish(folder, report, study), trials=args.trials)
    except RunError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
