"""The attention of an earlier commit against the current one, inside one process, on CPU.

Run-to-run differences on a shared 2-core VM are as large as the changes being measured (the BAM/Llama ratio at
4096 tokens moved by ~0.15 between runs of the same code), so a change to `bam_attention_blocked` is judged here:
the same BamLlama model runs with the earlier commit's `attention_bam.bam_attention_blocked` (read with
`git show`) and with the current one, interleaved with LlamaForCausalLM, repeat after repeat (models and
inputs as in `cpu_speed.py`).

    python benchmarks/cpu_speed_ab.py --old e3d8249 --length 4096 --cases bam bam+ssmax --repeats 5
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import cpu_speed
from cpu_speed import REPO_ROOT, build_model, input_ids, timed

from bam_llama import modeling_bam


def attention_at(commit: str, folder: Path):
    """`bam_attention_blocked` as `bam_llama/attention_bam.py` had it at `commit`."""
    shown = subprocess.run(
        ["git", "show", f"{commit}:bam_llama/attention_bam.py"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    if shown.returncode != 0:
        raise ValueError(f"--old {commit}: git show found no bam_llama/attention_bam.py ({shown.stderr.strip()})")
    source = shown.stdout
    path = folder / f"attention_{commit}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.bam_attention_blocked


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the earlier commit")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--cases", nargs="+", choices=[c for c in cpu_speed.CASES if c != "llama"], default=["bam"])
    parser.add_argument("--modes", nargs="+", choices=cpu_speed.MODES, default=["fwd", "fwd+bwd"],
                        help="decode: the time of 64 greedy steps after the prompt (prefill untimed)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.length < 2 or args.repeats < 1:
        parser.error("--length must be >= 2 and --repeats >= 1")
    with tempfile.TemporaryDirectory() as folder:
        try:
            versions = {args.old: attention_at(args.old, Path(folder)), "current": modeling_bam.bam_attention_blocked}
        except ValueError as error:
            parser.error(str(error))
    models = {case: build_model(case) for case in ["llama", *args.cases]}
    ids = input_ids(args.length)
    for model in models.values():
        timed(model, "fwd", ids[:, :64])  # warm-up
    times = {}
    for _ in range(args.repeats):
        for mode in args.modes:
            for case, model in models.items():
                for version, attention in ({"-": None} if case == "llama" else versions).items():
                    if attention is not None:
                        modeling_bam.bam_attention_blocked = attention
                    times.setdefault((mode, case, version), []).append(timed(model, mode, ids))
    modeling_bam.bam_attention_blocked = versions["current"]
    print(f"L={args.length}, {args.repeats} interleaved repeats; median (min) ms, ratio of medians to Llama's")
    for (mode, case, version), seconds in times.items():
        ratio = statistics.median(seconds) / statistics.median(times[mode, "llama", "-"])
        print(f"{mode:8} {case:20} {version:8} {statistics.median(seconds) * 1000:6.0f} ({min(seconds) * 1000:.0f})"
              f"  {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
