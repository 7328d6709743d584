"""Benchmark of GGD-BAM attention: the fused Triton kernels against materialized-bias baselines.

One run on one GPU measures milliseconds, TFLOP/s and peak memory of

    triton (bias off)            triton_bam.ggd_attention with a vanishing prior (theta_alpha = -30)
    triton (bias on)             ... with the GGD prior
    triton (bias on + SSMax)     ... with the prior and Scalable-Softmax
    eager materialized bias      reference_bam.bam_attention_reference (mask, prior and softmax materialized)
    SDPA float-mask bias         reference_bam.bam_attention_sdpa (prior passed as an L x L float mask)
    FlexAttention (compiled)     torch.compile(flex_attention) with a score_mod computing the same prior
    SDPA no bias (ceiling)       F.scaled_dot_product_attention(is_causal=True)

for the forward and forward + backward passes (bf16, causal, 16K tokens per batch, lengths 1K..64K, head sizes
64 and 128), then a decode sweep (one new token against a 4K..512K cache) in GB/s and % of the HBM peak.
Every provider is checked against the reference on a small shape before it is timed; a provider that fails
the check is not timed, one that runs out of memory is reported as OOM.

    python benchmarks/attention.py                       # full run, writes benchmarks/results/<device>-<date>.md
    python benchmarks/attention.py --lengths 1024 4096 --head-dims 128 --no-decode
    python benchmarks/attention.py --smoke               # CPU: the correctness checks on a tiny shape, interpreted

FLOP counts follow FlashAttention's convention: forward 4 * B * H * D * L^2 / 2 for causal attention,
forward + backward 3.5 times that.
"""

import argparse
import datetime
import json
import math
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bam_llama.model import prior_bam, reference_bam  # noqa: E402

PEAK_BANDWIDTH_GBPS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0}
MODES = ("fwd", "fwd+bwd")
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}


# ------------------------------------------------------------------------------------------------ problems


@dataclass
class Prior:
    """Per-head GGD prior parameters and the optional SSMax scale for one setting."""

    theta_alpha: torch.Tensor
    theta_beta: torch.Tensor
    theta_mu: torch.Tensor
    ssmax_scale: Optional[torch.Tensor] = None

    def parameters(self) -> list[torch.Tensor]:
        return [p for p in (self.theta_alpha, self.theta_beta, self.theta_mu, self.ssmax_scale) if p is not None]


def make_prior(setting: str, heads: int, device, requires_grad: bool) -> Prior:
    """'off': a vanishing prior (exp(-30) ~ 1e-13), 'on': GGD prior, 'ssmax': prior and SSMax."""
    theta_alpha = torch.full((heads,), -30.0) if setting == "off" else torch.linspace(-1.5, 0.5, heads)
    theta_beta = torch.linspace(-0.5, 1.2, heads)
    theta_mu = torch.linspace(-0.4, 0.4, heads)
    ssmax_scale = torch.linspace(0.8, 1.2, heads) if setting == "ssmax" else None
    tensors = [t.to(device).requires_grad_(requires_grad) if t is not None else None
               for t in (theta_alpha, theta_beta, theta_mu, ssmax_scale)]
    return Prior(*tensors)


@dataclass
class Problem:
    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    dtype: torch.dtype
    device: str

    @property
    def scaling(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.k_len - self.q_len, self.k_len, device=self.device)

    def inputs(self, requires_grad: bool, seed: int = 0) -> list[torch.Tensor]:
        generator = torch.Generator(device=self.device).manual_seed(seed)
        shapes = [(self.batch, self.heads, self.q_len, self.head_dim)] + 2 * [
            (self.batch, self.kv_heads, self.k_len, self.head_dim)
        ]
        return [
            torch.randn(shape, generator=generator, device=self.device, dtype=self.dtype).requires_grad_(requires_grad)
            for shape in shapes
        ]

    def causal_flops(self, mode: str) -> float:
        forward = 4.0 * self.batch * self.heads * self.head_dim * self.q_len * self.k_len / 2
        return forward * (3.5 if mode == "fwd+bwd" else 1.0)

    def cache_bytes(self) -> int:
        return 2 * self.batch * self.kv_heads * self.k_len * self.head_dim * torch.finfo(self.dtype).bits // 8


# ----------------------------------------------------------------------------------------------- providers


