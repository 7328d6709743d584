"""Train short, test long: a self-contained demo of GGD-BAM's length extrapolation.

Builds a byte-level tokenizer and synthetic passkey documents, trains a tiny BamLlama and two baselines (a
RoPE Llama from Transformers, and ALiBi as BamLlama with a fixed linear prior) with the same recipe at a short
context, then measures passkey retrieval far beyond it.

    bam-demo                                  # BAM against RoPE to 512x (64K bytes), ~45 min on 2 idle cores
    bam-demo --models bam,rope,alibi          # also the ALiBi baseline
    bam-demo --quick                          # seconds, for CI (the numbers mean nothing)
    bam-demo --device cuda --steps 4000 --train-length 256 --lengths 256,1024,4096,16384
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import signal
import tempfile
import threading
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
from torch.utils.data import IterableDataset
from tqdm import tqdm as tqdm_base
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback, TrainingArguments, set_seed

from ..data.packing import IGNORE_INDEX
from ..data.special_tokens import BOS_TOKEN_ID, BYTE_VOCAB_SIZE, EOS_TOKEN_ID, PAD_TOKEN_ID
from ..data.tokenizers import build_byte_tokenizer, encode
from ..evaluation.decoding import greedy_continuation
from ..evaluation.intervals import interval_text
from ..evaluation.passkey import (
    PasskeyKeys,
    PasskeyResults,
    PasskeyTemplate,
    build_passkey_prompt,
    evaluate_passkey,
    random_passkey,
    save_passkey_template,
)
from ..evaluation.plots import plot_prior
from ..files.outputs import OutputError, staged_output_dir
from ..positional_models import variant_config, variant_model
from ..positional_variants import POSITIONAL_VARIANTS
from ..runtime.cpu_threads import use_threads
from ..runtime.library_warnings import keep_first_screen_quiet
from ..runtime.processor import cpu_model
from ..runtime.progress import in_a_terminal, keep_library_bars_off_a_log
from ..training.callbacks import StepProgress, StepSeconds
from ..training.trainer import BamTrainer
from .settings import MODEL_NAMES, DataConfig, DemoSettings, ModelSize, TrainConfig, default_settings

# A short member of the paper's prompt family (same structure, shorter pieces), so that a document fits a
# 128-token training context with room for several fillers.
DEMO_TEMPLATE = PasskeyTemplate(
    task="",
    filler="The sky is blue. ",
    info="The pass key is {passkey}. ",
    question="The pass key is",
)


# ------------------------------------------------------------------------------------------------- data


def answer_text(passkey: str) -> str:
    """What follows the question: the key and the full stop that ends it, as in the info sentence. Trained without
    its terminator, a model goes on with an untrained token after the key, often one more digit, which the
    evaluation rightly counts as another number."""
    return f" {passkey}."


def passkey_example(
    rng: random.Random, tokenizer: PreTrainedTokenizerBase, template: PasskeyTemplate, data: DataConfig,
    trained_keys: set[str] | None = None,
) -> tuple[list[int], list[int]]:
    """The evaluation's prompt at a random length and depth, followed by the answer (`answer_text`): (input_ids,
    labels). Its key is added to `trained_keys` (the evaluation draws none of them).

    Prompt and answer together fit in `train_length` tokens.
    """
    passkey = random_passkey(rng, data.num_digits)
    if trained_keys is not None:
        trained_keys.add(passkey)
    answer = encode(tokenizer, answer_text(passkey))
    bos = int(data.add_bos and tokenizer.bos_token_id is not None)  # a prompt of `length` tokens has BOS before them
    shortest = len(build_passkey_prompt(tokenizer, 0, 0.0, passkey, template))
    length = rng.randint(shortest, max(shortest, data.train_length - bos - len(answer)))
    prompt = build_passkey_prompt(tokenizer, length, rng.random(), passkey, template, add_bos=data.add_bos)
    prompt_labels = [IGNORE_INDEX] * len(prompt) if data.answer_only_loss else list(prompt)
    return prompt + answer, prompt_labels + answer


def filler_example(
    rng: random.Random, tokenizer: PreTrainedTokenizerBase, template: PasskeyTemplate, data: DataConfig,
    trained_keys: set[str] | None = None,
) -> tuple[list[int], list[int]]:
    """Task and fillers only, at most `train_length` tokens; trained on every token."""
    bos = [tokenizer.bos_token_id] if data.add_bos else []
    filler = encode(tokenizer, template.filler)
    num_fillers = rng.randint(1, max(1, (data.train_length - len(bos)) // len(filler)))
    input_ids = (bos + encode(tokenizer, template.task) + filler * num_fillers)[: data.train_length]
    return input_ids, list(input_ids)


class PasskeyRows(IterableDataset):
    """The demo's `count` training documents (`passkey_example`, or `filler_example` where `data.passkey_fraction`
    says), generated in order from `seed` (an int or a string) as the loop reads them: the same rows for every model
    of a seed, none kept in memory. Each row's passkey is added to `trained_keys` as it is generated."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: PasskeyTemplate, data: DataConfig, seed: int | str,
                 count: int, trained_keys: set[str] | None = None):
        super().__init__()
        self.tokenizer, self.template, self.data = tokenizer, template, data
        self.seed, self.count, self.trained_keys = seed, count, trained_keys

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        rng = random.Random(self.seed)
        for _ in range(self.count):
            example = passkey_example if rng.random() < self.data.passkey_fraction else filler_example
            input_ids, labels = example(rng, self.tokenizer, self.template, self.data, self.trained_keys)
            yield {"input_ids": input_ids, "labels": labels}


