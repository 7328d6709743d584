"""One trial of one encoding and seed, trained: its stages through `bam-pretrain`'s Python API (a two-stage trial's
first stage is the one-stage trial it names, whose learned shape the second freezes), then the paper's context
extension through `bam-finetune --full` at twice the training length. What each stage learned (the prior, the SSMax
scales) is read back for results.json, from which a later run can rebuild a stage-one prior without its weights.

A stage saves a checkpoint every `CHECKPOINT_STEPS` steps and, once done, its summary beside its folder
(`resumable_stage`): the same job run again after a stop skips the stages done and continues the interrupted one
from its last checkpoint, with Trainer's saved optimizer, schedule and random state.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..model.configuration_bam import BamLlamaConfig
from ..model.prior_modules_bam import BamPrior, BamScalableSoftmax
from ..files.outputs import staged_files
from ..positional_models import variant_config
from ..training.arguments import FinetuneArguments, PretrainArguments
from ..training.checkpoints import latest_checkpoint
from ..training.finetune import Finetuning
from ..training.pretrain import run_pretraining
from ..training.run import run_training
from .encodings import Encoding, Trial
from .settings import Study

# what a stage learned, by tensor name: the module kind holding it (a prior holds the thetas or T5's bucket_bias)
LEARNED = {"theta_alpha": "prior", "theta_beta": "prior", "theta_mu": "prior", "bucket_bias": "prior", "scale": "ssmax"}
CHECKPOINT_STEPS = 250  # a stopped stage loses at most this many steps (a checkpoint of the study's model: ~20 MB)


def pretrain_arguments(encoding: Encoding, trial: Trial, study: Study, seed: int, data: Path, tokenizer: Path,
                       output_dir: Path, stage_one: Path | None) -> PretrainArguments:
    """bam-pretrain's settings of one stage: the study's sizes and data, the trial's learning rate and steps (the
    learned prior's and SSMax scales' at the study's shape rate, RoPE's scales too); with `stage_one` (a saved model),
    its learned prior (and with `trial.frozen_scales` its SSMax scales) frozen."""
    steps = study.steps * trial.steps_factor
    bam_llama = encoding.extends
    return PretrainArguments(
        data=str(data), output_dir=str(output_dir), context_length=study.train_length, positional=encoding.positional,
        ssmax=encoding.ssmax, hidden_size=study.hidden_size, num_hidden_layers=study.layers,
        num_attention_heads=study.heads, tokenizer=str(tokenizer), learning_rate=trial.learning_rate,
        prior_learning_rate=study.shape_learning_rate if bam_llama or encoding.ssmax else None,  # the SSMax scales' too
        ssmax_learning_rate=study.ssmax_learning_rate if encoding.ssmax else None,
        ssmax_scale_init=study.ssmax_scale_init if encoding.ssmax else None,
        warmup_steps=study.warmup_steps,
        per_device_train_batch_size=study.batch_size, max_steps=steps, save_steps=min(steps, CHECKPOINT_STEPS),
        save_total_limit=1,
        logging_steps=max(steps // 10, 1), seed=seed, disable_progress_bars=True, eval_rows=8,
        prior_scope="layer" if bam_llama else "global", threads=torch.get_num_threads(),
        frozen_prior_from=None if stage_one is None else str(stage_one), frozen_ssmax=trial.frozen_scales,
    )


def pretrain_stage(args: PretrainArguments) -> tuple[Path, dict]:
    """(saved model folder, its summary with the seconds and what it learned)."""
    started = time.perf_counter()
    summary, model, _ = run_pretraining(args)
    return Path(summary.final_dir), {**asdict(summary), "train_seconds": time.perf_counter() - started,
                                     "learned": learned_values(model)}


def resumable_stage(args: PretrainArguments | FinetuneArguments, train) -> tuple[Path, dict]:
    """`train(args)` (`pretrain_stage` or `extend_stage`) into `args.output_dir`, its summary then written beside
    that folder (`<folder>.json`). Where the summary is there already, the stage was done: its (folder, summary). Where
    only checkpoints are, an earlier run stopped mid-stage: training continues from the newest complete one. Where the
    folder holds no checkpoint, it stopped before the first: the folder is cleared and the stage begins again."""
    folder = Path(args.output_dir)
    record = folder.with_name(folder.name + ".json")
    if record.is_file():
        summary = json.loads(record.read_text())
        return folder / Path(summary["final_dir"]).name, summary  # the folder where it is now, if moved since
    if latest_checkpoint(folder) is not None:
        args = replace(args, resume_from_checkpoint="latest")
    elif folder.exists():
        shutil.rmtree(folder)
    final_dir, summary = train(args)
    write_json(record, summary)
    return final_dir, summary


def write_json(path: Path, value) -> None:
    """`path` written whole or not at all (a stopped run leaves no half of it)."""
    with staged_files(path.parent, path.name) as staging:
        (staging / path.name).write_text(json.dumps(value))


def extension_arguments(folder: Path, trial: Trial, study: Study, seed: int, data: Path, output_dir: Path,
                        ssmax: bool) -> FinetuneArguments:
    """The context extension of a trained BamLlama (with Scalable Softmax where `ssmax`): every weight (and whatever
    of the prior and scales its config trains) fine-tuned at `study.extension_length` for `study.extension_steps`
    steps, at `extension_rate_factor` times the stage's learning rates."""
    return FinetuneArguments(
        model=str(folder), data=str(data), output_dir=str(output_dir), context_length=study.extension_length,
        lora=False, learning_rate=trial.learning_rate * study.extension_rate_factor,
        prior_learning_rate=study.shape_learning_rate * study.extension_rate_factor, max_steps=study.extension_steps,
        ssmax_learning_rate=None if study.ssmax_learning_rate is None or not ssmax
        else study.ssmax_learning_rate * study.extension_rate_factor,
        per_device_train_batch_size=study.extension_batch_size,
        save_steps=min(study.extension_steps, CHECKPOINT_STEPS), save_total_limit=1,
        logging_steps=max(study.extension_steps // 8, 1), seed=seed, disable_progress_bars=True, eval_rows=8,
        weight_decay=0.1, threads=torch.get_num_threads(),
    )


def extend_stage(args: FinetuneArguments) -> tuple[Path, dict]:
    """(extended model folder, its summary with the seconds and what it learned)."""
    started = time.perf_counter()
    summary, model, _ = run_training(Finetuning(args))
    return Path(summary.final_dir), {**asdict(summary), "train_seconds": time.perf_counter() - started,
                                     "learned": learned_values(model)}


def learned_values(model) -> dict[str, list[list[float]]]:
    """Each BamLlama layer's prior and SSMax scales [layer][head] (T5's bucket_bias [layer][head][bucket]; a global
    prior: its one row); {} for other models."""
    learned: dict[str, list[list[float]]] = {}
    for module in model.modules():
        if isinstance(module, (BamPrior, BamScalableSoftmax)):
            for name, kind in LEARNED.items():
                if (kind == "prior") == isinstance(module, BamPrior) and hasattr(module, name):
                    learned.setdefault(name, []).append(getattr(module, name).detach().float().tolist())
    return learned


def with_uniform_head(learned: dict[str, list[list[float]]], layer: int, distance: int) -> tuple[dict, int]:
    """(the learned GGD prior with the flattest head of `layer`, the one whose prior costs least at `distance`
    tokens, set to the uniform prior: theta_alpha = theta_beta = 0, a cost of 1 at every distance; that head)."""
    alpha, beta = learned["theta_alpha"][layer], learned["theta_beta"][layer]
    head = min(range(len(alpha)), key=lambda index: alpha[index] + beta[index] * math.log(distance))  # log of the cost
    edited = {name: [list(row) for row in rows] for name, rows in learned.items()}
    edited["theta_alpha"][layer][head] = 0.0
    edited["theta_beta"][layer][head] = 0.0
    return edited, head


def stage_one_folder(learned: dict[str, list[list[float]]], encoding: Encoding, study: Study, folder: Path) -> Path:
    """A folder `bam-pretrain --frozen-prior-from` reads a stage-one model's prior (and SSMax scales) from, rebuilt
    from its learned values: the config of the study's sizes and encoding, and those tensors alone."""
    config = variant_config(encoding.positional, study.train_length, hidden_size=study.hidden_size,
                            num_hidden_layers=study.layers, num_attention_heads=study.heads, prior_scope="layer",
                            ssmax=encoding.ssmax)
    assert isinstance(config, BamLlamaConfig)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tensors = {}
    for name, kind in LEARNED.items():
        for layer, values in enumerate(learned.get(name, [])):
            tensors[f"model.layers.{layer}.self_attn.{kind}.{name}"] = torch.tensor(values, dtype=torch.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