def materialized_inputs(problem: Problem, prior: Prior):
    """Mask (1, 1, Lq, Lk), prior (H, Lq, Lk) and SSMax factor (1, H, Lq, 1) as the eager paths build them."""
    positions = problem.positions
    visible = prior_bam.visibility_from_positions(positions, problem.k_len)
    distance = prior_bam.relative_distance(positions, problem.k_len)
    bias = prior_bam.ggd_bias(distance, prior.theta_alpha, prior.theta_beta, prior.theta_mu)
    row_factor = None
    if prior.ssmax_scale is not None:
        counts = prior_bam.visible_key_counts(positions, problem.k_len)
        row_factor = prior_bam.ssmax_factor(counts, prior.ssmax_scale)
    return visible, bias, row_factor


def triton_provider(problem: Problem, prior: Prior, num_splits: Optional[int] = None) -> Callable:
    from bam_llama.model.triton_bam import ggd_attention

    def run(query, key, value):
        return ggd_attention(
            query, key, value, prior.theta_alpha, prior.theta_beta, prior.theta_mu, problem.positions,
            scaling=problem.scaling, ssmax_scale=prior.ssmax_scale, num_splits=num_splits,
        )

    return run


def eager_provider(problem: Problem, prior: Prior) -> Callable:
    def run(query, key, value):
        visible, bias, row_factor = materialized_inputs(problem, prior)
        return reference_bam.bam_attention_reference(query, key, value, visible, bias, problem.scaling, row_factor)[0]

    return run


def sdpa_mask_provider(problem: Problem, prior: Prior) -> Callable:
    def run(query, key, value):
        visible, bias, row_factor = materialized_inputs(problem, prior)
        return reference_bam.bam_attention_sdpa(query, key, value, visible, bias, problem.scaling, row_factor)

    return run


def sdpa_plain_provider(problem: Problem, prior: Prior) -> Callable:
    """The ceiling: causal SDPA without any bias (the 'off' prior is ~0, so it matches the reference)."""
    causal = problem.q_len == problem.k_len

    def run(query, key, value):
        if not causal:  # decode: one query at the end of the cache sees every key
            return F.scaled_dot_product_attention(query, key, value, scale=problem.scaling,
                                                  enable_gqa=problem.heads != problem.kv_heads)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=problem.scaling,
                                              enable_gqa=problem.heads != problem.kv_heads)

    return run


