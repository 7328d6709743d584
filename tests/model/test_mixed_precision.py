"""Mixed precision: `torch.autocast` (bf16 and fp16) around a training step, on every attention path, as Trainer,
TRL and `--bf16` run it.

* The model: loss and the gradient of every parameter (prior and SSMax scale included) within a few units of
  the dtype's precision of float32, on each path, with SSMax on and off, a global and a per-layer prior, padding
  and packed documents; a same-size Llama, measured in the same test, is the bar for that bound.
* The attention: autocast changes nothing in BAM's attention functions. Given the same 16-bit inputs they return
  the same output and gradients with or without autocast (their float32 compute stays float32; SDPA is not
  switched to 16 bits, nor is the prior's mask rounded).
* The fused kernels' wrapper: under autocast the kernels get query, key and value in autocast's dtype and the
  prior and SSMax parameters in float32; gradients come back in each input's dtype. The interpreter's 16-bit
  arithmetic is not a GPU's, so the kernels compute on float32 copies here (`float32_kernels`): what is checked is
  the wrapper around them.
"""

import contextlib

import pytest
import reference
import torch
from helpers import tiny_llama, tiny_model

from bam_llama.model import triton_bam
from bam_llama.model.attention_route_bam import bam_attention_blocked
from bam_llama.model.prior_bam import ggd_bias, ssmax_factor, visible_key_counts
from bam_llama.model.reference_bam import bam_attention_reference, bam_attention_sdpa

DTYPES = [torch.bfloat16, torch.float16]
# Relative error (Frobenius norm, per tensor) allowed against float32: 8 units of the dtype's precision
# (bf16: 0.0625, fp16: 0.0078). Measured at most ~3.3 units in bf16 and ~5.7 in fp16 (a per-layer prior's
# gradient with packed documents); Llama's worst tensor is at ~1 and ~3.8.
PRECISION_UNITS = 8
LENGTH = 40  # SSMax, padding or packing make "sdpa" materialize block masks of 32 rows: 2 blocks


def tolerance(dtype: torch.dtype) -> float:
    return PRECISION_UNITS * torch.finfo(dtype).eps


def batch(kind: str, mask_4d: bool = False, length: int = LENGTH) -> dict:
    """Inputs and labels: plain rows, left padding, or two packed documents a row; with `mask_4d` the same
    visibility as a custom boolean (B, 1, L, L) mask, which takes the materialized SDPA path."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 97, (2, length), generator=generator)
    labels = input_ids.clone()
    inputs = {"input_ids": input_ids}
    key_valid = torch.ones(2, length, dtype=torch.bool)
    documents = torch.zeros(2, length, dtype=torch.long)
    if kind == "padding":
        key_valid[1, :9] = False
        labels[~key_valid] = -100
        inputs["attention_mask"] = key_valid.long()
    elif kind == "packed":
        documents[:, 10:] = 1
        inputs["position_ids"] = torch.cat([torch.arange(10), torch.arange(length - 10)])[None].expand(2, -1)
    if mask_4d:
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        same_document = documents[:, :, None] == documents[:, None, :]
        inputs = {"input_ids": input_ids, "attention_mask": (causal & same_document & key_valid[:, None, :])[:, None]}
    return {**inputs, "labels": labels, "use_cache": False}


def loss_and_gradients(model, inputs: dict, dtype: torch.dtype | None):
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_errors(model, inputs: dict, dtype: torch.dtype) -> dict[str, float]:
    """Relative error of the loss and of every parameter's gradient under autocast, against float32."""
    loss, grads = loss_and_gradients(model, inputs, None)
    low_loss, low_grads = loss_and_gradients(model, inputs, dtype)
    assert low_grads.keys() == grads.keys()
    errors = {"loss": (abs(low_loss - loss) / abs(loss)).item()}
    for name, grad in grads.items():
        assert low_grads[name].dtype == grad.dtype, name  # every gradient in its parameter's dtype
        errors[name] = ((low_grads[name] - grad).norm() / grad.norm()).item()
    return errors


