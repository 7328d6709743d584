"""Running a causal LM (BamLlama or any other) for evaluation: loading it with its tokenizer, a prompt prefilled
through a KV cache in chunks (positions continue across chunks, read from the cache), greedy decoding after it.

Prompts that open alike (a passkey's filler before its key, at one length) can share a cache (`sharing_prefixes`):
each prompt then runs only from the first token where it parts from the one before, instead of from its first.
"""

from __future__ import annotations

import copy
import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import DynamicLayer

from ..data.tokenizers import load_tokenizer
from ..files.model_folders import check_finite_model, check_model_path, check_safetensors_files
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
    logits of the last position. Positions continue across chunks because they are read from the cache. Inside
    `sharing_prefixes(model)` the cache is the block's, already holding the tokens this prompt shares with the one
    before it."""
    shared = _SHARED_PREFIX.get()
    if shared is not None and shared.model is model:
        return shared.prefill(input_ids, chunk_size)
    cache = DynamicCache(config=model.config)
    return cache, _run_chunks(model, cache, input_ids, chunk_size)


def _run_chunks(model, cache, input_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """(1, L) tokens through `cache`, `chunk_size` at a time, after what it holds; the logits of the last one."""
    extra = {"logits_to_keep": 1} if forward_accepts(model, "logits_to_keep") else {}
    extra.update(with_cache(model, cache))
    logits = None
    for chunk in input_ids.split(chunk_size, dim=1):
        logits = model(input_ids=chunk, use_cache=True, **extra).logits[:, -1]
    return logits


@dataclass
class SharedPrefix:
    """The KV cache of the last prompt `prefill` ran inside `sharing_prefixes`, and that prompt's tokens."""

    model: object
    tokens: torch.Tensor | None = None  # (L,) on the CPU
    cache: DynamicCache | None = None
    tokens_run: int = 0  # prompt tokens the model ran in this block
    tokens_reused: int = 0  # prompt tokens taken from the cache instead

    def prefill(self, input_ids: torch.Tensor, chunk_size: int) -> tuple[DynamicCache, torch.Tensor]:
        """`prefill` of a (1, L) prompt from the first token where it parts from the last one (at least its last
        token runs: its logits are the answer's first). Whatever the cache holds past the shared tokens (the last
        prompt's rest, the tokens decoded after it) is cut off first."""
        tokens = input_ids[0].cpu()
        shared = 0 if self.cache is None or not _croppable(self.cache) else _common_prefix(self.tokens, tokens)
        shared = min(shared, tokens.numel() - 1)
        if shared == 0:
            self.cache = DynamicCache(config=self.model.config)
        elif self.cache.get_seq_length() > shared:
            self.cache.crop(shared - self.cache.get_seq_length())  # a negative count: that many tokens removed
        self.tokens = None  # until the prompt has run whole: a prompt stopped halfway leaves no prefix to share
        logits = _run_chunks(self.model, self.cache, input_ids[:, shared:], chunk_size)
        self.tokens = tokens
        self.tokens_run += tokens.numel() - shared
        self.tokens_reused += shared
        return self.cache, logits


_SHARED_PREFIX: ContextVar[SharedPrefix | None] = ContextVar("bam_llama_shared_prefix", default=None)


@contextmanager
def sharing_prefixes(model):
    """Within the block, `prefill` of `model` keeps the last prompt's KV cache and runs the next prompt only from
    where the two part: a KV cache entry depends on the tokens up to it alone (causal attention, positions counted
    from the start), so the shared tokens' entries are the ones a fresh prefill would compute, up to the rounding
    of other chunk boundaries. Passkey prompts of one length share their filler up to the earlier key: with keys at
    evenly spaced depths the attention of all prompts costs about 2/3 of running each from its start. Caches whose
    entries cannot be cut back (sliding windows) run every prompt from its start. Yields the `SharedPrefix`."""
    token = _SHARED_PREFIX.set(SharedPrefix(model))
    try:
        yield _SHARED_PREFIX.get()
    finally:
        _SHARED_PREFIX.reset(token)


def _croppable(cache: DynamicCache) -> bool:
    """Whether every layer keeps every entry, so that the cache can be cut back to any length."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _common_prefix(first: torch.Tensor | None, second: torch.Tensor) -> int:
    """How many tokens two 1-D token tensors share from their start."""
    if first is None:
        return 0
    length = min(first.numel(), second.numel())
    differ = (first[:length] != second[:length]).nonzero()
    return int(differ[0, 0]) if differ.numel() else length


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