def flex_provider(problem: Problem, prior: Prior, compiled: bool = True) -> Callable:
    """FlexAttention: causal block mask, the GGD prior (and SSMax) in a score_mod. The block mask is built once,
    outside the timed call, as a model would cache it."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    offset = problem.k_len - problem.q_len
    alpha_scale = prior.theta_alpha.detach().float().exp()
    beta = prior.theta_beta.detach().float()
    mu = prior_bam.prior_offset(prior.theta_mu.detach().float())
    row_factor = None
    if prior.ssmax_scale is not None:
        counts = prior_bam.visible_key_counts(problem.positions, problem.k_len)
        row_factor = prior_bam.ssmax_factor(counts, prior.ssmax_scale.detach())[0, :, :, 0]  # (H, Lq)

    def causal(batch, head, q_index, kv_index):
        return kv_index <= q_index + offset

    def score_mod(score, batch, head, q_index, kv_index):
        shifted = (kv_index - q_index - offset).to(torch.float32) - mu[head]
        bias = -alpha_scale[head] * (shifted.abs() + 1e-5) ** beta[head]
        if row_factor is None:
            return score + bias
        return (score + bias) * row_factor[head, q_index]

    block_mask = create_block_mask(causal, None, None, problem.q_len, problem.k_len, device=problem.device)
    attention = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def run(query, key, value):
        return attention(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=problem.scaling,
                         enable_gqa=problem.heads != problem.kv_heads)

    return run


@dataclass
class Provider:
    name: str
    build: Callable  # (problem, prior) -> run(query, key, value)
    setting: str  # prior setting: off / on / ssmax
    backward: bool = True  # whether fwd+bwd is measured
    prior_grads: bool = True  # whether the prior parameters get gradients in fwd+bwd


PROVIDERS = [
    Provider("triton (bias off)", triton_provider, "off"),
    Provider("triton (bias on)", triton_provider, "on"),
    Provider("triton (bias on + SSMax)", triton_provider, "ssmax"),
    Provider("eager materialized bias", eager_provider, "on"),
    Provider("SDPA float-mask bias", sdpa_mask_provider, "on"),
    Provider("FlexAttention (compiled)", flex_provider, "on", prior_grads=False),
    Provider("SDPA no bias (ceiling)", sdpa_plain_provider, "off", prior_grads=False),
]
DECODE_PROVIDERS = [p for p in PROVIDERS if p.name != "FlexAttention (compiled)"]


# ------------------------------------------------------------------------------------------ correctness


def check_provider(provider: Provider, problem: Problem, build: Optional[Callable] = None,
                   backward: bool = True) -> float:
    """Largest error of the output (and of dq, dk, dv when `backward`) against the fp32 reference, relative to
    the reference's scale; raises AssertionError above the tolerance of the problem's dtype."""
    prior = make_prior(provider.setting, problem.heads, problem.device, requires_grad=False)
    inputs = problem.inputs(requires_grad=backward)
    reference_inputs = [x.detach().float().requires_grad_(backward) for x in inputs]
    expected = eager_provider(problem, prior)(*reference_inputs)
    actual = (build or provider.build)(problem, prior)(*inputs)
    errors = [relative_error(actual, expected)]
    if backward:
        grad_output = torch.randn_like(expected)
        expected_grads = torch.autograd.grad(expected, reference_inputs, grad_output)
        actual_grads = torch.autograd.grad(actual, inputs, grad_output.to(actual.dtype))
        errors += [relative_error(a, e) for a, e in zip(actual_grads, expected_grads)]
    error = max(errors)
    if not error <= CHECK_TOLERANCE[problem.dtype]:
        raise AssertionError(f"{provider.name}: error {error:.2e} against the reference")
    return error


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = max(1.0, expected.abs().max().item())
    return ((actual.float() - expected.float()).abs().max() / scale).item()


def run_smoke(device: str = "cpu") -> dict[str, float]:
    """The correctness check of every provider on a tiny shape; on CPU the Triton kernels are interpreted and
    FlexAttention runs uncompiled, forward only. Returns {provider: error}."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    problem = Problem(batch=1, heads=4, kv_heads=2, q_len=24, k_len=24, head_dim=32, dtype=torch.float32,
                      device=device)
    errors = {}
    for provider in PROVIDERS:
        build, backward = provider.build, True
        if provider.build is flex_provider and device == "cpu":
            build, backward = (lambda problem, prior: flex_provider(problem, prior, compiled=False)), False
        errors[provider.name] = check_provider(provider, problem, build, backward)
    decode = Problem(batch=1, heads=4, kv_heads=2, q_len=1, k_len=40, head_dim=32, dtype=torch.float32,
                     device=device)
    split_kv = Provider("triton decode (3 splits)", lambda problem, prior: triton_provider(problem, prior, 3), "on")
    errors[split_kv.name] = check_provider(split_kv, decode, backward=False)
    return errors


# --------------------------------------------------------------------------------------------- measuring


@dataclass
class Result:
    section: str  # "prefill" or "decode"
    mode: str
    provider: str
    head_dim: int
    length: int
    batch: int
    status: str = "ok"  # ok, OOM, check failed, error
    ms: Optional[float] = None
    tflops: Optional[float] = None
    gbps: Optional[float] = None
    peak_bandwidth_percent: Optional[float] = None
    peak_memory_gib: Optional[float] = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def benchmark_ms(function: Callable, grad_to_none: list[torch.Tensor]) -> float:
    import triton.testing

    return triton.testing.do_bench(function, warmup=10, rep=50, grad_to_none=grad_to_none, return_mode="median")


def measure(provider: Provider, problem: Problem, mode: str) -> tuple[float, float]:
    """(median ms, peak GiB above the inputs) of one provider on one problem."""
    backward = mode == "fwd+bwd"
    prior = make_prior(provider.setting, problem.heads, problem.device,
                       requires_grad=backward and provider.prior_grads)
    inputs = problem.inputs(requires_grad=backward)
    run = provider.build(problem, prior)
    leaves = inputs + (prior.parameters() if backward and provider.prior_grads else [])
    grad_output = torch.randn(problem.batch, problem.heads, problem.q_len, problem.head_dim, device=problem.device,
                              dtype=problem.dtype)

    def step():
        output = run(*inputs)
        if backward:
            output.backward(grad_output)

    step()  # compile / autotune outside the measurement
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - baseline) / 2**30
    return benchmark_ms(step, leaves), peak_gib


