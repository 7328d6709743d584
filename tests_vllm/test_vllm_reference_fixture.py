"""A checkpoint of the reference BAM code, converted with `bam-convert reference`, served by vLLM: its prompt
log-probabilities match the logits the reference code itself produced (../shared/fixtures/official-bam, SSMax
variant: global prior with negative and positive theta_beta, per-layer SSMax scales, head size 16, which vLLM's own
CPU attention would refuse)."""

import importlib.util
from pathlib import Path

import torch
from conftest import run_vllm

TOLERANCE = 1e-4


def main_suite_helpers():
    """tests/helpers.py (its fixture lookup: skip locally, fail under CI=true when ../shared is missing)."""
    path = Path(__file__).resolve().parents[1] / "tests" / "helpers.py"
    spec = importlib.util.spec_from_file_location("bam_main_suite_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_converted_reference_checkpoint_served_by_vllm_matches_reference_logits(tmp_path):
    from bam_llama.conversion.reference import convert_reference_checkpoint

    fixtures = main_suite_helpers().require_reference_fixtures()
    folder = convert_reference_checkpoint(
        fixtures / "logs" / "l6" / "bam_ssmax" / "version_00", tmp_path / "converted", verbose=False
    )
    io = torch.load(fixtures / "bam_ssmax_io.pt")
    prompts = io["input_ids"].tolist()
    engine = dict(dtype="float32", enforce_eager=True, seed=0, max_model_len=64, skip_tokenizer_init=True,
                  max_num_batched_tokens=64, block_size=16)
    job = dict(folder=str(folder), engine=engine, batch=prompts, then=[], max_tokens=1, prompt_logprobs=True)
    results = run_vllm(job, tmp_path)
    for row, (prompt, result) in enumerate(zip(prompts, results["batch"])):
        golden = io["logits"][row, :-1].double().log_softmax(-1)
        expected = golden.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
        served = torch.tensor(result["prompt_logprobs"][1:], dtype=torch.float64)
        error = (served - expected).abs().max()
        assert error <= TOLERANCE, f"row {row}: |vLLM - reference| = {error:.2e}"
        assert result["tokens"] == [int(io["logits"][row, -1].argmax())]
