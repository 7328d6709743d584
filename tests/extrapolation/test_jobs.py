"""A phase's jobs: what is planned (validation: every trial of every seed; test: only chosen recipes, on the test
seeds), a two-stage job waiting for its stage one, --resume refusing other settings, one live run per output folder
(a killed one never blocks the next), the whole pipeline on tiny models, resumed without running anything twice, and
RoPE with Scalable Softmax's jobs."""

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import replace

import pytest
from helpers import checkout_environment

from bam_llama.extrapolation import jobs, stages
from bam_llama.extrapolation.encodings import ENCODINGS, FIXED_SHAPE_TRIALS
from bam_llama.extrapolation import run as runs
from bam_llama.extrapolation.jobs import Job
from bam_llama.extrapolation.run import RunError, earlier_results, plan, ready, run
from bam_llama.extrapolation.selection import job_key
from bam_llama.extrapolation.settings import QUICK, TEST, VALIDATION
from bam_llama.extrapolation.stages import pretrain_arguments
from bam_llama.files.outputs import FolderInUse, FolderLock

STUDY = QUICK


def test_validation_plans_every_trial_of_every_validation_seed_and_stage_ones_first():
    planned = plan(VALIDATION, ["bam-ssmax", "rope", "rope-ntk"], STUDY, {})
    pairs = [(training, trial, seed) for training, trial, seed, _ in planned]
    assert len(pairs) == len(set(pairs)) == 2 * 4 * len(STUDY.validation_seeds)  # rope-ntk shares rope's models
    assert {training for training, _, _ in pairs} == {"bam-ssmax", "rope"}
    two_stage = [index for index, (_, trial, _) in enumerate(pairs) if trial.startswith("two-stage")]
    assert min(two_stage) > max(index for index in range(len(pairs)) if index not in two_stage)


def test_validation_skips_jobs_done_and_test_needs_a_choice():
    done_key = job_key(VALIDATION, "alibi", "long", STUDY.validation_seeds[0])
    planned = plan(VALIDATION, ["alibi"], STUDY, {done_key: {}})
    assert ("alibi", "long", STUDY.validation_seeds[0]) not in [job[:3] for job in planned] and len(planned) == 7
    with pytest.raises(RunError, match="alibi: no recipe chosen yet"):
        plan(TEST, ["alibi"], STUDY, {})


def test_a_two_stage_job_waits_for_its_stage_one_only_where_the_run_has_it():
    job = Job(VALIDATION, "bam", "two-stage", 100, data=None, study=STUDY, work=None)
    stage_one = job_key(VALIDATION, "bam", "lr-1e-3", 100)
    assert job.stage_one_key == stage_one
    assert not ready(job, {stage_one}, {})
    assert ready(job, {stage_one}, {stage_one: {}})
    assert ready(job, set(), {})  # no stage-one job to wait for: the job trains it itself (a test job)
    assert Job(TEST, "bam", "lr-2e-3", 3, data=None, study=STUDY, work=None).stage_one_key is None


def test_trials_screen_validation_only_and_a_two_stage_screen_trains_its_own_stage_one(tmp_path):
    planned = plan(VALIDATION, ["bam", "alibi"], STUDY, {}, trials=["two-stage", "lr-2e-3"])
    assert sorted(job[:2] for job in planned) == sorted([(training, trial) for training in ("alibi", "bam")
                                                         for trial in ("lr-2e-3", "two-stage") if (training, trial)
                                                         != ("alibi", "two-stage")] * len(STUDY.validation_seeds))
    with pytest.raises(RunError, match="no trial of alibi"):
        run(VALIDATION, ["alibi"], STUDY, tmp_path, trials=["two-stage"])
    with pytest.raises(RunError, match="the test phase runs each encoding's choice"):
        run(TEST, ["bam"], STUDY, tmp_path, trials=["two-stage"])
    assert not list(tmp_path.iterdir())  # refused before the folder is locked or written