# Every pair of (SSMax on / off, global / per-layer prior, plain / padding / packed) in six variants.
VARIANTS = [
    dict(ssmax=True, prior_scope="global", kind="plain"),
    dict(ssmax=False, prior_scope="global", kind="padding"),
    dict(ssmax=True, prior_scope="global", kind="packed"),
    dict(ssmax=False, prior_scope="layer", kind="plain"),
    dict(ssmax=True, prior_scope="layer", kind="padding"),
    dict(ssmax=False, prior_scope="layer", kind="packed"),
]


def check_variants(attention: str, dtype: torch.dtype, variants, mask_4d: bool = False, length: int = LENGTH):
    bound = tolerance(dtype)
    llama = relative_errors(tiny_llama("sdpa").train(), batch("plain"), dtype)
    assert max(llama.values()) < bound, llama  # the bound is the dtype's precision, which Llama meets
    failures = []
    for variant in variants:
        variant = dict(variant)
        kind = variant.pop("kind")
        model = tiny_model(attention, train_theta_mu=True, **variant).train()
        errors = relative_errors(model, batch(kind, mask_4d, length), dtype)
        prior = [name for name in errors if "prior" in name or "ssmax" in name]
        assert len(prior) == 3 * (1 if variant["prior_scope"] == "global" else 2) + 2 * variant["ssmax"], prior
        failures += [(variant, kind, name, error) for name, error in errors.items() if not error < bound]
    assert not failures, f"relative error above {bound:.4f} (Llama's worst: {max(llama.values()):.4f}): {failures}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_autocast_training_matches_float32(attention, dtype):
    """`VARIANTS`, theta_mu trained too."""
    check_variants(attention, dtype, VARIANTS)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_autocast_training_with_a_custom_4d_mask_matches_float32(dtype):
    """A custom 4D mask takes the materialized SDPA path of "sdpa" (and of "bam_triton"'s fallback)."""
    check_variants("sdpa", dtype, VARIANTS, mask_4d=True)


# ------------------------------------------------------------------------------------ the attention functions


