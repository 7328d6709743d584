"""The comparison's results page (results.md) from results.json: what ran, the validation trials and each encoding's
choice, the test phase's passkey by length (the paper's Figure 3: the mean of the test seeds with the pooled count
and its exact 95% interval), per-seed rows, the interval over seeds, perplexity by length, BAM against the strongest
baseline at each length, and the targets."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..evaluation.intervals import clopper_pearson, interval_over_seeds, interval_text, rate_with_interval
from ..files.outputs import staged_files
from .encodings import ENCODINGS
from .figures import plot_passkey, plot_perplexity
from .selection import candidate_scores, found, last_window, test_results
from .settings import TEST, VALIDATION, Study, changed_settings

BAM_RECIPES = ("bam", "bam-ssmax")
TARGETS = {64: 0.95, 512: 0.80}  # strict passkey, the mean of the test seeds, for BAM's recipes
PERPLEXITY_TARGET = 1.10  # last-window perplexity at 512x within 10% of 2x


def counts_at(results: list[dict], length: int) -> list[tuple[int, int]]:
    """(strict keys found, prompts) at `length` of each seed's result that went there."""
    return [found(result["passkey"][length]) for result in results if length in result["passkey"]]


def pooled_cell(results: list[dict], length: int) -> str:
    """"91% 137/150 (86-95)": the mean of the seeds' strict rates, the pooled count and its exact interval."""
    counts = counts_at(results, length)
    if not counts:
        return "—"
    hits, prompts = sum(hit for hit, _ in counts), sum(total for _, total in counts)
    mean = sum(hit / total for hit, total in counts) / len(counts)
    seeds = "" if len(counts) == len(results) else f" [{len(counts)} seeds]"
    return f"{mean:.0%} {hits}/{prompts} ({interval_text(hits, prompts)}){seeds}"


def seeds_interval_cell(results: list[dict], length: int) -> str:
    rates = [hits / prompts for hits, prompts in counts_at(results, length)]
    interval = interval_over_seeds(rates)
    if interval is None:
        return "—"
    if len(set(rates)) == 1:  # no spread to estimate: a t-interval of zero width would claim certainty
        return f"{rates[0]:.0%} on every seed"
    return f"{interval[0]:.0%}-{interval[1]:.0%}"


def lengths_header(study: Study, scales) -> tuple[str, str]:
    cells = [f"{scale}x" for scale in scales]
    return "| encoding | " + " | ".join(cells) + " |", "|---|" + "---:|" * len(cells)


def passkey_table(jobs: dict, study: Study, names: list[str], cell) -> list[str]:
    scales = study.scales + study.long_scales
    lines = list(lengths_header(study, scales))
    for name in names:
        results = [result for _, result in test_results(jobs, study, name)]
        if results:
            lines.append(f"| {ENCODINGS[name].label} ({len(results)} seeds) | "
                         + " | ".join(cell(results, study.train_length * scale) for scale in scales) + " |")
    return lines


def per_seed_table(jobs: dict, study: Study, names: list[str]) -> list[str]:
    scales = study.scales + study.long_scales
    lines = ["| encoding | seed | " + " | ".join(f"{scale}x" for scale in scales) + " |",
             "|---|---:|" + "---:|" * len(scales)]
    for name in names:
        for seed, result in test_results(jobs, study, name):
            cells = []
            for scale in scales:
                length = study.train_length * scale
                if length not in result["passkey"]:
                    cells.append("—")
                    continue
                hits, prompts = found(result["passkey"][length])
                forced, _ = found(result["passkey"][length], "teacher_forced")
                cells.append(f"{hits}/{prompts} ({forced})")
            lines.append(f"| {ENCODINGS[name].label} | {seed} | " + " | ".join(cells) + " |")
    return lines


def perplexity_table(jobs: dict, study: Study, names: list[str]) -> list[str]:
    scales = study.scales + study.long_scales
    lines = list(lengths_header(study, scales))
    for name in names:
        results = [result for _, result in test_results(jobs, study, name)]
        if not results:
            continue
        cells = []
        for scale in scales:
            length = study.train_length * scale
            values = [last_window(result, length) for result in results if length in result["perplexity"]]
            cells.append("—" if len(values) != len(results) else f"{sum(values) / len(values):.2f}")
        lines.append(f"| {ENCODINGS[name].label} | " + " | ".join(cells) + " |")
    return lines