def test_a_uniform_head_is_refused_for_shapes_other_than_bam_s(tmp_path):
    study = replace(STUDY, uniform_head_layer=1)
    assert plan(VALIDATION, ["bam", "bam-ssmax", "alibi"], study, {})
    with pytest.raises(RunError, match="kerple, t5 learn another shape"):
        run(VALIDATION, ["bam", "kerple", "t5"], study, tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_uniform_head_replaces_the_flattest_head_of_its_layer_in_what_stage_two_freezes(tmp_path):
    """Stage one's prior as learned, but for the head of the chosen layer whose prior costs least at the longest
    validation length: it is frozen at theta_alpha = theta_beta = 0 (the uniform prior), every other value as learned."""
    study = replace(STUDY, uniform_head_layer=1)
    data = runs.phase_data(TEST, study, tmp_path)
    chosen = {"bam": {"trial": "two-stage", "candidate": "trained", "goes_long": False}}
    _, entry = jobs.run_job(runs.make_job(TEST, ("bam", "two-stage", study.test_seeds[0], chosen), study, data, tmp_path))
    first, frozen = entry["stages"]["stage_one"]["learned"], entry["stages"]["trained"]["learned"]
    alpha, beta = first["theta_alpha"][1], first["theta_beta"][1]
    longest = study.train_length * max(study.scales)
    costs = [math.exp(alpha[head]) * longest ** beta[head] for head in range(study.heads)]
    flattest = costs.index(min(costs))
    assert entry["stages"]["stage_one_shape"]["uniform_head"] == {"layer": 1, "head": flattest}
    for name in ("theta_alpha", "theta_beta"):
        expected = [list(row) for row in first[name]]
        assert expected[1][flattest] != 0.0  # stage one moved it
        expected[1][flattest] = 0.0
        assert frozen[name] == expected, name
    assert frozen["theta_mu"] == first["theta_mu"]


def test_resume_refuses_other_settings_and_a_run_without_resume(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"study": {**json.loads(json.dumps(STUDY.__dict__)), "steps": 99},
                                                       "jobs": {}}))
    with pytest.raises(RunError, match=r"other settings \(steps\)"):
        earlier_results(tmp_path, STUDY, resume=True)
    with pytest.raises(RunError, match="--resume continues it"):
        earlier_results(tmp_path, replace(STUDY, steps=99), resume=False)
    assert earlier_results(tmp_path, replace(STUDY, steps=99), resume=True) == {}


def test_a_setting_added_since_a_run_is_its_default_there(tmp_path):
    """A folder recorded before a setting existed (`uniform_head_layer`, `extension_rate_factor` here) resumes with
    its default and refuses another value, in its results and in its unfinished jobs."""
    recorded = json.loads(json.dumps(STUDY.__dict__))
    del recorded["uniform_head_layer"], recorded["extension_rate_factor"]  # defaults None and 0.1
    (tmp_path / "results.json").write_text(json.dumps({"study": recorded, "jobs": {}}))
    assert earlier_results(tmp_path, STUDY, resume=True) == {}
    with pytest.raises(RunError, match=r"other settings \(uniform_head_layer\)"):
        earlier_results(tmp_path, replace(STUDY, uniform_head_layer=1), resume=True)
    runs.start_jobs_in_progress(tmp_path, STUDY)
    (tmp_path / runs.JOBS_IN_PROGRESS / runs.STUDY_RECORD).write_text(json.dumps(recorded))
    runs.check_jobs_in_progress(tmp_path, STUDY, resume=True)
    with pytest.raises(RunError, match="were run with other settings"):
        runs.check_jobs_in_progress(tmp_path, replace(STUDY, uniform_head_layer=1), resume=True)


def test_one_live_run_per_folder_and_a_killed_holder_blocks_nobody(tmp_path):
    hold = FolderLock(tmp_path)
    with pytest.raises(RunError, match="another live process is writing"):
        run(VALIDATION, ["alibi"], STUDY, tmp_path)
    hold.release()
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from bam_llama.files.outputs import FolderLock; import pathlib, time; "
         f"held = FolderLock(pathlib.Path({str(tmp_path)!r})); print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, env=checkout_environment())
    try:
        assert holder.stdout.readline().strip() == "held"  # a light import: no PyTorch in the holder
        with pytest.raises(FolderInUse):
            FolderLock(tmp_path)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        FolderLock(tmp_path).release()  # at once: the kernel dropped the dead holder's lock
    finally:
        holder.kill()


