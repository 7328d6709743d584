"""vLLM serving a BamLlama (through the package's entry point) gives Transformers' results in fp32.

Each case is one tiny random model served by one vLLM engine: a batch of prompts from 5 to 8,000 tokens submitted
together (continuous batching of very different lengths), their greedy tokens and prompt log-probabilities, then two
prompts that share a long prefix with a finished one (prefix caching). The witness is Transformers' default path
(`sdpa`) on the same folder, in this process. Log-probabilities agree within 1e-3 per token: two correct fp32
summation orders over several layers drift apart by up to a few 1e-4 at thousands of tokens.

The cases cover both prior scopes and formulas, SSMax off and on in both orders, grouped-query attention 2:1 and 4:1
and multi-head attention, tied word embeddings (as converted Llama-3.2-1B/3B checkpoints have), chunked prefill
forced (100- and 700-token steps, so the 8,000-token prompt runs in chunks beside the others' decoding steps) and
whole prompts, block sizes 16, 32 and vLLM's CPU default 128, and vLLM's default compilation (Dynamo and Inductor
around the attention op) besides eager mode.
"""

import pytest
import torch
from conftest import TransformersReference, build_tiny_bam, run_vllm, text_token_ids

NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3
PROMPT_LENGTHS = (5, 17, 130, 511, 777, 1_024, 1_500, 8_000)
PREFIX_LENGTH = 900  # shared by the batch's 1,024-token prompt and the two prompts submitted after it
MAX_MODEL_LEN = 8_192

CASES = {
    # name: (model overrides, engine overrides)
    "layer-prior_ssmax-scales-prior_gqa_sinusoidal-positions_chunked_compiled": (
        dict(prior_scope="layer", ssmax=True, ssmax_prior=True, num_key_value_heads=2, absolute_positions="sinusoidal"),
        dict(max_num_batched_tokens=100, block_size=16, enforce_eager=False),
    ),
    "global-prior_ssmax-after-prior_legacy-formula_mha_tied-embeddings_chunked": (
        dict(prior_scope="global", ssmax=True, ssmax_prior=False, prior_formula="legacy", num_key_value_heads=4,
             tie_word_embeddings=True),
        dict(max_num_batched_tokens=700, block_size=32),
    ),
    "global-prior_no-ssmax_gqa-4-to-1_whole-prompts": (
        dict(prior_scope="global", ssmax=False, num_key_value_heads=1),
        dict(max_num_batched_tokens=MAX_MODEL_LEN, enable_chunked_prefill=False),
    ),
    "layer-prior_t5-buckets_ssmax_gqa_chunked": (
        dict(prior_scope="layer", prior_formula="t5_buckets", ssmax=True, num_key_value_heads=2),
        dict(max_num_batched_tokens=300, block_size=16),
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
    folder = build_tiny_bam(tmp_path_factory.mktemp("model"), seed=len(request.param),
                            max_position_embeddings=MAX_MODEL_LEN, **model_overrides)
    batch, then = batch_prompts(), prefix_sharing_prompts()
    engine = dict(
        dtype="float32", enforce_eager=True, seed=0, max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
        enable_prefix_caching=True, enable_chunked_prefill=True, skip_tokenizer_init=True,
    )
    engine.update(engine_overrides)
    job = dict(folder=str(folder), engine=engine, batch=batch, then=then, max_tokens=NEW_TOKENS, prompt_logprobs=True)
    results = run_vllm(job, tmp_path_factory.mktemp("vllm"))
    return TransformersReference(folder), results, batch, then


def test_greedy_tokens_equal_transformers(served):
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
    assert error.max() <= LOGPROB_TOLERANCE, f"{what}: |vLLM - Transformers| = {error.max():.2e} at token {worst + 1}"
