"""The compiled Triton kernels on a CUDA GPU (skipped without one): realistic lengths, every supported head size,
16-bit inputs, split-KV decode against a long cache, and the model's `bam_triton` path against `bam_sdpa`.

The CPU suite checks the kernels' logic under TRITON_INTERPRET=1 on tiny shapes; this module checks what the
interpreter cannot: that the kernels compile for the GPU (tl.dot shapes, block sizes, shared memory) and keep their
accuracy at lengths where tiles are full and many programs run.
"""

import pytest
import reference
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the CPU suite runs the kernels in Triton's interpreter)", allow_module_level=True)
pytest.importorskip("triton")

from helpers import tiny_model  # noqa: E402

from bam_llama.model import triton_bam  # noqa: E402

DEVICE = torch.device("cuda")
HEAD_SIZES = (32, 48, 64, 80, 96, 128)  # fp32 inputs are supported up to 64 (triton_bam.MAX_HEAD_DIM)


def random_attention_inputs(batch, heads, kv_heads, q_len, k_len, head_dim, dtype, seed=0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)

    def tensor(num_heads, length):
        storage = torch.randn(batch, length, num_heads, head_dim, generator=generator, device=DEVICE)
        return storage.to(dtype).transpose(1, 2)  # the model's (B, H, L, D) view of (B, L, H, D) storage

    query, key, value = tensor(heads, q_len), tensor(kv_heads, k_len), tensor(kv_heads, k_len)
    theta_alpha = torch.rand(heads, generator=generator, device=DEVICE) * 2 - 1.5
    theta_beta = torch.linspace(-2.0, 2.0, heads, device=DEVICE)
    theta_mu = torch.rand(heads, generator=generator, device=DEVICE) - 0.5
    ssmax_scale = 0.8 + 0.4 * torch.rand(heads, generator=generator, device=DEVICE)
    return [query, key, value], [theta_alpha, theta_beta, theta_mu, ssmax_scale]


def expected_attention(query, key, value, theta_alpha, theta_beta, theta_mu, ssmax_scale, positions, scaling,
                       key_valid=None):
    """tests/reference.py's float64 attention (SSMax scaling the prior, the config's default)."""
    return reference.bam_attention(
        query, key, value, positions, theta_alpha, theta_beta, theta_mu, scaling=scaling, ssmax_scale=ssmax_scale,
        key_valid=key_valid,
    )


def with_gradients(attention, tensors, grad_output):
    leaves = [tensor.detach().clone().requires_grad_() for tensor in tensors]
    output = attention(*leaves)
    (output.float() * grad_output).sum().backward()
    return output.detach().float(), [leaf.grad.float() for leaf in leaves]


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-6)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_prefill_forward_and_backward_match_the_reference(head_dim, dtype):
    if not triton_bam.head_dim_supported(head_dim, dtype):
        pytest.skip(f"{dtype} at head size {head_dim} does not fit a GPU: ggd_attention raises")
    batch, heads, kv_heads, length = 2, 8, 2, 1029  # not a multiple of any block size
    inputs, params = random_attention_inputs(batch, heads, kv_heads, length, length, head_dim, dtype)
    positions = torch.arange(length, device=DEVICE)
    key_valid = torch.ones(batch, length, dtype=torch.bool, device=DEVICE)
    key_valid[1, :300] = False  # left padding
    scaling = head_dim**-0.5
    grad_output = torch.randn(batch, heads, length, head_dim, device=DEVICE)

    def fused(query, key, value, *params):
        return triton_bam.ggd_attention(query, key, value, *params[:3], positions, scaling=scaling,
                                        key_valid=key_valid, ssmax_scale=params[3])

    def plain(query, key, value, *params):
        return expected_attention(query, key, value, *params, positions, scaling, key_valid)

    expected, expected_grads = with_gradients(plain, [t.float() for t in inputs] + params, grad_output)
    actual, actual_grads = with_gradients(fused, inputs + params, grad_output)
    tolerance = 1e-3 if dtype == torch.float32 else 2e-2
    assert relative_error(actual, expected) < tolerance
    names = ["dq", "dk", "dv", "d theta_alpha", "d theta_beta", "d theta_mu", "d ssmax_scale"]
    for name, got, want in zip(names, actual_grads, expected_grads):
        assert torch.isfinite(got).all(), name
        assert relative_error(got, want) < 5 * tolerance, name