def test_the_pipeline_on_tiny_models_resumes_without_running_a_job_twice(tmp_path, monkeypatch):
    published = []
    report = run(VALIDATION, ["alibi"], STUDY, tmp_path, publish=lambda folder, report: published.append(len(report["jobs"])))
    assert len(report["jobs"]) == 4 * len(STUDY.validation_seeds) and published[-1] == len(report["jobs"])
    assert published[:len(report["jobs"])] == list(range(1, len(report["jobs"]) + 1))  # each job published as it ends
    chosen = report["choices"]["alibi"]
    for job in report["jobs"].values():
        for candidate in ("trained", "extended"):
            result = job["results"]["alibi"][candidate]
            assert sorted(result["passkey"]) == [STUDY.train_length * scale for scale in STUDY.scales]
            assert result["evaluation_keys"]["in_training"] == 0
        assert job["stages"]["extended"]["context_length"] == STUDY.extension_length
        assert job["stages"]["trained"]["steps"] == STUDY.steps * (2 if job["trial"].startswith("long") else 1)
    assert not (tmp_path / runs.JOBS_IN_PROGRESS).exists()  # each job's folder gone once its result is in
    (tmp_path / "results.json").write_text(json.dumps(report))
    again = run(VALIDATION, ["alibi"], STUDY, tmp_path, resume=True)
    assert again["jobs"].keys() == report["jobs"].keys()
    monkeypatch.setattr(jobs, "goes_long", lambda chosen, result, study: True)  # every test model past 64x here
    test = run(TEST, ["alibi"], STUDY, tmp_path, resume=True)
    test_jobs = {key: job for key, job in test["jobs"].items() if job["phase"] == TEST}
    assert sorted(test_jobs) == [job_key(TEST, "alibi", chosen["trial"], seed) for seed in STUDY.test_seeds]
    lengths = [STUDY.train_length * scale for scale in STUDY.scales + STUDY.long_scales]
    for job in test_jobs.values():
        assert list(job["results"]["alibi"]) == [chosen["candidate"]]
        result = job["results"]["alibi"][chosen["candidate"]]
        assert sorted(result["passkey"]) == lengths and sorted(result["perplexity"]) == lengths
        keys = [key for length in lengths for row in result["passkey"][length]["passkeys"] for key in row]
        assert len(keys) == len(set(keys)) == result["evaluation_keys"]["keys"]  # one drawer past 64x too
        assert [len(result["passkey"][length]["passkeys"][0]) for length in lengths] == \
            [STUDY.prompts(TEST, scale) for scale in STUDY.scales + STUDY.long_scales]


class Stopped(Exception):
    """A run killed at this point."""


def without_costs(value):
    """Results without the seconds and memory each measurement took, which differ run to run."""
    if isinstance(value, dict):
        return {key: without_costs(item) for key, item in value.items()
                if key not in ("seconds", "peak_rss_mib", "peak_gpu_mib")}
    return value


def test_a_job_s_minutes_count_every_run_that_worked_on_it(tmp_path, monkeypatch):
    """A job stopped after 60 s and finished by a resumed run of 30 s records 1.5 minutes, not the last run's 0.5."""
    now = [100.0]
    monkeypatch.setattr(jobs.time, "perf_counter", lambda: now[0])
    first = jobs.JobClock(tmp_path / "job", interval=3600)
    now[0] = 160.0
    first.stop()  # the stopped run: 1 minute kept in the job's folder
    now[0] = 1000.0
    resumed = jobs.JobClock(tmp_path / "job", interval=3600)
    now[0] = 1030.0
    resumed.stop()
    now[0] = 5000.0  # after the end: not counted
    assert resumed.minutes() == 1.5
    assert json.loads((tmp_path / "job" / "minutes.json").read_text()) == {"minutes": 1.5}
    another = jobs.JobClock(tmp_path / "another job", interval=3600)
    another.stop()
    assert another.minutes() == 0.0


