"""BAM's CPU attention paths against Llama's SDPA, one attention call at a time, interleaved in one process (issue 45).

Which fused path should carry BAM's long prompts on a CPU? Each shape (Lq queries at the last positions of Lk keys;
Lq = Lk is a full causal forward, Lq = 1024 one chunk of `bam-eval`'s prefill) runs

    llama          F.scaled_dot_product_attention: is_causal for a full forward, else the boolean (Lq x Lk) mask
                   Transformers builds for a chunk against a KV cache (what LlamaForCausalLM runs)
    blocked        model/blocked_bam.py, the "sdpa" path: query blocks whose mask is a view of the prior table
    blocked+ssmax  the same with SSMax scaling the prior (every block's mask materialized)
    flex+ssmax     the serving path's prefill before issue 45 (kept below): torch.compile(flex_attention,
                   dynamic=True), the prior and the SSMax factor in a score_mod (compiled once per prior-table
                   length, untimed)

in rounds, every candidate once a round, so that a load spike hits all of them; the median wall time, its ratio to
llama's, and the process CPU time per call. Every candidate is checked against a float64 reference first (shapes up
to 4096 x 4096). Sizes of the cpu_speed.py model: 8 query heads, 4 key/value heads, head size 32, float32, batch 1.

    python benchmarks/cpu_attention_ab.py --threads 1 --shapes 1024x8192 1024x16384 4096x4096 --repeats 5

--serving times the vLLM plugin's CPU prefill instead, as the plugin calls it: `paged_attention_cpu` on one step
of one request whose Lq queries are the last chunk of an Lk-token prompt (vLLM's CPU chunks: 4096 tokens for the
LLM class, 2048 for the server), its keys in a head-major cache of 128-token blocks (vLLM's CPU default), at the
sizes of benchmarks/serving.py's model (4 query heads, 2 key/value heads, head size 64), through `--layers` layers
whose priors are per layer (distinct tables) or global (one table). Candidates: the plugin's path (blocked SDPA)
with SSMax scaling the prior and without SSMax, and, over the same gathered keys, compiled FlexAttention for SSMax
scaling the prior (the plugin's path before issue 45) and Llama's SDPA:

    python benchmarks/cpu_attention_ab.py --serving --threads 1 --shapes 1024x1024 4096x4096 4096x32768 --repeats 3
"""

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bam_llama.model.attention_route_bam import bam_attention_blocked  # noqa: E402
from bam_llama.model.cpu_kernels_bam import cpu_kernels_enabled  # noqa: E402
from bam_llama.model.fused_cpu_bam import fused_cpu_available  # noqa: E402
from bam_llama.model.prior_bam import ggd_bias  # noqa: E402
from bam_llama.serving import paged_cpu_path  # noqa: E402
from bam_llama.serving.paged_batch import BamTerms, PagedBatch  # noqa: E402

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


# --------------------------------------------------------------------------------------- flex+ssmax: the candidate
# The serving path's FlexAttention prefill until blocked SDPA replaced it (issue 45), kept here to measure it again
# on another machine: the row factor times a window of the prior table is no window of one table (blocked SDPA
# writes every mask block out; FlexAttention computes it in registers).
FLEX_BLOCK = 128  # query and key block of the block mask
FLEX_PADDING = 2 * FLEX_BLOCK
_FLEX = {"compiled": None}


def _compiled_flex():
    if _FLEX["compiled"] is None:
        # dynamic: one compiled kernel for every prompt and chunk length (`_causal_block_mask` keeps the sizes that
        # Dynamo would specialize on, 1, out of its shapes)
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=True)
    return _FLEX["compiled"]


