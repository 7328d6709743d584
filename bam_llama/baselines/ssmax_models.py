"""Transformers' Llama (RoPE) and Mistral (RoPE local) with Scalable Softmax: the models of `bam-pretrain
--positional rope --ssmax` and `--positional rope-local --ssmax`.

Scalable Softmax (Nakanishi, 2025) multiplies query i's logits by c_i = s_h * ln(n_i): s_h a learned scale per head,
n_i the number of keys the query may see (causal, its own document, no padding, inside the sliding window). It is
BamLlama's `ssmax` (`model/prior_modules_bam.py: BamScalableSoftmax`, the math `model/prior_bam.py: ssmax_factor`),
here beside Transformers' own attention, in two parts:

* A registered attention function, "ssmax_sdpa" (and "ssmax_eager"): it reads the calling attention module's `ssmax`
  scales, counts n_i from the mask Transformers built for that call (boolean or additive; `None` where SDPA runs
  causal by itself), multiplies the query by c_i (so the logits q.k * scaling are scaled per row) and calls
  Transformers' own "sdpa" (or "eager") function. The count comes from the very mask the softmax runs with, so
  padding, packed documents (position ids restarting), Mistral's window and a cache's length are counted exactly as
  they are masked, with no second rule beside Transformers' to drift from it. Rotary embeddings, the cache, GQA
  and the kernels stay Transformers' own, untouched: only the query is scaled, which is why a function and not a
  rewritten attention module.
* Small model classes: a config with a model type of its own (`ssmax_configs.py`), the base model adding a
  `BamScalableSoftmax` as `ssmax` to every layer's `self_attn` (float32 kept, initialised and trained as
  BamLlama's: the trainer's SSMax learning rate, PEFT's `modules_to_save=["ssmax"]` and the comparison's read-back
  find it by that name), and the causal LM over it. A saved folder loads back with its scales through the Auto
  classes. The config keeps "ssmax_sdpa" / "ssmax_eager": asking such a model for "sdpa" or "eager" (or nothing)
  selects them, and any other backend (flash, flex, paged, Hub kernels), which would drop the scales, is refused.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import LlamaForCausalLM, LlamaModel, eager_attention_forward
from transformers.models.mistral.modeling_mistral import MistralForCausalLM, MistralModel

from ..model.prior_modules_bam import BamScalableSoftmax
from .ssmax_configs import LlamaSsmaxConfig, MistralSsmaxConfig

# The attention a user asks for -> the name the config keeps, registered with Transformers' attention interface
SSMAX_ATTENTION = {"sdpa": "ssmax_sdpa", "eager": "ssmax_eager"}


def visible_key_counts_from_mask(
    attention_mask: torch.Tensor | None, query_length: int, key_length: int, causal_without_mask: bool
) -> torch.Tensor:
    """(B or 1, Lq) number of keys each query sees under the mask an attention call runs with: boolean (True: seen)
    or additive (the dtype's minimum or -inf: hidden), (B, 1, Lq, >= Lk). Without a mask, SDPA runs causal by itself
    (`causal_without_mask`, several queries: query i sees keys 0..i, the keys cut to the queries) or sees every key."""
    if attention_mask is None:
        if causal_without_mask and query_length > 1:
            return torch.arange(1, query_length + 1)[None]
        return torch.full((1, query_length), key_length)
    if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
        raise ValueError(
            "Scalable Softmax counts the keys each query sees from a (batch, 1, queries, keys) mask shared by the "
            f"heads; got a mask of shape {tuple(attention_mask.shape)}"
        )
    mask = attention_mask[:, 0, :, :key_length]
    visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    return visible.sum(-1)


def ssmax_query(
    module: nn.Module, query: torch.Tensor, attention_mask: torch.Tensor | None, key_length: int, causal_without_mask: bool
) -> torch.Tensor:
    """The query (B, H, Lq, D) times the row factor s_h * ln(n_i) of the module's `ssmax` scales."""
    ssmax = getattr(module, "ssmax", None)
    if not isinstance(ssmax, BamScalableSoftmax):
        raise ValueError(
            f"attention {', '.join(SSMAX_ATTENTION.values())} is Scalable Softmax's: it needs an attention module "
            f"with an `ssmax` scale (a {LlamaSsmaxConfig.model_type} or {MistralSsmaxConfig.model_type} model), "
            f"and {type(module).__name__} has none"
        )
    counts = visible_key_counts_from_mask(attention_mask, query.shape[2], key_length, causal_without_mask)
    factor = ssmax.row_factor(counts.to(query.device))  # (B, H, Lq, 1) float32
    return query * factor.to(query.dtype)


def ssmax_sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """Transformers' "sdpa" attention with Scalable Softmax."""
    is_causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal  # as sdpa_attention_forward reads it
    query = ssmax_query(module, query, attention_mask, key.shape[2], causal)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def ssmax_eager_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """Transformers' "eager" attention with Scalable Softmax (it applies no causality of its own without a mask)."""
    query = ssmax_query(module, query, attention_mask, key.shape[2], causal_without_mask=False)
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_ssmax_attention() -> None:
    """The two functions and their mask functions (Transformers' own) under their names; idempotent."""
    functions = {"sdpa": ssmax_sdpa_attention_forward, "eager": ssmax_eager_attention_forward}
    masks = {"sdpa": sdpa_mask, "eager": eager_mask}
    for requested, name in SSMAX_ATTENTION.items():
        AttentionInterface.register(name, functions[requested])
        AttentionMaskInterface.register(name, masks[requested])


register_ssmax_attention()


def ssmax_attention_name(requested: str | None) -> str:
    """The name the config keeps for a requested implementation (None: sdpa); a clear error for one that would drop
    the scales."""
    if requested is None or requested in SSMAX_ATTENTION.values():
        return requested or SSMAX_ATTENTION["sdpa"]
    if requested not in SSMAX_ATTENTION:
        raise ValueError(  # Transformers' own wording first: tools match on it
            f'Specified `attn_implementation="{requested}"` is not supported. A model with Scalable Softmax runs it '
            "around Transformers' sdpa or eager attention only: other backends (flash, flex, paged, kernels from "
            f"the Hub) would drop its scales. Choose one of {sorted(SSMAX_ATTENTION)}."
        )
    return SSMAX_ATTENTION[requested]


class ScalableSoftmaxPreTrainedModel:
    """What the models with Scalable Softmax share (a mixin before Transformers' class): the scales initialised as
    the config says and kept float32, and the attention names."""

    _keep_in_fp32_modules_strict = ["ssmax"]

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, BamScalableSoftmax):
            module.reset_parameters(self.config)
        else:
            super()._init_weights(module)

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        return ssmax_attention_name(attn_implementation)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True