@pytest.mark.parametrize("num_splits", [None, 1, 8, 64])
def test_decode_against_a_long_cache_equals_prefill(num_splits):
    batch, heads, kv_heads, k_len, head_dim = 1, 8, 2, 65_536, 128
    inputs, params = random_attention_inputs(batch, heads, kv_heads, 4, k_len, head_dim, torch.bfloat16)
    query, key, value = inputs
    positions = torch.arange(k_len - 4, k_len, device=DEVICE)
    common = dict(scaling=head_dim**-0.5, ssmax_scale=params[3])
    with torch.no_grad():
        single_pass = triton_bam.ggd_attention(query, key, value, *params[:3], positions, num_splits=0, **common)
        split = triton_bam.ggd_attention(query, key, value, *params[:3], positions, num_splits=num_splits, **common)
    assert relative_error(split.float(), single_pass.float()) < 1e-2


@pytest.mark.parametrize("q_len, num_splits", [(1, 8), (11, None), (16, 3)])
def test_gradients_through_split_kv_decode(q_len, num_splits):
    """A training call with <= 16 queries takes split-KV: its backward must recompute the forward's exact scores
    (same prior table), for negative beta without SSMax in particular."""
    batch, heads, kv_heads, k_len, head_dim = 2, 8, 2, 3000, 128
    inputs, params = random_attention_inputs(batch, heads, kv_heads, q_len, k_len, head_dim, torch.bfloat16)
    with torch.no_grad():
        params[2][0] = 0.0  # mu = 0 with beta = -2: a huge prior at distance 0
    positions = torch.arange(k_len - q_len, k_len, device=DEVICE)
    scaling = head_dim**-0.5
    grad_output = torch.randn(batch, heads, q_len, head_dim, device=DEVICE)

    def fused(query, key, value, *params):
        return triton_bam.ggd_attention(query, key, value, *params[:3], positions, scaling=scaling,
                                        num_splits=num_splits)

    def plain(query, key, value, *params):
        return reference.bam_attention(query, key, value, positions, *params[:3], scaling=scaling)

    expected, expected_grads = with_gradients(plain, [t.float() for t in inputs] + params[:3], grad_output)
    actual, actual_grads = with_gradients(fused, inputs + params[:3], grad_output)
    assert relative_error(actual, expected) < 2e-2
    for name, got, want in zip(["dq", "dk", "dv", "d theta_alpha", "d theta_beta", "d theta_mu"], actual_grads,
                               expected_grads):
        assert torch.isfinite(got).all(), name
        assert relative_error(got, want) < 5e-2, name


def test_parameter_gradients_are_bitwise_deterministic():
    inputs, params = random_attention_inputs(1, 8, 2, 2048, 2048, 64, torch.bfloat16)
    positions = torch.arange(2048, device=DEVICE)
    grad_output = torch.randn(1, 8, 2048, 64, device=DEVICE)

    def fused(query, key, value, *params):
        return triton_bam.ggd_attention(query, key, value, *params[:3], positions, scaling=0.125, ssmax_scale=params[3])

    first = with_gradients(fused, inputs + params, grad_output)[1][3:]
    second = with_gradients(fused, inputs + params, grad_output)[1][3:]
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def bam_pair(**overrides):
    sdpa = tiny_model("bam_sdpa", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, **overrides)
    triton = tiny_model("bam_triton", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, **overrides)
    return sdpa.to(DEVICE), triton.to(DEVICE)


@pytest.mark.parametrize("overrides", [{}, {"ssmax": True, "prior_scope": "layer"}], ids=["global", "ssmax-layer"])
def test_model_with_bam_triton_matches_bam_sdpa_and_generates_the_same(overrides):
    sdpa, triton = bam_pair(**overrides)
    input_ids = torch.randint(3, 97, (2, 700), device=DEVICE)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :123] = 0
    with torch.no_grad():
        expected = sdpa(input_ids, attention_mask=attention_mask).logits
        actual = triton(input_ids, attention_mask=attention_mask).logits
    rows = attention_mask.bool()
    torch.testing.assert_close(actual[rows], expected[rows], atol=2e-3, rtol=2e-3)
    prompt = input_ids[:1, :300]
    generated = [model.generate(prompt, max_new_tokens=24, do_sample=False) for model in (sdpa, triton)]
    assert torch.equal(*generated)


def test_model_under_torch_compile():
    _, triton = bam_pair(ssmax=True)
    input_ids = torch.randint(3, 97, (1, 512), device=DEVICE)
    with torch.no_grad():
        eager = triton(input_ids).logits
        compiled = torch.compile(triton, fullgraph=False)(input_ids).logits
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
