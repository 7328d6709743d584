"""BAM attention over Transformers' paged KV cache: continuous batching (`model.generate_batch`,
`model.init_continuous_batching`, `transformers serve --continuous-batching`).

Continuous batching packs the tokens every request processes in one step into a single row: queries (1, H, T, D),
request after request. The paged cache's `update` writes their keys and values into its pages and hands back, for
each request, all of its keys and values (those cached from earlier steps, then the new ones), request after
request. `cu_seq_lens_q` and `cu_seq_lens_k` delimit the requests in both. Request r's keys sit at its positions
0 .. k_r - 1 (the cache reads its pages in order), so its q_r queries are at positions k_r - q_r .. k_r - 1: the
positions come from what the cache holds for the request, not from where its tokens sit in the packed row. Each
request then gets BAM's attention function on its own slice, with its own positions (prior, causality, SSMax
counts); the mask continuous batching builds is not used.

Transformers 5.24 calls `cache.update(key, value, layer, kwargs)` and reads the layer's `cu_seq_lens_k` from the
kwargs; earlier 5.x releases take `read_index` / `write_index` and return (keys, heads, dim) tensors.
"""

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

CONTINUOUS_BATCHING_ATTENTION = ("eager", "sdpa")  # BAM's implementations that run over the paged cache
PAGED_PREFIX = "paged|"  # Transformers' name for the paged variant of an implementation (e.g. "paged|eager")


def is_paged_cache(cache) -> bool:
    """True for Transformers' `PagedAttentionCache` (continuous batching). Its module is loaded by then: read from
    sys.modules, so that ordinary forwards never import continuous batching."""
    module = sys.modules.get("transformers.generation.continuous_batching.cache")
    return module is not None and isinstance(cache, module.PagedAttentionCache)


@dataclass(frozen=True)
class PagedRequests:
    """Where each request of a continuous-batching step sits in the packed queries and in the keys the cache hands
    back: query_starts[r] .. query_starts[r + 1] and key_starts[r] .. key_starts[r + 1]."""

    query_starts: tuple[int, ...]
    key_starts: tuple[int, ...]

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> "PagedRequests":
        if kwargs.get("block_table") is not None:  # only flash attention's kernels read pages themselves
            raise ValueError("BamLlama's paged attention reads the cache through its read indices, not a block table")
        return cls(tuple(kwargs["cu_seq_lens_q"].tolist()), tuple(_full_attention(kwargs["cu_seq_lens_k"]).tolist()))

    def spans(self):
        """(queries, keys) slices of every request with queries; requests of length 0 (padding) are skipped."""
        for r in range(len(self.query_starts) - 1):
            queries = slice(self.query_starts[r], self.query_starts[r + 1])
            if queries.stop > queries.start:
                yield queries, slice(self.key_starts[r], self.key_starts[r + 1])

    @property
    def last_position(self) -> int:
        """The largest query position of the step: the prior table of every request is a window of one this long."""
        return max(keys.stop - keys.start for _, keys in self.spans()) - 1

    def token_positions(self, token_count: int, device: torch.device) -> torch.Tensor:
        """(1, token_count) absolute positions of the step's packed tokens, each request's as its attention sees
        them; padding tokens at 0."""
        positions = torch.zeros(1, token_count, dtype=torch.long, device=device)
        for queries, keys in self.spans():
            positions[0, queries] = _request_positions(queries, keys, device)
        return positions

    def update_cache(self, cache, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs: dict):
        """Write this step's (1, Hkv, T, D) keys and values into the cache; every request's keys and values back."""
        if _update_takes_kwargs(type(cache)):  # Transformers >= 5.24
            return cache.update(key, value, layer_idx, kwargs)
        key, value = cache.update(key, value, layer_idx, read_index=kwargs["read_index"], write_index=kwargs["write_index"])
        return key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)

    def wrap(self, attention: Callable) -> Callable:
        """`attention` run request by request; same signature, (1, T, H, D) output (zeros for padding tokens). Each
        request's last query position goes along as a Python int (`last_position`), so that "sdpa" runs its blocked
        path over a window of the step's prior table, never a (queries x keys) bias."""

        def paged_attention(module, query, key, value, attention_mask, *, query_positions=None, prior=None,
                            prior_table=None, document_ids=None, **kwargs):
            output = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])
            for queries, keys in self.spans():
                length = keys.stop - keys.start
                positions = _request_positions(queries, keys, query.device)
                table = None if prior_table is None else prior_table[:, prior_table.shape[1] - length:]
                output[:, queries] = attention(
                    module, query[:, :, queries], key[:, :, keys], value[:, :, keys], None,
                    query_positions=positions, prior=prior, prior_table=table, last_position=length - 1, **kwargs,
                )[0]
            return output, None

        return paged_attention


def _request_positions(queries: slice, keys: slice, device: torch.device) -> torch.Tensor:
    """A request's query positions: its last (queries) of the (keys) positions the cache holds for it."""
    length = keys.stop - keys.start
    return torch.arange(length - (queries.stop - queries.start), length, device=device)


def _full_attention(lengths):
    """The full-attention layers' entry of a per-layer-type dict (Transformers' hybrid models), or the tensor."""
    return lengths["full_attention"] if isinstance(lengths, dict) else lengths


@functools.cache
def _update_takes_kwargs(cache_type: type) -> bool:
    return "kwargs" in inspect.signature(cache_type.update).parameters
