"""The command line pieces the commands share: argparse `type=` checks (a bad value becomes one line naming the
argument and exit status 2, before any weights are loaded) and the flags of `bam-finetune` and `bam-pretrain`. Light
on purpose: every command imports it before parsing; what a check needs of the library is imported inside it."""

import argparse
import logging
import os

from ..evaluation.depth_plan import DepthPlan
from ..files.outputs import exit_on_sigterm
from ..training.arguments import saved_bam_llama_config
from .reporting import run_reported


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    value = _float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1), got {text!r}")
    return value


def length_list(text: str) -> list[int]:
    """`"256,512,1k"` -> `[256, 512, 1024]`; `k` means 1024; every length must be positive."""
    lengths = []
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        number, scale = (item[:-1], 1024) if item.endswith("k") else (item, 1)
        try:
            length = int(number) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is not a length in tokens (write e.g. 512,1k,2k)") from None
        if length <= 0:
            raise argparse.ArgumentTypeError(f"lengths must be positive, got {item!r}")
        if length in lengths:
            raise argparse.ArgumentTypeError(f"length {length} is given twice in {text!r}; name each length once")
        lengths.append(length)
    if not lengths:
        raise argparse.ArgumentTypeError(f"no length in {text!r}")
    return lengths


class DistinctLengths(argparse.Action):
    """`--lengths 256,512 1k`: the `length_list` values of one flag joined into one list, refused when a length is
    named twice across them (`--lengths 300 300`, or `1k 1024`): the same prompts measured twice would count twice."""

    def __call__(self, parser, namespace, values, option_string=None):
        lengths = [length for value in values for length in value]
        repeated = sorted({length for length in lengths if lengths.count(length) > 1})
        if repeated:
            raise argparse.ArgumentError(
                self, f"length {', '.join(map(str, repeated))} is given twice in {' '.join(map(str, lengths))}; "
                "name each length once"
            )
        setattr(namespace, self.dest, lengths)


def depth_plan(text: str):
    """`"20"` -> 20 depths at every length; `"20,32k=10,64k=4"` -> 20, but 10 at 32768 tokens and 4 at 65536 (a
    `DepthPlan`; `k` means 1024). A length named twice (`300=2,300=5`, or `1k=2,1024=5`) is refused."""

    default, *overrides = [part.strip() for part in text.split(",")]
    by_length = {}
    for item in overrides:
        length, equals, count = item.partition("=")
        if not equals:
            raise argparse.ArgumentTypeError(f"{item!r}: name a length's depths as LENGTH=N, e.g. 64k=4")
        lengths = length_list(length)
        if len(lengths) != 1:
            raise argparse.ArgumentTypeError(f"{item!r}: one length per LENGTH=N")
        if lengths[0] in by_length:
            raise argparse.ArgumentTypeError(
                f"{item!r}: length {lengths[0]} is given its depths twice in {text!r}; name each length once"
            )
        by_length[lengths[0]] = positive_int(count)
    return DepthPlan(positive_int(default), by_length)


def checked_by(check):
    """An argparse `type=` that runs `check(text)` (which raises ValueError naming the problem) and passes the text
    on as written."""

    def checked(text: str) -> str:
        try:
            check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return checked


# A saved BamLlama folder, judged by its config.json (no weights read).
bam_llama_folder = checked_by(saved_bam_llama_config)


def device_name(text: str) -> str:
    """A torch device this PyTorch build can use: cpu, cuda, cuda:N, mps, ..."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "has no CUDA support" if torch.version.cuda is None else "sees no GPU"
            raise argparse.ArgumentTypeError(f"{text!r}: this PyTorch build ({torch.__version__}) {build}; use cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: there are only {torch.cuda.device_count()} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: MPS is not available on this machine; use cpu")
    return text


def run_training(prog: str, train, args) -> int:
    """`train(args)` as a training command runs it: SIGTERM ends it like Ctrl-C (staged outputs cleaned up), logs at
    INFO, every failure is one line and an exit status (`reporting.py`: 2 for bad input, 1 for a diverged loss or
    an I/O error, 130 for Ctrl-C), the process group of a torchrun run is destroyed, and each rank says when it
    finished."""
    from ..files.model_folders import TrainingDiverged

    exit_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    status = run_reported(prog, train, args, failures=(TrainingDiverged,))
    if status:
        return status
    from ..training.distributed import end_distributed_run  # PyTorch is loaded by now

    end_distributed_run()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    print(f"{prog}: rank {rank} of {world_size} finished", flush=True)
    return 0


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every option's default in its --help line (flags with no help text get one), unless the help already names
    it; options without a default value (None, off) are left as they are."""
    for action in parser._actions:
        help_text = action.help or ""
        unset = any(action.default is value for value in (None, False, argparse.SUPPRESS))
        if not action.option_strings or unset or "default" in help_text:
            continue
        action.help = f"{help_text} (default: %(default)s)".strip()
    return parser


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """The data and output flags of `bam-finetune` and `bam-pretrain`; in the functions below `defaults` is the
    command's arguments dataclass."""
    parser.add_argument(
        "--data", required=True,
        help=".txt (documents separated by blank lines), .jsonl, .json, .csv, .parquet, a folder of .txt/.jsonl "
        "files, a datasets.save_to_disk folder, or a datasets name",
    )
    parser.add_argument("--output-dir", required=True)


