"""The attention of an earlier commit against the current one, inside one process, on CPU.

Run-to-run differences on a shared 2-core VM are as large as the changes being measured (the BAM/Llama ratio at
4096 tokens moved by ~0.15 between runs of the same code), so a change to `bam_attention_blocked` is judged here:
the same BamLlama model runs with the earlier commit's `bam_attention_blocked` (read with `git show` from
`--old-path`, by default where that commit kept it) and with the current one, interleaved with LlamaForCausalLM,
repeat after repeat (models and inputs as in `cpu_speed.py`).

    python benchmarks/cpu_speed_ab.py --old e3d8249 --length 4096 --cases bam bam+ssmax --repeats 5

`--attention` times the attention alone instead, on one layer's shapes (batch `--batch`, 8 heads, 4 KV heads, head
size 32, the prior and q/k/v trained in fwd+bwd), against Llama's causal SDPA on the same q/k/v; `--padded` pads
the keys of the last batch row (its first eighth), which makes every block's mask a materialized one (Llama's SDPA
stays unpadded, is_causal):

    python benchmarks/cpu_speed_ab.py --old cbd198b --attention --length 4096 --cases bam bam+ssmax --padded
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cpu_speed
import torch
import torch.nn.functional as F
from cpu_speed import REPO_ROOT, build_model, input_ids, timed

from bam_llama.model import attention_route_bam, dispatch_bam
from bam_llama.model.prior_bam import ggd_bias

HEADS, KV_HEADS, HEAD_SIZE = 8, 4, 32


# Where `bam_attention_blocked` lived, newest layout first: the attention route's module, before it
# bam_llama/model/blocked_bam.py, and before the package's sub-packages (issue 35) bam_llama/attention_bam.py.
ATTENTION_FILES = (
    "bam_llama/model/attention_route_bam.py", "bam_llama/model/blocked_bam.py", "bam_llama/attention_bam.py"
)


def attention_at(commit: str, folder: Path, path: str | None = None):
    """`bam_attention_blocked` as `commit` had it, from `path` (default: the first of ATTENTION_FILES the commit
    has). The file is imported with its sibling files of that commit as one package, so its relative imports
    (`from .prior_bam import ...`) resolve to the same commit's code."""
    path = path or next((candidate for candidate in ATTENTION_FILES if _git_show(commit, candidate) is not None), None)
    if path is None or _git_show(commit, path) is None:
        raise ValueError(f"--old {commit}: git show found no {path or ' or '.join(ATTENTION_FILES)}")
    package = folder / f"attention_{commit}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    directory = path.rpartition("/")[0]
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:{directory}"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout.split()
    for name in listed:
        if name.endswith(".py") and name != "__init__.py":
            (package / name).write_text(_git_show(commit, f"{directory}/{name}"))
    sys.path.insert(0, str(folder))
    module = importlib.import_module(f"{package.name}.{Path(path).stem}")
    return module.bam_attention_blocked


def _git_show(commit: str, path: str) -> str | None:
    shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=REPO_ROOT, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else None


class AttentionInputs:
    """One layer's q, k, v (laid out as the model passes them), prior parameters and key padding."""

    def __init__(self, length: int, batch: int, padded: bool, trained: bool):
        generator = torch.Generator().manual_seed(0)

        def projection(heads):
            return torch.randn(batch, length, heads, HEAD_SIZE, generator=generator).transpose(1, 2)

        self.query, self.key, self.value = projection(HEADS), projection(KV_HEADS), projection(KV_HEADS)
        self.theta_alpha = torch.full((HEADS,), -2.0)
        self.theta_beta = torch.linspace(-1.0, 1.0, HEADS)
        self.ssmax_scale = torch.ones(HEADS)
        for tensor in (self.query, self.key, self.value, self.theta_alpha, self.theta_beta, self.ssmax_scale):
            tensor.requires_grad_(trained)
        self.positions = torch.arange(length)
        self.key_valid = None
        if padded:
            self.key_valid = torch.ones(batch, length, dtype=torch.long)
            self.key_valid[-1, : length // 8] = 0


def attention_call(attention, inputs: AttentionInputs, ssmax: bool) -> torch.Tensor:
    length = inputs.positions.numel()
    table = ggd_bias(torch.arange(-(length - 1), 1), inputs.theta_alpha, inputs.theta_beta, torch.zeros(HEADS))
    return attention(
        inputs.query, inputs.key, inputs.value, inputs.positions, table, HEAD_SIZE**-0.5,
        ssmax_scale=inputs.ssmax_scale if ssmax else None, key_valid=inputs.key_valid,
    )


def llama_attention_call(inputs: AttentionInputs) -> torch.Tensor:
    query, key, value = (t.contiguous() for t in (inputs.query, inputs.key, inputs.value))
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)


