"""The results page's numbers: the mean of the seeds' strict rates with the pooled count and its exact interval, the
t-interval over seeds, per-seed rows with the teacher-forced count, and the targets met or missed by how much."""

import math

from bam_llama.extrapolation.report import (answer_kinds_table, distance_table, pooled_cell, seeds_interval_cell, strongest_baseline_lines,
                                            target_lines, write_report)
from bam_llama.extrapolation.selection import job_key
from bam_llama.extrapolation.settings import TEST, VALIDATION, Study

STUDY = Study()


def passkey(hits: int, prompts: int, prompt_length: int = 128) -> dict:
    """One length's result: the first `hits` of `prompts` keys found, at depths 0, 1/(prompts-1), ..., 1; the misses
    answer a number of other digits."""
    keys = [f"{10000 + index}" for index in range(prompts)]
    return {"correct": [[index < hits for index in range(prompts)]], "teacher_forced": [[True] * prompts],
            "passkeys": [keys], "predictions": [[f" {key}" if index < hits else " 99999" for index, key in enumerate(keys)]],
            "depths": [[index / max(prompts - 1, 1) for index in range(prompts)]], "prompt_lengths": [prompt_length]}


def exact_interval(hits: int, prompts: int) -> tuple[float, float]:
    """Clopper-Pearson by bisection on the binomial tails summed term by term (fractions of math.comb)."""
    def at_least(p):
        return sum(math.comb(prompts, k) * p**k * (1 - p) ** (prompts - k) for k in range(hits, prompts + 1))

    def bisect(rising, target):
        low, high = 0.0, 1.0
        for _ in range(60):
            middle = (low + high) / 2
            low, high = (low, middle) if rising(middle) > target else (middle, high)
        return low

    low = 0.0 if hits == 0 else bisect(at_least, 0.025)
    # P(X > hits) rises with p; the upper end is where P(X <= hits) falls to 0.025
    high = 1.0 if hits == prompts else bisect(lambda p: at_least(p) - math.comb(prompts, hits) * p**hits
                                              * (1 - p) ** (prompts - hits), 0.975)
    return low, high


def test_the_pooled_cell_is_the_mean_of_the_seeds_with_the_pooled_count_and_its_exact_interval():
    results = [{"passkey": {8192: passkey(hits, 50)}} for hits in (49, 40, 45)]
    low, high = exact_interval(134, 150)  # mean of 98%, 80%, 90% = 89.3%; 134 of 150
    assert pooled_cell(results, 8192) == f"89% 134/150 ({math.floor(100 * low)}-{math.ceil(100 * high)})"
    assert pooled_cell(results, 16384) == "—"


def test_the_interval_over_seeds_is_student_s_t_with_two_degrees_of_freedom():
    rates = [0.98, 0.80, 0.90]
    results = [{"passkey": {8192: passkey(round(rate * 50), 50)}} for rate in rates]
    mean = sum(rates) / 3
    half = 4.303 * math.sqrt(sum((rate - mean) ** 2 for rate in rates) / 2) / math.sqrt(3)
    assert seeds_interval_cell(results, 8192) == f"{mean - half:.0%}-{min(1, mean + half):.0%}"
    assert seeds_interval_cell(results[:1], 8192) == "—"


def test_seeds_with_one_rate_get_no_zero_width_interval():
    results = [{"passkey": {65536: passkey(1, 20), 8192: passkey(50, 50)}} for _ in range(3)]
    assert seeds_interval_cell(results, 65536) == "5% on every seed"
    assert seeds_interval_cell(results, 8192) == "100% on every seed"
    results[0]["passkey"][65536] = passkey(2, 20)
    assert seeds_interval_cell(results, 65536).endswith("%") and "-" in seeds_interval_cell(results, 65536)