def validation_table(jobs: dict, study: Study, chosen: dict, names: list[str]) -> list[str]:
    lines = ["| encoding | trial | candidate | score: strict " + ", ".join(f"{s}x" for s in study.selection_scales)
             + f" pooled (by seed) | {max(study.scales)}x | last-window perplexity {max(study.scales)}x | chosen |", "|---|---|---|---:|---:|---:|---|"]
    for name in names:
        scores = candidate_scores(jobs, study, name)
        if scores is None:
            done = sum(key.startswith(f"{VALIDATION}/{ENCODINGS[name].training}/") for key in jobs)
            lines.append(f"| {ENCODINGS[name].label} | {done} of {len(ENCODINGS[name].trials) * len(study.validation_seeds)} "
                         "validation jobs done | | | | | |")
            continue
        for (trial, candidate), score in scores.items():
            by_seed = " / ".join(f"{rate:.0%}" for rate in score["by_seed"])
            mark = "**chosen**" if chosen.get(name, {}).get("trial") == trial and chosen[name]["candidate"] == candidate else ""
            lines.append(f"| {ENCODINGS[name].label} | {trial} | {candidate} | {score['rate']:.0%} ({by_seed}) | "
                         f"{score['rate_at_longest']:.0%} | {score['perplexity_at_longest']:.2f} | {mark} |")
    return lines


def validation_jobs_table(jobs: dict, study: Study, names: list[str]) -> list[str]:
    """Every finished validation job's candidates, strict keys found of asked by length (teacher-forced in brackets
    at the longest): what the choice reads, shown as the jobs end."""
    scales = study.scales
    lines = ["| encoding | trial | seed | candidate | " + " | ".join(f"{scale}x" for scale in scales) + " |",
             "|---|---|---:|---|" + "---:|" * len(scales)]
    for key, job in jobs.items():
        if job["phase"] != VALIDATION:
            continue
        for name in (name for name in names if name in job["results"]):
            for candidate, result in job["results"][name].items():
                cells = [f"{hits}/{prompts}" for hits, prompts in
                         (found(result["passkey"][study.train_length * scale]) for scale in scales)]
                cells[-1] += f" ({found(result['passkey'][study.train_length * scales[-1]], 'teacher_forced')[0]})"
                lines.append(f"| {ENCODINGS[name].label} | {job['trial']} | {job['seed']} | {candidate} | "
                             + " | ".join(cells) + " |")
    return lines


def distance_counts(results: list[dict], study: Study) -> tuple[tuple[int, int], tuple[int, int]]:
    """(found, asked) of the keys within one training length of the question and of the keys farther from it, over
    the prompts of `results` at the selection scales. A key's distance from the question is taken as (1 - depth) x
    the prompt length (the filler after the key; the info line and the question add a few tokens)."""
    near, far = [0, 0], [0, 0]
    for result in results:
        for scale in study.selection_scales:
            passkey = result["passkey"].get(study.train_length * scale)
            if passkey is None:
                continue
            for depths, correct, prompt_length in zip(passkey["depths"], passkey["correct"], passkey["prompt_lengths"]):
                for depth, hit in zip(depths, correct):
                    counts = near if (1 - depth) * prompt_length < study.train_length else far
                    counts[0] += hit
                    counts[1] += 1
    return (near[0], near[1]), (far[0], far[1])


def count_cell(hits: int, prompts: int) -> str:
    return "—" if prompts == 0 else f"{hits}/{prompts} {rate_with_interval(hits, prompts)}"


def results_by_phase(jobs: dict, study: Study, name: str) -> tuple[tuple[str, list[dict]], tuple[str, list[dict]]]:
    """`name`'s results on the test seeds (its chosen recipe) and on the validation seeds (every finished trial's
    candidates)."""
    validation = [result for job in jobs.values() if job["phase"] == VALIDATION and name in job["results"]
                  for result in job["results"][name].values()]
    return (TEST, [result for _, result in test_results(jobs, study, name)]), (VALIDATION, validation)


