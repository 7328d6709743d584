"""vLLM serving a BamLlama (through the package's entry point) gives Transformers' `eager` results in fp32.

Each case is one tiny random model served by one vLLM engine: a batch of prompts from 5 to 1,500 tokens submitted
together (continuous batching of very different lengths), their greedy tokens and prompt log-probabilities, then two
prompts that share a long prefix with a finished one (prefix caching). The witness is Transformers' `eager` path on
the same folder, in this process.
"""

import pytest
import torch
from conftest import EagerReference, build_tiny_bam, run_vllm, text_token_ids

NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-4
PROMPT_LENGTHS = (5, 17, 130, 511, 777, 1_024, 1_500)
PREFIX_LENGTH = 900  # shared by the batch's 1,024-token prompt and the two prompts submitted after it
MAX_MODEL_LEN = 1_600

CASES = {
    # name: (model overrides, engine overrides)
    "layer-prior_ssmax-scales-prior_gqa_whole-prompts": (
        dict(prior_scope="layer", ssmax=True, ssmax_prior=True, num_key_value_heads=2),
        dict(max_num_batched_tokens=2_048),
    ),
    "layer-prior_ssmax-scales-prior_gqa_chunked": (
        dict(prior_scope="layer", ssmax=True, ssmax_prior=True, num_key_value_heads=2),
        dict(max_num_batched_tokens=100, block_size=16),
    ),
    "global-prior_ssmax-after-prior_legacy-formula_mha_chunked": (
        dict(prior_scope="global", ssmax=True, ssmax_prior=False, prior_formula="legacy", num_key_value_heads=4),
        dict(max_num_batched_tokens=100, block_size=16),
    ),
    "global-prior_no-ssmax_gqa-4-to-1_whole-prompts": (
        dict(prior_scope="global", ssmax=False, num_key_value_heads=1),
        dict(max_num_batched_tokens=2_048),
    ),
}


def batch_prompts() -> list[list[int]]:
    """Different text for every prompt; the 1,024-token one starts with the shared prefix."""
    prompts = [text_token_ids(length, offset=10_000 * (index + 1)) for index, length in enumerate(PROMPT_LENGTHS)]
    shared = PROMPT_LENGTHS.index(1_024)
    prompts[shared] = text_token_ids(PREFIX_LENGTH) + text_token_ids(1_024 - PREFIX_LENGTH, offset=200_000)
    return prompts


def prefix_sharing_prompts() -> list[list[int]]:
    return [text_token_ids(PREFIX_LENGTH) + text_token_ids(length, offset=300_000 + length) for length in (40, 133)]


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory):
    """(reference, vLLM's results, the batch, the prefix-sharing prompts) for one case."""
    model_overrides, engine_overrides = CASES[request.param]
    folder = build_tiny_bam(tmp_path_factory.mktemp("model"), seed=len(request.param), **model_overrides)
    batch, then = batch_prompts(), prefix_sharing_prompts()
    engine = dict(
        dtype="float32", enforce_eager=True, seed=0, max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
        enable_prefix_caching=True, skip_tokenizer_init=True, **engine_overrides,
    )
    job = dict(folder=str(folder), engine=engine, batch=batch, then=then, max_tokens=NEW_TOKENS, prompt_logprobs=True)
    results = run_vllm(job, tmp_path_factory.mktemp("vllm"))
    return EagerReference(folder), results, batch, then


def test_greedy_tokens_equal_transformers_eager(served):
    reference, results, batch, _ = served
    for prompt, result in zip(batch, results["batch"]):
        assert result["tokens"] == reference.greedy(prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_prompt_and_token_logprobs_within_tolerance(served):
    reference, results, batch, _ = served
    for prompt, result in zip(batch, results["batch"]):
        expected = reference.token_logprobs(prompt + result["tokens"])
        prompt_logprobs = torch.tensor(result["prompt_logprobs"][1:], dtype=torch.float64)
        token_logprobs = torch.tensor(result["logprobs"], dtype=torch.float64)
        assert result["prompt_logprobs"][0] is None
        _assert_close(prompt_logprobs, expected[: len(prompt) - 1], f"prompt of {len(prompt)} tokens")
        _assert_close(token_logprobs, expected[len(prompt) - 1 :], f"tokens after {len(prompt)} prompt tokens")


def test_prefix_cache_hits_give_the_same_tokens(served):
    reference, results, _, then = served
    for prompt, result in zip(then, results["then"]):
        assert result["cached_tokens"] >= PREFIX_LENGTH - 128, "the shared prefix was not served from the cache"
        assert result["tokens"] == reference.greedy(prompt, NEW_TOKENS)
        expected = reference.token_logprobs(prompt + result["tokens"])[len(prompt) - 1 :]
        _assert_close(torch.tensor(result["logprobs"], dtype=torch.float64), expected, "after a prefix-cache hit")


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    error = (actual - expected).abs()
    worst = int(error.argmax())
    assert error.max() <= LOGPROB_TOLERANCE, f"{what}: |vLLM - eager| = {error.max():.2e} at token {worst + 1}"
