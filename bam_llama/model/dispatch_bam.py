"""BamLlama's attention dispatch: the implementations a config names, their mask functions, the causal mask.

The config keeps the attention names users pass; for this model they select BAM's own implementations: "eager"
(materialized reference), "sdpa" (bias as a float mask) and "bam_triton" (fused kernels, never materializes the
bias). `BamAttention` looks them up in `BAM_ATTENTION_FUNCTIONS`, never in Transformers' global registry, so "eager"
and "sdpa" keep their meaning for other models. Only the mask functions are registered with Transformers, under
private names: `create_causal_mask` finds a mask function only there.

Every implementation takes the attention module, query (B, H, Lq, D), key and value (B, Hkv, Lk, D), the mask the
mask function made, and BAM's inputs: the query positions (Lq,) and the prior (the layer's or the model's
`BamPrior`); it returns (B, Lq, H, D) and the probabilities (eager only).
"""

import inspect

import torch
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask, sdpa_mask
from transformers.utils import logging

from .attention_route_bam import module_attention_call, run_attention
from .configuration_bam import BamLlamaConfig
from .continuous_batching_bam import CONTINUOUS_BATCHING_ATTENTION, PAGED_PREFIX
from .reference_bam import bam_attention_reference, materialized_inputs
from .triton_bam import TRITON_AVAILABLE, triton_usable


logger = logging.get_logger(__name__)


# --------------------------------------------------------------------------------------------------------
# Attention implementations (looked up in BAM_ATTENTION_FUNCTIONS, not in Transformers' AttentionInterface)
# --------------------------------------------------------------------------------------------------------


def bam_eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    query_positions: torch.Tensor,
    prior: nn.Module,
    document_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: materialized bias, fp32 softmax. Returns (B, Lq, H, D) and the probabilities."""
    visible, bias, row_factor = materialized_inputs(module, key, attention_mask, query_positions, prior, document_ids)
    output, probs = bam_attention_reference(
        query, key, value, visible, bias, scaling, row_factor, module.config.ssmax_prior, dropout
    )
    return output.transpose(1, 2).contiguous(), probs


def bam_sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    query_positions: torch.Tensor,
    prior: nn.Module,
    document_ids: torch.Tensor | None = None,
    prior_table: torch.Tensor | None = None,
    last_position: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """BAM's attention without the (Lq x Lk) bias where it can: the route (`attention_route_bam.attention_path`)
    picks the path. With `last_position`, the last query's position as a Python int, the planned paths run: the
    decoding step, the fused CPU kernel, or SDPA over blocks of queries whose mask is a view of a 1-D prior table per
    head. Where only a tensor knows it (a static cache in a traced graph: None), in an exported program (None: its
    length may be dynamic, see `_last_query_position`), or with a custom 4D mask, the (Lq x Lk) prior is
    materialized from the query positions instead (one SDPA call), except a static cache's decoding step in a
    compiled CPU graph (one operator that reads the position itself and keeps its prior table).

    prior_table: the layer's (H, P + 1) table where the model computed it (`BamLlamaModel._prior_tables`: the
    global prior's, once for all layers, or, without gradients on the CPU, each layer's own prior's)."""
    return _routed("sdpa", module, query, key, value, attention_mask, scaling, dropout, query_positions, prior,
                   document_ids, prior_table, last_position)


def bam_triton_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    query_positions: torch.Tensor,
    prior: nn.Module,
    document_ids: torch.Tensor | None = None,
    prior_table: torch.Tensor | None = None,
    last_position: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Fused Triton kernels; the route runs the "sdpa" paths instead off-GPU, with dropout, or with a custom 4D
    mask."""
    if query.is_cuda and not triton_usable(query):
        logger.warning_once(
            f"bam_triton: the fused kernels do not fit head size {query.shape[-1]} in {query.dtype} on a GPU; "
            "attention runs on SDPA (use fp16/bf16 for the kernels)"
        )
    return _routed("bam_triton", module, query, key, value, attention_mask, scaling, dropout, query_positions, prior,
                   document_ids, prior_table, last_position)


def _routed(implementation: str, *arguments) -> tuple[torch.Tensor, None]:
    """(B, Lq, H, D) contiguous from the path the route picks for the call."""
    return run_attention(module_attention_call(implementation, *arguments)).contiguous(), None


# --------------------------------------------------------------------------------------------------------
# Mask functions (registered with Transformers' mask interface under BAM's private names)
# --------------------------------------------------------------------------------------------------------


def bam_boolean_mask(*args, **kwargs) -> torch.Tensor:
    """The full boolean (B, 1, Lq, Lk) mask; never skipped, since the prior must be added everywhere."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def bam_key_padding_mask(
    *, kv_length: int, kv_offset: int = 0, attention_mask: torch.Tensor | None = None, **kwargs
) -> torch.Tensor | None:
    """For the fused kernels: a (B, kv_length) key-validity mask, or None when nothing is padded.

    Causality and documents are handled in the kernel from positions and document ids.
    """
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, kv_offset : kv_offset + kv_length].bool()
    missing = kv_length - attention_mask.shape[1]
    if missing > 0:  # static caches are longer than the mask; the unfilled tail is hidden by causality
        attention_mask = nn.functional.pad(attention_mask, (0, missing), value=True)
    if torch.compiler.is_compiling():  # a traced graph keeps the mask: its value cannot choose the graph
        return attention_mask
    return None if bool(attention_mask.all()) else attention_mask