def test_targets_say_by_how_much_they_are_missed():
    jobs = {}
    for seed, (at_64, at_512) in zip(STUDY.test_seeds, ((50, 18), (48, 14), (49, 16))):
        result = {"passkey": {8192: passkey(at_64, 50), 65536: passkey(at_512, 20)},
                  "perplexity": {256: {"last_window": {"perplexity": 50.0}}, 65536: {"last_window": {"perplexity": 54.0}}}}
        jobs[job_key(TEST, "bam", "two-stage", seed)] = {"phase": TEST, "seed": seed, "results": {"bam": {"trained": result}}}
    lines = "\n".join(target_lines(jobs, STUDY))
    assert "| BAM | strict passkey >= 95% at 64x | 98% (3 seeds) | yes |" in lines
    assert "| BAM | strict passkey >= 80% at 512x | 80% (3 seeds) | yes |" in lines  # 90%, 70%, 80%
    assert "| BAM | last-window perplexity at 512x within 10% of 2x | 1.080x | yes |" in lines
    for perplexity, verdict in ((44.0, "0.880x | no, lower than 2x's by more than 10%"),
                                (56.0, "1.120x | no, higher than 2x's by more than 10%")):
        for job in jobs.values():
            job["results"]["bam"]["trained"]["perplexity"][65536]["last_window"]["perplexity"] = perplexity
        assert f"| BAM | last-window perplexity at 512x within 10% of 2x | {verdict} |" in "\n".join(target_lines(jobs, STUDY))
    jobs[job_key(TEST, "bam", "two-stage", 5)]["results"]["bam"]["trained"]["passkey"][65536] = passkey(10, 20)
    assert "| 70% (3 seeds) | no, by 10 points |" in "\n".join(target_lines(jobs, STUDY))  # 90%, 70%, 50%


def test_a_target_past_64x_that_some_test_seeds_never_reached_is_not_met_and_says_how_many():
    jobs = {}
    for seed, at_512 in zip(STUDY.test_seeds, (19, None, None)):  # seeds 4 and 5 stopped at 64x
        passkeys = {8192: passkey(45, 50)}
        perplexity = {256: {"last_window": {"perplexity": 50.0}}}
        if at_512 is not None:
            passkeys[65536] = passkey(at_512, 20)
            perplexity[65536] = {"last_window": {"perplexity": 51.0}}
        result = {"passkey": passkeys, "perplexity": perplexity}
        jobs[job_key(TEST, "bam", "two-stage", seed)] = {"phase": TEST, "seed": seed, "results": {"bam": {"trained": result}}}
    lines = target_lines(jobs, STUDY)
    at_512 = next(line for line in lines if "at 512x |" in line)
    assert "95% on 1 of 3 seeds: 2 of 3 stopped at 64x" in at_512 and at_512.endswith("| no, not reached on every seed |")
    perplexity = next(line for line in lines if "perplexity" in line)
    assert "1.020x on 1 of 3 seeds" in perplexity and "| no, not reached on every seed |" in perplexity
    for seed in STUDY.test_seeds[:1]:  # no seed past 64x
        del jobs[job_key(TEST, "bam", "two-stage", seed)]["results"]["bam"]["trained"]["passkey"][65536]
    at_512 = next(line for line in target_lines(jobs, STUDY) if "at 512x |" in line)
    assert "| not measured: 3 of 3 stopped at 64x" in at_512
    assert "| 90% (3 seeds) | no, by 5 points |" in "\n".join(target_lines(jobs, STUDY))  # 64x: 45 of 50 each


def test_the_page_and_its_figures_are_written_together(tmp_path):
    from bam_llama.extrapolation.report import publish

    study = Study(scales=(1, 64), long_scales=(512,), validation_seeds=(100,), test_seeds=(3, 4), selection_scales=(64,))
    jobs = {}
    for seed, hits in ((3, 20), (4, 10)):
        lengths = (128, 8192, 65536)
        result = {"passkey": {length: passkey(hits, 20) for length in lengths},
                  "perplexity": {length: {"last_window": {"perplexity": 40.0 + seed}} for length in lengths}}
        jobs[job_key(TEST, "bam", "two-stage", seed)] = {
            "phase": TEST, "seed": seed, "commit": "abc", "minutes": 1.0, "results": {"bam": {"trained": result}},
            "machine": {"processor": "cpu", "torch": "t", "transformers": "x", "threads": 1}}
    validation = {"passkey": {128: passkey(20, 20), 8192: passkey(3, 20)},
                  "perplexity": {length: {"last_window": {"perplexity": 50.0}} for length in (128, 8192)}}
    jobs[job_key(VALIDATION, "bam", "lr-1e-3", 100)] = {
        "phase": VALIDATION, "seed": 100, "trial": "lr-1e-3", "commit": "abc", "minutes": 1.0,
        "results": {"bam": {"trained": validation, "extended": validation}}}
    validation_only = {key: job for key, job in jobs.items() if job["phase"] == VALIDATION}
    publish(tmp_path, {"study": {}, "machine": {}, "jobs": validation_only, "choices": {}}, study)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["results.json", "results.md"]  # no empty figures
    text = publish(tmp_path, {"study": {}, "machine": {}, "jobs": jobs, "choices": {}}, study)
    assert "| BAM | lr-1e-3 | 100 | extended | 20/20 | 3/20 (20) |" in text  # a finished validation job, as it ends
    assert sorted(path.name for path in tmp_path.iterdir()) == ["passkey.png", "perplexity.png", "results.json",
                                                               "results.md"]
    assert (tmp_path / "results.md").read_text() == text
    assert "| BAM (2 seeds) | 75% 30/40 (58-88) |" in text and "| BAM | 43.50 | 43.50 | 43.50 |" in text
    assert "| BAM | 3 | 20/20 (20) | 20/20 (20) | 20/20 (20) |" in text