def timed_result(provider: Provider, problem: Problem, mode: str, section: str, checked: dict) -> Result:
    result = Result(section, mode, provider.name, problem.head_dim, problem.k_len, problem.batch)
    if checked.get(provider.name) is not None:
        result.status, result.note = "check failed", checked[provider.name]
        return result
    try:
        result.ms, result.peak_memory_gib = measure(provider, problem, mode)
    except Exception as error:  # noqa: BLE001 - every failure becomes a row of the table
        result.status = "OOM" if is_out_of_memory(error) else "error"
        result.note = "" if result.status == "OOM" else f"{type(error).__name__}: {str(error)[:120]}"
    finally:
        torch.cuda.empty_cache()
    if result.ms is not None:
        if section == "prefill":
            result.tflops = problem.causal_flops(mode) / (result.ms * 1e-3) / 1e12
        else:
            result.gbps = problem.cache_bytes() / (result.ms * 1e-3) / 1e9
    return result


def check_all(providers: list[Provider], problem: Problem, backward: bool) -> dict[str, Optional[str]]:
    """{provider: None if it matches the reference, else the reason}; printed as it goes."""
    outcome = {}
    for provider in providers:
        try:
            error = check_provider(provider, problem, backward=backward and provider.backward)
            outcome[provider.name] = None
            print(f"  check {provider.name:28s} ok (max relative error {error:.1e})", flush=True)
        except Exception as failure:  # noqa: BLE001
            outcome[provider.name] = f"{type(failure).__name__}: {str(failure)[:200]}"
            print(f"  check {provider.name:28s} FAILED {outcome[provider.name]}", flush=True)
        torch.cuda.empty_cache()
    return outcome


