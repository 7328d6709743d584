"""BAM attention over a paged KV cache (bam_llama/serving/paged_*.py) against the suite's float64 reference
(tests/reference.py), without vLLM: every path (plain PyTorch; the CPU path with its C++ decode and the fused kernel
for prompts; the same with its C++ kernels switched off; the Triton kernels through Triton's interpreter) on steps
that mix decoding requests, chunks of prompts after cached tokens (chunk boundaries, prefix-cache hits) and whole
prompts, over shuffled block tables in runs of one to four consecutive blocks, several block sizes and both cache
layouts.

Every request's keys are written into the cache here (independently of `write_cache`, tested apart) and the
reference attends over them in order; output rows are pre-filled with NaN, so a row a path forgets fails.
"""

import json
import os
import sys
from unittest import mock

import pytest
import reference
import torch
from helpers import checkout_environment, fused_kernel_calls, require_modules
from waiting import run_within

from bam_llama.serving import paged_attention, paged_kernels, paged_cpu_path, paged_triton
from bam_llama.serving.paged_batch import BamTerms, PagedBatch, prior_table

HEADS, HEAD_DIM, MAX_LEN = 4, 32, 1024


def cpu_without_kernels(*arguments) -> None:
    """The CPU path where its C++ kernels are switched off (BAM_CPU_KERNELS=0) or not built: PyTorch decodes."""
    with mock.patch.dict(os.environ, {"BAM_CPU_KERNELS": "0"}):
        paged_cpu_path.paged_attention_cpu(*arguments)


PATHS = {
    "reference": paged_cpu_path.paged_attention_reference,
    "cpu": paged_cpu_path.paged_attention_cpu,
    "cpu_pytorch": cpu_without_kernels,
    "triton": paged_triton.paged_attention_triton,
}


@pytest.fixture(autouse=True)
def path_needs(request):
    """CPU tests (tests/model/test_triton_gpu.py is their place on a GPU). A test of the "cpu" path needs the C++
    kernels (built ahead by tests/conftest.py), one of the "triton" path Triton's interpreter; the other paths
    neither."""
    if torch.cuda.is_available():
        pytest.skip("CPU tests: tests/model/test_triton_gpu.py's place on a GPU")
    callspec = getattr(request.node, "callspec", None)
    path = callspec.params.get("path") if callspec else None
    if path in ("cpu", "triton"):
        request.getfixturevalue({"cpu": "cpu_kernels", "triton": "triton_interpreter"}[path])


@pytest.fixture
def triton_interpreter(monkeypatch):
    """The Triton path runs in Triton's interpreter (tests/conftest.py imported triton for it); the kernels' scratch
    buffers start as NaN, so that a partial result a kernel forgets to write fails."""
    require_modules("triton", provided_by="the dev extra")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(paged_triton, "_new_output", lambda tensor: tensor.fill_(float("nan")))  # unwritten: NaN


# ------------------------------------------------------------------------------------------------- a step


def make_terms(heads=HEADS, formula="current", ssmax=None, max_len=MAX_LEN, seed=0, head_dim=HEAD_DIM):
    """Prior parameters with a negative beta, mu != 0; ssmax None, "prior" (SSMax scales the prior) or "logits"."""
    generator = torch.Generator().manual_seed(seed)
    theta_alpha = torch.rand(heads, generator=generator) * 1.5 - 2.0
    theta_beta = torch.cat([torch.tensor([-0.4]), torch.rand(heads - 1, generator=generator)])
    theta_mu = (torch.rand(heads, generator=generator) - 0.5) * 1.2
    scale = torch.rand(heads, generator=generator) + 0.5 if ssmax else None
    table = prior_table((theta_alpha, theta_beta, theta_mu), formula, 1e-5, max_len)
    terms = BamTerms(table, scale, ssmax == "prior", head_dim**-0.5)
    witness = dict(theta_alpha=theta_alpha, theta_beta=theta_beta, theta_mu=theta_mu, formula=formula,
                   ssmax_scale=scale, ssmax_prior=ssmax == "prior", scaling=head_dim**-0.5)
    return terms, witness


