"""Fused Triton GGD-BAM kernels against the suite's float64 reference (tests/reference.py), on CPU through Triton's
interpreter.

Tiny shapes only: the interpreter is ~300x slower than torch. Every kernel output buffer is pre-filled with NaN
(`poison_outputs`), so a tile a kernel forgets to write fails the comparison.
"""

import os

_PREVIOUS_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # before bam_llama.model.triton_bam is first imported in this process

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import reference  # noqa: E402
import torch  # noqa: E402
from waiting import run_within  # noqa: E402

pytest.importorskip("triton")

from bam_llama.model import triton_bam  # noqa: E402

# triton_bam reads TRITON_INTERPRET at call time: restore the variable so that it does not leak into the
# other test modules of this session, and set it again around each test here.
if _PREVIOUS_INTERPRET is None:
    del os.environ["TRITON_INTERPRET"]
else:
    os.environ["TRITON_INTERPRET"] = _PREVIOUS_INTERPRET

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_bam, "_new_output", lambda tensor: tensor.fill_(float("nan")))


# ------------------------------------------------------------------------------------------------- helpers


def make_inputs(batch, heads, kv_heads, q_len, k_len, head_dim, dtype=torch.float32, seed=0):
    """Query, key, value as transposed (B, L, H, D) storage, the layout the model passes (non-contiguous)."""
    generator = torch.Generator().manual_seed(seed)

    def tensor(num_heads, length):
        storage = torch.randn(batch, length, num_heads, head_dim, generator=generator)
        return storage.to(dtype).transpose(1, 2).requires_grad_()

    return tensor(heads, q_len), tensor(kv_heads, k_len), tensor(kv_heads, k_len)


def make_parameters(heads, seed=0):
    """theta_alpha, theta_beta (-3 .. 3), theta_mu (non-zero except head 0: mu = 0 with beta = -3 makes the
    prior at distance 0 huge, eps ** -3), SSMax scale."""
    generator = torch.Generator().manual_seed(seed)
    theta_alpha = torch.rand(heads, generator=generator) * 2 - 1.5
    theta_beta = torch.linspace(-3.0, 3.0, heads)
    theta_mu = torch.rand(heads, generator=generator) - 0.5
    theta_mu[0] = 0.0
    ssmax_scale = 0.8 + 0.4 * torch.rand(heads, generator=generator)
    return [p.requires_grad_() for p in (theta_alpha, theta_beta, theta_mu, ssmax_scale)]


def left_padding(batch, k_len, pad):
    key_valid = torch.ones(batch, k_len, dtype=torch.bool)
    key_valid[-1, :pad] = False  # the last row is left-padded; its first queries see no key at all
    return key_valid


def packed_documents(batch, k_len, lengths):
    """Document ids (B, Lk): `lengths` packs the first row (the others hold one document), or is a tuple of one
    list of lengths per row."""
    document_ids = torch.zeros(batch, k_len, dtype=torch.long)
    for row, row_lengths in enumerate(lengths if isinstance(lengths, tuple) else (lengths,)):
        boundaries = torch.tensor(row_lengths).cumsum(0)
        document_ids[row] = torch.bucketize(torch.arange(k_len), boundaries, right=True)
    return document_ids


def reference_attention(query, key, value, params, positions, *, scaling, formula, key_valid=None,
                        document_ids=None, ssmax=True, ssmax_prior=True):
    """tests/reference.py's float64 attention; params: theta_alpha, theta_beta, theta_mu, ssmax_scale."""
    theta_alpha, theta_beta, theta_mu, ssmax_scale = params
    return reference.bam_attention(
        query, key, value, positions, theta_alpha, theta_beta, theta_mu, scaling=scaling, formula=formula,
        ssmax_scale=ssmax_scale if ssmax else None, ssmax_prior=ssmax_prior, key_valid=key_valid,
        document_ids=document_ids,
    )


def run_with_gradients(attention, inputs, params, grad_output):
    """Output and the gradients of (output * grad_output).sum() w.r.t. inputs and parameters."""
    leaves = [tensor.detach().clone().requires_grad_() for tensor in (*inputs, *params)]
    output = attention(*leaves)
    (output * grad_output).sum().backward()
    return output.detach(), [leaf.grad for leaf in leaves]


def assert_close(actual, expected, tolerance, name=""):
    """Per element: |actual - expected| <= tolerance * (|expected| + 1). For a parameter gradient each element is one
    head, so every head is checked against its own magnitude, not against the largest head."""
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tolerance, atol=tolerance,
                               msg=lambda message: f"{name}: {message}")


