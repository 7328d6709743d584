"""CPU speed of BamLlama against Transformers' LlamaForCausalLM of the same sizes, in one run.

Models: 4 layers, hidden 256, 8 heads (head size 32), 4 KV heads, intermediate 704, vocabulary 512, float32,
batch 1, each model in its default attention implementation on CPU (Llama: sdpa; BamLlama: its default). Cases:

    llama                 LlamaForCausalLM, sdpa
    bam                   BamLlama, GGD prior on, no SSMax (the config default)
    bam+ssmax             BamLlama, prior on, Scalable Softmax on
    bam bias-off          BamLlama, prior vanishing (theta_alpha = -30: still computed, contributes ~0)
    bam bias-off+ssmax    ... with Scalable Softmax
    bam layer             BamLlama, one prior per layer (prior_scope="layer"), no SSMax (not run by default)
    bam+ssmax layer       ... with Scalable Softmax (not run by default)
    llama compiled        LlamaForCausalLM under torch.compile(fullgraph=True, dynamic=False) (inductor)
    bam compiled          BamLlama, prior on, no SSMax, compiled the same way
    bam+ssmax compiled    BamLlama, prior and Scalable Softmax on, compiled the same way
    bam+ssmax layer compiled  ... one prior per layer (not run by default)

Modes at every length L (tokens):
    fwd       forward of L tokens without gradients (use_cache=False)
    fwd+bwd   forward with labels, loss.backward()
    decode    prefill L tokens (untimed), then 64 greedy steps against the KV cache (timed): tokens/s. Compiled
              cases decode as Transformers' static-cache recipe does: an eager prefill into a StaticCache, then
              every step through the compiled forward (one graph for all steps)
    eval-loop `bam-eval`'s loop on one L-token prompt (`evaluation.decoding.greedy_continuation` under
              inference_mode): prefill in chunks of 1024 tokens through a DynamicCache, then 16 greedy tokens,
              timed whole. Eager cases only (not run by default: `--modes ... eval-loop`)

Compiled cases compile every (mode, length) in an untimed warm-up, and their ratio is to "llama compiled" (the
eager cases' to "llama"); their peak memory is not measured (the child process would compile them all again).

Timing: `--repeats` rounds; in every round each (case, mode) runs once, the cases interleaved, so a load spike
hits all of them; the table gives the median and the min-max spread. Peak memory: a separate untimed pass per
(case, mode, length) resets the process' peak RSS (`echo 5 > /proc/self/clear_refs`, Linux), runs once, and
reports VmHWM minus the RSS before the run. The memory passes run in a child process started with
MALLOC_MMAP_THRESHOLD_=128K, so that every tensor above 128 KiB is mmapped and returned to the system when freed
(the increase is that run's own); the timings run without it, as users run.
A profile (`--profile L`) prints torch.profiler's top operators for the BAM forward.

    python benchmarks/cpu_speed.py                          # 512..4096, writes benchmarks/results/cpu-speed.{md,json}
    python benchmarks/cpu_speed.py --lengths 512 --repeats 1 --out /tmp/x    # quick look
    python benchmarks/cpu_speed.py --profile 2048           # where the time goes
    python benchmarks/cpu_speed.py --lengths 1024 2048 --cases llama bam+ssmax "llama compiled" "bam+ssmax compiled"
    python benchmarks/cpu_speed.py --long --threads 1 --repeats 3 --out benchmarks/results/cpu-speed-long
                                                            # 16K/32K/64K: fwd, decode, eval-loop, every eager case
    python benchmarks/cpu_speed.py --lengths 16384 --modes eval-loop --cases llama bam+ssmax "bam+ssmax layer"
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache  # noqa: E402

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM  # noqa: E402
from bam_llama.evaluation.decoding import greedy_continuation  # noqa: E402
from bam_llama.model.modeling_bam import CACHE_NAME  # noqa: E402  (the installed Transformers' name of the KV cache)
from bam_llama.runtime.processor import cpu_model  # noqa: E402
from bam_llama.model.cpu_kernels_bam import cpu_kernels_enabled  # noqa: E402
from bam_llama.model.fused_cpu_bam import fused_cpu_available  # noqa: E402

SIZES = dict(
    vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4,
)
CASES = {
    "llama": None,
    "bam": dict(ssmax=False),
    "bam+ssmax": dict(ssmax=True),
    "bam bias-off": dict(ssmax=False, theta_alpha_init=-30.0),
    "bam bias-off+ssmax": dict(ssmax=True, theta_alpha_init=-30.0),
    "bam layer": dict(ssmax=False, prior_scope="layer"),
    "bam+ssmax layer": dict(ssmax=True, prior_scope="layer"),
    "llama compiled": None,
    "bam compiled": dict(ssmax=False),
    "bam+ssmax compiled": dict(ssmax=True),
    "bam+ssmax layer compiled": dict(ssmax=True, prior_scope="layer"),
}
DEFAULT_CASES = [case for case in CASES if " layer" not in case]
COMPILED = " compiled"
MODES = ("fwd", "fwd+bwd", "decode", "eval-loop")
DEFAULT_MODES = ("fwd", "fwd+bwd", "decode")
DECODE_TOKENS = 64
EVAL_CHUNK, EVAL_NEW_TOKENS = 1024, 16  # bam-eval's default --chunk-size; a passkey's answer and then some
LONG_LENGTHS = [16384, 32768, 65536]
LONG_MODES = ("fwd", "decode", "eval-loop")  # fwd+bwd at 64K: minutes a step; ask for it with --modes


def build_model(case: str) -> torch.nn.Module:
    """The case's model; a compiled case's is a `CompiledModel`."""
    torch.manual_seed(0)
    overrides = CASES[case]
    if overrides is None:
        config = LlamaConfig(**SIZES, max_position_embeddings=1 << 17, attn_implementation="sdpa")
        model = LlamaForCausalLM(config)
    else:
        config = BamLlamaConfig(**SIZES, theta_beta_init="linear", **{"theta_alpha_init": -2.0, **overrides})
        model = BamLlamaForCausalLM(config)
    return CompiledModel(model) if case.endswith(COMPILED) else model


PEERS = ("llama compiled", "llama")


def peer(case: str, compiled_peer: str = "llama compiled") -> str:
    """The Llama case a case's ratio is taken to: compiled to `compiled_peer` (compiled Llama unless it cannot run
    the lengths asked), eager to eager."""
    return compiled_peer if case.endswith(COMPILED) else "llama"


class CompiledModel(torch.nn.Module):
    """`torch.compile(model, fullgraph=True, dynamic=False)`: one graph per shape, no graph break allowed. Decoding
    follows Transformers' static-cache recipe: the prompt is prefilled eagerly into a StaticCache (one per prompt
    length, reset and reused, as `generate` does: a new one would recompile), each step runs the compiled forward,
    whose position lives in the cache's length tensor."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.compiled = torch.compile(model, fullgraph=True, dynamic=False)
        self.caches = {}

    def forward(self, *args, **kwargs):
        return self.compiled(*args, **kwargs)

    def decode_cache(self, ids):
        """The prompt prefilled (eagerly) into this length's static cache: (cache, next token)."""
        length = ids.shape[1]
        if length not in self.caches:
            self.caches[length] = StaticCache(config=self.model.config, max_cache_len=length + DECODE_TOKENS + 1)
        cache = self.caches[length]
        cache.reset()
        with torch.no_grad():
            output = self.model(ids, **{CACHE_NAME: cache}, use_cache=True)
        return cache, output.logits[:, -1:].argmax(-1)


