"""Time each command's --help: wall-clock and CPU seconds of `python -m <its module> --help`, in fresh processes,
for this checkout and optionally another one (e.g. the main branch) on the same machine. Each checkout's
pyproject.toml says which module runs each command, so checkouts of other layouts compare too.

    python benchmarks/help_time.py                              # this checkout, 5 runs per command
    python benchmarks/help_time.py --compare /path/to/other/checkout --out benchmarks/results/help-time.md

Columns name each checkout by its commit (with "+ uncommitted changes" where its tracked files differ).

CPU time (user + system, from the children's rusage) is what a loaded machine multiplies: the tests that run
`bam-eval --help` used to time out at 60 s with several jobs sharing two cores.
"""

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tomllib

COMMANDS = ("bam-eval", "bam-demo", "bam-finetune", "bam-convert", "bam-card")
REPOSITORY = Path(__file__).resolve().parents[1]


def command_modules(checkout: Path) -> dict[str, str]:
    """The module each command runs in `checkout`, from its pyproject.toml's console scripts."""
    scripts = tomllib.loads((checkout / "pyproject.toml").read_text())["project"]["scripts"]
    return {command: scripts[command].partition(":")[0] for command in COMMANDS}


def time_help(checkout: Path, module: str) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one `--help` run with `checkout` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, env=env, cwd=checkout)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise RuntimeError(f"{module} --help failed in {checkout}: {completed.stderr.decode()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(checkout: Path, runs: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds per command."""
    medians = {}
    for command, module in command_modules(checkout).items():
        samples = [time_help(checkout, module) for _ in range(runs)]
        medians[command] = (statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples))
    return medians


def checkout_label(checkout: Path) -> str:
    """A checkout named by its commit (and whether its files differ from it), never by its local path."""
    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *arguments], capture_output=True, text=True, check=True).stdout

    label = git("rev-parse", "--short", "HEAD").strip()
    return f"{label} + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no").strip() else label


def versions() -> str:
    import torch
    import transformers

    return f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"


def report(results: dict[str, dict[str, tuple[float, float]]], runs: int) -> str:
    names = list(results)
    header = "| command | " + " | ".join(f"{name}: wall s | {name}: CPU s" for name in names) + " |"
    lines = [
        f"# `--help` time per command (median of {runs} fresh processes)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}; load average while measuring "
        f"{', '.join(f'{load:.1f}' for load in os.getloadavg())}.",
        f"{versions()}.",
        "",
        header,
        "|---|" + "---:|---:|" * len(names),
    ]
    for command in COMMANDS:
        cells = [f"{results[name][command][0]:.2f} | {results[name][command][1]:.2f}" for name in names]
        lines.append(f"| {command} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--compare", type=Path, help="another checkout to measure the same way")
    parser.add_argument("--out", type=Path, help="write the Markdown table here too")
    args = parser.parse_args()
    results = {checkout_label(REPOSITORY): measure(REPOSITORY, args.runs)}
    if args.compare:
        results[checkout_label(args.compare.resolve())] = measure(args.compare.resolve(), args.runs)
    table = report(results, args.runs)
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
