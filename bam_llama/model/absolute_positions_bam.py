"""Absolute position embeddings a BamLlama can add to its token embeddings (`BamLlamaConfig.absolute_positions`).

"sinusoidal" is Vaswani et al.'s fixed embedding, with d the hidden size and p a token's absolute position:

    PE[p, 2k] = sin(p / 10000 ** (2k / d)),    PE[p, 2k + 1] = cos(p / 10000 ** (2k / d))

It has no parameters and no table of a longest length: it is computed from the positions at every call, in
float32 (as Transformers computes RoPE's angles) and then cast to the embeddings' dtype, and added unscaled.
"""

from collections.abc import Callable

import torch

SINUSOID_BASE = 10000.0


def sinusoidal_position_embedding(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """(*positions.shape, dim) embedding of the absolute positions `positions` (any integer shape)."""
    # 10000^(-2k/d) in Python floats, rounded to float32 once (float32's own power would add ulps to every angle)
    frequencies = [SINUSOID_BASE ** (-two_k / dim) for two_k in range(0, dim, 2)]
    inverse_frequencies = torch.tensor(frequencies, dtype=torch.float32, device=positions.device)
    angles = positions.to(torch.float32)[..., None] * inverse_frequencies  # elementwise: autocast leaves it float32
    embedding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # sin, cos interleaved
    return embedding[..., :dim].to(dtype)  # an odd dim ends with a sine


ABSOLUTE_POSITION_EMBEDDINGS: dict[str, Callable[[torch.Tensor, int, torch.dtype], torch.Tensor]] = {
    "sinusoidal": sinusoidal_position_embedding,
}
ABSOLUTE_POSITIONS = tuple(ABSOLUTE_POSITION_EMBEDDINGS)


def add_absolute_positions(kind: str | None, embeddings: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`embeddings` (..., L, d) plus the `kind` embedding of `positions` (..., L) (broadcast over rows); unchanged
    where `kind` is None."""
    if kind is None:
        return embeddings
    return embeddings + ABSOLUTE_POSITION_EMBEDDINGS[kind](positions, embeddings.shape[-1], embeddings.dtype)


def positions_from_padding(attention_mask: torch.Tensor, query_length: int) -> torch.Tensor:
    """(B, query_length) absolute positions of the last `query_length` tokens of a 2D padding mask that covers the
    cached tokens and these (B, past + query_length): the count of real tokens before each, as Transformers'
    `generate` numbers `position_ids`, so that a left-padded row's first real token is at 0. Padding gets 0."""
    positions = attention_mask.long().cumsum(-1)[:, -query_length:] - 1
    return positions.masked_fill(attention_mask[:, -query_length:] == 0, 0)
