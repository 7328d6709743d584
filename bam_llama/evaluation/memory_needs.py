"""What one prompt length needs in memory at the least, checked against what the machine has before anything of it
is built: a length that cannot fit is refused in one line (`LengthDoesNotFit`), instead of a `MemoryError` (or the
kernel's OOM killer) once its prompt is half built. Lengths far past the model's declared context stay allowed.

The estimate is a lower bound, from the model's config:

* the KV cache: 2 (keys and values) x layers x KV heads x head size x the model's bytes per value, per token;
* the prompt's token ids on the host: a Python list, its copy while the pieces are joined, and an int64 tensor
  (`HOST_BYTES_PER_TOKEN`);
* the logits of one chunk (`chunk_size` tokens x the vocabulary, in float32).

Attention never holds a (length x length) tensor (`model/blocked_bam.py`), so it is left out. On CUDA the cache and
the logits are compared with the device's free memory, the ids with the host's; on a CPU all with the host's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .decoding import model_device

HOST_BYTES_PER_TOKEN = 3 * 8 + 8  # a list of ids and two joined copies (8-byte pointers), then an int64 tensor
LOGIT_BYTES = 4  # float32
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


class LengthDoesNotFit(ValueError):
    """A prompt length whose KV cache, token ids or logits cannot fit in the memory available; the message says
    how much it needs and how much there is."""


@dataclass(frozen=True)
class MemoryNeed:
    kv_cache: int
    token_ids: int
    logits: int

    def on(self, device_type: str) -> dict[str, int]:
        """Bytes needed where they live: {"cuda": ..., "host": ...}, or all on the host."""
        if device_type == "cuda":
            return {"cuda": self.kv_cache + self.logits, "host": self.token_ids}
        return {"host": self.kv_cache + self.token_ids + self.logits}


def kv_cache_bytes_per_token(model) -> int:
    """2 x layers x KV heads x head size x bytes per value, from the config (0 where it names none of them)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    if not layers or not heads:
        return 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * layers * kv_heads * head_dim * next(model.parameters()).element_size()


def memory_need(model, length: int, chunk_size: int) -> MemoryNeed:
    vocab_size = getattr(model.config, "vocab_size", 0) or 0
    return MemoryNeed(
        kv_cache=kv_cache_bytes_per_token(model) * length,
        token_ids=HOST_BYTES_PER_TOKEN * length,
        logits=min(chunk_size, length) * vocab_size * LOGIT_BYTES,
    )


def check_lengths_fit(model, lengths, chunk_size: int) -> None:
    """Raise LengthDoesNotFit for the shortest of `lengths` whose need (`memory_need`) exceeds the memory available
    (`available_bytes`), naming the length, the bytes it needs and the bytes there are. Nothing is allocated."""
    device = model_device(model)
    available = {place: available_bytes(place, device) for place in ("host", device.type)}
    for length in sorted(set(lengths)):
        need = memory_need(model, length, chunk_size)
        for place, needed in need.on(device.type).items():
            if available[place] is not None and needed > available[place]:
                raise LengthDoesNotFit(
                    f"length {length} cannot fit in memory: it needs at least {needed:,} bytes ({_gib(needed)}) on "
                    f"{'the ' + str(device) if place == 'cuda' else 'the host'} (KV cache {need.kv_cache:,}, token "
                    f"ids {need.token_ids:,}, logits of a chunk {need.logits:,}) and {available[place]:,} bytes "
                    f"({_gib(available[place])}) are available; choose shorter lengths"
                )


def available_bytes(place: str, device) -> int | None:
    """Free bytes on the CUDA `device` (place "cuda"), or available to this process on the host; None if unknown."""
    if place == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if place == "host":
        return available_host_bytes()
    return None


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux: free memory plus what the kernel can reclaim), within the cgroup's
    limit where one is set; else the free pages sysconf reports; None where neither is known."""
    available = _meminfo_available() or _sysconf_available()
    limit = _cgroup_room()
    if available is None or limit is None:
        return available if limit is None else limit
    return min(available, limit)


def _meminfo_available() -> int | None:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_available() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _cgroup_room() -> int | None:
    """The room left under this process's cgroup v2 memory limit (a container's): the limit less the memory the
    kernel cannot reclaim (`anon` of memory.stat; the page cache it can). None without a limit."""
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        if limit == "max":
            return None
        stat = dict(line.split() for line in (CGROUP / "memory.stat").read_text().splitlines())
        return max(int(limit) - int(stat["anon"]), 0)
    except (OSError, ValueError, KeyError):
        return None


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"