class ScalableSoftmaxModel(ScalableSoftmaxPreTrainedModel):
    """Transformers' base model with a `BamScalableSoftmax` as `ssmax` in every layer's attention."""

    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:
            layer.self_attn.ssmax = BamScalableSoftmax(config)


class ScalableSoftmaxForCausalLM(ScalableSoftmaxPreTrainedModel):
    """Transformers' causal LM over `base_model_class`: its own `__init__` (which would build the plain base model),
    written out with the base model that carries the scales."""

    base_model_class: type[PreTrainedModel]

    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class LlamaSsmaxModel(ScalableSoftmaxModel, LlamaModel):
    config_class = LlamaSsmaxConfig


class LlamaSsmaxForCausalLM(ScalableSoftmaxForCausalLM, LlamaForCausalLM):
    config_class = LlamaSsmaxConfig
    base_model_class = LlamaSsmaxModel


class MistralSsmaxModel(ScalableSoftmaxModel, MistralModel):
    config_class = MistralSsmaxConfig


class MistralSsmaxForCausalLM(ScalableSoftmaxForCausalLM, MistralForCausalLM):
    config_class = MistralSsmaxConfig
    base_model_class = MistralSsmaxModel


# Auto class -> the model class of each config (`registration.register`)
SSMAX_AUTO_CLASSES = {
    "AutoModel": (LlamaSsmaxModel, MistralSsmaxModel),
    "AutoModelForCausalLM": (LlamaSsmaxForCausalLM, MistralSsmaxForCausalLM),
}
