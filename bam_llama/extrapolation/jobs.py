"""One job: one trial of one trained model (`Encoding.training`) and seed, start to end.

* validation: the trial trained, then every candidate of every encoding of that model evaluated to 64x;
* test: a trial some encoding chose, trained on a test seed, then each such encoding's chosen candidate evaluated to
  64x, and past it where `selection.goes_long` says.

A two-stage trial freezes the shape its stage-one trial learned on the same seed: from that job's results where it
ran (`run.py` hands them over), else trained first inside the job. Each job records the commit it ran on and
BamLlama's attention path.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from ..model.cpu_kernels_bam import FUSED_CPU, cpu_kernels_enabled, load_kernel
from .data import SeedData
from .encodings import ENCODINGS, EXTENDED, TRAINED, Encoding, Trial
from .evaluation import evaluate, seed_keys
from .selection import goes_long, job_key
from .settings import TEST, Study
from .stages import extend, pretrain_arguments, pretrain_stage, stage_one_folder

REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass
class Job:
    phase: str
    training: str
    trial: str
    seed: int
    data: SeedData
    study: Study
    candidates: dict[str, str] = field(default_factory=dict)  # test: encoding -> its chosen candidate
    chosen: dict[str, dict] = field(default_factory=dict)  # test: encoding -> its choice (goes_long)
    stage_one_learned: dict | None = None  # a two-stage trial's stage-one shape, once known

    @property
    def key(self) -> str:
        return job_key(self.phase, self.training, self.trial, self.seed)

    @property
    def encoding(self) -> Encoding:
        return training_encoding(self.training)

    @property
    def trial_spec(self) -> Trial:
        return self.encoding.trials[self.trial]

    @property
    def stage_one_key(self) -> str | None:
        stage_one = self.trial_spec.stage_one
        return None if stage_one is None else job_key(self.phase, self.training, stage_one, self.seed)


def trainings_encodings(training: str) -> list[str]:
    return [name for name, encoding in ENCODINGS.items() if encoding.training == training]


def training_encoding(training: str) -> Encoding:
    """An encoding of the trained model `training`: all of them train alike (variant, SSMax, trials)."""
    return ENCODINGS[trainings_encodings(training)[0]]


def run_job(job: Job) -> tuple[str, dict]:
    """One job, start to end: (its key, its entry in results.json)."""
    started = time.perf_counter()
    encoding, trial = job.encoding, job.trial_spec
    tokenizer = AutoTokenizer.from_pretrained(job.data.tokenizer)
    with tempfile.TemporaryDirectory(prefix=f"{job.training}-{job.trial}-", dir=job.data.work) as scratch:
        work, stages = Path(scratch), {}
        stage_one = None
        if trial.stage_one is not None:
            learned = job.stage_one_learned
            if learned is None:  # no stage-one job in this phase: trained here
                args = pretrain_arguments(encoding, encoding.trials[trial.stage_one], job.study, job.seed, job.data.texts, job.data.tokenizer,
                                          work / "stage-one", None)
                _, stages["stage_one"] = pretrain_stage(args)
                learned = stages["stage_one"]["learned"]
            stage_one = stage_one_folder(learned, encoding, job.study, work / "stage-one-shape")
        args = pretrain_arguments(encoding, trial, job.study, job.seed, job.data.texts, job.data.tokenizer,
                                  work / "trained", stage_one)
        folders = {}
        folders[TRAINED], stages[TRAINED] = pretrain_stage(args)
        results = {}
        for name, candidate in evaluations(job):
            if candidate not in folders:
                folders[EXTENDED], stages[EXTENDED] = extend(folders[TRAINED], trial, job.study, job.seed,
                                                             job.data.texts, work / "extended", encoding.ssmax)
            results.setdefault(name, {})[candidate] = evaluate_candidate(job, name, folders[candidate], tokenizer)
    return job.key, {"phase": job.phase, "training": job.training, "trial": job.trial, "seed": job.seed,
                     "commit": code_commit(), "attention": attention_path(),
                     "minutes": (time.perf_counter() - started) / 60, "stages": stages, "results": results}


def evaluations(job: Job) -> list[tuple[str, str]]:
    """(encoding, candidate) pairs the job evaluates: every one of its model on validation, the chosen on test."""
    if job.phase == TEST:
        return list(job.candidates.items())
    return [(name, candidate) for name in trainings_encodings(job.training)
            for candidate in ENCODINGS[name].candidates]


def evaluate_candidate(job: Job, name: str, folder: Path, tokenizer) -> dict:
    """To 64x; on test past it where `goes_long` says (then the long lengths' results join the same entry)."""
    study, encoding = job.study, ENCODINGS[name]
    keys = seed_keys(job.seed, job.data)
    lengths = {study.train_length * scale: study.prompts(job.phase, scale) for scale in study.scales}
    result = evaluate(folder, encoding.rope_scaling, job.data, tokenizer, keys, study.train_length, lengths)
    if job.phase == TEST and goes_long(job.chosen[name], result, study):
        longer = {study.train_length * scale: study.prompts(TEST, scale) for scale in study.long_scales}
        more = evaluate(folder, encoding.rope_scaling, job.data, tokenizer, keys, study.train_length, longer)
        for part in ("perplexity", "passkey", "seconds", "peak_rss_mib"):
            result[part].update(more[part])
        for count, value in more["evaluation_keys"].items():
            result["evaluation_keys"][count] += value
    return result


def code_commit() -> str:
    """The commit of the code that ran, with `+dirty` where the work tree differed from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPOSITORY), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def attention_path() -> str:
    """What BamLlama's CPU attention runs in this process: the fused C++ kernel, or PyTorch's blocked SDPA where the
    C++ kernels are switched off (BAM_CPU_KERNELS=0)."""
    return "fused C++ CPU kernel" if cpu_kernels_enabled() and load_kernel(FUSED_CPU) else "blocked SDPA"
