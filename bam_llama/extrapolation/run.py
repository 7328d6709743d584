"""A phase's jobs (`jobs.py`), planned, run one at a time or a few at once in spawned processes, each published to
results.json as it ends, so a run stopped at any point keeps every finished job and `--resume` runs only the others,
each unfinished one on from its last checkpoint (its folder in `JOBS_IN_PROGRESS`, removed once it is published).
One live run per output folder; the fused CPU kernel is built before any job.
"""

from __future__ import annotations

import json
import multiprocessing
import platform
import queue
import shutil
import signal
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from ..data.corpus import python_documents, split_documents
from ..files.outputs import FolderInUse, FolderLock
from ..model.cpu_kernels_bam import FUSED_CPU, KernelBuildError, build_kernel, cpu_kernels_enabled
from ..runtime.processor import cpu_model
from .data import SeedData, python_test_suites, seed_data
from .encodings import ENCODINGS, TRAINED, trainings
from .jobs import Job, run_job, training_encoding, with_int_keys
from .report import publish
from .selection import choices, job_key
from .settings import VALIDATION, Study
from .stages import write_json


JOBS_IN_PROGRESS = "jobs-in-progress"  # in the output folder: each unfinished job's checkpoints and evaluations
STUDY_RECORD = "study.json"  # in JOBS_IN_PROGRESS: the settings its jobs run with


class RunError(ValueError):
    """A run that cannot start as asked: one line naming why."""


def plan(phase: str, names: list[str], study: Study, done: dict,
         trials: list[str] | None = None) -> list[tuple[str, str, int, dict]]:
    """(training, trial, seed, chosen) of every job of `phase` the encodings `names` need and `done` lacks, on
    validation only the `trials` named where given (a screen: no choice is made until every trial is done); chosen:
    {encoding: its choice} on test. A RunError where a test job's encoding has no choice yet."""
    planned, made = [], choices(done, study)
    for training, served in trainings(names).items():
        if phase == VALIDATION:
            by_trial = {trial: {} for trial in ENCODINGS[served[0]].trials if trials is None or trial in trials}
        else:
            missing = [name for name in served if name not in made]
            if missing:
                raise RunError(f"{', '.join(missing)}: no recipe chosen yet; run --phase validation for "
                               f"{'it' if len(missing) == 1 else 'them'} to the end first")
            by_trial = {}
            for name in served:
                by_trial.setdefault(made[name]["trial"], {})[name] = made[name]
        for trial, chosen in by_trial.items():
            for seed in study.seeds(phase):
                if job_key(phase, training, trial, seed) not in done:
                    planned.append((training, trial, seed, chosen))
    return sorted(planned, key=lambda job: training_encoding(job[0]).trials[job[1]].stage_one is not None)


def check_request(phase: str, names: list[str], study: Study, trials: list[str] | None) -> None:
    """A RunError where the run asks what no job can do, before any kernel is built or folder locked."""
    check_uniform_head(names, study)
    check_trials(phase, names, trials)


def check_trials(phase: str, names: list[str], trials: list[str] | None) -> None:
    """A RunError where `trials` is given on test (it runs each encoding's choice) or an encoding has none of them."""
    if trials is None:
        return
    if phase != VALIDATION:
        raise RunError("--trials screens validation trials; the test phase runs each encoding's choice")
    without = [name for name in names if not set(trials) & set(ENCODINGS[name].trials)]
    if without:
        raise RunError(f"--trials {','.join(trials)}: no trial of {', '.join(without)} (its trials: "
                       f"{', '.join(ENCODINGS[without[0]].trials)})")


def check_uniform_head(names: list[str], study: Study) -> None:
    """A RunError where `uniform_head_layer` is set and an encoding learns a shape other than BAM's GGD prior (its
    uniform head is BAM's)."""
    others = [name for name in names if ENCODINGS[name].learned_shape and ENCODINGS[name].positional != "bam"]
    if study.uniform_head_layer is not None and others:
        raise RunError(f"uniform_head_layer sets a head of BAM's GGD prior; {', '.join(others)} "
                       f"{'learns' if len(others) == 1 else 'learn'} another shape")


def make_job(phase: str, planned: tuple[str, str, int, dict], study: Study, data: dict[int, SeedData],
             output_dir: Path) -> Job:
    training, trial, seed, chosen = planned
    return Job(phase, training, trial, seed, data[seed], study, job_folder(output_dir, job_key(phase, training, trial, seed)),
               chosen=dict(chosen), candidates={name: made["candidate"] for name, made in chosen.items()})