def finished_test_job(seed: int, name: str, hits: dict[int, tuple[int, int]]) -> tuple[str, dict]:
    result = {"passkey": {length: passkey(*count) for length, count in hits.items()},
              "perplexity": {length: {"last_window": {"perplexity": 40.0}} for length in hits}}
    return job_key(TEST, name, "lr-1e-3", seed), {
        "phase": TEST, "seed": seed, "trial": "lr-1e-3", "commit": "abc", "minutes": 1.0, "results": {name: {"trained": result}},
        "machine": {"processor": "cpu", "torch": "t", "transformers": "x", "threads": 1}}


def test_bam_is_set_against_the_baseline_with_the_highest_mean_at_each_length():
    study = Study(scales=(1, 64), long_scales=(512,), test_seeds=(3, 4, 5))
    jobs = dict(finished_test_job(seed, "bam-ssmax", {128: (50, 50), 8192: (hits, 50), 65536: (at_512, 20)})
                for seed, hits, at_512 in ((3, 50, 20), (4, 49, 2), (5, 48, 19)))
    jobs.update(finished_test_job(seed, "bam", {128: (50, 50), 8192: (10, 50)}) for seed in (3, 4, 5))
    jobs.update(finished_test_job(seed, "alibi", {128: (50, 50), 8192: (hits, 50)}) for seed, hits in ((3, 30), (4, 20), (5, 25)))
    jobs.update(finished_test_job(seed, "rope", {128: (49, 50), 8192: (0, 50)}) for seed in (3, 4, 5))
    lines = strongest_baseline_lines(jobs, study, ["bam", "bam-ssmax", "alibi", "rope"])
    # 1x: BAM 100% (its first recipe of two at 100%), ALiBi 100% against RoPE's 98%: equal, the intervals overlap
    assert lines[2] == "| 1x | BAM 100% | ALiBi 100% | +0 points | overlap |"
    # 64x: BAM + SSMax 98% (147/150) against ALiBi's 50% (75/150), BAM alone 20%
    assert lines[3] == "| 64x | BAM + SSMax 98% | ALiBi 50% | +48 points | BAM's above |"
    assert len(lines) == 4  # 512x: no baseline went there


def test_the_page_shows_every_encoding_with_a_job_whichever_the_run_runs():
    study = Study(scales=(1, 64), long_scales=(), test_seeds=(3,), validation_seeds=(100,))
    jobs = dict([finished_test_job(3, "alibi", {128: (5, 50), 8192: (1, 50)}), finished_test_job(3, "bam-ssmax", {128: (50, 50), 8192: (20, 50)})])
    text = write_report({"jobs": jobs, "choices": {}}, study)
    assert "| ALiBi (1 seeds) | 10% 5/50" in text and "| BAM + SSMax (1 seeds) | 100% 50/50" in text
    assert "| 64x | BAM + SSMax 40% | ALiBi 2% | +38 points | BAM's above |" in text
    assert "NoPE" not in text  # no job of its own