def assert_close_per_head(actual, expected, tolerance, name=""):
    """16-bit inputs round p and dS to 16 bits before each dot, so single elements can be far off: compare the error
    norm of every head (dim 1 of (B, H, L, D), dim 0 of an (H,) parameter gradient) with that head's norm."""
    head_dim = 1 if expected.dim() == 4 else 0
    dims = [d for d in range(expected.dim()) if d != head_dim]
    error = (actual.double() - expected.double()).square().sum(dims).sqrt() if dims else (actual - expected).abs()
    norm = expected.double().square().sum(dims).sqrt() if dims else expected.double().abs()
    assert (error <= tolerance * norm + 1e-6).all(), f"{name}: per-head error {error.tolist()}, norm {norm.tolist()}"


GRADIENT_NAMES = ["dq", "dk", "dv", "d theta_alpha", "d theta_beta", "d theta_mu", "d ssmax_scale"]


def assert_output_and_gradients(actual, actual_grads, expected, expected_grads, tolerance, parameter_tolerance, ssmax):
    assert actual.shape == expected.shape
    assert_close(actual, expected, tolerance, "output")
    for name, got, want in zip(GRADIENT_NAMES, actual_grads, expected_grads):
        if name == "d ssmax_scale" and not ssmax:
            assert got is None
            continue
        assert_close(got, want, tolerance if name in ("dq", "dk", "dv") else parameter_tolerance, name)


# ------------------------------------------------------------------------------------------ prefill parity

# (batch, heads, kv_heads, q_len, k_len, head_dim, formula, ssmax, ssmax_prior, padding, documents, num_splits)
# num_splits: 0 is the single-pass kernel, n >= 1 split-KV with n splits, None the automatic choice (split-KV for
# <= 16 queries). The backward is the same for both forwards, so it must recompute exactly the forward's scores.
PARITY_CASES = {
    "len1-mha-d32": (1, 4, 4, 1, 1, 32, "current", False, True, 0, None, 0),
    "len7-gqa2-d48-legacy-pad": (2, 4, 2, 7, 7, 48, "legacy", True, True, 3, None, 0),
    "len16-gqa4-d64-unscaled-prior": (1, 4, 1, 16, 16, 64, "current", True, False, 0, None, 0),
    "len64-gqa2-d96-docs": (1, 4, 2, 64, 64, 96, "current", True, True, 0, [20, 1, 30, 13], 0),
    "len133-gqa2-d48-legacy-pad-docs": (2, 4, 2, 133, 133, 48, "legacy", True, False, 37, [70, 63], 0),
    "len133-mha-d32-no-ssmax": (1, 2, 2, 133, 133, 32, "current", False, True, 0, None, 0),
    # Documents that end or start one token off a tile boundary (interpreter tiles: dk/dv 64 keys x 32 queries,
    # dq 64 queries x 32 keys). Full length: row 0 ends one at 97, one query past the 3rd query tile of a key block
    # the document covers whole, row 3 at 95, one before it; row 1 starts one at 33, one key past a key tile, and
    # ends it at 129, one query past dq's 2nd tile; row 2 ends one at 65. The chunk starts at position 30, so query
    # tiles are 2 positions off the key tiles: row 0 ends a document at 125, one before the end of a query tile.
    "len133-mqa-d16-docs-end-next-to-tiles": (4, 2, 1, 133, 133, 16, "current", True, True, 0,
                                              ([97, 36], [33, 96, 4], [65, 1, 67], [95, 38]), 0),
    "chunk103-of-133-mqa-d16-docs-end-next-to-tiles": (2, 2, 1, 103, 133, 16, "legacy", True, False, 0,
                                                       ([125, 8], [33, 96, 4]), 0),
    "chunk16-of-133-d80-pad": (2, 4, 2, 16, 133, 80, "current", True, True, 40, None, 0),
    "split-auto-train11-no-ssmax": (2, 4, 2, 11, 11, 32, "current", False, True, 0, None, None),
    "split-auto-chunk7-of-64-legacy": (1, 4, 2, 7, 64, 64, "legacy", True, True, 0, None, None),
    "split3-decode1-of-70-pad": (2, 4, 2, 1, 70, 48, "current", True, True, 40, None, 3),
    "split2-decode3-of-70-docs-unscaled": (1, 4, 2, 3, 70, 32, "legacy", True, False, 0, [30, 25, 15], 2),
    "split4-chunk16-of-64-gqa4-pad-no-ssmax": (2, 4, 1, 16, 64, 32, "current", False, True, 5, None, 4),
    "split7-decode5-of-40-empty-splits": (1, 2, 2, 5, 40, 32, "current", True, True, 0, None, 7),
}