def distance_table(jobs: dict, study: Study, names: list[str]) -> list[str]:
    """Each encoding's strict keys found near the question and far from it in the same long prompts: test seeds (the
    chosen recipes) and validation seeds (every finished trial's candidates), a row each where there are results."""
    lines = ["| encoding | models | key within 1x of the question | key farther |", "|---|---|---:|---:|"]
    for name in names:
        for phase, results in results_by_phase(jobs, study, name):
            if results:
                near, far = distance_counts(results, study)
                lines.append(f"| {ENCODINGS[name].label} | {phase}: {len(results)} | {count_cell(*near)} | "
                             f"{count_cell(*far)} |")
    return lines


ANSWER_KINDS = ("found", "the key's digits in another order", "most digits in their places", "another answer")


def answer_kind(key: str, answer: str, hit: bool) -> int:
    """An index of ANSWER_KINDS, from the greedy answer's leading digits: the key's digits in another order (the key
    located, its order lost); most digits in their places (as many digits as the key, more than half of them the key's
    at the same place: the key located, some digits lost); anything else (another number, no number)."""
    stripped = answer.lstrip()
    digits = stripped[:len(stripped) - len(stripped.lstrip("0123456789"))]
    if hit:
        return 0
    if sorted(digits) == sorted(key):
        return 1
    if len(digits) == len(key) and 2 * sum(a == b for a, b in zip(digits, key)) > len(key):
        return 2
    return 3


def answer_kinds(passkey: dict) -> list[int]:
    """How many of one length's prompts got each of ANSWER_KINDS."""
    kinds = [0] * len(ANSWER_KINDS)
    for keys, answers, correct in zip(passkey["passkeys"], passkey["predictions"], passkey["correct"]):
        for key, answer, hit in zip(keys, answers, correct):
            kinds[answer_kind(key, answer, hit)] += 1
    return kinds


def answer_kinds_table(jobs: dict, study: Study, names: list[str]) -> list[str]:
    """Each encoding's strict answers at 1x and at the longest length every encoding reaches, by kind: test seeds
    (the chosen recipes) and validation seeds (every finished trial's candidates)."""
    lengths = (study.train_length, study.longest_common_length)
    lines = ["| encoding | models | length | " + " | ".join(ANSWER_KINDS) + " |", "|---|---|---:|" + "---:|" * len(ANSWER_KINDS)]
    for name in names:
        for phase, results in results_by_phase(jobs, study, name):
            for length in lengths:
                counted = [answer_kinds(result["passkey"][length]) for result in results if length in result["passkey"]]
                if counted:
                    prompts = sum(map(sum, counted))
                    cells = [count_cell(sum(kinds[index] for kinds in counted), prompts) for index in range(len(ANSWER_KINDS))]
                    lines.append(f"| {ENCODINGS[name].label} | {phase}: {len(counted)} | "
                                 f"{length // study.train_length}x | " + " | ".join(cells) + " |")
    return lines


