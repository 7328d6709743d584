"""Running a causal LM (BamLlama or any other) for evaluation: loading it with its tokenizer, a prompt prefilled
through a fresh KV cache in chunks (positions continue across chunks, read from the cache), greedy decoding after it."""

from __future__ import annotations

import copy
import inspect

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ..data.tokenizers import load_tokenizer
from ..model_folders import check_finite_model, check_model_path, check_safetensors_files
from ..registration import register


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def forward_accepts(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def with_cache(model, cache) -> dict:
    """The KV cache as the model's forward names it: `cache` from Transformers 5.24, `past_key_values` before."""
    return {"cache" if forward_accepts(model, "cache") else "past_key_values": cache}


def prefill(model, input_ids: torch.Tensor, chunk_size: int) -> tuple[DynamicCache, torch.Tensor]:
    """Run a (1, L) prompt through a fresh cache `chunk_size` tokens at a time; returns the cache and the
    logits of the last position. Positions continue across chunks because they are read from the cache."""
    cache = DynamicCache(config=model.config)
    extra = {"logits_to_keep": 1} if forward_accepts(model, "logits_to_keep") else {}
    extra.update(with_cache(model, cache))
    logits = None
    for chunk in input_ids.split(chunk_size, dim=1):
        logits = model(input_ids=chunk, use_cache=True, **extra).logits[:, -1]
    return cache, logits


def greedy_continuation(model, prompt_ids: list[int], max_new_tokens: int, chunk_size: int) -> list[int]:
    """Greedy decoding of `max_new_tokens` tokens after a chunked prefill, reusing the cache."""
    cache, logits = prefill(model, torch.tensor([prompt_ids], device=model_device(model)), chunk_size)
    return greedy_from(model, cache, logits, max_new_tokens)


def greedy_from(model, cache, logits: torch.Tensor, max_new_tokens: int) -> list[int]:
    """Greedy decoding of `max_new_tokens` tokens after a prefilled `cache` whose last logits are `logits`."""
    cache_argument = with_cache(model, cache)
    new_tokens = []
    for step in range(max_new_tokens):
        next_token = logits.argmax(-1, keepdim=True)
        new_tokens.append(next_token.item())
        if step + 1 < max_new_tokens:
            logits = model(input_ids=next_token, use_cache=True, **cache_argument).logits[:, -1]
    return new_tokens


def greedy_and_teacher_forced(
    model, prompt_ids: list[int], max_new_tokens: int, chunk_size: int, answer_ids: list[int]
) -> tuple[list[int], list[int]]:
    """`greedy_continuation`, and after the same prefill the model's argmax in place of each token of `answer_ids`,
    each given the true tokens before it (teacher forcing): the first from the prompt's last logits, the others
    from one forward of `answer_ids[:-1]` through a copy of the prompt's cache."""
    cache, logits = prefill(model, torch.tensor([prompt_ids], device=model_device(model)), chunk_size)
    forced = [int(logits[0].argmax())]
    if len(answer_ids) > 1:
        inputs = torch.tensor([answer_ids[:-1]], device=logits.device)
        forced += model(input_ids=inputs, use_cache=True, **with_cache(model, copy.deepcopy(cache))).logits[0].argmax(-1).tolist()
    return greedy_from(model, cache, logits, max_new_tokens), forced


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def load_model(path, device=None, dtype=None, attn_implementation=None):
    """A causal LM from a folder or Hub id (BamLlama or any other), in eval mode on `device` (default: CUDA if
    available). Weights holding NaN or infinity are refused (`NonFiniteError`, naming the tensor)."""
    register()  # BamLlama with the Auto classes

    check_model_path(path)
    check_safetensors_files(path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kwargs = {"dtype": parse_torch_dtype(dtype)}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    check_finite_model(model, path)
    return model.to(device).eval()


def load_model_and_tokenizer(path, tokenizer=None, device=None, dtype=None, attn_implementation=None):
    """`load_model(path, ...)` and its tokenizer: `tokenizer` (an object or a path) when given, else the one saved
    in `path`; when `path` has none, the built-in byte tokenizer, with a note on stderr."""
    model = load_model(path, device, dtype, attn_implementation)
    return model, load_tokenizer(path, model.config, tokenizer)


def parse_torch_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    return getattr(torch, dtype)
