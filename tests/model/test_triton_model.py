"""The model's "bam_triton" attention running the fused kernels in Triton's interpreter, against "bam_eager" in fp32.

The route runs the "sdpa" paths for "bam_triton" when the kernels cannot run; the `kernel_calls` fixture makes
that fallback fail the test and counts the kernel calls, so every test here proves the kernels ran. Tiny models
(head size 16, 2 layers, 4 query / 2 key-value heads) and short sequences: the interpreter is ~300x slower than
torch.
"""

import pytest
import torch
from helpers import route_path_calls, tiny_model
from transformers import DynamicCache

pytest.importorskip("triton")

from bam_llama.model import attention_route_bam  # noqa: E402

MODEL = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Interpreter on; the SDPA fallback raises; returns the list of (query length, key length) of kernel calls."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    ggd_attention = attention_route_bam.ggd_attention

    def counted(query, key, *args, **kwargs):
        calls.append((query.shape[2], key.shape[2]))
        return ggd_attention(query, key, *args, **kwargs)

    monkeypatch.setattr(attention_route_bam, "ggd_attention", counted)
    route_path_calls(monkeypatch, refuse=set(attention_route_bam.ATTENTION_PATHS) - {"triton"})  # no SDPA fallback
    return calls


def model_pair(seed=0, **overrides):
    """The same weights with "bam_eager" and "bam_triton" attention. The prior of every layer has beta from -3
    to 1.5 and mu != 0 except in head 0, where mu = 0 puts a huge prior, -e^alpha (1e-5)^-3, on distance 0: the
    key the first token sees alone (its probability is 1 whatever the score; only an exact recomputation of the
    forward's score in the backward keeps it 1)."""
    eager = tiny_model("bam_eager", seed=seed, **MODEL, **overrides)
    with torch.no_grad():
        for name, parameter in eager.state_dict(keep_vars=True).items():  # theta_mu is a buffer (frozen)
            if name.endswith("theta_beta"):
                parameter.copy_(torch.linspace(-3.0, 1.5, parameter.numel()))
            elif name.endswith("theta_mu"):
                parameter[0] = 0.0
    fused = tiny_model("bam_triton", seed=seed, **MODEL, **overrides)
    fused.load_state_dict(eager.state_dict())
    return eager, fused


@pytest.mark.parametrize("variant", [{}, {"ssmax": True}, {"ssmax": True, "ssmax_prior": False}],
                         ids=["plain", "ssmax", "ssmax-unscaled-prior"])
def test_left_padded_batch(kernel_calls, variant):
    eager, fused = model_pair(**variant)
    input_ids = torch.randint(3, 97, (2, 21))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :6] = 0
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=attention_mask).logits
        actual = fused(input_ids, attention_mask=attention_mask).logits
    rows = attention_mask.bool()
    torch.testing.assert_close(actual[rows], expected[rows], atol=1e-4, rtol=1e-4)
    assert kernel_calls == [(21, 21)] * 2  # one prefill call per layer


def test_packed_documents(kernel_calls):
    eager, fused = model_pair(ssmax=True)
    input_ids = torch.randint(3, 97, (1, 20))
    position_ids = torch.cat([torch.arange(7), torch.arange(9), torch.arange(4)])[None]  # three documents
    with torch.no_grad():
        expected = eager(input_ids, position_ids=position_ids, use_cache=False).logits
        actual = fused(input_ids, position_ids=position_ids, use_cache=False).logits
        unpacked = fused(input_ids[:, 7:16], use_cache=False).logits  # the second document on its own
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(actual[:, 7:16], unpacked, atol=1e-4, rtol=1e-4)
    assert len(kernel_calls) == 4


def test_chunked_prefill_against_a_cache(kernel_calls):
    """A 9-token prompt, then chunks of 5 (split-KV: <= 16 queries) and 1 token against the cache."""
    eager, fused = model_pair(ssmax=True)
    input_ids = torch.randint(3, 97, (2, 15))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    logits = {}
    with torch.no_grad():
        for name, model in (("eager", eager), ("fused", fused)):
            cache = DynamicCache(config=model.config)
            chunks = []
            for start, end in ((0, 9), (9, 14), (14, 15)):
                output = model(input_ids[:, start:end], attention_mask=attention_mask[:, :end],
                               past_key_values=cache, use_cache=True)
                chunks.append(output.logits)
            logits[name] = torch.cat(chunks, 1)
    rows = attention_mask.bool()
    torch.testing.assert_close(logits["fused"][rows], logits["eager"][rows], atol=1e-4, rtol=1e-4)
    assert kernel_calls == [(9, 9)] * 2 + [(5, 14)] * 2 + [(1, 15)] * 2


def test_generate(kernel_calls):
    eager, fused = model_pair(ssmax=True)
    prompt = torch.randint(3, 97, (2, 6))
    attention_mask = torch.ones_like(prompt)
    attention_mask[1, :2] = 0
    options = dict(attention_mask=attention_mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = eager.generate(prompt, **options)
        actual = fused.generate(prompt, **options)
    assert torch.equal(actual, expected)
    assert len(kernel_calls) == 2 * 4  # prompt + 3 decode steps, two layers


@pytest.mark.parametrize("length", [11, 20], ids=["split-kv-11", "prefill-20"])
@pytest.mark.parametrize("variant", [{}, {"ssmax": True, "prior_scope": "layer"}], ids=["plain", "ssmax-layer"])
def test_gradients_through_the_model(kernel_calls, length, variant):
    """Training loss and every parameter gradient (prior and SSMax included, theta_mu trained), left padding.

    11 tokens take the split-KV forward (<= 16 queries), 20 the single-pass kernel; both share the backward.
    """
    grads = {}
    losses = {}
    input_ids = torch.randint(3, 97, (2, length))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    for name, model in zip(("eager", "fused"), model_pair(**variant)):
        model.train()
        model.config.train_theta_mu = True
        model.apply_prior_trainability()
        loss = model(input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False).loss
        loss.backward()
        losses[name] = loss.detach()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(losses["fused"], losses["eager"], atol=1e-5, rtol=1e-5)
    assert grads["fused"].keys() == grads["eager"].keys()
    assert any(name.endswith("theta_mu") for name in grads["eager"])
    for name, expected in grads["eager"].items():  # per element: one head per element for the prior parameters
        torch.testing.assert_close(grads["fused"][name], expected, atol=1e-4, rtol=1e-3, msg=name)
    assert kernel_calls == [(length, length)] * 2