def test_a_job_stopped_mid_stage_or_mid_evaluation_goes_on_where_it_stopped_and_ends_as_never_stopped(
        tmp_path, monkeypatch):
    """A test job past 64x (12 training steps, a checkpoint every 4, 4 extension steps, two evaluations): stopped at
    training step 6, it resumes from checkpoint 4 and trains 8 steps; stopped again in its evaluation past 64x, it
    trains nothing more and evaluates only that part, whose keys are those of the job never stopped."""
    from bam_llama.training.trainer import BamTrainer

    monkeypatch.setattr(stages, "CHECKPOINT_STEPS", 4)
    monkeypatch.setattr(jobs, "goes_long", lambda chosen, result, study: True)
    data = runs.phase_data(TEST, STUDY, tmp_path / "data")
    chosen = {"bam": {"trial": "lr-1e-3", "candidate": "extended", "goes_long": True}}
    planned = ("bam", "lr-1e-3", STUDY.test_seeds[0], chosen)
    _, never_stopped = jobs.run_job(runs.make_job(TEST, planned, STUDY, data, tmp_path / "never-stopped"))

    steps, evaluated, stop_at = [], [], {"step": 6, "lengths": None}
    train_step, evaluate = BamTrainer.training_step, jobs.evaluate

    def training_step(self, *args, **kwargs):
        steps.append(self.state.global_step)
        if self.state.global_step == stop_at["step"]:
            stop_at["step"] = None
            raise Stopped
        return train_step(self, *args, **kwargs)

    def evaluating(folder, rope_scaling, data, tokenizer, keys, train_length, prompts):
        evaluated.append(sorted(prompts))
        if sorted(prompts) == stop_at["lengths"]:
            stop_at["lengths"] = None
            raise Stopped
        return evaluate(folder, rope_scaling, data, tokenizer, keys, train_length, prompts)

    monkeypatch.setattr(BamTrainer, "training_step", training_step)
    monkeypatch.setattr(jobs, "evaluate", evaluating)
    job = runs.make_job(TEST, planned, STUDY, data, tmp_path / "stopped")
    with pytest.raises(Stopped):
        jobs.run_job(job)
    assert [path.name for path in (job.work / "trained").glob("checkpoint-*")] == ["checkpoint-4"]

    long_lengths = [STUDY.train_length * scale for scale in STUDY.long_scales]
    steps.clear()
    stop_at["lengths"] = long_lengths
    with pytest.raises(Stopped):
        jobs.run_job(job)
    assert steps == list(range(4, STUDY.steps)) + list(range(STUDY.extension_steps))
    assert evaluated[-2:] == [[STUDY.train_length * scale for scale in STUDY.scales], long_lengths]

    steps.clear(), evaluated.clear()
    _, entry = jobs.run_job(job)
    assert steps == [] and evaluated == [long_lengths]
    assert entry["stages"]["trained"]["resumed_from_step"] == 4
    for stage in ("trained", "extended"):
        assert entry["stages"][stage]["learned"] == never_stopped["stages"][stage]["learned"], stage
    assert without_costs(entry["results"]) == without_costs(never_stopped["results"])


def test_unfinished_jobs_are_continued_only_with_resume_and_the_same_settings(tmp_path):
    runs.start_jobs_in_progress(tmp_path, STUDY)
    (runs.job_folder(tmp_path, job_key(VALIDATION, "bam", "lr-1e-3", 100)) / "trained").mkdir(parents=True)
    with pytest.raises(RunError, match="unfinished jobs: --resume continues them"):
        runs.check_jobs_in_progress(tmp_path, STUDY, resume=False)
    runs.check_jobs_in_progress(tmp_path, STUDY, resume=True)
    with pytest.raises(RunError, match="were run with other settings"):
        runs.check_jobs_in_progress(tmp_path, replace(STUDY, steps=STUDY.steps + 1), resume=True)


def test_a_two_stage_test_job_trains_its_stage_one_itself_and_freezes_what_it_learned(tmp_path):
    data = runs.phase_data(TEST, STUDY, tmp_path)
    chosen = {"bam-ssmax": {"trial": "two-stage-frozen-scales", "candidate": "trained", "goes_long": False}}
    job = runs.make_job(TEST, ("bam-ssmax", "two-stage-frozen-scales", STUDY.test_seeds[0], chosen), STUDY, data, tmp_path)
    assert job.stage_one_learned is None
    _, entry = jobs.run_job(job)
    learned_first, learned = entry["stages"]["stage_one"]["learned"], entry["stages"]["trained"]["learned"]
    assert entry["stages"]["stage_one"]["steps"] == entry["stages"]["trained"]["steps"] == STUDY.steps
    for name in ("theta_alpha", "theta_beta", "scale"):  # the prior and the scales exactly stage one's, frozen
        assert learned[name] == learned_first[name], name
    assert any(value != 1.0 for row in learned_first["scale"] for value in row)  # stage one did train its scales
    assert list(entry["results"]) == ["bam-ssmax"] and list(entry["results"]["bam-ssmax"]) == ["trained"]