def job_folder(output_dir: Path, key: str) -> Path:
    return output_dir / JOBS_IN_PROGRESS / key


def check_jobs_in_progress(output_dir: Path, study: Study, resume: bool) -> None:
    """A RunError where `output_dir` holds unfinished jobs that this run may not continue: without --resume, or
    with other study settings than theirs (their checkpoints would be trained on with this run's)."""
    root = output_dir / JOBS_IN_PROGRESS
    if not root.is_dir():
        return
    if not resume:
        raise RunError(f"{output_dir} holds an earlier run's unfinished jobs: --resume continues them (the same "
                       "settings), or give another --output-dir")
    record = root / STUDY_RECORD
    if not record.is_file() or settings_changed(json.loads(record.read_text()), study):
        raise RunError(f"--resume: the unfinished jobs in {root} were run with other settings; remove that folder "
                       "to start them again, or give another --output-dir")


def start_jobs_in_progress(output_dir: Path, study: Study) -> None:
    """The folder of unfinished jobs, with the study settings they run with."""
    root = output_dir / JOBS_IN_PROGRESS
    if not (root / STUDY_RECORD).is_file():
        write_json(root / STUDY_RECORD, asdict(study))


def remove_job_folders(output_dir: Path, keys) -> None:
    """The folders of jobs whose results are published (a run stopped in between leaves one)."""
    root = output_dir / JOBS_IN_PROGRESS
    for key in keys:
        shutil.rmtree(job_folder(output_dir, key), ignore_errors=True)
    for folder in sorted((path for path in root.rglob("*") if path.is_dir()), key=lambda path: -len(path.parts)):
        if not any(folder.iterdir()):
            folder.rmdir()


def close_jobs_in_progress(output_dir: Path) -> None:
    """The folder of unfinished jobs removed once it holds none."""
    root = output_dir / JOBS_IN_PROGRESS
    if root.is_dir() and [path.name for path in root.iterdir()] == [STUDY_RECORD]:
        shutil.rmtree(root)


def ready(job: Job, waiting_for: set[str], done: dict) -> bool:
    """A two-stage job waits for its stage-one job where this run has one to do."""
    return job.stage_one_key not in waiting_for or job.stage_one_key in done


def finished_jobs(jobs: list[Job], processes: int, threads: int, done: dict):
    """Each job run, one at a time here or `processes` at once in spawned processes of `threads` threads; yielded as
    each ends. A two-stage job starts once its stage-one job is done, in this run or an earlier one (its learned
    shape handed over)."""
    waiting, pending = list(jobs), {job.key for job in jobs}

    def startable() -> list[Job]:
        now = [job for job in waiting if ready(job, pending, done)]
        for job in now:
            waiting.remove(job)
            if job.stage_one_key in done and job.stage_one_learned is None:
                job.stage_one_learned = done[job.stage_one_key]["stages"][TRAINED]["learned"]
        return now

    if processes <= 1:
        queued = startable()
        while queued:
            key, entry = run_job(queued.pop(0))
            yield key, entry
            queued += startable()
        return
    finished = queue.SimpleQueue()
    pool = multiprocessing.get_context("spawn").Pool(processes, initializer=_start_worker, initargs=(threads,))
    try:
        running = 0
        while True:
            for job in startable():
                pool.apply_async(run_job, (job,), callback=finished.put, error_callback=finished.put)
                running += 1
            if not running:
                break
            outcome = finished.get()
            running -= 1
            if isinstance(outcome, BaseException):
                raise outcome
            yield outcome
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _start_worker(threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)