@pytest.mark.parametrize("case", list(PARITY_CASES.values()), ids=list(PARITY_CASES))
def test_output_and_gradients_match_reference(case):
    batch, heads, kv_heads, q_len, k_len, head_dim, formula, ssmax, ssmax_prior, pad, documents, splits = case
    inputs = make_inputs(batch, heads, kv_heads, q_len, k_len, head_dim)
    params = make_parameters(heads)
    positions = torch.arange(k_len - q_len, k_len)
    key_valid = left_padding(batch, k_len, pad) if pad else None
    document_ids = packed_documents(batch, k_len, documents) if documents else None
    scaling = head_dim**-0.5
    options = dict(formula=formula, key_valid=key_valid, document_ids=document_ids, ssmax_prior=ssmax_prior)

    def fused(query, key, value, theta_alpha, theta_beta, theta_mu, ssmax_scale):
        return triton_bam.ggd_attention(
            query, key, value, theta_alpha, theta_beta, theta_mu, positions, scaling=scaling,
            ssmax_scale=ssmax_scale if ssmax else None, num_splits=splits, **options,
        )

    def reference(query, key, value, *params):
        return reference_attention(query, key, value, params, positions, scaling=scaling, ssmax=ssmax, **options)

    grad_output = torch.randn(batch, q_len, heads, head_dim, dtype=torch.float64).transpose(1, 2)
    expected, expected_grads = run_with_gradients(reference, inputs, params, grad_output)
    actual, actual_grads = run_with_gradients(fused, inputs, params, grad_output.float())
    assert actual.dtype == torch.float32
    assert_output_and_gradients(actual, actual_grads, expected, expected_grads, 1e-4, 1e-3, ssmax)


def test_split_kv_is_taken_for_few_queries(monkeypatch):
    """The automatic choice really runs split-KV for <= 16 queries (so the split-auto cases above test it)."""
    calls = []
    monkeypatch.setattr(triton_bam, "_split_kv_forward", lambda *args: calls.append(args))
    query, key, value = (tensor.detach() for tensor in make_inputs(1, 4, 2, 11, 11, 32))
    theta = torch.zeros(4)
    triton_bam.ggd_attention(query, key, value, theta, theta, theta, torch.arange(11), scaling=0.2)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    batch, heads, kv_heads, length, head_dim = 1, 4, 2, 40, 64
    inputs = make_inputs(batch, heads, kv_heads, length, length, head_dim, dtype=dtype)
    params = make_parameters(heads)
    # The interpreter computes in fp32 whatever the input dtype, so this checks the 16-bit loads, casts and stores;
    # the beta range is covered in fp32 above. Here Delta = sum(dO * O) comes from the 16-bit output (as in
    # FlashAttention), an error that d theta grows with |b| (up to ~8% of a head's gradient at beta = 1.5, while the
    # same kernel on fp32 copies of these inputs is within 1e-5): a per-head 10% check still sees a wrong head,
    # a sign or a dropped term. beta = 1
    # is left out: d b / d mu is then the same for every visible key, so d theta_mu = const * sum_j dS_ij = 0 up
    # to rounding, nothing to compare.
    with torch.no_grad():
        params[1].copy_(torch.tensor([-2.0, -0.5, 0.5, 1.5]))
    positions = torch.arange(length)
    grad_output = torch.randn(batch, heads, length, head_dim).to(dtype)  # both sides get the same rounded values

    def fused(query, key, value, theta_alpha, theta_beta, theta_mu, ssmax_scale):
        return triton_bam.ggd_attention(query, key, value, theta_alpha, theta_beta, theta_mu, positions,
                                        scaling=head_dim**-0.5, ssmax_scale=ssmax_scale)

    def reference(query, key, value, *params):
        return reference_attention(query, key, value, params, positions, scaling=head_dim**-0.5, formula="current")

    expected, expected_grads = run_with_gradients(reference, inputs, params, grad_output.double())
    actual, actual_grads = run_with_gradients(fused, inputs, params, grad_output)
    assert actual.dtype == dtype and all(grad.dtype == dtype for grad in actual_grads[:3])
    for name, got, want in zip(["output", *GRADIENT_NAMES], [actual, *actual_grads], [expected, *expected_grads]):
        assert_close_per_head(got, want, 0.1, name)


