"""One job: one trial of one trained model (`Encoding.training`) and seed, start to end.

* validation: the trial trained, then every candidate of every encoding of that model evaluated to 64x;
* test: a trial some encoding chose, trained on a test seed, then each such encoding's chosen candidate evaluated to
  64x, and past it where `selection.goes_long` says.

A two-stage trial freezes the shape its stage-one trial learned on the same seed: from that job's results where it
ran (`run.py` hands them over), else trained first inside the job. Each job records the commit it ran on and
BamLlama's attention path.

A job works in a folder of its own (`Job.work`, kept until its result is published): its stages resume where a stopped
run left them (`stages.resumable_stage`), and each evaluation it finished is kept there and not run again.
"""

from __future__ import annotations

import json
import subprocess
import threading
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
from .stages import (extend_stage, extension_arguments, pretrain_arguments, pretrain_stage, resumable_stage,
                     stage_one_folder, with_uniform_head, write_json)

REPOSITORY = Path(__file__).resolve().parents[2]


@dataclass
class Job:
    phase: str
    training: str
    trial: str
    seed: int
    data: SeedData
    study: Study
    work: Path  # the job's own folder: its stages' checkpoints and models, its finished evaluations
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
    """One job, start to end, or on from where a stopped run left it in `job.work`: (its key, its entry in
    results.json, whose minutes count every run that worked on the job)."""
    clock = JobClock(job.work)
    try:
        stages, results = trained_and_evaluated(job)
    finally:
        clock.stop()
    return job.key, {"phase": job.phase, "training": job.training, "trial": job.trial, "seed": job.seed,
                     "commit": code_commit(), "attention": attention_path(), "minutes": clock.minutes(),
                     "stages": stages, "results": results}


def trained_and_evaluated(job: Job) -> tuple[dict, dict]:
    """(stages, results): the trial's stages trained (or read back where a stopped run finished them) and every
    candidate it serves evaluated."""
    encoding, trial, work = job.encoding, job.trial_spec, job.work
    tokenizer = AutoTokenizer.from_pretrained(job.data.tokenizer)
    stages, stage_one = {}, None
    if trial.stage_one is not None:
        learned = job.stage_one_learned
        if learned is None:  # no stage-one job in this phase: trained here
            args = pretrain_arguments(encoding, encoding.trials[trial.stage_one], job.study, job.seed, job.data.texts,
                                      job.data.tokenizer, work / "stage-one", None)
            _, stages["stage_one"] = resumable_stage(args, pretrain_stage)
            learned = stages["stage_one"]["learned"]
        if job.study.uniform_head_layer is not None:
            learned, head = with_uniform_head(learned, job.study.uniform_head_layer, job.study.longest_common_length)
            stages["stage_one_shape"] = {"uniform_head": {"layer": job.study.uniform_head_layer, "head": head},
                                         "learned": learned}
        stage_one = stage_one_folder(learned, encoding, job.study, work / "stage-one-shape")
    args = pretrain_arguments(encoding, trial, job.study, job.seed, job.data.texts, job.data.tokenizer,
                              work / TRAINED, stage_one)
    folders = {}
    folders[TRAINED], stages[TRAINED] = resumable_stage(args, pretrain_stage)
    results = {}
    for name, candidate in evaluations(job):
        if candidate not in folders:
            args = extension_arguments(folders[TRAINED], trial, job.study, job.seed, job.data.extension_texts,
                                       work / EXTENDED, encoding.ssmax)
            folders[EXTENDED], stages[EXTENDED] = resumable_stage(args, extend_stage)
        results.setdefault(name, {})[candidate] = evaluate_candidate(job, name, candidate, folders[candidate], tokenizer)
    return stages, results


class JobClock:
    """The minutes a job has run over every run that worked on it, kept in its folder every `interval` seconds and
    at the end: a job stopped and resumed counts each run's time (less at most `interval` of a run killed)."""

    def __init__(self, work: Path, interval: float = 30.0):
        self.path = work / "minutes.json"
        self.before = json.loads(self.path.read_text())["minutes"] if self.path.is_file() else 0.0
        self.started, self.ended = time.perf_counter(), None
        self.stopped = threading.Event()
        work.mkdir(parents=True, exist_ok=True)
        self.keeper = threading.Thread(target=self.keep, args=(interval,), daemon=True)
        self.keeper.start()

    def minutes(self) -> float:
        return self.before + ((self.ended or time.perf_counter()) - self.started) / 60

    def save(self) -> None:
        write_json(self.path, {"minutes": self.minutes()})

    def keep(self, interval: float) -> None:
        while not self.stopped.wait(interval):
            self.save()

    def stop(self) -> None:
        self.stopped.set()
        self.keeper.join()
        self.ended = time.perf_counter()
        self.save()


def evaluations(job: Job) -> list[tuple[str, str]]:
    """(encoding, candidate) pairs the job evaluates: every one of its model on validation, the chosen on test."""
    if job.phase == TEST:
        return list(job.candidates.items())
    return [(name, candidate) for name in trainings_encodings(job.training)
            for candidate in ENCODINGS[name].candidates]


def evaluate_candidate(job: Job, name: str, candidate: str, folder: Path, tokenizer) -> dict:
    """To 64x; on test past it where `goes_long` says (then the long lengths' results join the same entry). Each
    part is kept in the job's folder once done, and read back there by a run that resumes the job."""
    study, encoding = job.study, ENCODINGS[name]
    keys = seed_keys(job.seed, job.data)

    def evaluated(part: str, scales) -> dict:
        kept = job.work / f"evaluation-{name}-{candidate}-{part}.json"
        if kept.is_file():
            result = with_int_keys(json.loads(kept.read_text()))
            draw_again(keys, result, kept)
            return result
        lengths = {study.train_length * scale: study.prompts(job.phase, scale) for scale in scales}
        result = evaluate(folder, encoding.rope_scaling, job.data, tokenizer, keys, study.train_length, lengths)
        write_json(kept, result)
        return with_int_keys(json.loads(json.dumps(result)))  # as read back from `kept`, or from results.json

    result = evaluated("to-64x", study.scales)
    if job.phase == TEST and goes_long(job.chosen[name], result, study):
        more = evaluated("past-64x", study.long_scales)
        for part in ("perplexity", "passkey", "seconds", "peak_rss_mib"):
            result[part].update(more[part])
        for count, value in more["evaluation_keys"].items():
            result["evaluation_keys"][count] += value
    return result


def draw_again(keys, result: dict, kept: Path) -> None:
    """The keys a kept evaluation drew, drawn again in their order, so that the drawer goes on as in a job never
    stopped (a later part draws the same keys, none a repeat). A ValueError where they differ: the file is not this
    job's."""
    for found in result["passkey"].values():
        for key in (key for row in found["passkeys"] for key in row):
            drawn = keys.draw()
            if drawn != key:
                raise ValueError(f"{kept}: its key {key} is not the evaluation's next key ({drawn}); remove the file")


def with_int_keys(value):
    """JSON's string keys of lengths made integers again."""
    if isinstance(value, dict):
        return {int(key) if key.isdigit() else key: with_int_keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [with_int_keys(item) for item in value]
    return value


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
