"""The GPU check: everything the CPU suite cannot check, in one command, for the day a CUDA GPU is lent.

It needs no network and nothing beyond the package on a stock CUDA PyTorch image (`pip install --no-deps
--no-build-isolation -e .`; torch, Triton, Transformers, PEFT and Accelerate; no DeepSpeed, vLLM or gguf), and stays
under 10 minutes: every step runs in its own process with its own time limit (STEPS), and one that runs out of it
fails as timed out while the others go on.

    python benchmarks/gpu_check.py                              # writes benchmarks/results/gpu-check/: commit it
    python benchmarks/gpu_check.py --steps kernels autocast --out /tmp/gpu-check

Steps:
    environment  the GPU, the driver, and the versions of everything that ran
    gpu-tests    python -m pytest tests/model/test_triton_gpu.py (skipped where pytest is not installed)
    kernels      triton_bam.ggd_attention in fp32 / bf16 / fp16 against tests/reference.py's float64 attention:
                 the output and every gradient (q, k, v, the prior's three parameters, the SSMax scale) of a
                 left-padded prefill, and a decode step against a 16K-token cache
    autocast     a model's forward and backward under torch.autocast(bfloat16) on every attention path (eager,
                 sdpa, bam_triton), SSMax and padding on: every parameter's gradient against the fp32 run's
    pretrain     bam-pretrain --bf16 for a few steps of a small model on the standard library's documentation
    benchmark    benchmarks/attention.py: the kernels against SDPA (with and without a bias) and compiled
                 FlexAttention, a reduced sweep (--full-benchmark: the default one, which takes longer)

The results folder (summary.md, summary.json, each step's log and figures) is written beside its place and renamed
in when the run ends. Exit status: 0 every step that ran passed; 1 one failed, or no CUDA GPU was found (then
nothing runs and nothing is written); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "gpu-check"
# name -> time limit in seconds; together under 10 minutes
STEPS = {"environment": 30, "gpu-tests": 150, "kernels": 60, "autocast": 60, "pretrain": 90, "benchmark": 200}
REDUCED_BENCHMARK = ["--lengths", "2048", "16384", "--head-dims", "128", "--decode-lengths", "65536", "262144"]
KERNEL_TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}  # output; gradients: 5x
AUTOCAST_TOLERANCE = 5e-2  # relative error of a bf16-autocast gradient against fp32's, per tensor
PACKAGES = ("torch", "triton", "transformers", "peft", "accelerate", "safetensors", "pytest", "datasets", "deepspeed",
            "vllm", "gguf")


@dataclass
class StepResult:
    name: str
    status: str  # passed, failed, skipped
    summary: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ the steps


def environment_step(work: Path) -> StepResult:
    import torch

    versions = {name: _version(name) for name in PACKAGES}
    properties = torch.cuda.get_device_properties(0)
    figures = {
        "gpu": torch.cuda.get_device_name(0),
        "capability": f"sm_{properties.major}{properties.minor}",
        "memory_gib": round(properties.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "driver": _nvidia_smi("driver_version"),
        "python": platform.python_version(),
        "versions": versions,
    }
    return StepResult("environment", "passed", f"{figures['gpu']} ({figures['capability']}), CUDA {figures['cuda']}, "
                      f"torch {versions['torch']}, triton {versions['triton']}, transformers {versions['transformers']}",
                      figures=figures)


def gpu_tests_step(work: Path) -> StepResult:
    if importlib.util.find_spec("pytest") is None:
        return StepResult("gpu-tests", "skipped", "pytest is not installed: tests/model/test_triton_gpu.py not run "
                          "(the kernels step compares the same kernels with the reference)")
    log = work / "gpu-tests.log"
    command = [sys.executable, "-m", "pytest", "tests/model/test_triton_gpu.py", "-q", "-p", "no:cacheprovider", "-rs"]
    returncode = _run_logged(command, log, timeout=STEPS["gpu-tests"] - 10)
    last = _last_line(log)
    return StepResult("gpu-tests", "passed" if returncode == 0 else "failed", last, figures={"log": log.name})


def kernels_step(work: Path) -> StepResult:
    import torch

    sys.path.insert(0, str(REPO_ROOT / "tests"))
    import reference

    from bam_llama.model import triton_bam

    rows, failures = [], []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for head_dim in (64, 128):
            if not triton_bam.head_dim_supported(head_dim, dtype):
                continue
            for case, errors in (("prefill", _prefill_errors(triton_bam, reference, dtype, head_dim)),
                                 ("decode", _decode_errors(triton_bam, reference, dtype, head_dim))):
                tolerance = KERNEL_TOLERANCE[str(dtype).removeprefix("torch.")]
                bad = [name for name, error in errors.items()
                       if not error < (tolerance if name == "output" else 5 * tolerance)]
                rows.append({"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim, "case": case,
                             "relative_errors": errors, "tolerance": tolerance, "failed": bad})
                failures += [f"{rows[-1]['dtype']} d={head_dim} {case}: {name}" for name in bad]
    worst = max(error for row in rows for error in row["relative_errors"].values())
    summary = f"{len(rows)} cases, worst relative error {worst:.1e}" + (f"; out of tolerance: {failures}" if failures else "")
    return StepResult("kernels", "failed" if failures else "passed", summary, figures={"cases": rows})


def autocast_step(work: Path) -> StepResult:
    rows, failures = {}, []
    for implementation in ("eager", "sdpa", "bam_triton"):
        try:
            errors = _autocast_gradient_errors(implementation)
        except Exception as error:  # a path that crashes under autocast is this step's finding
            rows[implementation] = {"error": f"{type(error).__name__}: {error}"[:500]}
            failures.append(f"{implementation}: {type(error).__name__}")
            continue
        worst = max(errors, key=errors.get)
        rows[implementation] = {"worst_tensor": worst, "worst_relative_error": errors[worst], "relative_errors": errors}
        if not errors[worst] < AUTOCAST_TOLERANCE:
            failures.append(f"{implementation}: {worst} {errors[worst]:.1e}")
    summary = "; ".join(
        f"{name} {row['worst_relative_error']:.1e}" if "error" not in row else f"{name} {row['error'][:80]}"
        for name, row in rows.items()
    )
    return StepResult("autocast", "failed" if failures else "passed", f"worst gradient error vs fp32: {summary}",
                      figures={"tolerance": AUTOCAST_TOLERANCE, "paths": rows})


def pretrain_step(work: Path) -> StepResult:
    corpus = work / "pretrain-corpus.txt"
    corpus.write_text(_documentation_corpus())
    run = Path(tempfile.mkdtemp(prefix="gpu-check-pretrain-"))
    log = work / "pretrain.log"
    returncode = _run_logged(pretrain_command(corpus, run / "out"), log, timeout=STEPS["pretrain"] - 10)
    summary_file = run / "out" / "summary.json"
    figures = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    figures["log"] = log.name
    finite = all(isinstance(figures.get(key), (int, float)) and figures[key] == figures[key]  # not NaN
                 for key in ("loss_before", "loss_after"))
    passed = returncode == 0 and finite
    detail = (f"held-out loss {figures['loss_before']:.3f} -> {figures['loss_after']:.3f}" if finite
              else f"exit status {returncode}: {_last_line(log)}")
    return StepResult("pretrain", "passed" if passed else "failed", detail, figures=figures)


def benchmark_step(work: Path, full: bool = False) -> StepResult:
    log = work / "attention.log"
    returncode = _run_logged(benchmark_command(work / "attention.md", full), log, timeout=STEPS["benchmark"] - 10)
    return StepResult("benchmark", "passed" if returncode == 0 else "failed",
                      "attention.md / attention.json" if returncode == 0 else _last_line(log),
                      figures={"log": log.name, "sweep": "full" if full else " ".join(REDUCED_BENCHMARK)})


STEP_FUNCTIONS = {"environment": environment_step, "gpu-tests": gpu_tests_step, "kernels": kernels_step,
                  "autocast": autocast_step, "pretrain": pretrain_step, "benchmark": benchmark_step}


def pretrain_command(corpus: Path, output_dir: Path) -> list[str]:
    return [sys.executable, "-m", "bam_llama.cli.pretrain", "--data", str(corpus), "--output-dir", str(output_dir),
            "--hidden-size", "128", "--layers", "2", "--heads", "4", "--context-length", "256", "--ssmax",
            "--max-steps", "30", "--per-device-train-batch-size", "8", "--bf16", "--save-steps", "1000",
            "--logging-steps", "10", "--report-to", "none", "--disable-progress-bars"]


def benchmark_command(out: Path, full: bool) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "benchmarks" / "attention.py"), "--out", str(out),
            *([] if full else REDUCED_BENCHMARK)]


# ------------------------------------------------------------------------------------------------ the comparisons


def _random_problem(torch, batch, heads, kv_heads, q_len, k_len, head_dim, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def tensor(num_heads, length):
        storage = torch.randn(batch, length, num_heads, head_dim, generator=generator, device="cuda")
        return storage.to(dtype).transpose(1, 2)

    inputs = [tensor(heads, q_len), tensor(kv_heads, k_len), tensor(kv_heads, k_len)]
    params = [torch.rand(heads, generator=generator, device="cuda") * 2 - 1.5,  # theta_alpha
              torch.linspace(-2.0, 2.0, heads, device="cuda"),  # theta_beta, negative included
              torch.rand(heads, generator=generator, device="cuda") - 0.5,  # theta_mu
              0.8 + 0.4 * torch.rand(heads, generator=generator, device="cuda")]  # SSMax scale
    return inputs, params


def _relative_error(actual, expected) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-12))


def _prefill_errors(triton_bam, reference, dtype, head_dim) -> dict[str, float]:
    import torch

    batch, heads, kv_heads, length = 2, 8, 2, 1029  # not a multiple of any block size
    inputs, params = _random_problem(torch, batch, heads, kv_heads, length, length, head_dim, dtype)
    positions = torch.arange(length, device="cuda")
    key_valid = torch.ones(batch, length, dtype=torch.bool, device="cuda")
    key_valid[1, :300] = False  # left padding
    scaling = head_dim**-0.5
    grad_output = torch.randn(batch, heads, length, head_dim, device="cuda")

    def fused(query, key, value, *prior):
        return triton_bam.ggd_attention(query, key, value, *prior[:3], positions, scaling=scaling,
                                        key_valid=key_valid, ssmax_scale=prior[3])

    def plain(query, key, value, *prior):
        return reference.bam_attention(query, key, value, positions, *prior[:3], scaling=scaling,
                                       ssmax_scale=prior[3], key_valid=key_valid)

    expected = _with_gradients(plain, [t.double() for t in inputs] + [p.double() for p in params], grad_output)
    actual = _with_gradients(fused, inputs + params, grad_output)
    names = ["output", "dq", "dk", "dv", "d theta_alpha", "d theta_beta", "d theta_mu", "d ssmax_scale"]
    return {name: _relative_error(got, want) for name, got, want in zip(names, actual, expected)}


def _decode_errors(triton_bam, reference, dtype, head_dim) -> dict[str, float]:
    import torch

    k_len = 16_384
    inputs, params = _random_problem(torch, 1, 8, 2, 4, k_len, head_dim, dtype)
    positions = torch.arange(k_len - 4, k_len, device="cuda")
    with torch.no_grad():
        actual = triton_bam.ggd_attention(*inputs, *params[:3], positions, scaling=head_dim**-0.5, ssmax_scale=params[3])
        expected = reference.bam_attention(*[t.double() for t in inputs], positions, *[p.double() for p in params[:3]],
                                           scaling=head_dim**-0.5, ssmax_scale=params[3].double())
    return {"output": _relative_error(actual, expected)}


def _with_gradients(attention, tensors, grad_output):
    leaves = [tensor.detach().clone().requires_grad_() for tensor in tensors]
    output = attention(*leaves)
    (output.double() * grad_output.double()).sum().backward()
    return [output.detach()] + [leaf.grad for leaf in leaves]


def _autocast_gradient_errors(implementation: str) -> dict[str, float]:
    import torch

    from bam_llama import BamLlamaConfig, BamLlamaForCausalLM

    config = BamLlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, ssmax=True, train_context_length=512)
    torch.manual_seed(0)
    input_ids = torch.randint(3, 512, (2, 300), device="cuda")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :57] = 0  # left padding
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    gradients = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = BamLlamaForCausalLM(config).to("cuda").train()
        model.set_attn_implementation(implementation)
        _randomize_prior(torch, model)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(input_ids, attention_mask=attention_mask, labels=labels, use_cache=False).loss
        loss.backward()
        gradients[precision] = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    missing = set(gradients["fp32"]) - set(gradients["bf16"])
    if missing:
        raise RuntimeError(f"no gradient under autocast for {sorted(missing)}")
    return {name: _relative_error(gradients["bf16"][name], expected) for name, expected in gradients["fp32"].items()}


def _randomize_prior(torch, model) -> None:
    """Non-trivial prior and SSMax values (negative beta, non-zero mu) on every head."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            heads = tensor.numel()
            values = {"theta_alpha": torch.rand(heads, generator=generator) * 2 - 1.5,
                      "theta_beta": torch.linspace(-0.5, 1.2, heads),
                      "theta_mu": torch.rand(heads, generator=generator) - 0.5,
                      "ssmax.scale": 0.8 + 0.4 * torch.rand(heads, generator=generator)}
            for suffix, value in values.items():
                if name.endswith(suffix):
                    tensor.copy_(value)


