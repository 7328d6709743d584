"""BAM's CPU attention paths against Llama's SDPA, one attention call at a time, interleaved in one process (issue 45).

Which fused path should carry BAM's long prompts on a CPU? Each shape (Lq queries at the last positions of Lk keys;
Lq = Lk is a full causal forward, Lq = 1024 one chunk of `bam-eval`'s prefill) runs

    llama          F.scaled_dot_product_attention: is_causal for a full forward, else the boolean (Lq x Lk) mask
                   Transformers builds for a chunk against a KV cache (what LlamaForCausalLM runs)
    blocked        model/blocked_bam.py, the "sdpa" path: query blocks whose mask is a view of the prior table
    blocked+ssmax  the same with SSMax scaling the prior (every block's mask materialized)
    flex+ssmax     serving/paged_torch.py's prefill: torch.compile(flex_attention, dynamic=True), the prior and
                   the SSMax factor in a score_mod (compiled once per prior-table length, untimed)

in rounds, every candidate once a round, so that a load spike hits all of them; the median wall time, its ratio to
llama's, and the process CPU time per call. Every candidate is checked against a float64 reference first (shapes up
to 4096 x 4096). Sizes of the cpu_speed.py model: 8 query heads, 4 key/value heads, head size 32, float32, batch 1.

    python benchmarks/cpu_attention_ab.py --threads 1 --shapes 1024x8192 1024x16384 4096x4096 --repeats 5
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bam_llama.model.blocked_bam import bam_attention_blocked  # noqa: E402
from bam_llama.model.prior_bam import ggd_bias  # noqa: E402
from bam_llama.serving import paged_torch  # noqa: E402
from bam_llama.serving.paged_batch import BamTerms  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32
SSMAX_SCALE = 0.4


def prior_terms(keys: int, ssmax: bool) -> BamTerms:
    """The prior at distances -(keys - 1)..0 (theta_alpha -2, beta 0.3..1.2 over the heads, mu 0)."""
    table = ggd_bias(torch.arange(-(keys - 1), 1.0), torch.full((HEADS,), -2.0), torch.linspace(0.3, 1.2, HEADS),
                     torch.zeros(HEADS))
    return BamTerms(table, torch.full((HEADS,), SSMAX_SCALE) if ssmax else None, True, HEAD_DIM ** -0.5)


def llama(query, key, value, terms):
    rows, keys = query.shape[2], key.shape[2]
    if rows == keys:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)
    visible = torch.arange(keys)[None] <= torch.arange(keys - rows, keys)[:, None]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, enable_gqa=True)


def blocked(query, key, value, terms):
    rows, keys = query.shape[2], key.shape[2]
    return bam_attention_blocked(query, key, value, torch.arange(keys - rows, keys), terms.prior_table,
                                 terms.scaling, ssmax_scale=terms.ssmax_scale)


def flex(query, key, value, terms):
    return paged_torch._flex_prefill(query, key, value, terms)


CANDIDATES = {"llama": (llama, False), "blocked": (blocked, False), "blocked+ssmax": (blocked, True),
              "flex+ssmax": (flex, True)}


def reference(query, key, value, terms) -> torch.Tensor:
    """Float64, every score materialized: (1, H, Lq, D)."""
    rows, keys = query.shape[2], key.shape[2]
    positions = torch.arange(keys - rows, keys, dtype=torch.float64)
    distance = torch.arange(keys, dtype=torch.float64)[None] - positions[:, None]
    bias = terms.prior_table.double()[:, (distance.clamp(max=0) + keys - 1).long()]
    group = HEADS // KV_HEADS
    keys_, values = (t.double().repeat_interleave(group, 1) for t in (key, value))
    scores = query.double() @ keys_.transpose(-1, -2) * terms.scaling + bias
    if terms.ssmax_scale is not None:
        scores = scores * (terms.ssmax_scale.double()[:, None, None] * (positions + 1).log()[:, None])
    return scores.masked_fill(distance > 0, float("-inf")).softmax(-1) @ values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1024x8192", "1024x16384", "4096x4096"], help="LqxLk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # flex+ssmax compiles once per prior-table length
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        rows, keys = map(int, shape.split("x"))
        query = torch.randn(1, HEADS, rows, HEAD_DIM, generator=generator)
        key, value = (torch.randn(1, KV_HEADS, keys, HEAD_DIM, generator=generator) for _ in range(2))
        terms = {ssmax: prior_terms(keys, ssmax) for ssmax in (False, True)}
        seconds = {name: [] for name in args.candidates}
        cpu = dict.fromkeys(args.candidates, 0.0)
        with torch.no_grad():
            for name in args.candidates:  # warm-up (flex: compiles), checked against the reference
                attend, ssmax = CANDIDATES[name]
                output = attend(query, key, value, terms[ssmax])
                if name != "llama" and rows * keys <= 4096 * 4096:
                    error = (output.double() - reference(query, key, value, terms[ssmax])).abs().max().item()
                    print(f"{shape} {name}: max abs error against float64 {error:.1e}", flush=True)
            for _ in range(args.repeats):
                for name in args.candidates:
                    attend, ssmax = CANDIDATES[name]
                    cpu_start, start = time.process_time(), time.perf_counter()
                    attend(query, key, value, terms[ssmax])
                    seconds[name].append(time.perf_counter() - start)
                    cpu[name] += time.process_time() - cpu_start
        base = statistics.median(seconds["llama"]) if "llama" in seconds else None
        for name in args.candidates:
            median = statistics.median(seconds[name])
            ratio = f"{median / base:5.2f}x" if base else "-"
            print(f"{shape} {name:14s} median {median * 1000:8.1f} ms  ratio {ratio}  "
                  f"cpu {cpu[name] / args.repeats * 1000:8.1f} ms/call", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