def machine(threads: int) -> dict:
    return {"processor": cpu_model(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "threads": threads}


def earlier_results(output_dir: Path, study: Study, resume: bool) -> dict:
    """The jobs an earlier run left in `output_dir` (with --resume; the same study settings), else {}."""
    return with_int_keys(earlier_run(output_dir, study, resume).get("jobs", {}))


def earlier_run(output_dir: Path, study: Study, resume: bool) -> dict:
    """The results.json an earlier run left in `output_dir` (with --resume; the same study settings), else {}."""
    path = output_dir / "results.json"
    if not path.is_file():
        return {}
    if not resume:
        raise RunError(f"{output_dir} holds an earlier run: --resume continues it (the same settings), or give "
                       "another --output-dir")
    earlier = json.loads(path.read_text())
    changed = settings_changed(earlier["study"], study)
    if changed:
        raise RunError(f"--resume: the run in {output_dir} has other settings ({', '.join(changed)}); its results "
                       "would not compare with this run's")
    return earlier


def settings_changed(recorded: dict, study: Study) -> list[str]:
    """The settings in which `study` differs from a run's `recorded` ones; a setting added since that run is its
    default there (the run could not set it)."""
    now = json.loads(json.dumps(asdict(study)))
    default = json.loads(json.dumps(asdict(Study())))
    then = {**{key: value for key, value in default.items() if key not in recorded}, **recorded}
    return sorted(key for key in now.keys() | then.keys() if now.get(key) != then.get(key))


def phase_data(phase: str, study: Study, scratch: Path) -> dict[int, SeedData]:
    """Every seed's data of `phase`, built in `scratch`."""
    train, heldout = split_documents(python_documents(), study.heldout_fraction)
    never_trained = [*heldout, *python_test_suites()]
    return {seed: seed_data(train, never_trained, study, seed, study.documents(phase), scratch / f"seed-{seed}")
            for seed in study.seeds(phase)}


def build_attention_kernel() -> None:
    """The fused CPU kernel built before any job (never inside one's forward), unless switched off: a job must not
    train through another attention path than the run's other jobs for want of a build."""
    if not cpu_kernels_enabled():
        return
    try:
        build_kernel(FUSED_CPU)
    except KernelBuildError as error:
        raise RunError(f"the fused CPU attention kernel could not be built ({error}); BAM_CPU_KERNELS=0 runs every job "
                       "through blocked SDPA instead") from None


def run(phase: str, names: list[str], study: Study, output_dir: Path, jobs: int = 1, threads: int = 1,
        resume: bool = False, publish=None, trials: list[str] | None = None) -> dict:
    """Run every job of `phase` that `names` need (on validation, of `trials` where given) and `output_dir` lacks,
    publishing (`publish(output_dir, report)`) after each; returns the final report."""
    check_request(phase, names, study, trials)
    build_attention_kernel()
    try:
        hold = FolderLock(output_dir)
    except FolderInUse as error:
        raise RunError(f"{error}: wait for that run, or give another --output-dir") from None
    try:
        done = earlier_results(output_dir, study, resume)
        check_jobs_in_progress(output_dir, study, resume)
        remove_job_folders(output_dir, done)
        planned = plan(phase, names, study, done, trials)
        if planned:
            start_jobs_in_progress(output_dir, study)
        report = report_of(study, done, machine(threads))
        with tempfile.TemporaryDirectory(prefix="text-extrapolation-") as scratch:
            data = phase_data(phase, study, Path(scratch)) if planned else {}
            queued = [make_job(phase, job, study, data, output_dir) for job in planned]
            for key, entry in finished_jobs(queued, jobs, threads, done):
                entry["machine"] = machine(threads)
                done[key] = entry
                report = report_of(study, done, machine(threads))
                print(f"[{key}] {entry['minutes']:.1f} min", flush=True)
                if publish is not None:
                    publish(output_dir, report)
                remove_job_folders(output_dir, [key])
        close_jobs_in_progress(output_dir)
        if publish is not None:
            publish(output_dir, report)
        return report
    finally:
        hold.release()


SCRATCH_PATHS = ("final_dir", "output_dir", "data", "model")  # a stage summary's folders in the run's scratch space


def without_scratch_paths(entry: dict) -> dict:
    """A job's entry without the scratch folders its stage summaries name (gone when the run ends); the tokenizer is
    the seed's BPE."""
    stages = {name: {key: value for key, value in summary.items() if key not in SCRATCH_PATHS}
              for name, summary in entry["stages"].items()}
    for summary in stages.values():
        if "tokenizer" in summary:
            summary["tokenizer"] = "the seed's BPE"
    return {**entry, "stages": stages}


def report_of(study: Study, done: dict, machine_now: dict) -> dict:
    return {"study": asdict(study), "machine": machine_now,
            "jobs": {key: without_scratch_paths(entry) for key, entry in sorted(done.items())},
            "choices": choices(done, study)}


def rewrite_report(output_dir: Path, study: Study) -> str:
    """The page of `output_dir`'s results written again (`--report-only`), while no run writes there."""
    try:
        hold = FolderLock(output_dir)
    except FolderInUse as error:
        raise RunError(f"{error}: its page is rewritten as each of its jobs ends") from None
    try:
        earlier = earlier_run(output_dir, study, resume=True)  # a page rewritten elsewhere keeps its run's machine
        jobs = with_int_keys(earlier.get("jobs", {}))
        return publish(output_dir, report_of(study, jobs, earlier.get("machine", {})), study)
    finally:
        hold.release()