def _documentation_corpus() -> str:
    """The standard library's own documentation topics: real text that ships with Python (no download)."""
    from pydoc_data.topics import topics

    return "\n\n".join(text.strip() for text in topics.values()) + "\n"


# ------------------------------------------------------------------------------------------------ running


def run_step(name: str, work: Path, full_benchmark: bool) -> StepResult:
    """One step in its own process, within its time limit."""
    result_file = work / f".{name}.result.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--run-step", name, "--work", str(work)]
    command += ["--full-benchmark"] if full_benchmark else []
    started = time.perf_counter()
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    try:
        completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                   timeout=STEPS[name])
    except subprocess.TimeoutExpired:
        return StepResult(name, "failed", f"timed out after {STEPS[name]} s", time.perf_counter() - started)
    seconds = time.perf_counter() - started
    if completed.returncode != 0 or not result_file.exists():
        (work / f"{name}.stderr.log").write_text(completed.stdout + completed.stderr)
        last = (completed.stderr.strip().splitlines() or ["no output"])[-1]
        return StepResult(name, "failed", f"crashed (exit status {completed.returncode}): {last}", seconds,
                          {"log": f"{name}.stderr.log"})
    result = StepResult(**json.loads(result_file.read_text()))
    result_file.unlink()
    result.seconds = seconds
    return result