def target_lines(jobs: dict, study: Study) -> list[str]:
    """Each of BAM's recipes with test results against each target: met, missed by how much, or not measured where
    a test seed stopped at 64x (it found at most half the keys there, the gate to 128x-512x)."""
    lines = ["| encoding | target | mean of the test seeds | met |", "|---|---|---|---|"]
    for name in BAM_RECIPES:
        results = [result for _, result in test_results(jobs, study, name)]
        if not results:
            continue
        label = ENCODINGS[name].label
        for scale, target in TARGETS.items():
            rates = [hits / prompts for hits, prompts in counts_at(results, study.train_length * scale)]
            what = f"strict passkey >= {target:.0%} at {scale}x"
            if len(rates) < len(results):
                lines.append(unmeasured_target_line(label, what, rates, len(results), f"{mean_of(rates):.0%}"))
                continue
            mean = mean_of(rates)
            met = mean >= target - 1e-9  # a mean of rates of equal counts: its float sum may fall short by an ulp
            lines.append(f"| {label} | {what} | {mean:.0%} ({len(rates)} seeds) | "
                         f"{'yes' if met else f'no, by {100 * (target - mean):.0f} points'} |")
        longest, short = study.train_length * 512, study.train_length * 2
        ratios = [last_window(r, longest) / last_window(r, short) for r in results
                  if longest in r["perplexity"] and short in r["perplexity"]]
        what = "last-window perplexity at 512x within 10% of 2x"
        if len(ratios) < len(results):
            lines.append(unmeasured_target_line(label, what, ratios, len(results), f"{mean_of(ratios):.3f}x"))
        else:
            mean = mean_of(ratios)
            within = abs(math.log(mean)) <= math.log(PERPLEXITY_TARGET)
            verdict = "yes" if within else f"no, {'lower' if mean < 1 else 'higher'} than 2x's by more than 10%"
            lines.append(f"| {label} | {what} | {mean:.3f}x | {verdict} |")
    return lines


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def unmeasured_target_line(label: str, what: str, measured: list[float], seeds: int, mean: str) -> str:
    """A target not measured on every test seed: it cannot be met (its mean is of all the seeds)."""
    shown = f"{mean} on {len(measured)} of {seeds} seeds" if measured else "not measured"
    return (f"| {label} | {what} | {shown}: {seeds - len(measured)} of {seeds} stopped at 64x (at most half the keys "
            f"found there) | no, not reached on every seed |")


def length_standing(jobs: dict, study: Study, names: list[str], length: int) -> dict[str, tuple[float, int, int]]:
    """{encoding: (mean of its test seeds' strict rates, pooled hits, pooled prompts)} of the encodings evaluated at
    `length` on every test seed they have."""
    standing = {}
    for name in names:
        results = [result for _, result in test_results(jobs, study, name)]
        counts = counts_at(results, length)
        if counts and len(counts) == len(results):
            standing[name] = (sum(hits / prompts for hits, prompts in counts) / len(counts),
                              sum(hits for hits, _ in counts), sum(prompts for _, prompts in counts))
    return standing


def strongest_baseline_lines(jobs: dict, study: Study, names: list[str]) -> list[str]:
    """At each length, BAM's better recipe against the baseline with the highest mean strict rate: both rates, the
    difference, and whether their pooled exact intervals are apart (they leave the seeds' spread out)."""
    lines = ["| length | BAM's better recipe | strongest baseline | difference | pooled 95% intervals |",
             "|---:|---|---|---:|---|"]
    for scale in study.scales + study.long_scales:
        standing = length_standing(jobs, study, names, study.train_length * scale)
        bam = {name: value for name, value in standing.items() if name in BAM_RECIPES}
        baselines = {name: value for name, value in standing.items() if name not in BAM_RECIPES}
        if not bam or not baselines:
            continue
        best, rival = max(bam, key=lambda name: bam[name][0]), max(baselines, key=lambda name: baselines[name][0])
        (rate, hits, prompts), (rival_rate, rival_hits, rival_prompts) = bam[best], baselines[rival]
        low, high = clopper_pearson(hits, prompts)
        rival_low, rival_high = clopper_pearson(rival_hits, rival_prompts)
        apart = "BAM's above" if low > rival_high else "BAM's below" if high < rival_low else "overlap"
        lines.append(f"| {scale}x | {ENCODINGS[best].label} {rate:.0%} | {ENCODINGS[rival].label} {rival_rate:.0%} | "
                     f"{100 * (rate - rival_rate):+.0f} points | {apart} |")
    return lines


def shown_encodings(jobs: dict) -> list[str]:
    """The encodings with a finished job in `jobs`, in ENCODINGS' order: the page shows every one of them, whichever
    encodings the run that publishes it runs."""
    return [name for name in ENCODINGS if any(name in job["results"] for job in jobs.values())]


