"""Tensor parallelism: two CPU ranks split the query and key/value heads, and each must take its own heads' prior
and SSMax parameters (rank 1 heads 2-3 of 4). The checkpoint's per-head parameters all differ, so a rank reading
another rank's slice changes the log-probabilities by far more than the tolerance.

One engine, two ranks: a model with a per-layer prior and SSMax scaling it (layer-scope slices), and one with the
global prior (the model's slice), each against Transformers' default path on prompts of 5 to 1,500 tokens with
chunked prefill.
"""

import pytest
import torch
from conftest import TransformersReference, build_tiny_bam, run_vllm, text_token_ids

NEW_TOKENS = 6
LOGPROB_TOLERANCE = 1e-3
PROMPT_LENGTHS = (5, 130, 777, 1_500)

CASES = {
    "layer-prior_ssmax-scales-prior_gqa": dict(prior_scope="layer", ssmax=True, ssmax_prior=True,
                                                num_key_value_heads=2),
    "global-prior_ssmax-after-prior_mha": dict(prior_scope="global", ssmax=True, ssmax_prior=False,
                                               num_key_value_heads=4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_give_transformers_results(case, tmp_path):
    folder = build_tiny_bam(tmp_path / "model", seed=11, **CASES[case])
    prompts = [text_token_ids(length, offset=7_000 * (index + 1)) for index, length in enumerate(PROMPT_LENGTHS)]
    engine = dict(dtype="float32", enforce_eager=True, seed=0, max_model_len=2_048, tensor_parallel_size=2,
                  max_num_batched_tokens=256, enable_chunked_prefill=True, skip_tokenizer_init=True)
    job = dict(folder=str(folder), engine=engine, batch=prompts, then=[], max_tokens=NEW_TOKENS, prompt_logprobs=True)
    results = run_vllm(job, tmp_path)
    reference = TransformersReference(folder)
    for prompt, result in zip(prompts, results["batch"]):
        assert result["tokens"] == reference.greedy(prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        expected = reference.token_logprobs(prompt + result["tokens"])
        served = torch.tensor(result["prompt_logprobs"][1:] + result["logprobs"], dtype=torch.float64)
        error = (served - expected).abs().max()
        assert error <= LOGPROB_TOLERANCE, f"prompt of {len(prompt)} tokens: |vLLM - Transformers| = {error:.2e}"