class Step:
    """Requests (queries this step, keys after it) with random keys, values and queries, their keys written into a
    cache of `block_size` tokens per block, blocks handed out shuffled in runs of 1-4 consecutive ones.

    head_major: the cache is the head-major layout the plugin asks vLLM for (else vLLM's default, blocks outermost).
    padding: rows past the last request (a captured batch's padding)."""

    def __init__(self, requests, kv_heads, block_size, head_major=True, padding=0, seed=0, dtype=torch.float32,
                 head_dim=HEAD_DIM):
        generator = torch.Generator().manual_seed(seed)
        self.head_dim = head_dim
        self.requests, self.kv_heads, self.block_size = requests, kv_heads, block_size
        needed = [-(-keys // block_size) for _, keys in requests]  # a padding request: no query, no key
        free = _shuffled_runs(sum(needed) + 3, generator)
        blocks = len(free) + 1  # block 0 stays unused (vLLM's null block)
        storage_shape = (kv_heads, blocks, block_size, 2 * head_dim) if head_major else (
            blocks, kv_heads, block_size, 2 * head_dim)
        storage = torch.randn(storage_shape, generator=generator).to(dtype)  # unwritten cells hold noise
        self.kv_cache = storage.transpose(0, 1) if head_major else storage
        self.block_table = torch.zeros(len(requests), max(needed) + 2, dtype=torch.int32)  # + unused entries
        self.keys, self.values = [], []
        for r, ((rows, keys), count) in enumerate(zip(requests, needed)):
            self.block_table[r, :count] = torch.tensor(free[:count], dtype=torch.int32)
            free = free[count:]
            key, value = (torch.randn(keys, kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
            slots = self.slots(r, torch.arange(keys))
            self.kv_cache[slots // block_size, :, slots % block_size, :head_dim] = key
            self.kv_cache[slots // block_size, :, slots % block_size, head_dim:] = value
            self.keys.append(key)
            self.values.append(value)
        self.num_tokens = sum(rows for rows, _ in requests)
        self.query = torch.randn(self.num_tokens + padding, HEADS * head_dim, generator=generator).to(dtype)
        starts = torch.tensor([0] + [rows for rows, _ in requests]).cumsum(0).to(torch.int32)
        self.batch = PagedBatch(
            query_start_loc=starts, seq_lens=torch.tensor([keys for _, keys in requests], dtype=torch.int32),
            block_table=self.block_table, slot_mapping=self.step_slots(padding), num_tokens=self.num_tokens,
            max_query_len=max(rows for rows, _ in requests), block_size=block_size, query_start_loc_cpu=starts,
        )
        self.dtype = dtype

    def slots(self, request: int, positions: torch.Tensor) -> torch.Tensor:
        blocks = self.block_table[request, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def step_slots(self, padding: int) -> torch.Tensor:
        """The slots of this step's tokens (each request's last positions), -1 for padding rows."""
        slots = [self.slots(r, torch.arange(keys - rows, keys)) for r, (rows, keys) in enumerate(self.requests)]
        return torch.cat(slots + [torch.full((padding,), -1)])

    def expected(self, witness: dict) -> list[torch.Tensor]:
        """float64 (rows, H, D) of every request, from tests/reference.py over its keys in order."""
        outputs, first = [], 0
        for (rows, keys), key, value in zip(self.requests, self.keys, self.values):
            if rows == 0:
                outputs.append(None)
                continue
            query = self.query[first : first + rows].view(1, rows, HEADS, self.head_dim).transpose(1, 2).float()
            output = reference.bam_attention(
                query, key.transpose(0, 1)[None].float(), value.transpose(0, 1)[None].float(),
                torch.arange(keys - rows, keys),
                **witness,
            )
            outputs.append(output[0].transpose(0, 1))
            first += rows
        return outputs


def _shuffled_runs(count: int, generator: torch.Generator) -> list[int]:
    """Block ids 1..count as runs of 1-4 consecutive ids, the runs in random order."""
    runs, start = [], 1
    while start <= count:
        length = int(torch.randint(1, 5, (1,), generator=generator))
        runs.append(list(range(start, min(start + length, count + 1))))
        start += length
    order = torch.randperm(len(runs), generator=generator).tolist()
    return [block for index in order for block in runs[index]]


def run_path(path, step: Step, terms: BamTerms) -> torch.Tensor:
    output = torch.full_like(step.query, float("nan"))
    PATHS[path](step.query, step.kv_cache, step.batch, terms, output)
    return output


def assert_rows_match(output: torch.Tensor, step: Step, witness: dict, tolerance: float = 2e-5) -> None:
    """Every request's rows within `tolerance` of the reference, element by element."""
    first = 0
    for (rows, keys), expected in zip(step.requests, step.expected(witness)):
        if rows == 0:
            continue
        actual = output[first : first + rows].view(rows, HEADS, step.head_dim).double()
        error = (actual - expected).abs().max().item()
        assert error <= tolerance, f"request with {rows} queries and {keys} keys: max |error| {error:.2e}"
        first += rows


# A mixed step: decoding requests (1 query), a chunk after cached keys (a chunk boundary or a prefix-cache hit), a
# whole prompt, a decode of a single key, and a chunk of 150 queries (several query blocks) after more cached keys.
MIXED = [(1, 45), (20, 77), (33, 33), (1, 1), (150, 300), (1, 130)]

CONFIGS = {
    # name: (kv heads, block size, formula, ssmax)
    "gqa2-block16-scaled-prior": (2, 16, "current", "prior"),
    "gqa4-block32-legacy-ssmax-logits": (1, 32, "legacy", "logits"),
    "mha-block16-no-ssmax": (4, 16, "current", None),
    "gqa2-block32-legacy-scaled-prior": (2, 32, "legacy", "prior"),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_path_matches_the_reference_on_a_mixed_step(path, config):
    kv_heads, block_size, formula, ssmax = CONFIGS[config]
    terms, witness = make_terms(formula=formula, ssmax=ssmax)
    step = Step(MIXED, kv_heads, block_size)
    assert_rows_match(run_path(path, step, terms), step, witness)


# Decoding steps: split-KV on the Triton path (several splits, some empty), keys in place on the CPU path. Rows
# past the last request and a request without a query are what vLLM adds to a step it replays from a CUDA graph.
DECODES = [(1, 45), (1, 1), (1, 130), (1, 77), (1, 16), (0, 0)]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("config", ["gqa2-block16-scaled-prior", "gqa4-block32-legacy-ssmax-logits",
                                    "mha-block16-no-ssmax"])
def test_every_path_matches_the_reference_on_a_decoding_step(path, config):
    kv_heads, block_size, formula, ssmax = CONFIGS[config]
    terms, witness = make_terms(formula=formula, ssmax=ssmax)
    step = Step(DECODES, kv_heads, block_size, padding=3)
    output = run_path(path, step, terms)
    assert_rows_match(output, step, witness)
    if path == "triton":  # the padding rows were combined from empty splits: zeros, not garbage
        assert torch.equal(output[step.num_tokens :], torch.zeros_like(output[step.num_tokens :]))


@pytest.mark.usefixtures("triton_interpreter")
def test_triton_decode_kernel_runs_for_single_query_steps(monkeypatch):
    calls = []
    monkeypatch.setattr(paged_triton, "_launch_prefill", lambda *args: calls.append("prefill"))
    terms, _ = make_terms(ssmax="prior")
    run_path("triton", Step(DECODES, 2, 16), terms)
    assert calls == []


@pytest.mark.parametrize("path", ["cpu", "cpu_pytorch"])
@pytest.mark.parametrize("ssmax", ["prior", "logits", None])
def test_cpu_path_reads_decoding_keys_in_place_and_gathers_prompts(monkeypatch, ssmax, path):
    """On the head-major cache a decoding request copies none of its keys; every prompt, SSMax scaling the prior or
    not, gathers its keys (in C++, or PyTorch where the kernels are off) and runs the package's attention (compiled
    FlexAttention was slower or tied at every measured shape: benchmarks/results/cpu-attention-serving.md)."""
    gathered, blocked = [], []
    spy = lambda calls, function: lambda *args, **kwargs: calls.append(1) or function(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(paged_cpu_path, "_gather_keys", spy(gathered, paged_cpu_path._gather_keys))
    monkeypatch.setattr(paged_cpu_path, "gather_cpu", spy(gathered, paged_cpu_path.gather_cpu))
    monkeypatch.setattr(paged_cpu_path, "bam_attention_blocked", spy(blocked, paged_cpu_path.bam_attention_blocked))
    terms, witness = make_terms(ssmax=ssmax)
    step = Step(MIXED, 2, 16)
    assert_rows_match(run_path(path, step, terms), step, witness)
    prompts = sum(rows > 1 for rows, _ in MIXED)
    assert len(gathered) == len(blocked) == prompts


@pytest.mark.usefixtures("cpu_kernels")
def test_cpu_prompts_past_8k_keys_run_the_fused_kernel(monkeypatch):
    """SSMax scaling the prior past 8192 keys: the prompt (40 queries) runs the fused CPU kernel once, the decoding
    request reads its keys in place; the rows stay exact."""
    calls = fused_kernel_calls(monkeypatch)
    terms, witness = make_terms(ssmax="prior", max_len=26_500)
    step = Step([(40, 26_000), (1, 300)], 2, 128)
    assert_rows_match(run_path("cpu", step, terms), step, witness)
    assert calls == [(1, HEADS, 40, HEAD_DIM)]  # the prompt, once; the decoding request reads its keys in place


def test_cpu_prompts_past_8k_keys_run_over_key_tiles_without_the_fused_kernel(monkeypatch):
    """The same prompt with the fused kernel switched off (BAM_CPU_KERNELS=0, as where it is not built): its 40
    queries, both query heads of each key/value head stacked, meet the keys in tiles of 512 whose masks stay in cache
    (the tile with the diagonal first, up to 40 keys wider), every key in one tile; the rows stay exact."""
    import bam_llama.model.blocked_bam as blocked

    monkeypatch.setenv("BAM_CPU_KERNELS", "0")
    calls = []
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def counting_flash(query, key, *args, **kwargs):
        calls.append((tuple(query.shape[1:3]), key.shape[2]))
        return flash(query, key, *args, **kwargs)

    monkeypatch.setattr(blocked.torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", counting_flash)
    terms, witness = make_terms(ssmax="prior", max_len=26_500)
    step = Step([(40, 26_000), (1, 300)], 2, 128)
    assert_rows_match(run_path("cpu", step, terms), step, witness)
    assert {stacked for stacked, _ in calls} == {(2, 80)}  # 2 key/value heads, 2 x 40 query rows each
    widths = [width for _, width in calls]
    assert sum(widths) == 26_000 and widths[1:] == [512] * (len(widths) - 1) and widths[0] <= 512 + 40  # diagonal first


@pytest.mark.usefixtures("cpu_kernels")
def test_cpu_path_on_the_blocks_outermost_layout():
    """vLLM's default layout (no strided view of a run of blocks per head): decoding requests gather instead."""
    terms, witness = make_terms(ssmax="logits")
    step = Step(MIXED, 2, 32, head_major=False)
    assert paged_cpu_path._head_major_tokens(step.kv_cache) is None
    assert_rows_match(run_path("cpu", step, terms), step, witness)


@pytest.mark.usefixtures("cpu_kernels")
def test_cpu_decodes_a_steps_decoding_requests_in_one_kernel_call(monkeypatch):
    """The C++ decode takes every request with one query in one call (PyTorch's decode none); switched off, PyTorch
    decodes each of them. Prompts run the fused attention either way."""
    kernel, pytorch = [], []
    spy = lambda calls, function: lambda *args, **kwargs: calls.append(1) or function(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(paged_cpu_path, "decode_cpu", spy(kernel, paged_cpu_path.decode_cpu))
    monkeypatch.setattr(paged_cpu_path, "_decode_in_place", spy(pytorch, paged_cpu_path._decode_in_place))
    terms, witness = make_terms(ssmax="prior")
    step = Step(MIXED, 2, 16)
    assert_rows_match(run_path("cpu", step, terms), step, witness)
    assert (len(kernel), len(pytorch)) == (1, 0)
    assert_rows_match(run_path("cpu_pytorch", step, terms), step, witness)
    assert (len(kernel), len(pytorch)) == (1, sum(rows == 1 and keys > 0 for rows, keys in MIXED))


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
@pytest.mark.parametrize("head_dim", [64, 80, 36])
def test_cpu_decode_at_head_sizes_that_fill_vector_registers(head_dim, dtype, tolerance):
    """Head sizes of real models: 64 channels fill the C++ decode's four vector registers of values (AVX-512), 80
    leave a tail after them; 36 leaves channels past the last whole vector (AVX-512 and AVX2) to scalar loops. Keys
    in blocks of 16 (the kernel's four-key dot products, and the tails of both), GQA 2.
    16-bit caches are read as float32 (the reference gets the same rounded keys; the output is rounded again)."""
    terms, witness = make_terms(ssmax="prior", head_dim=head_dim)
    step = Step(DECODES + [(1, 300)], 2, 16, dtype=dtype, head_dim=head_dim)
    assert_rows_match(run_path("cpu", step, terms), step, witness, tolerance)


@pytest.mark.usefixtures("cpu_kernels")
def test_cpu_decode_refuses_a_request_longer_than_the_prior_table():
    terms, _ = make_terms(max_len=100)
    step = Step([(1, 130)], 2, 16)
    with pytest.raises(RuntimeError, match="longer than the prior table"):
        run_path("cpu", step, terms)


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("rows", [1, 5], ids=["decoding", "prompt"])
def test_cpu_kernels_refuse_block_ids_outside_the_cache(rows):
    """A block table entry past the cache (a decoding request's, read in place; a prompt's, gathered) is one error,
    not a read of memory the cache does not own."""
    terms, _ = make_terms()
    step = Step([(rows, 40)], 2, 16)
    step.block_table[0, 1] = step.kv_cache.shape[0]
    with pytest.raises(RuntimeError, match="block id .* outside the cache"):
        run_path("cpu", step, terms)


# A child that runs each case of `block_table_cases` through the CPU path and prints, as JSON lines, the case before
# the call and its error (or None) after it: a kernel that reads a block it did not check may crash the child, never
# pytest, and the last case started names the one that crashed it.
BLOCK_TABLE_CHILD = """
import json, sys, torch
from bam_llama.serving.paged_batch import BamTerms, PagedBatch, prior_table
from bam_llama.serving.paged_cpu import paged_cpu_available
from bam_llama.serving.paged_cpu_path import paged_attention_cpu

heads, kv_heads, dim, block_size, blocks = 4, 2, 32, 16, 8
assert paged_cpu_available(), "the C++ kernels did not load in the child"
terms = BamTerms(prior_table((torch.zeros(heads), torch.ones(heads), torch.zeros(heads)), "current", 1e-5, 256), None,
                 True, dim**-0.5)
cache = torch.randn(blocks, kv_heads, block_size, 2 * dim)
for case in json.loads(sys.argv[1]):
    rows, keys, columns, entry, block_id = case["rows"], case["keys"], case["columns"], case["entry"], case["id"]
    table = torch.arange(1, columns + 1, dtype=torch.int32)[None]  # blocks 1, 2, ... (all inside the cache)
    if entry is not None:
        table[0, entry] = block_id
    starts = torch.tensor([0, rows], dtype=torch.int32)
    batch = PagedBatch(starts, torch.tensor([keys], dtype=torch.int32), table, torch.zeros(rows, dtype=torch.long),
                       rows, rows, block_size, starts)
    print(json.dumps({"started": case["name"]}), flush=True)
    try:
        paged_attention_cpu(torch.randn(rows, heads * dim), cache, batch, terms, torch.zeros(rows, heads * dim))
        error = None
    except RuntimeError as raised:
        error = str(raised)
    print(json.dumps({"name": case["name"], "error": error}), flush=True)
"""


def block_table_cases(blocks: int, block_size: int) -> list[dict]:
    """Requests of 1, 16, 17, 40 and 48 keys in blocks of 16 (a partly filled last block, a full one), decoding (one
    query) and prompts (five queries: the gathering path), with a bad entry in the block table: the last block a
    request reads (the partly filled one where there is one) just past the cache, at -1 or far past it (2^30),
    each refused naming the id; the first entry past the request's blocks bad (never read: no error); a row of
    exactly the request's blocks (no error) and one entry shorter (refused). `expected`: the error's text (None:
    no error)."""
    cases = []
    for keys in (1, 16, 17, 40, 48):
        needed = -(-keys // block_size)  # the blocks holding `keys` keys: a partly filled last one counts
        for rows in (1, 5) if keys >= 5 else (1,):
            path = "decoding" if rows == 1 else "prompt"
            bad = [(block_id, f"block id {block_id} outside the cache's {blocks} blocks")
                   for block_id in (blocks, -1, 2**30)]
            variants = [(f"last block id {block_id}", needed + 2, needed - 1, block_id, said) for block_id, said in bad]
            variants += [("unused entry past the cache", needed + 2, needed, blocks, None),
                         ("row exactly its blocks", needed, None, 0, None),
                         ("row one block short", needed - 1, None, 0, "more blocks than its block table row")]
            cases += [dict(name=f"{path}, {keys} keys: {what}", rows=rows, keys=keys, columns=columns, entry=entry,
                           id=block_id, expected=said) for what, columns, entry, block_id, said in variants]
    return cases


def answered_as_expected(error: str | None, expected: str | None) -> bool:
    """No error where none is expected, else one whose first line says `expected`."""
    return error is None if expected is None else error is not None and expected in error.splitlines()[0]


@pytest.mark.usefixtures("cpu_kernels")
def test_cpu_kernels_check_every_block_a_request_reads_before_reading_any():
    """Each block the C++ decode reads in place, or gathers for a prompt, is checked against the block table row and
    the cache before anything is read, the partly filled last block included: a bad id is one line of error, not
    a read of memory the cache does not own (a crash, or another block's keys); an entry past the request's blocks
    is never read, so never refused. Run in a child process (see BLOCK_TABLE_CHILD)."""
    cases = block_table_cases(blocks=8, block_size=16)
    child = run_within([sys.executable, "-c", BLOCK_TABLE_CHILD, json.dumps(cases)], 300, env=checkout_environment())
    lines = [json.loads(line) for line in child.stdout.splitlines()]
    errors = {line["name"]: line["error"] for line in lines if "name" in line}
    wrong = [f"{case['name']}: {errors[case['name']]!r}" for case in cases
             if case["name"] in errors and not answered_as_expected(errors[case["name"]], case["expected"])]
    started = [line["started"] for line in lines if "started" in line]
    crash = [] if child.returncode == 0 else [
        f"the child ended with status {child.returncode} in the case {started[-1] if started else None!r}: "
        f"{child.stderr[-2000:]}"]
    assert not wrong + crash, "\n".join(wrong + crash)
    assert list(errors) == [case["name"] for case in cases]


@pytest.mark.usefixtures("cpu_kernels")
def test_cpu_cache_write_refuses_a_slot_outside_the_cache():
    """Checked before anything is written: the good slot before the bad one stays unwritten too."""
    cache = torch.zeros(2, 6, 16, 2 * HEAD_DIM).transpose(0, 1)
    key = value = torch.ones(2, 2 * HEAD_DIM)
    batch = PagedBatch(torch.tensor([0, 2]), torch.tensor([2]), torch.zeros(1, 1, dtype=torch.int32),
                       torch.tensor([3, 6 * 16]), 2, 2, 16, torch.tensor([0, 2]))
    with pytest.raises(RuntimeError, match="slot 96 outside the cache's 96 cells"):
        paged_attention.write_cache(key, value, cache, batch)
    assert not cache.any()


@pytest.mark.parametrize("path", ["cpu", "cpu_pytorch", "triton"])
def test_bfloat16_cache_and_queries(path):
    """16-bit loads, casts and stores (the interpreter computes in fp32; its bf16 arithmetic is not the GPU's). The
    outputs are rounded to bf16 (up to 0.008 at |x| < 4) and the Triton dots of 16-bit inputs run at tf32, which the
    interpreter emulates: 3e-2 still fails a wrong head, key or position (errors of order 1)."""
    terms, witness = make_terms(ssmax="prior")
    step = Step(MIXED, 2, 16, dtype=torch.bfloat16)
    output = run_path(path, step, terms)
    assert output.dtype == torch.bfloat16
    assert_rows_match(output, step, witness, tolerance=3e-2)


@pytest.mark.parametrize("formula", ["current", "legacy"])
def test_prior_table_is_the_prior_at_each_distance(formula):
    terms, witness = make_terms(formula=formula, max_len=300)
    distance = torch.arange(-299, 1)
    expected = reference.prior(distance, witness["theta_alpha"], witness["theta_beta"], witness["theta_mu"], formula)
    torch.testing.assert_close(terms.prior_table.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value_rows", ["fused", "own"])
@pytest.mark.parametrize("path", ["torch", "cpu", "triton"])
def test_write_cache_puts_each_token_in_its_slot(path, value_rows, dtype, monkeypatch):
    """Keys and values as vLLM's fused qkv projection hands them over (rows strided), padding slots skipped,
    every other cell untouched; values in a tensor of their own (another row stride than the keys') too. Paths:
    PyTorch (BAM_CPU_KERNELS=0), the C++ CPU kernel, the Triton launcher the plugin calls on CUDA."""
    if path == "triton":
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda tensor: True))
    else:
        monkeypatch.setattr(paged_kernels, "TRITON_AVAILABLE", False)
        if path == "torch":
            monkeypatch.setenv("BAM_CPU_KERNELS", "0")
    kv_heads, block_size, blocks = 2, 16, 6
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (HEADS + 2 * kv_heads) * HEAD_DIM, generator=generator).to(dtype)
    key = qkv[:, HEADS * HEAD_DIM : (HEADS + kv_heads) * HEAD_DIM]
    value = qkv[:, (HEADS + kv_heads) * HEAD_DIM :]
    if value_rows == "own":
        value = value.contiguous()
    cache = torch.randn(kv_heads, blocks, block_size, 2 * HEAD_DIM, generator=generator).to(dtype).transpose(0, 1)
    before = cache.clone()
    slots = torch.tensor([3 * 16 + 5, -1, 1 * 16 + 15, 5 * 16 + 0, -1])
    batch = PagedBatch(torch.tensor([0, 5]), torch.tensor([5]), torch.zeros(1, 1, dtype=torch.int32), slots, 5, 5,
                       block_size, torch.tensor([0, 5]))
    paged_attention.write_cache(key, value, cache, batch)
    expected = before.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot // block_size, :, slot % block_size] = torch.cat(
                [key[token].view(kv_heads, HEAD_DIM), value[token].view(kv_heads, HEAD_DIM)], -1)
    assert torch.equal(cache, expected)


def test_a_t5_prior_s_serving_table_is_its_bucket_bias_by_bucket():
    """vLLM's plugin builds a layer's table from the checkpoint's tensors (`prior_parameter_shapes`): under T5's
    buckets, bucket_bias (H, buckets), whose table at distance -n is bucket_bias[:, bucket(n)] (the reference's)."""
    from helpers import tiny_config

    from bam_llama.serving.paged_batch import prior_parameter_shapes

    config = tiny_config(prior_formula="t5_buckets", t5_num_buckets=8, t5_max_distance=12)
    assert prior_parameter_shapes(config) == {"bucket_bias": (4, 8)}
    assert prior_parameter_shapes(tiny_config()) == {name: (4,) for name in ("theta_alpha", "theta_beta", "theta_mu")}
    bucket_bias = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    table = prior_table((bucket_bias,), "t5_buckets", 1e-5, 300, 12)  # distances -299 .. 0
    expected = reference.t5_prior(torch.arange(-299, 1), bucket_bias, 12)
    torch.testing.assert_close(table.double(), expected, atol=0, rtol=0)
