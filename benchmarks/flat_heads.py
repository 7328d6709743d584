"""Which layers of a learned prior keep a flat head, against how far the model reads keys: every BAM and BAM + SSMax
model of the real-text studies (`text_extrapolation.py`'s results.json files), grouped by its prior.

A head is flat where its GGD prior costs less than `--flat-below` (logit) at `--distance` tokens:
exp(theta_alpha) * distance ** theta_beta (theta_mu is 0 in these studies). A prior is counted once (its values
rounded to 0.1: a two-stage trial and its extension share the stage-one prior), with the best strict rate at 64x
of the models that use it.

    python benchmarks/flat_heads.py > benchmarks/results/text-extrapolation/flat-heads.md
"""

import argparse
import glob
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "text-extrapolation"
LENGTH_64X = "8192"


def flat_layers(learned: dict, distance: int, flat_below: float) -> list[int]:
    alpha, beta = learned["theta_alpha"], learned["theta_beta"]
    return sorted({layer for layer, heads in enumerate(alpha) for head in range(len(heads))
                   if math.exp(alpha[layer][head]) * distance ** beta[layer][head] < flat_below})


def models(paths: list[Path], encoding: str):
    """(study, job key, learned prior, found, asked at 64x) of every candidate of `encoding` evaluated at 64x."""
    for path in paths:
        jobs = json.loads(path.read_text())["jobs"]
        for key, job in jobs.items():
            for candidate, result in job["results"].get(encoding, {}).items():
                stage = job["stages"].get(candidate) or job["stages"]["trained"]
                passkey = result["passkey"].get(LENGTH_64X)
                if passkey is None or "learned" not in stage:
                    continue
                found = sum(map(sum, passkey["correct"]))
                asked = sum(map(len, passkey["correct"]))
                yield path.parent.name, key, stage["learned"], found, asked


def prior_rows(paths: list[Path], encoding: str, distance: int, flat_below: float) -> list[dict]:
    priors = {}
    for study, key, learned, found, asked in models(paths, encoding):
        values = tuple(round(value, 1) for name in ("theta_alpha", "theta_beta") for row in learned[name] for value in row)
        row = priors.setdefault(values, {"layers": flat_layers(learned, distance, flat_below),
                                         "depth": len(learned["theta_alpha"]), "rate": -1.0, "phases": set(),
                                         "jobs": set()})
        if found / asked > row["rate"]:
            row["rate"], row["found"], row["asked"] = found / asked, found, asked
        row["phases"].add(key.split("/")[0])
        row["jobs"].add(f"{study}: {key}")
    return list(priors.values())


def table(rows: list[dict]) -> list[str]:
    below_last = [row for row in rows if any(layer < row["depth"] - 1 for layer in row["layers"])]
    others = [row for row in rows if row not in below_last]
    lines = ["| flat head below the last layer | priors | of them test-seed priors | read >= half the keys at 64x | "
             "best at 64x |", "|---|---:|---:|---:|---:|"]
    for label, group in (("yes", below_last), ("no", others)):
        good = sum(row["rate"] >= 0.5 for row in group)
        best = max((row["rate"] for row in group), default=0.0)
        tests = sum("test" in row["phases"] for row in group)
        lines.append(f"| {label} | {len(group)} | {tests} | {good} | {best:.0%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--distance", type=int, default=4096)
    parser.add_argument("--flat-below", type=float, default=5.0)
    args = parser.parse_args()
    paths = [RESULTS / "results.json", *sorted(Path(p) for p in glob.glob(str(RESULTS / "studies" / "*" / "results.json")))]
    print(f"# Flat prior heads and far reading\n\n`python benchmarks/flat_heads.py --distance {args.distance} "
          f"--flat-below {args.flat_below}` over {', '.join(str(p.relative_to(RESULTS)) for p in paths)}.\n")
    for encoding, name in (("bam", "BAM"), ("bam-ssmax", "BAM + SSMax")):
        rows = prior_rows(paths, encoding, args.distance, args.flat_below)
        print(f"## {name}\n")
        print("\n".join(table(rows)))
        print("\n| flat layers | 64x, best of the prior's models | jobs |\n|---|---:|---|")
        for row in sorted(rows, key=lambda row: (row["rate"], str(row["layers"]))):
            print(f"| {row['layers']} | {row['found']}/{row['asked']} | {'; '.join(sorted(row['jobs']))} |")
        print()


if __name__ == "__main__":
    main()