def test_negative_beta_at_distance_zero_is_finite():
    """beta = -2 with mu = 0: the prior at distance 0 is -exp(alpha) * eps ** -2 ~ -1e10 and its beta
    derivative multiplies ln(eps); the first query sees only that key."""
    heads, length, head_dim = 2, 20, 32
    inputs = make_inputs(1, heads, heads, length, length, head_dim)
    theta_alpha = torch.zeros(heads, requires_grad=True)
    theta_beta = torch.full((heads,), -2.0, requires_grad=True)
    theta_mu = torch.zeros(heads, requires_grad=True)
    ssmax_scale = torch.ones(heads, requires_grad=True)
    output = triton_bam.ggd_attention(*inputs, theta_alpha, theta_beta, theta_mu, torch.arange(length),
                                      scaling=0.2, ssmax_scale=ssmax_scale, num_splits=0)
    output.square().sum().backward()
    for tensor in (output, *(x.grad for x in (*inputs, theta_alpha, theta_beta, theta_mu, ssmax_scale))):
        assert torch.isfinite(tensor).all()
    torch.testing.assert_close(output[:, :, 0], inputs[2][:, :, 0])  # a single visible key: its value


# ---------------------------------------------------------------------------------------------------- decode


@pytest.mark.parametrize("formula", ["current", "legacy", "kerple_log"])
def test_decode_equals_last_rows_of_prefill(formula):
    """Split-KV decode (prior computed analytically) against the single-pass kernel (prior table).

    Key tiles are 32 keys under the interpreter; 70 keys make 3 tiles. 4 and 7 splits leave empty splits, and
    the second row's 40 padded keys hide its whole first split.
    """
    batch, heads, kv_heads, length, head_dim = 2, 4, 2, 70, 48
    query, key, value = (tensor.detach() for tensor in make_inputs(batch, heads, kv_heads, length, length, head_dim))
    theta_alpha, theta_beta, theta_mu, ssmax_scale = (p.detach() for p in make_parameters(heads))
    key_valid = left_padding(batch, length, 40)

    def attention(rows, num_splits):
        return triton_bam.ggd_attention(
            query[:, :, length - rows:], key, value, theta_alpha, theta_beta, theta_mu,
            torch.arange(length - rows, length), scaling=head_dim**-0.5, formula=formula, key_valid=key_valid,
            ssmax_scale=ssmax_scale, num_splits=num_splits,
        )

    prefill = attention(length, 0)
    for rows in (1, 3):
        for num_splits in (None, 1, 2, 4, 7):
            decoded = attention(rows, num_splits)
            assert_close(decoded, prefill[:, :, length - rows:], 2e-5, f"{rows} rows, {num_splits} splits")


def test_decode_rows_with_no_visible_key_are_zero():
    query, key, value = (tensor.detach() for tensor in make_inputs(1, 2, 1, 2, 40, 32))
    theta_alpha, theta_beta, theta_mu, ssmax_scale = (p.detach() for p in make_parameters(2))
    key_valid = torch.zeros(1, 40, dtype=torch.bool)
    output = triton_bam.ggd_attention(query, key, value, theta_alpha, theta_beta, theta_mu, torch.arange(38, 40),
                                      scaling=0.2, key_valid=key_valid, ssmax_scale=ssmax_scale, num_splits=3)
    assert torch.equal(output, torch.zeros_like(output))


# ----------------------------------------------------------------------------------- determinism, compile


def test_gradients_are_bitwise_deterministic():
    batch, heads, kv_heads, length, head_dim = 2, 4, 2, 48, 32
    inputs = make_inputs(batch, heads, kv_heads, length, length, head_dim)
    params = make_parameters(heads)
    grad_output = torch.randn(batch, heads, length, head_dim)

    def fused(query, key, value, theta_alpha, theta_beta, theta_mu, ssmax_scale):
        return triton_bam.ggd_attention(query, key, value, theta_alpha, theta_beta, theta_mu, torch.arange(length),
                                        scaling=0.2, key_valid=left_padding(batch, length, 5),
                                        ssmax_scale=ssmax_scale)

    _, first = run_with_gradients(fused, inputs, params, grad_output)
    _, second = run_with_gradients(fused, inputs, params, grad_output)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_custom_op_and_torch_compile():
    """Fake tensors, schema and autograd registration (opcheck), then the op inside a compiled graph.

    The aot_eager backend traces what Inductor would (Dynamo + AOTAutograd with the fake kernels); Inductor
    itself on CPU needs a C++ toolchain and minutes of compile time, too slow for this suite.
    """
    heads, length, head_dim = 2, 16, 32
    inputs = make_inputs(1, heads, 1, length, length, head_dim)
    params = make_parameters(heads)
    positions = torch.arange(length)
    op_args = (*inputs, *params[:3], positions, None, None, params[3], 0.2, "current", 1e-5, True, 0)
    torch.library.opcheck(triton_bam._ggd_attention_forward_op, op_args)

    def loss(query, key, value, theta_alpha, theta_beta, theta_mu, ssmax_scale):
        output = triton_bam.ggd_attention(query * 2.0, key, value, theta_alpha, theta_beta, theta_mu, positions,
                                          scaling=0.2, ssmax_scale=ssmax_scale)
        return output.square().sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    grad_output = torch.ones(())
    _, eager_grads = run_with_gradients(loss, inputs, params, grad_output)
    _, compiled_grads = run_with_gradients(compiled, inputs, params, grad_output)
    for a, b in zip(eager_grads, compiled_grads):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------------------------------ API and imports


