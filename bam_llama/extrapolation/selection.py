"""Each encoding's recipe, chosen on the validation seeds alone: the trial and candidate (as trained, or after the
context extension) with the highest strict passkey rate pooled over `Study.selection_scales` (the mean of the
validation seeds' rates), ties to the lower last-window perplexity at the longest validation length. A choice exists
once every trial of the encoding is done on every validation seed; the test phase runs only chosen recipes.

Also which encodings go past 64x in the test phase: those whose choice found more than `Study.long_threshold` of the
keys at 64x on validation, and any test seed's model that finds more than that at 64x itself.
"""

from __future__ import annotations

from .encodings import ENCODINGS
from .settings import TEST, VALIDATION, Study


def job_key(phase: str, training: str, trial: str, seed: int) -> str:
    return f"{phase}/{training}/{trial}/seed-{seed}"


def found(passkey: dict, score: str = "correct") -> tuple[int, int]:
    """(prompts found, prompts) of one length's passkey result."""
    flags = [flag for row in passkey[score] for flag in row]
    return sum(flags), len(flags)


def rate_over(result: dict, lengths: list[int], score: str = "correct") -> float:
    counts = [found(result["passkey"][length], score) for length in lengths]
    return sum(hits for hits, _ in counts) / sum(prompts for _, prompts in counts)


def last_window(result: dict, length: int) -> float:
    return result["perplexity"][length]["last_window"]["perplexity"]


def candidate_results(jobs: dict, study: Study, encoding: str, trial: str, candidate: str) -> list[dict] | None:
    """The validation results of one candidate, a seed each; None until every validation seed has it."""
    training = ENCODINGS[encoding].training
    results = []
    for seed in study.validation_seeds:
        job = jobs.get(job_key(VALIDATION, training, trial, seed))
        if job is None:
            return None
        results.append(job["results"][encoding][candidate])
    return results


def candidate_scores(jobs: dict, study: Study, encoding: str) -> dict[tuple[str, str], dict] | None:
    """{(trial, candidate): score} of every candidate of `encoding`; None until all are done on validation."""
    lengths = [study.train_length * scale for scale in study.selection_scales]
    longest = study.longest_common_length
    scores = {}
    for trial in ENCODINGS[encoding].trials:
        for candidate in ENCODINGS[encoding].candidates:
            results = candidate_results(jobs, study, encoding, trial, candidate)
            if results is None:
                return None
            rates = [rate_over(result, lengths) for result in results]
            at_longest = [rate_over(result, [longest]) for result in results]
            perplexities = [last_window(result, longest) for result in results]
            scores[trial, candidate] = {"rate": sum(rates) / len(rates), "by_seed": rates,
                                        "rate_at_longest": sum(at_longest) / len(at_longest),
                                        "perplexity_at_longest": sum(perplexities) / len(perplexities)}
    return scores


def choice(jobs: dict, study: Study, encoding: str) -> dict | None:
    """The chosen trial and candidate of `encoding` with its validation score and whether it goes long; None while
    its validation is incomplete."""
    scores = candidate_scores(jobs, study, encoding)
    if scores is None:
        return None
    (trial, candidate), score = max(scores.items(), key=lambda item: (item[1]["rate"], -item[1]["perplexity_at_longest"]))
    return {"trial": trial, "candidate": candidate, **score,
            "goes_long": score["rate_at_longest"] > study.long_threshold}


def choices(jobs: dict, study: Study) -> dict[str, dict]:
    """Every encoding's choice so far."""
    return {name: chosen for name in ENCODINGS if (chosen := choice(jobs, study, name)) is not None}


def goes_long(chosen: dict, result_to_longest: dict, study: Study) -> bool:
    """Whether a test model goes past 64x: its encoding's choice did on validation, or this model did at 64x."""
    at_longest = rate_over(result_to_longest, [study.longest_common_length])
    return chosen["goes_long"] or at_longest > study.long_threshold


def test_results(jobs: dict, study: Study, name: str) -> list[tuple[int, dict]]:
    """(seed, result) of encoding `name`'s chosen recipe on each test seed that has one."""
    rows = []
    for job in jobs.values():
        if job["phase"] == TEST and name in job["results"]:
            rows.append((job["seed"], next(iter(job["results"][name].values()))))
    return sorted(rows)