def input_ids(length: int) -> torch.Tensor:
    return torch.randint(3, SIZES["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))


def run_forward(model, ids):
    model.eval()
    with torch.no_grad():
        model(ids, use_cache=False)


def run_forward_backward(model, ids):
    model.train()
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()
    model.eval()


def prefill(model, ids):
    model.eval()
    if isinstance(model, CompiledModel):
        return model.decode_cache(ids)
    with torch.no_grad():
        output = model(ids, use_cache=True)
    return getattr(output, CACHE_NAME), output.logits[:, -1:].argmax(-1)


def run_decode(model, cache, next_token) -> float:
    """64 greedy steps against the cache; returns the seconds they took."""
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(DECODE_TOKENS):
            output = model(next_token, **{CACHE_NAME: cache}, use_cache=True)
            cache, next_token = getattr(output, CACHE_NAME), output.logits[:, -1:].argmax(-1)
    return time.perf_counter() - start


def run_eval_loop(model, ids):
    """`bam-eval`'s prompt loop: chunked prefill, then greedy decoding (as `run_retrieval` runs it)."""
    model.eval()
    with torch.inference_mode():
        greedy_continuation(model, ids[0].tolist(), EVAL_NEW_TOKENS, EVAL_CHUNK)


def timed(model, mode: str, ids) -> float:
    if mode == "decode":
        cache, next_token = prefill(model, ids)
        return run_decode(model, cache, next_token)
    step = {"fwd": run_forward, "fwd+bwd": run_forward_backward, "eval-loop": run_eval_loop}[mode]
    start = time.perf_counter()
    step(model, ids)
    return time.perf_counter() - start


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_rss_increase_mib(model, mode: str, ids) -> float:
    """Peak RSS during one run minus the RSS just before it (the decode mode includes its prefill)."""
    import gc

    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    timed(model, mode, ids)
    return (_status_kib("VmHWM") - before) / 1024


def machine_info() -> dict:
    return {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


def case_modes(case: str, modes) -> list[str]:
    """The modes a case runs: compiled cases have no eval-loop (a DynamicCache would recompile every chunk)."""
    return [mode for mode in modes if not (case.endswith(COMPILED) and mode == "eval-loop")]


def benchmark(lengths, repeats, cases, modes=DEFAULT_MODES) -> list[dict]:
    models = {case: build_model(case) for case in cases}
    rows = []
    for length in lengths:
        ids = input_ids(length)
        for case, model in models.items():  # warm-up: first calls allocate and pick kernels, or compile
            for mode in case_modes(case, modes) if isinstance(model, CompiledModel) else ["fwd"]:
                timed(model, mode, ids if isinstance(model, CompiledModel) else ids[:, :64])
        times = {(case, mode): [] for case in cases for mode in case_modes(case, modes)}
        for _ in range(repeats):
            for mode in modes:
                for case, model in models.items():
                    if mode in case_modes(case, modes):
                        times[case, mode].append(timed(model, mode, ids))
        for case in cases:
            for mode in case_modes(case, modes):
                seconds = times[case, mode]
                median = statistics.median(seconds)
                rows.append({"case": case, "mode": mode, "length": length, "seconds": seconds, "median_s": median})
            print(f"L={length} {case}: " + ", ".join(
                f"{r['mode']} {r['median_s']:.3f}s" for r in rows if r["case"] == case and r["length"] == length
            ), flush=True)
    return rows


def peak_memory(lengths, cases, modes=DEFAULT_MODES) -> dict:
    """{(case, mode, length): MiB}, one untimed run each, in this process (started with a fixed mmap threshold)."""
    models = {case: build_model(case) for case in cases if not case.endswith(COMPILED)}
    return {
        (case, mode, length): peak_rss_increase_mib(model, mode, input_ids(length))
        for length in lengths for case, model in models.items() for mode in modes
    }


def peak_memory_in_child(args) -> dict:
    """`peak_memory` in a child process with MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB: every large tensor is mmapped
    and returned to the system when freed, so the RSS of one run is that run's own (glibc's dynamic threshold
    would keep freed tensors in the heap). Timings run without it: a fixed threshold makes every large allocation
    page-fault, which is not what users run."""
    command = [sys.executable, __file__, "--memory-only", "--lengths", *map(str, args.lengths), "--modes", *args.modes]
    command += ["--cases", *[case for case in args.cases if not case.endswith(COMPILED)]]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
    output = subprocess.run(command, env=environment, check=True, capture_output=True, text=True).stdout
    return {tuple(entry["key"]): entry["mib"] for entry in json.loads(output)}


def markdown(rows, info, command, load, modes=DEFAULT_MODES, compiled_peer="llama compiled") -> str:
    llamas = {(r["case"], r["mode"], r["length"]): r["median_s"] for r in rows if r["case"] in PEERS}
    lines = [
        "# BamLlama against LlamaForCausalLM on CPU",
        "",
        f"Command: `{command}`  ",
        f"Date: {info['date']}  ",
        f"Machine: {info['cpu']}, {info['usable_cores']} usable cores of {info['logical_cores']}, "
        f"torch threads {info['torch_threads']}; load average before / after: {load[0]} / {load[1]}  ",
        f"Versions: python {info['python']}, torch {info['torch']}, transformers {info['transformers']}",
        "",
        "Sizes: 4 layers, hidden 256, 8 heads, 4 KV heads, intermediate 704, vocabulary 512, float32, batch 1. "
        "Median of interleaved repeats (spread min-max in the JSON); ratio = time / Llama's time at the same "
        f"mode and length (compiled cases: / {compiled_peer}'s). "
        f"decode = {DECODE_TOKENS} greedy tokens after an L-token prompt, in tokens/s (compiled: static cache). "
        f"eval-loop = bam-eval's prefill in chunks of {EVAL_CHUNK} and {EVAL_NEW_TOKENS} greedy tokens, in s. "
        "Peak memory = peak RSS increase of one run (MiB; not measured for compiled cases).",
        "",
        "| L | case | " + " | ".join(f"{mode} {MODE_UNITS[mode]} | ratio" for mode in modes)
        + f" | peak MiB {' / '.join(modes)} |",
        "|---:|---|" + "---:|---:|" * len(modes) + "---|",
    ]
    for length in sorted({r["length"] for r in rows}):
        for case in dict.fromkeys(r["case"] for r in rows):
            by_mode = {r["mode"]: r for r in rows if r["case"] == case and r["length"] == length}
            cells = []
            for mode in modes:
                if mode not in by_mode:  # a compiled case's eval-loop
                    cells += ["-", "-"]
                    continue
                median = by_mode[mode]["median_s"]
                value = _mode_value(mode, median)
                spread = by_mode[mode]["seconds"]
                value += f" ({min(spread) / median:.2f}-{max(spread) / median:.2f})" if len(spread) > 1 else ""
                reference = llamas.get((peer(case, compiled_peer), mode, length))
                cells += [value, f"{median / reference:.2f}x" if reference else "-"]
            peaks = " / ".join(_mib(by_mode[m]["peak_rss_increase_mib"]) if m in by_mode else "-" for m in modes)
            lines.append(f"| {length} | {case} | " + " | ".join(cells) + f" | {peaks} |")
    lines += ["", "Spread in parentheses: min and max of the repeats divided by the median."]
    return "\n".join(lines) + "\n"


MODE_UNITS = {"fwd": "ms", "fwd+bwd": "ms", "decode": "tok/s", "eval-loop": "s"}


def _mode_value(mode: str, seconds: float) -> str:
    if mode == "decode":
        return f"{DECODE_TOKENS / seconds:.0f}"
    return f"{seconds:.2f}" if mode == "eval-loop" else f"{seconds * 1000:.0f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as handle:
        handle.write(text)
    os.replace(handle.name, path)


def profile(length: int, case: str) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model, ids = build_model(case), input_ids(length)
    for mode, step in [("fwd", run_forward), ("fwd+bwd", run_forward_backward)]:
        step(model, ids)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            step(model, ids)
        print(f"== {case} {mode} L={length}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", help="default: 512 1024 2048 4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), help="default: all but the per-layer priors")
    parser.add_argument("--modes", nargs="+", choices=MODES, help=f"default: {' '.join(DEFAULT_MODES)}")
    parser.add_argument("--long", action="store_true", help=f"lengths {' '.join(map(str, LONG_LENGTHS))}, modes "
                        f"{' '.join(LONG_MODES)}, every eager case (each unless given)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "cpu-speed")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--profile", type=int, metavar="L", help="print a torch.profiler table instead")
    parser.add_argument("--profile-case", choices=list(CASES), default="bam+ssmax")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory passes (they double a run)")
    parser.add_argument("--compiled-peer", choices=PEERS, default="llama compiled",
                        help="the case compiled cases' ratios are taken to: 'llama' (eager) where compiled Llama does "
                        "not fit in memory (its graph holds the L x L mask: 9 GiB of RSS at 32K tokens)")
    parser.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)  # peak_memory_in_child
    args = parser.parse_args(argv)
    if cpu_kernels_enabled() and not fused_cpu_available():  # it would time blocked SDPA and call it the kernel
        parser.error("BAM's fused CPU kernel is not built for this installation: run bam-build-kernels first "
                     "(BAM_CPU_KERNELS=0 times blocked SDPA on purpose)")
    args.lengths = args.lengths or (LONG_LENGTHS if args.long else [512, 1024, 2048, 4096])
    args.modes = args.modes or list(LONG_MODES if args.long else DEFAULT_MODES)
    args.cases = args.cases or [case for case in (CASES if args.long else DEFAULT_CASES)
                                if not (args.long and case.endswith(COMPILED))]
    if any(length < 2 for length in args.lengths) or args.repeats < 1:
        parser.error("--lengths must be >= 2 and --repeats >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.memory_only:
        peaks = peak_memory(args.lengths, args.cases, args.modes)
        print(json.dumps([{"key": list(key), "mib": mib} for key, mib in peaks.items()]))
        return 0
    if args.profile is not None:
        profile(args.profile, args.profile_case)
        return 0
    for llama in dict.fromkeys(peer(case, args.compiled_peer) for case in args.cases):
        if llama not in args.cases:
            args.cases.insert(0, llama)
    torch._dynamo.config.cache_size_limit = 64  # a compiled case compiles each (mode, length)...
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # ...and never falls back to eager silently
    command = "python benchmarks/cpu_speed.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    load_before = os.getloadavg()[0]
    rows = benchmark(args.lengths, args.repeats, args.cases, args.modes)
    memory = {} if args.no_memory else peak_memory_in_child(args)
    for row in rows:
        row["peak_rss_increase_mib"] = memory.get((row["case"], row["mode"], row["length"]))
    info = {**machine_info(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    load = (f"{load_before:.2f}", f"{os.getloadavg()[0]:.2f}")
    report = {"command": command, "machine": info, "load_average": load, "sizes": SIZES, "rows": rows,
              "compiled_peer": args.compiled_peer}
    write_atomically(args.out.with_suffix(".json"), json.dumps(report, indent=1) + "\n")
    write_atomically(args.out.with_suffix(".md"), markdown(rows, info, command, load, args.modes, args.compiled_peer))
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