def test_triton_usable_reads_the_environment_at_call_time(monkeypatch):
    tensor = torch.zeros(1)
    assert triton_bam.triton_usable(tensor)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_bam.triton_usable(tensor)


def test_invalid_arguments_raise():
    query, key, value = make_inputs(1, 4, 2, 4, 4, 32)
    theta = torch.zeros(4)
    with pytest.raises(ValueError, match="formula"):
        triton_bam.ggd_attention(query, key, value, theta, theta, theta, torch.arange(4), scaling=1.0, formula="new")
    with pytest.raises(ValueError, match="do not match"):
        triton_bam.ggd_attention(query, key[:, :, :, :16], value[:, :, :, :16], theta, theta, theta,
                                 torch.arange(4), scaling=1.0)


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 128), (torch.bfloat16, 256)])
def test_head_sizes_that_do_not_fit_a_gpu_raise_before_launch(monkeypatch, dtype, head_dim):
    """Compiled (not interpreted), fp32 above 64 and 16-bit above 128 would fail at launch with OutOfResources
    (benchmarks/gpu_readiness.py): ggd_attention names the problem first."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    query, key, value = make_inputs(1, 2, 1, 4, 4, head_dim, dtype=dtype)
    theta = torch.zeros(2)
    with pytest.raises(ValueError, match=f"head size {head_dim} is not supported"):
        triton_bam.ggd_attention(query, key, value, theta, theta, theta, torch.arange(4), scaling=1.0)


def test_split_kv_beyond_one_tile_of_rows_raises():
    query, key, value = make_inputs(1, 8, 1, 9, 9, 32)  # 8 heads x 9 queries = 72 rows > 64
    theta = torch.zeros(8)
    with pytest.raises(ValueError, match="split-KV decode takes at most 64"):
        triton_bam.ggd_attention(query, key, value, theta, theta, theta, torch.arange(9), scaling=1.0, num_splits=2)


def test_module_imports_without_triton():
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "from bam_llama.model import triton_bam\n"
        "assert not triton_bam.TRITON_AVAILABLE\n"
        "assert not triton_bam.triton_usable(torch.zeros(1))\n"
    )
    result = run_within([sys.executable, "-c", script], 300, cwd=REPO_ROOT, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr


def test_benchmark_smoke():
    """benchmarks/attention.py --smoke: every provider's correctness check on a tiny shape (CPU providers only).

    Run as the command users run, in its own process (the compiled FlexAttention provider needs its module
    importable by name, which a file loaded from a path is not)."""
    result = run_within([sys.executable, str(REPO_ROOT / "benchmarks" / "attention.py"), "--smoke"], 600,
                        env={**os.environ, "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    assert "triton (bias on + SSMax)" in result.stdout


def test_triton_usable_refuses_gpu_inputs_whose_tiles_do_not_fit(monkeypatch):
    """On a GPU the model must fall back to SDPA instead of reaching the kernels' ValueError: fp32 fits up to
    head size 64, fp16/bf16 up to 128 (the limits of the ahead-of-time readiness table)."""
    monkeypatch.setattr(triton_bam, "interpreting", lambda: False)

    class GpuTensor:
        is_cuda = True

        def __init__(self, head_dim, dtype):
            self.shape, self.dtype = (1, 2, 3, head_dim), dtype

    assert triton_bam.triton_usable(GpuTensor(64, torch.float32))
    assert not triton_bam.triton_usable(GpuTensor(65, torch.float32))
    assert not triton_bam.triton_usable(GpuTensor(128, torch.float32))
    assert triton_bam.triton_usable(GpuTensor(128, torch.bfloat16))
    assert triton_bam.triton_usable(GpuTensor(128, torch.float16))
    assert not triton_bam.triton_usable(GpuTensor(256, torch.bfloat16))
    assert not triton_bam.triton_usable(torch.zeros(1, 2, 3, 64))  # a CPU tensor without the interpreter