def add_dataset_arguments(parser: argparse.ArgumentParser, defaults) -> None:
    parser.add_argument("--text-field", default=defaults.text_field, help="text field of JSON lines / dataset rows")
    parser.add_argument("--dataset-config", default=None, help="configuration name of a datasets dataset")
    parser.add_argument("--dataset-split", default=defaults.dataset_split)
    parser.add_argument("--eval-rows", type=positive_int, default=defaults.eval_rows, help="packed rows held out for loss before/after")


def add_trainer_arguments(parser: argparse.ArgumentParser, defaults) -> None:
    """The `Trainer` flags both training commands share, after their learning rates."""
    parser.add_argument("--weight-decay", type=non_negative_float, default=defaults.weight_decay)
    parser.add_argument("--warmup-steps", type=non_negative_int, default=defaults.warmup_steps)
    parser.add_argument("--lr-scheduler-type", default=defaults.lr_scheduler_type)
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps, help="optimizer steps; <= 0 uses --num-train-epochs")
    parser.add_argument("--num-train-epochs", type=positive_float, default=defaults.num_train_epochs)
    parser.add_argument("--per-device-train-batch-size", "--batch-size", type=positive_int, default=defaults.per_device_train_batch_size)
    parser.add_argument("--gradient-accumulation-steps", type=positive_int, default=defaults.gradient_accumulation_steps)
    parser.add_argument(
        "--gradient-checkpointing", action="store_true",
        help="recompute each layer in the backward pass (torch's non-reentrant checkpoint, Transformers' default)",
    )
    parser.add_argument(
        "--reentrant-checkpointing", action="store_true",
        help="gradient checkpointing with use_reentrant=True, as many PEFT / QLoRA recipes pass (same gradients)",
    )
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="bf16 autocast (default: on where the GPU supports it; --bf16 without a GPU: the CPU's)")
    parser.add_argument("--attn-implementation", default=None, help="sdpa, eager or bam_triton (default: fastest available)")
    parser.add_argument("--save-steps", type=positive_int, default=defaults.save_steps)
    parser.add_argument("--save-total-limit", type=positive_int, default=defaults.save_total_limit)
    parser.add_argument("--resume-from-checkpoint", default=None, help="a checkpoint folder, or 'latest' in --output-dir")
    parser.add_argument(
        "--overwrite-output-dir", action="store_true",
        help="delete an earlier run's results in --output-dir (checkpoints, saved model, summary.json) and start "
        "afresh; without it such a folder is refused unless --resume-from-checkpoint continues that run",
    )


def add_parallel_arguments(parser: argparse.ArgumentParser, defaults) -> None:
    parallel = parser.add_argument_group("sharding and sequence parallelism (CUDA; launch with accelerate launch / torchrun)")
    parallel.add_argument("--fsdp", action="store_true", help="FSDP2: shard parameters, gradients and optimizer state")
    parallel.add_argument("--deepspeed", default=None, metavar="zero2|zero3|CONFIG", help="DeepSpeed ZeRO (pip install 'bam-llama[deepspeed]')")
    parallel.add_argument(
        "--sp-size", type=positive_int, default=defaults.sp_size,
        help="Ulysses sequence parallelism over N GPUs (needs --deepspeed, --attn-implementation sdpa)",
    )


def add_run_arguments(parser: argparse.ArgumentParser, defaults) -> None:
    parser.add_argument("--logging-steps", type=positive_int, default=defaults.logging_steps)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    add_threads_argument(parser)
    parser.add_argument("--disable-progress-bars", action="store_true")


# benchmarks/threads_beside_load.py, 2026-11-27; docs/pretraining.md#threads gives the run and its load.
THREADS_MEASURED = (
    "A small bam-pretrain beside two busy processes on 2 cores (lscpu: Intel(R) Xeon(R) Processor) took 13-15 s per "
    "step on torch's default 2 threads, 0.9-1.3 s per step on 1"
)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """`--threads` of bam-pretrain, bam-finetune and bam-eval; `cpu_threads.use_threads` applies it."""
    parser.add_argument(
        "--threads", type=positive_int, default=None,
        help="torch threads (default: on a CPU 1, or OMP_NUM_THREADS where it is set, e.g. by torchrun; on a GPU "
        "torch's own). One thread cannot oversubscribe: with several, every operation waits for its slowest thread, "
        f"so where other programs share the cores it stalls. {THREADS_MEASURED}",
    )


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