def test_keys_are_counted_near_the_question_or_far_from_it_by_the_filler_after_them():
    study = Study(scales=(1, 16, 64), selection_scales=(16, 64), test_seeds=(3,), validation_seeds=(100,))
    # 20 depths k/19. At 16x (2,046 tokens) the keys at depths 18/19 and 1 have 108 and 0 tokens after them (near);
    # at 64x (8,190 tokens) only depth 1 is within 128 tokens (depth 18/19: 431). 3 near keys, 37 far.
    at_16 = passkey(0, 20, 2046)
    at_16["correct"] = [[depth < 5 or depth >= 18 for depth in range(20)]]  # 5 far keys found, both near ones
    at_64 = passkey(0, 20, 8190)
    at_64["correct"] = [[depth == 19 for depth in range(20)]]
    at_1 = passkey(0, 20, 126)  # 1x is not a selection scale: never counted
    test = {"passkey": {128: at_1, 2048: at_16, 8192: at_64}}
    jobs = {job_key(TEST, "bam", "two-stage", 3): {"phase": TEST, "seed": 3, "results": {"bam": {"trained": test}}}}
    missing_far = {"passkey": {2048: passkey(20, 20, 2046), 8192: passkey(0, 20, 8190)}}  # depth 1 at 64x missed
    jobs[job_key(VALIDATION, "bam", "lr-1e-3", 100)] = {
        "phase": VALIDATION, "seed": 100, "results": {"bam": {"trained": test, "extended": missing_far}}}
    lines = distance_table(jobs, study, ["bam", "alibi"])
    low, high = exact_interval(5, 37)
    far = f"5/37 14% ({math.floor(100 * low)}-{math.ceil(100 * high)})"
    assert lines[2] == f"| BAM | test: 1 | 3/3 100% (29-100) | {far} |"
    # validation: both candidates, 3 + 3 near keys (found 3 + 2), 37 + 37 far (found 5 + 18: all of 16x's far keys)
    low, high = exact_interval(23, 74)
    assert lines[3] == (f"| BAM | validation: 2 | 5/6 83% (35-100) | 23/74 31% ({math.floor(100 * low)}-"
                        f"{math.ceil(100 * high)}) |")
    assert len(lines) == 4  # ALiBi: no results, no row


def test_misses_are_told_apart_by_what_of_the_key_they_hold():
    study = Study(scales=(1, 64), test_seeds=(3,), validation_seeds=(100,))
    at_1 = passkey(0, 8)
    at_1["passkeys"] = [["12345"] * 5 + ["11223"] * 3]
    # found; reordered (then text); three of five in place (one digit more: not the key's digits); two of five in
    # place; no number; 11223's digits reordered; its digits in other counts, three in place; other counts, two in place
    at_1["predictions"] = [[" 12345", " 54321.", "  123999", " 12999", " the key", " 12231", " 11333", " 12333"]]
    at_1["correct"] = [[True] + [False] * 7]
    at_64 = passkey(1, 4, 8190)  # one found, three answering 99999
    jobs = {job_key(TEST, "bam", "two-stage", 3): {"phase": TEST, "seed": 3,
                                                   "results": {"bam": {"extended": {"passkey": {128: at_1, 8192: at_64}}}}}}
    jobs[job_key(VALIDATION, "bam", "lr-1e-3", 100)] = {"phase": VALIDATION, "seed": 100, "results": {"bam": {
        "trained": {"passkey": {128: at_1}}, "extended": {"passkey": {128: at_1}}}}}
    lines = answer_kinds_table(jobs, study, ["bam", "alibi"])
    cell = {(hits, prompts): f"{hits}/{prompts} {hits / prompts:.0%} ({math.floor(100 * low)}-{math.ceil(100 * high)})"
            for hits, prompts in ((1, 8), (2, 8), (4, 8), (0, 4), (1, 4), (3, 4), (2, 16), (4, 16), (8, 16))
            for low, high in [exact_interval(hits, prompts)]}
    assert lines[0].count("|") == 8  # four kinds
    assert lines[2] == f"| BAM | test: 1 | 1x | {cell[1, 8]} | {cell[2, 8]} | {cell[1, 8]} | {cell[4, 8]} |"
    assert lines[3] == f"| BAM | test: 1 | 64x | {cell[1, 4]} | {cell[0, 4]} | {cell[0, 4]} | {cell[3, 4]} |"
    assert lines[4] == f"| BAM | validation: 2 | 1x | {cell[2, 16]} | {cell[4, 16]} | {cell[2, 16]} | {cell[8, 16]} |"
    assert len(lines) == 5  # no validation result reached 64x; ALiBi has none


def test_a_page_rewritten_from_its_results_keeps_the_machine_its_run_recorded(tmp_path):
    import json
    from dataclasses import asdict

    from bam_llama.extrapolation.run import rewrite_report

    ran_on = {"processor": "the run's CPU", "torch": "t", "transformers": "x", "threads": 1}
    (tmp_path / "results.json").write_text(json.dumps({"study": asdict(STUDY), "machine": ran_on, "jobs": {},
                                                       "choices": {}}))
    rewrite_report(tmp_path, STUDY)
    assert json.loads((tmp_path / "results.json").read_text())["machine"] == ran_on