# --------------------------------------------------------------------------------------------------------
# The names a config keeps, their functions and mask functions
# --------------------------------------------------------------------------------------------------------


# The attention names the config keeps, and BAM's function for each. They are looked up here, never in Transformers'
# global registry, so "eager" and "sdpa" keep Transformers' meaning for every other model in the process.
BAM_ATTENTION_FUNCTIONS = {
    "eager": bam_eager_attention_forward,
    "sdpa": bam_sdpa_attention_forward,
    "bam_triton": bam_triton_attention_forward,
}
ATTENTION_ALIASES = {"bam_eager": "eager", "bam_sdpa": "sdpa"}  # the names of earlier releases
# `create_causal_mask` finds the mask function by the config's name in the global registry, so BAM's are registered
# under private names, and the model hands it a config view carrying the private name (see `_MaskingConfig`).
BAM_MASK_FUNCTIONS = {"bam_eager": bam_boolean_mask, "bam_sdpa": bam_key_padding_mask, "bam_triton": bam_key_padding_mask}
MASK_FUNCTION_NAMES = {"eager": "bam_eager", "sdpa": "bam_sdpa", "bam_triton": "bam_triton"}


def register_bam_attention() -> None:
    """Register BAM's mask functions under BAM's private names; idempotent (runs on every import of this module).
    The attention functions are not registered: no other model could call them (they need BAM's prior), and
    Transformers' own entries are left alone."""
    for name, mask_fn in BAM_MASK_FUNCTIONS.items():
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask_fn)


register_bam_attention()


def default_attn_implementation() -> str:
    return "bam_triton" if TRITON_AVAILABLE and torch.cuda.is_available() else "sdpa"


def bam_attention_name(requested: str) -> str:
    """The name the config keeps for a requested implementation; a clear error for any that would drop the prior.
    "paged|eager" / "paged|sdpa", which continuous batching asks for, are BAM's own: they run over the paged cache
    (continuous_batching_bam.py)."""
    name = ATTENTION_ALIASES.get(requested, requested)
    if name.startswith(PAGED_PREFIX) and name.removeprefix(PAGED_PREFIX) in CONTINUOUS_BATCHING_ATTENTION:
        name = name.removeprefix(PAGED_PREFIX)
    if name not in BAM_ATTENTION_FUNCTIONS:
        raise ValueError(  # Transformers' own wording first: tools and tests match on it
            f'Specified `attn_implementation="{requested}"` is not supported. BamLlama runs only its own attention: '
            "other backends (flash, flex, Transformers' paged kernels, kernels from the Hub) would drop the "
            f"positional prior. Choose one of {sorted(BAM_ATTENTION_FUNCTIONS)}."
        )
    return name


# --------------------------------------------------------------------------------------------------------
# The causal mask across Transformers versions
# --------------------------------------------------------------------------------------------------------


_CAUSAL_MASK_PARAMETERS = inspect.signature(create_causal_mask).parameters


class _MaskingConfig:
    """The model's config as `create_causal_mask` sees it: every field is the config's, except the attention name,
    which is the private name BAM's mask function is registered under (the global "eager" / "sdpa" mask
    functions are Transformers' own and stay so)."""

    def __init__(self, config: BamLlamaConfig):
        self._config = config
        self._attn_implementation = MASK_FUNCTION_NAMES[bam_attention_name(config._attn_implementation)]

    def __getattr__(self, name: str):
        return getattr(self._config, name)


def create_bam_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids, query_positions):
    """`create_causal_mask` with BAM's mask function, across Transformers 5.x: early releases name the embeddings
    `input_embeds` and take `cache_position`; later ones read the query offset from the cache; 5.24 renamed
    `past_key_values` to `cache`."""
    kwargs = dict(config=_MaskingConfig(config), attention_mask=attention_mask, position_ids=position_ids)
    kwargs["inputs_embeds" if "inputs_embeds" in _CAUSAL_MASK_PARAMETERS else "input_embeds"] = inputs_embeds
    kwargs["cache" if "cache" in _CAUSAL_MASK_PARAMETERS else "past_key_values"] = cache
    if "cache_position" in _CAUSAL_MASK_PARAMETERS:
        kwargs["cache_position"] = query_positions
    return create_causal_mask(**kwargs)
