"""Seconds per step of one small `bam-pretrain` run at several `--threads`, each beside busy processes, as another
program sharing the cores would be: the measurement behind `--threads`' default (`bam_llama/runtime/cpu_threads.py`).

    python -m bam_llama.cli.corpus python-corpus
    python benchmarks/threads_beside_load.py --data python-corpus/heldout.jsonl --threads 2,1,2,1 --busy 2

Each run is `python -m bam_llama.cli.pretrain` of this checkout, the 1.71M-parameter model of the real-text benchmark
(hidden 128, 4 layers, 4 heads, 128 tokens, 8 rows a step) for --steps steps; its seconds per step are Trainer's
train_runtime over the steps. The busy processes (`while True: pass`) start before each run and are killed after it.
OMP_NUM_THREADS is removed from the runs' environment, so that --threads alone decides.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bam_llama.runtime.processor import cpu_model

REPOSITORY = Path(__file__).resolve().parents[1]
SIZE = ["--hidden-size", "128", "--layers", "4", "--heads", "4", "--context-length", "128", "--batch-size", "8"]


def seconds_per_step(data: str, threads: int, steps: int, busy: int) -> float:
    """One run at `threads` beside `busy` busy processes."""
    environment = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    environment.update(PYTHONPATH=str(REPOSITORY), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            command = [sys.executable, "-m", "bam_llama.cli.pretrain", "--data", data, "--output-dir", output_dir,
                       *SIZE, "--max-steps", str(steps), "--save-steps", str(steps), "--threads", str(threads),
                       "--disable-progress-bars"]
            result = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    runtime = re.findall(r"'train_runtime': '?([0-9.]+)", result.stdout)[-1]  # the first is the first step's log
    return float(runtime) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--threads", default=f"{os.cpu_count()},1", help="comma-separated thread counts")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside each run")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, load {load:.1f} before; {args.busy} busy processes beside each run; "
          f"{time.strftime('%Y-%m-%d')}")
    print("| threads | seconds per step |\n|---:|---:|")
    for threads in map(int, args.threads.split(",")):
        print(f"| {threads} | {seconds_per_step(args.data, threads, args.steps, args.busy):.2f} |", flush=True)


if __name__ == "__main__":
    main()
