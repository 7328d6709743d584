"""Continuous batching (`generate_batch`, `init_continuous_batching`): BAM's attention over Transformers' paged KV
cache gives every request the tokens and log-probabilities of greedy decoding by full forward passes, whatever the
other requests of its steps, and what cannot keep the prior is refused before any request runs.

The reference is computed here: one full forward (no cache) per generated token, argmax and log-softmax.
"""

import dataclasses

import pytest
import torch
from helpers import route_path_calls, tiny_model
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching import initialization
from waiting import scaled

from bam_llama.model import continuous_batching_bam

VOCAB = 97
STEPS = 5
PROMPTS = [  # different lengths; the 13-token prompt takes several steps of prefill at 8 tokens a batch
    [5, 17, 33, 8, 71, 2, 64],
    [90, 12, 45],
    [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43],
    [60],
]
PAGE_FIELD = "page_size" if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} else "block_size"


def batching_config(max_batch_tokens: int = 64, **overrides) -> ContinuousBatchingConfig:
    """A small paged cache (Transformers sizes it from free memory otherwise: slow to allocate on CPU)."""
    settings = {PAGE_FIELD: 8, "num_blocks": 32, "max_batch_tokens": max_batch_tokens, "return_logprobs": True}
    return ContinuousBatchingConfig(**{**settings, **overrides})


def greedy(**overrides) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=STEPS, do_sample=False, eos_token_id=-1, pad_token_id=0, **overrides)


def full_forward_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Tokens and their log-probabilities, one full forward of the whole sequence per token."""
    sequence, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(STEPS):
            log_probs = model(torch.tensor([sequence]), use_cache=False).logits[0, -1].float().log_softmax(-1)
            token = int(log_probs.argmax())
            tokens.append(token)
            logprobs.append(float(log_probs[token]))
            sequence.append(token)
    return tokens, logprobs


def assert_matches_full_forwards(model, prompts, outputs):
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        assert output.error is None, output.error
        assert output.prompt_ids == prompt
        tokens, logprobs = full_forward_greedy(model, prompt)
        assert output.generated_tokens == tokens, prompt
        torch.testing.assert_close(torch.tensor(output.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=1e-4)


@pytest.fixture
def steps(monkeypatch):
    """Every step's requests as (queries, keys) lengths, recorded where the model reads them."""
    recorded = []
    from_kwargs = continuous_batching_bam.PagedRequests.from_kwargs.__func__

    def recording(cls, kwargs):
        requests = from_kwargs(cls, kwargs)
        recorded.append([(q.stop - q.start, k.stop - k.start) for q, k in requests.spans()])
        return requests

    monkeypatch.setattr(continuous_batching_bam.PagedRequests, "from_kwargs", classmethod(recording))
    return recorded


VARIANTS = {
    "global": {},
    "ssmax-layer": {"ssmax": True, "prior_scope": "layer"},
    "ssmax-unscaled-prior": {"ssmax": True, "ssmax_prior": False},
    "ssmax-sinusoidal-positions": {"ssmax": True, "absolute_positions": "sinusoidal"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_generate_batch_equals_greedy_full_forwards(implementation, variant, steps):
    model = tiny_model(implementation, **VARIANTS[variant])
    outputs = model.generate_batch(PROMPTS, generation_config=greedy(), continuous_batching_config=batching_config(8))
    assert_matches_full_forwards(model, PROMPTS, list(outputs.values()))
    assert model.config._attn_implementation == implementation  # "paged|eager" while batching, then restored
    chunked = [(q, k) for step in steps for q, k in step if 1 < q < k]
    assert chunked, "no step prefilled a prompt after earlier chunks of it"
    assert any(len({k - q for q, k in step}) > 1 for step in steps), "no step batched requests at different positions"


def test_sdpa_batches_through_the_blocked_path_never_a_materialized_bias(monkeypatch):
    """Each request's attention is the blocked SDPA over a window of the step's prior table: a path that builds the
    (queries x keys) bias per request grows with the square of a long prompt (issue 47 found every request taking
    it, the table unused)."""
    paths = route_path_calls(monkeypatch)
    model = tiny_model("sdpa", ssmax=True)
    outputs = model.generate_batch(PROMPTS, generation_config=greedy(), continuous_batching_config=batching_config(8))
    assert_matches_full_forwards(model, PROMPTS, list(outputs.values()))
    calls = {  # blocked: the paths over a window of the step's prior table
        "blocked": sum(call.prior_table is not None for _, call in paths),
        "materialized": sum(path == "materialized" for path, _ in paths),
    }
    assert calls["blocked"] > 0 and calls["materialized"] == 0, calls


def test_requests_of_a_started_manager_equal_greedy_full_forwards():
    model = tiny_model("sdpa", ssmax=True)
    manager = model.init_continuous_batching(generation_config=greedy(), continuous_batching_config=batching_config())
    manager.start()
    try:
        request_ids = [manager.add_request(prompt, max_new_tokens=STEPS) for prompt in PROMPTS]
        outputs = [manager.get_result(request_id, timeout=scaled(120)) for request_id in request_ids]
    finally:
        manager.stop(block=True, timeout=scaled(60))
    assert all(output is not None and output.is_finished() for output in outputs)
    assert_matches_full_forwards(model, PROMPTS, outputs)


def count_forwards(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


def test_fused_kernels_are_refused_before_any_request_runs():
    model = tiny_model("bam_triton")
    calls = count_forwards(model)
    with pytest.raises(ValueError, match=r"'bam_triton' kernels do not read that cache.*set_attn_implementation\('sdpa'\)"):
        model.generate_batch(PROMPTS, generation_config=greedy(), continuous_batching_config=batching_config())
    assert calls == []


def test_cuda_graphs_are_refused_before_any_request_runs(monkeypatch):
    """CUDA graphs cannot capture the host-side read of each request's length (here forced on, as on a GPU)."""

    def graphs_on(cb_config, *args, **kwargs):
        cb_config.use_cuda_graph = (True, True)

    monkeypatch.setattr(initialization, "decide_use_cuda_graphs", graphs_on)
    model = tiny_model("sdpa")
    calls = count_forwards(model)
    with pytest.raises(ValueError, match=r"CUDA graphs.*use_cuda_graph=False"):
        model.generate_batch(PROMPTS, generation_config=greedy(), continuous_batching_config=batching_config())
    assert calls == []


@pytest.mark.parametrize("requested, kept", [("paged|eager", "eager"), ("paged|sdpa", "sdpa")])
def test_paged_names_select_bams_own_attention(requested, kept):
    """The names continuous batching asks for (Transformers 5.24 switches eager to "paged|eager", earlier releases
    every implementation to "paged|<name>") keep BAM's attention, which reads the paged cache itself."""
    model = tiny_model("sdpa")
    model.set_attn_implementation(requested)
    assert model.config._attn_implementation == kept