def attention_inputs(dtype, kind, ssmax=True, batch_size=2, heads=4, kv_heads=2, length=40, head_dim=8):
    """16-bit query / key / value and float32 prior and SSMax parameters, all leaves requiring gradients."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(batch_size, heads, length, head_dim)] + [(batch_size, kv_heads, length, head_dim)] * 2
    qkv = [torch.randn(shape, generator=generator).to(dtype).requires_grad_() for shape in shapes]
    prior = [torch.linspace(-1.0, 1.0, heads), torch.linspace(-0.5, 1.2, heads), torch.linspace(-0.3, 0.4, heads)]
    prior = [p.clone().requires_grad_() for p in prior]
    scale = torch.linspace(0.8, 1.2, heads).requires_grad_() if ssmax else None
    key_valid = document_ids = None
    if kind == "padding":
        key_valid = torch.ones(batch_size, length, dtype=torch.bool)
        key_valid[1, :7] = False
    elif kind == "packed":
        document_ids = (torch.arange(length) >= 8).long()[None].expand(batch_size, -1)
    return qkv, prior, scale, key_valid, document_ids


def run_blocked(qkv, prior, scale, key_valid, document_ids, ssmax_prior, dropout=0.0):
    positions = torch.arange(qkv[0].shape[2])
    table = ggd_bias(torch.arange(-int(positions[-1]), 1, dtype=torch.float32), *prior)
    return bam_attention_blocked(
        *qkv, positions, table, qkv[0].shape[-1] ** -0.5, ssmax_scale=scale, ssmax_prior=ssmax_prior,
        key_valid=key_valid, document_ids=document_ids, dropout=dropout,
    )


def materialized_inputs(qkv, prior, scale, key_valid, document_ids):
    positions = torch.arange(qkv[0].shape[2])
    visible = reference.visible(positions, positions.numel(), key_valid, document_ids, qkv[0].shape[0])[:, None]
    distance = (positions[None, :] - positions[:, None]).float()
    bias = ggd_bias(distance, *prior)[None]
    factor = None
    if scale is not None:
        factor = ssmax_factor(visible_key_counts(positions, positions.numel(), key_valid, document_ids), scale)
    return visible, bias, factor


def run_materialized(function, qkv, prior, scale, key_valid, document_ids, ssmax_prior):
    visible, bias, factor = materialized_inputs(qkv, prior, scale, key_valid, document_ids)
    output = function(*qkv, visible, bias, qkv[0].shape[-1] ** -0.5, factor, ssmax_prior)
    return output[0] if isinstance(output, tuple) else output


PATHS = {
    "blocked": run_blocked,  # "sdpa"
    "blocked-dropout": lambda *a: run_blocked(*a, dropout=0.25),  # "sdpa" training with dropout: blocks replayed
    "materialized-sdpa": lambda *a: run_materialized(bam_attention_sdpa, *a),  # "sdpa" with a custom 4D mask
    "eager": lambda *a: run_materialized(bam_attention_reference, *a),
}


def output_and_gradients(path, dtype, kind, ssmax, ssmax_prior, autocast_dtype):
    """The path's output and the gradients of its inputs (query, key, value, prior, SSMax scale). The backward
    runs outside autocast, as PyTorch recommends, except through BAM's own backward ("blocked"), which must run
    as its forward did even when called inside an autocast region (torch.amp.custom_bwd's convention). Dropout's
    random masks are drawn from the same seed in every call."""
    torch.manual_seed(0)
    qkv, prior, scale, key_valid, document_ids = attention_inputs(dtype, kind, ssmax)
    autocast = torch.autocast("cpu", dtype=autocast_dtype or dtype, enabled=autocast_dtype is not None)
    with autocast, torch.no_grad():  # inference takes other paths than training
        inference = PATHS[path](qkv, prior, scale, key_valid, document_ids, ssmax_prior)
    with autocast:
        output = PATHS[path](qkv, prior, scale, key_valid, document_ids, ssmax_prior)
    weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(5))
    with autocast if path.startswith("blocked") else contextlib.nullcontext():
        (output.float() * weights).sum().backward()
    leaves = [*qkv, *prior] + ([scale] if scale is not None else [])
    return [inference, output.detach()], [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(
    "kind, ssmax, ssmax_prior",
    [("plain", False, True), ("plain", True, True), ("padding", True, True), ("packed", True, False)],
    ids=["plain", "ssmax", "ssmax-padding", "ssmax-unscaled-prior-packed"],
)
def test_autocast_leaves_the_attention_unchanged(path, dtype, kind, ssmax, ssmax_prior):
    """The same 16-bit inputs, with and without autocast: the same output (inference and training) and gradients,
    bit for bit, each gradient in its input's dtype. (Autocast on inside would run SDPA in 16 bits with a 16-bit
    prior mask.)"""
    expected, expected_grads = output_and_gradients(path, dtype, kind, ssmax, ssmax_prior, None)
    outputs, grads = output_and_gradients(path, dtype, kind, ssmax, ssmax_prior, dtype)
    for output, expected_output in zip(outputs, expected):  # without gradients, then with
        assert output.dtype == expected_output.dtype == dtype
        assert torch.equal(output, expected_output)
    for index, (grad, expected_grad) in enumerate(zip(grads, expected_grads)):
        assert grad.dtype == expected_grad.dtype, index
        assert torch.equal(grad, expected_grad), index


# ------------------------------------------------------------------------------------------ the fused kernels


@pytest.fixture
def float32_kernels(monkeypatch):
    """The interpreter on, the fused kernels computing on float32 copies of their 16-bit inputs (results cast back
    to the dtypes a GPU's kernels return); returns the dtypes each call received."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    forward, backward = triton_bam._attention_forward, triton_bam._attention_backward

    def dtypes(arguments):
        return [a.dtype if isinstance(a, torch.Tensor) else None for a in arguments]

    def float32_forward(query, key, value, *rest):
        calls.append(("forward", dtypes((query, key, value, *rest[:3]))))
        out, lse = forward(query.float(), key.float(), value.float(), *rest)
        return out.to(query.dtype), lse

    def float32_backward(grad_out, query, key, value, out, *rest):
        calls.append(("backward", dtypes((grad_out, query, key, value, out, *rest[1:4]))))
        grads = backward(grad_out.float(), query.float(), key.float(), value.float(), out.float(), *rest)
        return (grads[0].to(query.dtype), grads[1].to(key.dtype), grads[2].to(value.dtype), *grads[3:])

    monkeypatch.setattr(triton_bam, "_attention_forward", float32_forward)
    monkeypatch.setattr(triton_bam, "_attention_backward", float32_backward)
    return calls


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_kernels_take_autocast_dtype_inputs_and_float32_parameters(float32_kernels, dtype):
    """Under autocast, query in float32 with key / value in 16 bits (a float32 prefix before 16-bit keys, say):
    the kernels get all three in autocast's dtype, the prior and SSMax parameters in float32; the output is in
    autocast's dtype, within its precision of the float64 reference; each gradient is in its input's dtype."""
    (query, key, value), prior, scale, key_valid, _ = attention_inputs(dtype, "padding")
    query = query.detach().float().requires_grad_()
    positions = torch.arange(query.shape[2])
    with torch.autocast("cpu", dtype=dtype):
        output = triton_bam.ggd_attention(query, key, value, *prior, positions, scaling=0.25, key_valid=key_valid,
                                          ssmax_scale=scale)
    output.float().sum().backward()
    assert output.dtype == dtype
    assert float32_kernels == [("forward", [dtype] * 3 + [torch.float32] * 3),
                               ("backward", [dtype] * 5 + [torch.float32] * 3)]
    assert query.grad.dtype == torch.float32 and key.grad.dtype == value.grad.dtype == dtype
    assert all(p.grad.dtype == torch.float32 for p in (*prior, scale))
    expected = reference.bam_attention(query, key, value, positions, *prior, scaling=0.25, ssmax_scale=scale,
                                       key_valid=key_valid)
    rows = key_valid[:, None, :, None].expand_as(expected)
    torch.testing.assert_close(output.double()[rows], expected[rows].detach(), rtol=0, atol=tolerance(dtype))


@pytest.mark.parametrize(
    "dtype, variant",
    [(torch.bfloat16, dict(ssmax=True, prior_scope="global", kind="padding")),
     (torch.float16, dict(ssmax=False, prior_scope="layer", kind="packed"))],
    ids=["bf16-ssmax-global-padding", "fp16-layer-packed"],
)
def test_autocast_training_on_the_kernels_matches_float32(float32_kernels, dtype, variant):
    """The model's "bam_triton" path under autocast (kernels on float32 copies, see the fixture); 24 tokens, for
    the interpreter's sake."""
    check_variants("bam_triton", dtype, [variant], length=24)
    forward = [kinds for call, kinds in float32_kernels if call == "forward"]
    assert {tuple(kinds[:3]) for kinds in forward} == {(torch.float32,) * 3, (dtype,) * 3}  # float32, autocast
    assert all(kinds[3:] == [torch.float32] * 3 for kinds in forward)
    assert len(forward) == len(float32_kernels) / 2  # every forward's backward ran on the kernels too


def test_compiled_model_under_autocast_equals_eager_under_autocast():
    """`torch.compile(fullgraph=True)` of a model trained under autocast: the loss and gradients of eager autocast
    (the autocast-off region of the attention and BAM's own backward operator inside a compiled graph)."""
    model = tiny_model("sdpa", ssmax=True).train()
    inputs = batch("padding")
    expected_loss, expected = loss_and_gradients(model, inputs, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled(**inputs).loss
    loss.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    for name, grad in expected.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-5, atol=1e-6, msg=name)