def write_report(report: dict, study: Study) -> str:
    jobs, chosen = report["jobs"], report["choices"]
    names = shown_encodings(jobs)
    commits = sorted({job["commit"] for job in jobs.values()})
    machines = sorted({f"{job['machine']['processor']}, torch {job['machine']['torch']}, transformers "
                       f"{job['machine']['transformers']}, {job['machine']['threads']} thread(s) a job"
                       for job in jobs.values() if "machine" in job})
    minutes = sum(job["minutes"] for job in jobs.values())
    paths = sorted({job.get("attention", "fused C++ CPU kernel") for job in jobs.values()})
    done = {phase: sum(job["phase"] == phase for job in jobs.values()) for phase in (VALIDATION, TEST)}
    changed = ", ".join(changed_settings(study))
    changed = f"; settings other than the study's defaults: {changed}" if changed else ""
    lines = [
        "# Train short, test long on real text: every positional encoding, chosen on validation, reported on test seeds",
        "",
        f"Trained at {study.train_length} tokens ({study.layers} layers, hidden {study.hidden_size}, {study.heads} heads, "
        f"{study.steps} steps of {study.batch_size} rows a stage{changed}). Validation seeds {', '.join(map(str, study.validation_seeds))} "
        f"choose each encoding's recipe; test seeds {', '.join(map(str, study.test_seeds))} report it. Jobs done: "
        f"{done[VALIDATION]} validation, {done[TEST]} test; {minutes / 60:.1f} hours of one-thread jobs. Commits: "
        f"{', '.join(commits) or 'none yet'}. Machines: {'; '.join(machines) or 'none yet'}. BamLlama's attention: "
        f"{', '.join(paths) or 'none yet'}.",
        "",
        "## Test seeds: passkey retrieval by length (strict; mean of the seeds, pooled count, exact 95% interval)",
        "",
        *passkey_table(jobs, study, names, pooled_cell),
        "",
        "Interval over seeds (the 95% t-interval of the seeds' rates, which the pooled interval leaves out; where every "
        "seed has the same rate it has no spread to estimate, and the cell says so):",
        "",
        *passkey_table(jobs, study, names, seeds_interval_cell),
        "",
        "Per seed, strict found of asked (teacher-forced in brackets):",
        "",
        *per_seed_table(jobs, study, names),
        "",
        "## Test seeds: last-window perplexity by length (mean of the seeds)",
        "",
        *perplexity_table(jobs, study, names),
        "",
        "## BAM against the strongest baseline at each length (test seeds, strict, mean of the seeds)",
        "",
        *strongest_baseline_lines(jobs, study, names),
        "",
        "## Where the keys are missed: near the question or far from it (strict, prompts of "
        f"{', '.join(f'{scale}x' for scale in study.selection_scales)})",
        "",
        "A key within the training length of the question is read through the same short distances as in training, "
        "whatever the prompt's length; a key farther needs attention past them. Each model's prompts are pooled (a "
        "validation job's candidates each count as a model; they share their keys).",
        "",
        *distance_table(jobs, study, names),
        "",
        "## What the answers are (strict)",
        "",
        "A miss with the key's digits in another order, or with most of them in their places, found the key and lost "
        "some of it; another answer (another number, no number) shows no sign of the key.",
        "",
        *answer_kinds_table(jobs, study, names),
        "",
        "## Targets (BAM's recipes)",
        "",
        *target_lines(jobs, study),
        "",
        "## Validation: every trial and candidate, and the choice",
        "",
        *validation_table(jobs, study, chosen, names),
        "",
        "Every finished validation job, strict keys found of asked by length (teacher-forced at the longest in brackets):",
        "",
        *validation_jobs_table(jobs, study, names),
        "",
    ]
    return "\n".join(lines)


def publish(output_dir: Path, report: dict, study: Study) -> str:
    """results.json, results.md and, once a test job is done, passkey.png and perplexity.png (the figures plot test
    seeds only) of `report`, replacing the earlier ones together."""
    text = write_report(report, study)
    names = shown_encodings(report["jobs"])
    with staged_files(output_dir, "results") as staging:
        (staging / "results.json").write_text(json.dumps(report, indent=1) + "\n")
        (staging / "results.md").write_text(text)
        if any(job["phase"] == TEST for job in report["jobs"].values()):
            plot_passkey(report["jobs"], study, names, staging / "passkey.png")
            plot_perplexity(report["jobs"], study, names, staging / "perplexity.png")
    return text