def prefill_sweep(args, heads_for: Callable[[int], tuple[int, int]]) -> list[Result]:
    results = []
    for head_dim in args.head_dims:
        heads, kv_heads = heads_for(head_dim)
        small = Problem(2, heads, kv_heads, 256, 256, head_dim, torch.bfloat16, "cuda")
        print(f"prefill, head size {head_dim}: checking providers on {small}", flush=True)
        checked = check_all(PROVIDERS, small, backward=True)
        for mode in args.modes:
            for length in args.lengths:
                batch = max(1, args.tokens // length)
                problem = Problem(batch, heads, kv_heads, length, length, head_dim, torch.bfloat16, "cuda")
                for provider in PROVIDERS:
                    if mode == "fwd+bwd" and not provider.backward:
                        continue
                    result = timed_result(provider, problem, mode, "prefill", checked)
                    print(format_line(result), flush=True)
                    results.append(result)
    return results


def decode_sweep(args, peak_gbps: Optional[float]) -> list[Result]:
    results = []
    head_dim, heads, kv_heads = args.decode_head_dim, args.decode_heads, args.decode_kv_heads
    small = Problem(1, heads, kv_heads, 1, 4096, head_dim, torch.bfloat16, "cuda")
    print(f"decode: checking providers on {small}", flush=True)
    checked = check_all(DECODE_PROVIDERS, small, backward=False)
    for length in args.decode_lengths:
        problem = Problem(args.decode_batch, heads, kv_heads, 1, length, head_dim, torch.bfloat16, "cuda")
        for provider in DECODE_PROVIDERS:
            result = timed_result(provider, problem, "fwd", "decode", checked)
            if result.gbps is not None and peak_gbps:
                result.peak_bandwidth_percent = 100.0 * result.gbps / peak_gbps
            print(format_line(result), flush=True)
            results.append(result)
    return results


# ------------------------------------------------------------------------------------------------ report


def peak_bandwidth(device_name: str) -> Optional[float]:
    for key, value in PEAK_BANDWIDTH_GBPS.items():  # most specific names first
        if key in device_name:
            return value
    return None


def format_line(result: Result) -> str:
    if result.status != "ok":
        return f"  {result.section:7s} {result.mode:7s} L={result.length:<7d} {result.provider:28s} {result.status}"
    rate = f"{result.tflops:7.1f} TFLOP/s" if result.tflops is not None else f"{result.gbps:7.0f} GB/s"
    return (f"  {result.section:7s} {result.mode:7s} L={result.length:<7d} {result.provider:28s} "
            f"{result.ms:9.3f} ms {rate} {result.peak_memory_gib:7.2f} GiB")


def cell(result: Result, metric: str) -> str:
    if result.status != "ok":
        return result.status
    value = getattr(result, metric)
    return "n/a" if value is None else f"{value:.3f}" if metric == "ms" else f"{value:.1f}"


def markdown_report(results: list[Result], metadata: dict) -> str:
    lines = [f"# GGD-BAM attention benchmark: {metadata['device']}", ""]
    lines += [f"- {key}: {value}" for key, value in metadata.items()]
    for section, metrics in (("prefill", ("ms", "tflops", "peak_memory_gib")),
                             ("decode", ("ms", "gbps", "peak_bandwidth_percent", "peak_memory_gib"))):
        rows = [r for r in results if r.section == section]
        for mode in dict.fromkeys(r.mode for r in rows):
            for head_dim in dict.fromkeys(r.head_dim for r in rows):
                subset = [r for r in rows if r.mode == mode and r.head_dim == head_dim]
                providers = list(dict.fromkeys(r.provider for r in subset))
                lines += ["", f"## {section} {mode}, head size {head_dim}", ""]
                header = ["L", "batch", "provider", *metrics]
                lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                for r in sorted(subset, key=lambda r: (r.length, providers.index(r.provider))):
                    values = [str(r.length), str(r.batch), r.provider, *(cell(r, m) for m in metrics)]
                    lines.append("| " + " | ".join(values) + " |")
    notes = [r for r in results if r.note]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {r.section} {r.mode} L={r.length} {r.provider}: {r.note}" for r in notes]
    return "\n".join(lines) + "\n"


def default_output_path(device_name: str) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in device_name).strip("-").lower()
    return REPO_ROOT / "benchmarks" / "results" / f"{slug}-{datetime.date.today().isoformat()}.md"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="markdown output; the JSON goes beside it "
                        "(default benchmarks/results/<device>-<date>.md)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per batch (batch = tokens // length)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--model-dim", type=int, default=2048, help="query heads = model-dim // head size")
    parser.add_argument("--kv-group", type=int, default=1, help="query heads per key/value head (GQA)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--no-decode", action="store_true", help="skip the decode sweep")
    parser.add_argument("--decode-lengths", type=int, nargs="+",
                        default=[4096, 16384, 65536, 131072, 262144, 524288])
    parser.add_argument("--decode-batch", type=int, default=1)
    parser.add_argument("--decode-heads", type=int, default=32)
    parser.add_argument("--decode-kv-heads", type=int, default=8)
    parser.add_argument("--decode-head-dim", type=int, default=128)
    parser.add_argument("--smoke", action="store_true",
                        help="only run every provider's correctness check on a tiny shape (CPU, interpreted)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        for name, error in run_smoke("cpu").items():
            print(f"{name:28s} ok (max relative error {error:.1e})")
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA GPU (use --smoke for the CPU correctness check)")
        return 1
    torch._dynamo.config.cache_size_limit = 256  # one FlexAttention compile per shape

    device_name = torch.cuda.get_device_name()
    peak_gbps = peak_bandwidth(device_name)

    def heads_for(head_dim):
        heads = args.model_dim // head_dim
        return heads, max(1, heads // args.kv_group)

    results = prefill_sweep(args, heads_for)
    if not args.no_decode:
        results += decode_sweep(args, peak_gbps)

    import triton

    metadata = {
        "device": device_name,
        "peak bandwidth (GB/s)": peak_gbps,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": "bfloat16",
        "prefill": f"causal, {args.tokens} tokens per batch, model dim {args.model_dim}, kv group {args.kv_group}",
        "decode": f"1 query, batch {args.decode_batch}, {args.decode_heads} heads / {args.decode_kv_heads} kv heads, "
                  f"head size {args.decode_head_dim}; GB/s counts the K and V cache read once",
        "timing": "triton.testing.do_bench median (L2 flushed between runs); peak memory above the inputs",
        "fwd+bwd gradients": "q, k, v and the prior/SSMax parameters (FlexAttention and plain SDPA: q, k, v only)",
        "flops": "causal forward 2 * B * H * D * L^2, fwd+bwd 3.5x",
    }
    out = args.out or default_output_path(device_name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown_report(results, metadata))
    out.with_suffix(".json").write_text(json.dumps(
        {"metadata": metadata, "results": [result.__dict__ for result in results]}, indent=1))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