def test_a_two_stage_t5_job_freezes_the_bucket_biases_its_stage_one_learned(tmp_path):
    """T5's buckets: stage one learns each layer's bucket_bias [head][bucket] from 0, stage two keeps them exactly
    (through the folder rebuilt from results.json's values, `stages.stage_one_folder`)."""
    data = runs.phase_data(TEST, STUDY, tmp_path)
    chosen = {"t5": {"trial": "two-stage", "candidate": "trained", "goes_long": False}}
    job = runs.make_job(TEST, ("t5", "two-stage", STUDY.test_seeds[0], chosen), STUDY, data, tmp_path)
    _, entry = jobs.run_job(job)
    learned_first, learned = entry["stages"]["stage_one"]["learned"], entry["stages"]["trained"]["learned"]
    assert set(learned_first) == set(learned) == {"bucket_bias"}
    assert learned["bucket_bias"] == learned_first["bucket_bias"]
    rows = [value for layer in learned_first["bucket_bias"] for head in layer for value in head]
    assert len(rows) == STUDY.layers * STUDY.heads * 32 and any(value != 0.0 for value in rows)  # stage one trained
    assert list(entry["results"]["t5"]) == ["trained"]


@pytest.mark.parametrize("name,positional", [("rope-ssmax", "rope"), ("rope-local-ssmax", "rope-local")])
def test_rope_with_ssmax_is_a_fixed_shape_encoding_of_its_own_trained_with_its_scales(tmp_path, name, positional):
    """RoPE has no learned positional shape (the SSMax scales are none) and bam-finetune takes BamLlama only: the
    fixed-shape trials, evaluated as trained; bam-pretrain gets --ssmax, the scales at the study's shape rate."""
    encoding = ENCODINGS[name]
    assert (encoding.positional, encoding.ssmax, encoding.training) == (positional, True, name)
    assert not encoding.learned_shape and not encoding.extends and encoding.candidates == ("trained",)
    assert encoding.trials == FIXED_SHAPE_TRIALS
    args = pretrain_arguments(encoding, FIXED_SHAPE_TRIALS["long"], STUDY, 100, tmp_path, tmp_path, tmp_path, None)
    assert args.ssmax and args.positional == positional and args.prior_scope == "global"
    assert args.prior_learning_rate == STUDY.shape_learning_rate and args.max_steps == 2 * STUDY.steps


def test_a_rope_ssmax_validation_job_trains_its_scales_and_evaluates_the_trained_model(tmp_path):
    data = runs.phase_data(VALIDATION, STUDY, tmp_path)
    job = runs.make_job(VALIDATION, ("rope-ssmax", "lr-1e-3", STUDY.validation_seeds[0], {}), STUDY, data, tmp_path)
    _, entry = jobs.run_job(job)
    scales = entry["stages"]["trained"]["learned"]["scale"]  # [layer][head]
    assert len(scales) == STUDY.layers and all(len(row) == STUDY.heads for row in scales)
    assert any(value != 1.0 for row in scales for value in row)  # trained from 1
    assert list(entry["results"]) == ["rope-ssmax"] and list(entry["results"]["rope-ssmax"]) == ["trained"]
    result = entry["results"]["rope-ssmax"]["trained"]
    assert sorted(result["passkey"]) == [STUDY.train_length * scale for scale in STUDY.scales]


def test_the_extension_trains_on_its_own_texts_where_the_study_asks_for_longer_passkeys(tmp_path):
    study = replace(STUDY, extension_passkeys=STUDY.extension_length).check()
    data = runs.phase_data(VALIDATION, study, tmp_path)
    seed = study.validation_seeds[0]
    job = runs.make_job(VALIDATION, ("bam", "lr-1e-3", seed, {}), study, data, tmp_path)
    _, entry = jobs.run_job(job)
    own = len(data[seed].extension_texts.read_text().splitlines())
    assert data[seed].extension_texts != data[seed].texts
    assert entry["stages"]["extended"]["documents"] == own != entry["stages"]["trained"]["documents"]