def right_padded_batch(rows: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Rows padded on the right to the longest; padding comes after every real token, so causal attention never
    sees it, and its labels are ignored."""
    width = max(len(row["input_ids"]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        labels[index, : len(row["labels"])] = torch.tensor(row["labels"])
    return {"input_ids": input_ids, "labels": labels}


# ----------------------------------------------------------------------------------------------- models


def llama_fields(size: ModelSize) -> dict:
    """Config fields every model of the demo shares: `size` and the byte tokenizer's vocabulary and special tokens."""
    return dict(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=size.hidden_size,
        intermediate_size=size.intermediate_size or 2 * size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )


def build_model(name: str, size: ModelSize, train_length: int, **bam_overrides) -> PreTrainedModel:
    """A fresh model of the positional variant `name` (`MODEL_NAMES`: "bam", uniform prior with alpha and beta
    trained; "alibi", fixed linear prior; "rope", Transformers' Llama with rotary embeddings for 64k positions);
    bam_overrides: BamLlamaConfig fields."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; expected {', '.join(MODEL_NAMES[:-1])} or {MODEL_NAMES[-1]}")
    fields = llama_fields(size)
    if POSITIONAL_VARIANTS[name].is_bam_llama:
        fields.update(bam_overrides)
    else:
        fields["max_position_embeddings"] = 1 << 16
    return variant_model(variant_config(name, train_length, **fields))


def bam_options(name: str, args: argparse.Namespace) -> dict:
    """The BamLlamaConfig fields the command line sets for model `name` (none but BAM's)."""
    if name != "bam":
        return {}
    return dict(prior_scope=args.prior_scope, ssmax=args.ssmax, train_ssmax_scale=args.train_ssmax_scale)


# --------------------------------------------------------------------------------------------- training


def training_arguments(train: TrainConfig, seed: int, device: str, folder: Path) -> TrainingArguments:
    """The demo's recipe as the shared loop's settings: AdamW (torch's, betas 0.9 and 0.95) at `train.lr`, linear
    warmup over `warmup_fraction` of the steps (at least one) then cosine decay to zero, the gradient's norm clipped,
    a loss logged every step, on `device` alone; nothing saved (`folder`: Trainer's output folder, which it only
    creates)."""
    training_args = TrainingArguments(
        output_dir=str(folder), per_device_train_batch_size=train.batch_size, max_steps=train.steps,
        learning_rate=train.lr, weight_decay=train.weight_decay, optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.95,
        lr_scheduler_type="cosine", warmup_steps=max(1, int(train.steps * train.warmup_fraction)),
        max_grad_norm=train.max_grad_norm, seed=seed, use_cpu=torch.device(device).type == "cpu", bf16=False,
        save_strategy="no", logging_steps=1, report_to="none", disable_tqdm=True, remove_unused_columns=False,
        dataloader_pin_memory=False,
    )
    training_args._n_gpu = min(training_args.n_gpu, 1)  # one device: no DataParallel across every visible GPU
    return training_args


def train_model(
    model: PreTrainedModel,
    rows: PasskeyRows,
    train: TrainConfig,
    seed: int,
    device: str,
    folder: Path,
    progress: StepProgress | None = None,
    callbacks: list[TrainerCallback] | None = None,
) -> list[float]:
    """Train in place through the package's training loop (`BamTrainer`, as bam-pretrain), on `rows` in order,
    `train.batch_size` a step; the prior and SSMax scales at `train.prior_lr` without decay. Returns each step's
    loss. `folder`: an existing folder given to Trainer as its output folder (nothing is written there: a killed
    model process leaves nothing behind); `progress`: how the steps show (None: not at all)."""
    progress = progress or StepProgress("train", disable=True)
    use_cache, model.config.use_cache = model.config.use_cache, False  # no cache while training
    try:
        trainer = BamTrainer(
            model=model, args=training_arguments(train, seed, device, folder), train_dataset=rows,
            data_collator=partial(right_padded_batch, pad_token_id=rows.tokenizer.pad_token_id),
            prior_learning_rate=train.prior_lr or train.lr, progress=progress, callbacks=callbacks,
        )
        trainer.train()
    finally:
        model.config.use_cache = use_cache
    model.eval()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def extension_recipe(settings: DemoSettings) -> tuple[DataConfig, TrainConfig]:
    """The context extension's data and recipe (`ExtensionConfig`): documents `factor` times longer, `factor` times
    fewer a step, the learning rates `rate_factor` times the training's."""
    extension, train = settings.extension, settings.train
    data = replace(settings.data, train_length=settings.data.train_length * extension.factor)
    prior_lr = None if train.prior_lr is None else train.prior_lr * extension.rate_factor
    recipe = replace(train, steps=extension.steps, batch_size=max(1, train.batch_size // extension.factor),
                     lr=train.lr * extension.rate_factor, prior_lr=prior_lr)
    return data, recipe


def extend_context(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, settings: DemoSettings, seed: int,
                   device: str, folder: Path, trained_keys: set[str], progress: StepProgress | None = None) -> list[float]:
    """The context extension of a trained model, in place (`extension_recipe`), on documents of their own stream
    (the seed's, apart from the training's); their keys join `trained_keys`. Returns each step's loss."""
    data, recipe = extension_recipe(settings)
    rows = PasskeyRows(tokenizer, DEMO_TEMPLATE, data, f"{seed}:extension", recipe.steps * recipe.batch_size,
                       trained_keys)
    return train_model(model, rows, recipe, seed, device, folder, progress)


# ------------------------------------------------------------------------------------------------- main


MODEL_LABELS = {name: POSITIONAL_VARIANTS[name].label for name in MODEL_NAMES}


def settings_from_args(args: argparse.Namespace) -> DemoSettings:
    settings = default_settings(args.quick)
    overrides = [
        (settings.data, "train_length", args.train_length),
        (settings.data, "num_digits", args.digits),
        (settings.train, "steps", args.steps),
        (settings.train, "batch_size", args.batch_size),
        (settings.train, "lr", args.lr),
        (settings.train, "prior_lr", args.prior_lr),
        (settings.extension, "steps", args.extension_steps),
        (settings.size, "hidden_size", args.hidden_size),
        (settings.size, "num_hidden_layers", args.layers),
        (settings.size, "num_attention_heads", args.heads),
        (settings, "num_depths", args.depths),
    ]
    for target, field, value in overrides:
        if value is not None:
            setattr(target, field, value)
    if args.lengths:
        settings.lengths = args.lengths
    return settings


def accuracy_table(results: dict[str, PasskeyResults], train_length: int) -> str:
    """Markdown table: one row per model, one column per length (with its multiple of the training length and its
    prompts), each cell the keys found (strict) and their 95% Clopper-Pearson interval."""
    first = next(iter(results.values()))
    header = "| model | " + " | ".join(
        f"{length} ({length / train_length:g}x, {count})" for length, count in zip(first.lengths, first.depth_counts())) + " |"
    rule = "|---|" + "---:|" * len(first.lengths)
    rows = []
    for name, result in results.items():
        cells = [f"{sum(row) / len(row):.0%} ({interval_text(sum(row), len(row))})" for row in result.correct]
        rows.append(f"| {MODEL_LABELS[name]} | " + " | ".join(cells) + " |")
    return "\n".join([header, rule, *rows])


def run(args: argparse.Namespace) -> dict[str, PasskeyResults]:
    """Train, evaluate and save as `args` (bam-demo's parsed command line) say; returns each model's passkey results.

    Everything is written into a staging folder beside --output-dir, which replaces it only once complete: an
    interrupted run leaves no partial result, and an earlier complete one survives it."""
    output_dir = Path(args.output_dir)
    check_replaceable(output_dir)
    torch.use_deterministic_algorithms(True, warn_only=True)
    keep_library_bars_off_a_log()
    start = time.perf_counter()
    with staged_output_dir(output_dir, force=True) as staging:
        results, summary, table = train_evaluate_and_save(args, staging, start)
    print(f"\n{summary}\n\n{table}\n\nHeatmaps, prior plot and the trained BAM model are in {output_dir}/")
    return results


def train_evaluate_and_save(args: argparse.Namespace, folder: Path, start: float):
    """Every model trained and evaluated, its outputs written to `folder`: (results, summary line, table). With
    `args.jobs` > 1 the models train at once, each in a process of its own (`train_in_processes`)."""
    settings = settings_from_args(args)
    names = args.models.split(",")
    jobs = min(args.jobs, len(names))
    print(run_plan(names, args, settings, jobs), flush=True)
    print(f"Timing {CALIBRATION_STEPS} training steps and two prompts of each model for an estimate of the "
          "run's time...", flush=True)
    print(run_estimate(names, args, settings, jobs), flush=True)
    if jobs > 1:
        results = train_in_processes(names, args, settings, folder, jobs)
    else:
        results = {name: train_and_evaluate(name, args, settings, folder) for name in names}
    minutes = (time.perf_counter() - start) / 60

    train_length = settings.data.train_length
    table = accuracy_table(results, train_length)
    keys = next(iter(results.values()))
    processor = cpu_model()
    summary = (f"Passkey retrieval accuracy (strict: the greedy answer is the key; in brackets the 95% interval; the "
               f"header gives each length's prompts), trained at {train_length} tokens ({minutes:.1f} min on "
               f"{args.device}, {thread_description(args.threads, jobs)}; {processor}). Evaluation keys: "
               f"{keys.describe_keys()}:")
    (folder / "results.md").write_text(f"{summary}\n\n{table}\n")
    run = {"minutes": minutes, "device": args.device, "processor": processor, "threads": args.threads, "jobs": jobs,
           "argv": args.argv, "settings": asdict(settings)}
    outputs = {"run": run, **{name: result.to_dict() for name, result in results.items()}}
    (folder / "results.json").write_text(json.dumps(outputs, indent=2))
    return results, summary, table


# ------------------------------------------------------------------------------------------------- what runs, how long

CALIBRATION_STEPS = 3  # timed after one untimed step
CALIBRATION_LONGEST_PROMPT = 4096  # the longer of the two timed prompts (fewer where the run's lengths are shorter)


def run_plan(names: list[str], args: argparse.Namespace, settings: DemoSettings, jobs: int) -> str:
    """What the run will do, in a sentence for its first screen."""
    size, train, plan = settings.size, settings.train, settings.num_depths
    fewer = "".join(f", {count} at {length}" for length, count in plan.by_length.items() if length in settings.lengths)
    extension = ""
    if settings.extension.steps:
        data, recipe = extension_recipe(settings)
        extension = (f", then a context extension of {recipe.steps} steps of {recipe.batch_size} documents of "
                     f"{data.train_length} tokens")
    return (f"bam-demo: training {', '.join(names)} ({size.num_hidden_layers} layers of width {size.hidden_size}; "
            f"{train.steps} steps of {train.batch_size} documents of {settings.data.train_length} tokens{extension}), then "
            f"evaluating each at {', '.join(map(str, settings.lengths))} tokens ({plan.default} prompts per length"
            f"{fewer}); on {args.device}, {thread_description(args.threads, jobs)}.")


def run_estimate(names: list[str], args: argparse.Namespace, settings: DemoSettings, jobs: int) -> str:
    """The run's wall time, estimated from a few training steps and two prompts of every model timed just now, each
    prompt's seconds fitted as a*length + b*length^2 (the prefill's attention grows with the square). The models of
    a round run at once, each on its own core: a round lasts as long as its slowest model (RoPE's prompts are
    slower than BAM's)."""
    costs = {name: model_seconds(name, args, settings) for name in names}  # (training, evaluation) of each
    rounds = [names[first : first + jobs] for first in range(0, len(names), jobs)]
    training = sum(max(costs[name][0] for name in round_names) for round_names in rounds)
    evaluation = sum(max(costs[name][1] for name in round_names) for round_names in rounds)
    return (f"Estimate: training ~{duration_text(training)}, evaluation ~{duration_text(evaluation)} at these lengths "
            f"(from {CALIBRATION_STEPS} training steps and two prompts of each model timed just now on this machine; "
            f"models trained at once share the memory bandwidth, and other programs on the cores make it longer).")


def model_seconds(name: str, args: argparse.Namespace, settings: DemoSettings) -> tuple[float, float]:
    """(training, evaluation) seconds of model `name` in this run, from `measure_costs`."""
    step_seconds, prompt_seconds = measure_costs(name, args, settings)
    evaluation = sum(settings.num_depths.count(length) * prompt_seconds(length) for length in settings.lengths)
    return (settings.train.steps + settings.extension.steps) * step_seconds, evaluation  # an extension step: as many tokens


def measure_costs(name: str, args: argparse.Namespace, settings: DemoSettings):
    """(seconds per training step, a prompt's seconds as a function of its length) of a fresh `name` model, timed
    here on `args.threads` threads; the model is then discarded (every model is seeded again before training)."""
    use_threads(args.threads, torch.device(args.device).type)
    tokenizer = build_byte_tokenizer()
    data, train = settings.data, settings.train
    model = build_model(name, settings.size, data.train_length, **bam_options(name, args))
    steps = StepSeconds()
    rows = PasskeyRows(tokenizer, DEMO_TEMPLATE, data, args.seed, (CALIBRATION_STEPS + 1) * train.batch_size)
    with tempfile.TemporaryDirectory(prefix="bam-demo-") as folder:
        train_model(model, rows, replace(train, steps=CALIBRATION_STEPS + 1), args.seed, args.device, Path(folder),
                    callbacks=[steps])
    longer = min(max(settings.lengths), CALIBRATION_LONGEST_PROMPT)
    shorter = max(longer // 4, 16)
    timed = {length: prompt_time(model, tokenizer, length, data) for length in (shorter, shorter, longer)}  # once untimed
    return sum(steps.seconds[1:]) / CALIBRATION_STEPS, prompt_cost(timed[shorter], shorter, timed[longer], longer)


def prompt_time(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, length: int, data: DataConfig) -> float:
    """Seconds of one passkey prompt of `length` tokens, prefilled and answered as the evaluation does."""
    prompt = build_passkey_prompt(tokenizer, length, 0.5, "0" * data.num_digits, DEMO_TEMPLATE, add_bos=data.add_bos)
    start = time.perf_counter()
    with torch.inference_mode():
        greedy_continuation(model, prompt, data.num_digits + 2, chunk_size=1024)
    return time.perf_counter() - start


def prompt_cost(seconds_1: float, length_1: int, seconds_2: float, length_2: int):
    """A prompt's seconds as a*length + b*length^2 through two timed prompts (b >= 0; a line where one length)."""
    per_token_1, per_token_2 = seconds_1 / length_1, seconds_2 / length_2
    b = max((per_token_2 - per_token_1) / (length_2 - length_1), 0.0) if length_2 != length_1 else 0.0
    a = max(per_token_2 - b * length_2, 0.0)
    return lambda length: a * length + b * length**2


def duration_text(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.0f} min"


def thread_description(threads: int, jobs: int) -> str:
    models = f"{jobs} models at once" if jobs > 1 else "one model at a time"
    return f"{models}, {threads} thread{'s' if threads > 1 else ''} each"


def train_and_evaluate(
    name: str, args: argparse.Namespace, settings: DemoSettings, folder: Path, progress_position: int | None = None
) -> PasskeyResults:
    """One model: seeded, trained (and its context extended where `settings.extension` says), evaluated on
    `args.threads` torch threads; its heatmap (and for BAM the model and
    its prior plot) written to `folder`."""
    use_threads(args.threads, torch.device(args.device).type)
    tokenizer = build_byte_tokenizer()
    train_length = settings.data.train_length
    set_seed(args.seed)  # identical initialization stream and identical batches for every model
    model = build_model(name, settings.size, train_length, **bam_options(name, args))
    trained_keys = set()
    rows = PasskeyRows(tokenizer, DEMO_TEMPLATE, settings.data, args.seed,
                       settings.train.steps * settings.train.batch_size, trained_keys)
    train_model(model, rows, settings.train, args.seed, args.device, folder,
                StepProgress(f"train {name}", progress_position))
    if settings.extension.steps:
        extend_context(model, tokenizer, settings, args.seed, args.device, folder, trained_keys,
                       StepProgress(f"extend {name}", progress_position))
    result = evaluate_passkey(
        model, tokenizer, settings.lengths, num_depths=settings.num_depths, template=DEMO_TEMPLATE,
        add_bos=settings.data.add_bos, progress=progress_position is None or not in_a_terminal(),
        description=f"evaluate {name}",
        keys=PasskeyKeys(args.seed, settings.data.num_digits, excluded=trained_keys),
    )
    result.save_heatmap(folder / f"passkey-{name}.png", title=f"{MODEL_LABELS[name]}, trained at {train_length} tokens")
    if name == "bam":
        save_passkey_template(model, DEMO_TEMPLATE, settings.data.add_bos)  # bam-eval passkey's default prompt
        save_bam(model, tokenizer, folder)
    return result


def train_in_processes(names, args, settings, folder: Path, jobs: int) -> dict[str, PasskeyResults]:
    """`train_and_evaluate` of every model in a pool of `jobs` processes (spawned: a fresh PyTorch each), in the
    order given. The workers ignore Ctrl-C; this process stops them (terminate) on Ctrl-C, SIGTERM or an error, so
    nothing outlives the run."""
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: each worker ignores Ctrl-C from its start
    try:
        pool = multiprocessing.get_context("spawn").Pool(jobs, initializer=_start_worker)
    finally:
        signal.signal(signal.SIGINT, handler)
    try:
        pending = {
            name: pool.apply_async(_model_job, (name, args, settings, folder, position))
            for position, name in enumerate(names)
        }
        results = {name: PasskeyResults.from_dict(job.get()) for name, job in pending.items()}
        pool.close()
        return results
    finally:
        pool.terminate()
        pool.join()


def _model_job(name, args, settings, folder, position) -> dict:
    torch.use_deterministic_algorithms(True, warn_only=True)
    return train_and_evaluate(name, args, settings, folder, progress_position=position).to_dict()


def _start_worker() -> None:
    """A model process's progress bars lock with a thread lock: tqdm's default is a multiprocessing semaphore, which
    a terminated worker cannot release, so the resource tracker would warn of it after the parent's last line. Its
    first screen is kept as quiet as the parent's, its output as plain."""
    tqdm_base.set_lock(threading.RLock())  # the class every progress bar's lock comes from
    keep_first_screen_quiet()
    keep_library_bars_off_a_log()


DEMO_RESULT_MARKER = "results.json"


def check_replaceable(output_dir: Path) -> None:
    """A re-run replaces --output-dir as a whole: only an empty folder or an earlier bam-demo result (it holds
    results.json) may be replaced, never a folder of the user's other files."""
    if output_dir.is_symlink() or (output_dir.exists() and not output_dir.is_dir()):
        raise OutputError(f"--output-dir {output_dir} is not a folder")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not (output_dir / DEMO_RESULT_MARKER).is_file():
        raise OutputError(
            f"--output-dir {output_dir} holds files that are not a bam-demo result (no {DEMO_RESULT_MARKER}), which "
            "a run would replace: choose another folder"
        )


def save_bam(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, output_dir: Path) -> None:
    """The trained model and tokenizer as a loadable folder (staged, then renamed), and its prior plot."""
    with staged_output_dir(output_dir / "bam-model", force=True) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    plot_prior(model, output_dir / "prior.png")