def timed_attention(call, mode: str) -> float:
    start = time.perf_counter()
    if mode == "fwd":
        with torch.no_grad():
            call()
    else:
        output = call()
        output.backward(torch.ones_like(output))
    return time.perf_counter() - start


def attention_timings(versions, args) -> dict:
    times = {}
    inputs = {mode: AttentionInputs(args.length, args.batch, args.padded, mode == "fwd+bwd") for mode in args.modes}
    calls = {("llama", "-"): lambda mode: llama_attention_call(inputs[mode])}
    for case in args.cases:
        for version, attention in versions.items():
            calls[case, version] = lambda mode, a=attention, s="ssmax" in case: attention_call(a, inputs[mode], s)
    for mode in args.modes:  # warm-up
        for call in calls.values():
            timed_attention(lambda: call(mode), mode)
    for _ in range(args.repeats):
        for mode in args.modes:
            for (case, version), call in calls.items():
                times.setdefault((mode, case, version), []).append(timed_attention(lambda: call(mode), mode))
    return times


def planned_paths_by(attention):
    """`dispatch_bam.run_attention` whose planned calls (the last position known: a prior table) run `attention`, a
    commit's `bam_attention_blocked`; the other calls take the route as they do now."""

    def run(call):
        if call.prior_table is None:
            return attention_route_bam.run_attention(call)
        return attention(
            call.query, call.key, call.value, call.query_positions, call.prior_table, call.scaling,
            ssmax_scale=call.ssmax_scale, ssmax_prior=call.ssmax_prior, key_valid=call.key_valid,
            document_ids=call.document_ids, dropout=call.dropout,
        ).transpose(1, 2)

    return run


def model_timings(versions, args) -> dict:
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
                        dispatch_bam.run_attention = planned_paths_by(attention)
                    times.setdefault((mode, case, version), []).append(timed(model, mode, ids))
    dispatch_bam.run_attention = attention_route_bam.run_attention
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="the earlier commit")
    parser.add_argument("--old-path", help="the earlier commit's file holding bam_attention_blocked (default: the "
                        f"first of {', '.join(ATTENTION_FILES)} it has)")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--cases", nargs="+", choices=[c for c in cpu_speed.CASES if c != "llama"], default=["bam"])
    parser.add_argument("--modes", nargs="+", choices=cpu_speed.MODES, default=["fwd", "fwd+bwd"],
                        help="decode: the time of 64 greedy steps after the prompt (prefill untimed)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--attention", action="store_true", help="time the attention alone, not the model")
    parser.add_argument("--batch", type=int, default=1, help="--attention: batch size")
    parser.add_argument("--padded", action="store_true", help="--attention: pad the keys of the last batch row")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice; on cores "
                        "shared with other work, 1: two threads on one free core wait on each other)")
    args = parser.parse_args(argv)
    if args.length < 2 or args.repeats < 1 or args.batch < 1:
        parser.error("--length must be >= 2, --repeats and --batch >= 1")
    if args.attention and "decode" in args.modes:
        parser.error("--attention times fwd and fwd+bwd only")
    if (args.batch != 1 or args.padded) and not args.attention:
        parser.error("--batch and --padded apply to --attention only")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        try:
            versions = {
                args.old: attention_at(args.old, Path(folder), args.old_path),
                "current": attention_route_bam.bam_attention_blocked,
            }
        except ValueError as error:
            parser.error(str(error))
    times = (attention_timings if args.attention else model_timings)(versions, args)
    what = f"attention alone, batch {args.batch}{', padded' if args.padded else ''}" if args.attention else "model"
    print(f"L={args.length}, {what}, {torch.get_num_threads()} threads, {args.repeats} interleaved repeats; "
          "median (min) ms, ratio of medians to Llama's")
    for (mode, case, version), seconds in times.items():
        ratio = statistics.median(seconds) / statistics.median(times[mode, "llama", "-"])
        print(f"{mode:8} {case:20} {version:8} {statistics.median(seconds) * 1000:7.1f} ({min(seconds) * 1000:.1f})"
              f"  {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