def _flex_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, terms: BamTerms) -> torch.Tensor:
    """query (1, H, Lq, D) at positions L - Lq .. L - 1, key / value (1, Hkv, L, D), SSMax scaling the prior."""
    rows, keys = query.shape[2], key.shape[2]
    offset = keys - rows  # position of query 0
    table, log_counts = _flex_tables(terms)
    scale = terms.ssmax_scale
    for captured in (table, log_counts, scale):  # fixed per layer; symbolic sizes for them make Inductor's CPU
        torch._dynamo.mark_static(captured)  # template emit C++ that does not compile (torch 2.13)
    # table index of (query i, key j): distance j - (i + offset) past the first entry, distance -(T-1), and the
    # padding; one integer per call (Inductor's CPU template takes single symbols, not expressions of them)
    shift = terms.max_len - 1 + FLEX_PADDING - offset

    def score_mod(score, batch, head, q_index, k_index):
        return (scale[head] * log_counts[q_index + offset]) * (score + table[head, k_index - q_index + shift])

    block_mask = _causal_block_mask(rows, keys, query.device)
    return _compiled_flex()(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=terms.scaling,
                            enable_gqa=True)


def _flex_tables(terms: BamTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """The prior table and ln(n) padded with FLEX_PADDING zeros on both sides: FlexAttention evaluates the
    score_mod on the hidden keys of a block on the diagonal too (at most 2 FLEX_BLOCK past a query), and may on
    the rows past the end of the last query block, before masking them."""
    if "flex" not in terms.__dict__:
        pad = torch.nn.functional.pad
        terms.__dict__["flex"] = (pad(terms.prior_table, (FLEX_PADDING, FLEX_PADDING)).contiguous(),
                                  pad(terms.log_counts, (0, FLEX_PADDING)).contiguous())
    return terms.__dict__["flex"]


@functools.lru_cache(maxsize=64)  # every layer of a step asks for the same masks
def _causal_block_mask(rows: int, keys: int, device: torch.device):
    """FlexAttention's BlockMask for Lq queries at the last positions of L keys, without evaluating any mask: per
    block of FLEX_BLOCK queries, the key blocks every row sees whole, then those on its diagonal. At least two
    query and two key blocks, so that no dimension of the mask is 1 (Dynamo would compile that size apart)."""
    offset = keys - rows
    query_blocks, key_blocks = max(2, -(-rows // FLEX_BLOCK)), max(2, -(-keys // FLEX_BLOCK))
    first = offset + torch.arange(query_blocks, device=device) * FLEX_BLOCK  # position of each block's first row
    last = (first + FLEX_BLOCK - 1).clamp(max=keys - 1)
    full = ((first + 1) // FLEX_BLOCK).clamp(max=key_blocks)
    partial = (last // FLEX_BLOCK + 1 - full).clamp(min=0)
    columns = torch.arange(key_blocks, device=device)
    full_indices = columns.expand(query_blocks, key_blocks)
    partial_indices = (full[:, None] + columns).clamp(max=key_blocks - 1)

    def causal(batch, head, q_index, k_index):
        return k_index <= q_index + offset

    as_mask = lambda tensor: tensor[None, None].to(torch.int32).contiguous()  # noqa: E731
    return BlockMask.from_kv_blocks(
        as_mask(partial), as_mask(partial_indices), as_mask(full), as_mask(full_indices), BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=causal, seq_lengths=(rows, keys),
    )


def flex(query, key, value, terms):
    return _flex_prefill(query.contiguous(), key, value, terms)


CANDIDATES = {"llama": (llama, False), "blocked": (blocked, False), "blocked+ssmax": (blocked, True),
              "flex+ssmax": (flex, True)}


def reference(query, key, value, terms) -> torch.Tensor:
    """Float64, every score materialized: (1, H, Lq, D)."""
    rows, keys = query.shape[2], key.shape[2]
    positions = torch.arange(keys - rows, keys, dtype=torch.float64)
    distance = torch.arange(keys, dtype=torch.float64)[None] - positions[:, None]
    bias = terms.prior_table.double()[:, (distance.clamp(max=0) + keys - 1).long()]
    group = query.shape[1] // key.shape[1]
    keys_, values = (t.double().repeat_interleave(group, 1) for t in (key, value))
    scores = query.double() @ keys_.transpose(-1, -2) * terms.scaling + bias
    if terms.ssmax_scale is not None:
        scores = scores * (terms.ssmax_scale.double()[:, None, None] * (positions + 1).log()[:, None])
    return scores.masked_fill(distance > 0, float("-inf")).softmax(-1) @ values


# ---------------------------------------------------------------------------------------- --serving: the vLLM prefill

SERVING_HEADS, SERVING_KV_HEADS, SERVING_HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 128


def serving_layers(scope: str, ssmax: bool, layers: int, max_len: int) -> list[BamTerms]:
    """One BamTerms per layer: tables of their own ("layer") or one shared table ("global"), SSMax scaling it."""
    def table(layer):
        theta_beta = torch.linspace(0.3, 1.2, SERVING_HEADS) + 0.1 * layer
        return ggd_bias(torch.arange(-(max_len - 1), 1.0), torch.full((SERVING_HEADS,), -2.0), theta_beta,
                        torch.zeros(SERVING_HEADS)).contiguous()
    tables = [table(layer if scope == "layer" else 0) for layer in range(layers)]
    scale = torch.full((SERVING_HEADS,), SSMAX_SCALE) if ssmax else None
    return [BamTerms(tables[layer], scale, True, SERVING_HEAD_DIM ** -0.5) for layer in range(layers)]


def serving_step(rows: int, keys: int, generator) -> tuple[torch.Tensor, torch.Tensor, PagedBatch]:
    """The query rows, a head-major cache holding the request's keys in consecutive blocks, and the step."""
    blocks = -(-keys // BLOCK_SIZE)
    storage = torch.randn(SERVING_KV_HEADS, blocks + 1, BLOCK_SIZE, 2 * SERVING_HEAD_DIM, generator=generator)
    starts = torch.tensor([0, rows], dtype=torch.int32)
    batch = PagedBatch(
        query_start_loc=starts, seq_lens=torch.tensor([keys], dtype=torch.int32),
        block_table=torch.arange(1, blocks + 1, dtype=torch.int32)[None],
        slot_mapping=torch.arange(keys - rows, keys) + BLOCK_SIZE, num_tokens=rows, max_query_len=rows,
        block_size=BLOCK_SIZE, query_start_loc_cpu=starts,
    )
    query = torch.randn(rows, SERVING_HEADS * SERVING_HEAD_DIM, generator=generator)
    return query, storage.transpose(0, 1), batch


def serving_blocked(query, kv_cache, batch, layers):
    """The plugin's CPU path, `paged_attention_cpu`, one call per layer: its prompts run blocked SDPA."""
    output = torch.empty_like(query)
    for terms in layers:
        paged_cpu_path.paged_attention_cpu(query, kv_cache, batch, terms, output)
    return output


def gathered_prompt(attend):
    """`attend(query, key, value, terms)` on (1, H, Lq, D) queries and the request's gathered keys, as
    paged_attention_cpu calls its prefill, one call per layer."""
    def run(query, kv_cache, batch, layers):
        (_, rows, keys), = batch.host_requests
        output = torch.empty_like(query)
        for terms in layers:
            key, value = paged_cpu_path._gather_keys(kv_cache, batch.host_block_ids[0], keys)
            queries = query.view(rows, SERVING_HEADS, SERVING_HEAD_DIM).transpose(0, 1)[None]
            attended = attend(queries, key[None], value[None], terms)
            output[:] = attended[0].transpose(0, 1).reshape(rows, -1)
        return output
    return run


SERVING_CANDIDATES = {"llama": (gathered_prompt(llama), False), "blocked": (serving_blocked, False),
                      "blocked+ssmax": (serving_blocked, True), "flex+ssmax": (gathered_prompt(flex), True)}


def serving_reference(query, kv_cache, batch, terms: BamTerms) -> torch.Tensor:
    """Float64 (Lq, H * D) of one layer, every score materialized."""
    (_, rows, keys), = batch.host_requests
    key, value = paged_cpu_path._gather_keys(kv_cache, batch.host_block_ids[0], keys)
    queries = query.view(rows, SERVING_HEADS, SERVING_HEAD_DIM).transpose(0, 1)[None]
    window = BamTerms(terms.prior_window(keys).contiguous(), terms.ssmax_scale, True, terms.scaling)
    output = reference(queries, key[None], value[None], window)
    return output[0].transpose(0, 1).reshape(rows, -1)


def time_serving(args) -> None:
    """Every shape and prior scope: candidates in rounds, as `main` does for single attention calls."""
    max_len = max(int(shape.split("x")[1]) for shape in args.shapes)
    generator = torch.Generator().manual_seed(0)
    print(f"load before: {load_average()}", flush=True)
    for shape in args.shapes:
        rows, keys = map(int, shape.split("x"))
        query, kv_cache, batch = serving_step(rows, keys, generator)
        for scope in args.scopes:
            layers = {ssmax: serving_layers(scope, ssmax, args.layers, max_len) for ssmax in (False, True)}
            calls = {name: functools.partial(SERVING_CANDIDATES[name][0], query, kv_cache, batch,
                                             layers[SERVING_CANDIDATES[name][1]]) for name in args.candidates}
            with torch.no_grad():
                for name, call in calls.items():  # warm-up (flex compiles once per process), checked
                    output = call()
                    if name != "llama" and rows * keys <= 2048 * 4096:
                        expected = serving_reference(query, kv_cache, batch, call.args[-1][-1])
                        error = (output.double() - expected).abs().max().item()
                        print(f"{shape} {scope} {name}: max abs error against float64 {error:.1e}", flush=True)
                seconds, cpu = time_in_rounds(calls, args.repeats, args.layers)
            report(f"{shape} {scope}", seconds, cpu, args.repeats)
        print(f"load after {shape}: {load_average()}", flush=True)


def time_in_rounds(calls: dict, repeats: int, per_call: int = 1) -> tuple[dict, dict]:
    """Every call once a round, so that a load spike hits them all: {name: wall seconds of each round}, {name: CPU
    seconds over all rounds}, both divided by `per_call` (the layers one call runs)."""
    seconds, cpu = {name: [] for name in calls}, dict.fromkeys(calls, 0.0)
    for _ in range(repeats):
        for name, call in calls.items():
            cpu_start, start = time.process_time(), time.perf_counter()
            call()
            seconds[name].append((time.perf_counter() - start) / per_call)
            cpu[name] += (time.process_time() - cpu_start) / per_call
    return seconds, cpu


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def report(label: str, seconds: dict, cpu: dict, repeats: int) -> None:
    """Median wall time per call (per layer with --serving), its ratio to llama's and to blocked+ssmax's, CPU time."""
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    for name, median in medians.items():
        ratios = [f"{median / medians[base]:5.2f}x {base}" for base in ("llama", "blocked+ssmax") if base in medians]
        print(f"{label} {name:14s} median {median * 1000:8.1f} ms  ratio {'  '.join(ratios) or '-'}  "
              f"cpu {cpu[name] / repeats * 1000:8.1f} ms/call", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1024x8192", "1024x16384", "4096x4096"], help="LqxLk")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--serving", action="store_true", help="time the vLLM plugin's CPU prefill (see above)")
    parser.add_argument("--scopes", nargs="+", choices=["layer", "global"], default=["layer", "global"])
    parser.add_argument("--layers", type=int, default=2, help="--serving: layers per step")
    args = parser.parse_args(argv)
    if cpu_kernels_enabled() and not fused_cpu_available():  # it would time blocked SDPA and call it the kernel
        parser.error("BAM's fused CPU kernel is not built for this installation: run bam-build-kernels first "
                     "(BAM_CPU_KERNELS=0 times blocked SDPA on purpose)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64  # flex+ssmax compiles once per prior-table length
    if args.serving:
        time_serving(args)
        return 0
    generator = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        rows, keys = map(int, shape.split("x"))
        query = torch.randn(1, HEADS, rows, HEAD_DIM, generator=generator)
        key, value = (torch.randn(1, KV_HEADS, keys, HEAD_DIM, generator=generator) for _ in range(2))
        terms = {ssmax: prior_terms(keys, ssmax) for ssmax in (False, True)}
        calls = {name: functools.partial(CANDIDATES[name][0], query, key, value, terms[CANDIDATES[name][1]])
                 for name in args.candidates}
        with torch.no_grad():
            for name, call in calls.items():  # warm-up (flex: compiles), checked against the reference
                output = call()
                if name != "llama" and rows * keys <= 4096 * 4096:
                    error = (output.double() - reference(*call.args)).abs().max().item()
                    print(f"{shape} {name}: max abs error against float64 {error:.1e}", flush=True)
            seconds, cpu = time_in_rounds(calls, args.repeats)
        report(shape, seconds, cpu, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