def step_worker(name: str, work: Path, full_benchmark: bool) -> int:
    function = STEP_FUNCTIONS[name]
    result = function(work, full_benchmark) if name == "benchmark" else function(work)
    (work / f".{name}.result.json").write_text(json.dumps(asdict(result), default=str))
    return 0


def write_report(results: list[StepResult], folder: Path, command: list[str]) -> None:
    """summary.md (a table of the steps, then each step's figures) and summary.json."""
    started = datetime.datetime.now().isoformat(timespec="seconds")
    environment = next((r.figures for r in results if r.name == "environment" and r.status == "passed"), {})
    lines = ["# GPU check", "", f"`{' '.join(command)}`, {started}, {environment.get('gpu', 'GPU unknown')}", "",
             "| step | status | seconds | result |", "|---|---|---|---|"]
    for result in results:
        lines.append(f"| {result.name} | {result.status} | {result.seconds:.0f} | {result.summary} |")
    for result in results:
        if result.figures:
            lines += ["", f"## {result.name}", "", "```json", json.dumps(result.figures, indent=1, default=str), "```"]
    (folder / "summary.md").write_text("\n".join(lines) + "\n")
    (folder / "summary.json").write_text(json.dumps(
        {"command": command, "date": started, "steps": [asdict(result) for result in results]}, indent=1, default=str))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        epilog="steps (time limit): " + ", ".join(f"{name} ({limit} s)" for name, limit in STEPS.items()),
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="results folder, replaced when the run ends (default: benchmarks/results/gpu-check)")
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS), metavar="STEP",
                        help=f"the steps to run, in this order: {' '.join(STEPS)} (default: all)")
    parser.add_argument("--full-benchmark", action="store_true",
                        help="benchmarks/attention.py's default sweep instead of the reduced one (beyond 10 minutes)")
    parser.add_argument("--run-step", choices=list(STEPS), help=argparse.SUPPRESS)  # a step's own process
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file, not a folder")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_step:
        return step_worker(args.run_step, args.work, args.full_benchmark)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU found (torch.cuda.is_available() is False): every step needs one; nothing run, "
              "nothing written", file=sys.stderr)
        for name in args.steps:
            print(f"skipped  {name}: no CUDA GPU")
        return 1
    if importlib.util.find_spec("triton") is None:
        print("gpu_check: Triton is not installed: the fused kernels cannot run", file=sys.stderr)
        return 1
    from bam_llama.files.outputs import staged_output_dir

    command = ["python", "benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]
    results = []
    with staged_output_dir(args.out, force=True) as work:
        for name in [step for step in STEPS if step in args.steps]:
            result = run_step(name, work, args.full_benchmark)
            print(f"{result.status:8s} {name} ({result.seconds:.0f} s): {result.summary}", flush=True)
            results.append(result)
        write_report(results, work, command)
    print(f"wrote {args.out}")
    return 0 if all(result.status != "failed" for result in results) else 1


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi(query: str) -> str | None:
    try:
        output = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return output.stdout.strip().splitlines()[0] if output.returncode == 0 and output.stdout.strip() else None


def _run_logged(command: list[str], log: Path, timeout: float) -> int:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    with log.open("w") as handle:
        try:
            return subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            handle.write(f"\ntimed out after {timeout:.0f} s\n")
            return -1


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "no output"


if __name__ == "__main__":
    sys.exit(main())
