"""Each encoding's recipe is chosen on validation alone: the candidate with the highest strict passkey rate over the
selection lengths (the mean of the validation seeds' pooled rates), ties to the lower perplexity; no choice until
every trial is done on every validation seed; the test phase goes past 64x only above the threshold."""

import pytest

from bam_llama.extrapolation.encodings import ENCODINGS
from bam_llama.extrapolation.selection import choice, goes_long, job_key
from bam_llama.extrapolation.settings import QUICK, TEST, VALIDATION

STUDY = QUICK  # train length 64, scales 1-2, selection over 2x, validation seeds 100, 101
LENGTHS = [STUDY.train_length * scale for scale in STUDY.scales]


def result(hits_by_length: dict[int, int], prompts: int = 4, perplexity: float = 10.0) -> dict:
    """A candidate's result with `hits` of `prompts` strict (the first ones) at each length."""
    return {
        "passkey": {length: {"correct": [[index < hits for index in range(prompts)]],
                             "teacher_forced": [[index <= hits for index in range(prompts)]]}
                    for length, hits in hits_by_length.items()},
        "perplexity": {length: {"last_window": {"perplexity": perplexity}} for length in hits_by_length},
    }


def validation_jobs(encoding: str, hits: dict[tuple[str, str, int], int], perplexity=None, skip=()) -> dict:
    """Every validation job of `encoding`: `hits[(trial, candidate, seed)]` keys of 4 found at the longest length
    (and all at 1x)."""
    jobs = {}
    spec = ENCODINGS[encoding]
    for trial in spec.trials:
        for seed in STUDY.validation_seeds:
            if (trial, seed) in skip:
                continue
            results = {candidate: result({LENGTHS[0]: 4, LENGTHS[-1]: hits.get((trial, candidate, seed), 0)},
                                         perplexity=(perplexity or {}).get((trial, candidate), 10.0))
                       for candidate in spec.candidates}
            jobs[job_key(VALIDATION, spec.training, trial, seed)] = {"phase": VALIDATION, "seed": seed,
                                                                     "results": {encoding: results}}
    return jobs


def test_the_highest_mean_of_the_validation_seeds_is_chosen():
    # lr-2e-3 extended: 4/4 and 0/4 (mean 50%); two-stage trained: 3/4 and 2/4 (mean 62.5%): the higher mean wins
    hits = {("lr-2e-3", "extended", 100): 4, ("two-stage", "trained", 100): 3, ("two-stage", "trained", 101): 2}
    chosen = choice(validation_jobs("bam", hits), STUDY, "bam")
    assert (chosen["trial"], chosen["candidate"]) == ("two-stage", "trained")
    assert chosen["rate"] == pytest.approx(0.625) and chosen["by_seed"] == pytest.approx([0.75, 0.5])


def test_a_tie_goes_to_the_lower_perplexity():
    hits = {(trial, candidate, seed): 2 for trial in ENCODINGS["alibi"].trials for candidate in ("trained", "extended")
            for seed in STUDY.validation_seeds}
    perplexity = {("long", "extended"): 9.5, ("lr-1e-3", "trained"): 9.9}
    chosen = choice(validation_jobs("alibi", hits, perplexity), STUDY, "alibi")
    assert (chosen["trial"], chosen["candidate"]) == ("long", "extended")


def test_no_choice_until_every_trial_is_done_on_every_validation_seed():
    jobs = validation_jobs("bam-ssmax", {}, skip={("two-stage-frozen-scales", 101)})
    assert choice(jobs, STUDY, "bam-ssmax") is None
    jobs.update(validation_jobs("bam-ssmax", {}))
    assert choice(jobs, STUDY, "bam-ssmax") is not None


def test_a_test_job_never_counts_as_validation():
    jobs = validation_jobs("nope", {})
    trial_jobs = {key: job for key, job in jobs.items() if "/lr-1e-3/" in key}
    for key, job in trial_jobs.items():  # the same results filed as test jobs: no choice from them
        jobs.pop(key)
        jobs[key.replace(VALIDATION, TEST, 1)] = {**job, "phase": TEST}
    assert choice(jobs, STUDY, "nope") is None


@pytest.mark.parametrize("validation_rate,own_hits,expected", [
    (0.5, 2, False),  # exactly the threshold is not above it
    (0.75, 0, True),  # the choice passed on validation
    (0.25, 3, True),  # this model passed at 64x itself
])
def test_going_past_64x(validation_rate, own_hits, expected):
    chosen = {"goes_long": validation_rate > STUDY.long_threshold}
    assert goes_long(chosen, result({LENGTHS[-1]: own_hits}), STUDY) is expected
