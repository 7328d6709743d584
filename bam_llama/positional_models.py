"""A fresh config and model of each positional variant (`positional_variants.POSITIONAL_VARIANTS`), for the
commands that train from scratch (`bam-pretrain`, `bam-demo`); each passes its own sizes and recipe as fields."""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from .model.configuration_bam import BamLlamaConfig
from .model.modeling_bam import BamLlamaForCausalLM
from .positional_variants import POSITIONAL_VARIANTS


def variant_config(name: str, train_context_length: int, **fields) -> PretrainedConfig:
    """The config of variant `name` trained at `train_context_length` tokens: BamLlamaConfig with the variant's
    prior, or the Transformers model's config (with a sliding window of that length where the variant has one;
    with `ssmax=True`, its model with Scalable Softmax); `fields` (sizes, token ids, ...) complete it and win over the
    variant's own."""
    variant = POSITIONAL_VARIANTS[name]
    if variant.is_bam_llama:
        return BamLlamaConfig(**{**variant.config, "train_context_length": train_context_length, **fields})
    ssmax = fields.pop("ssmax", False)
    if ssmax and not variant.takes_ssmax:
        raise ValueError(f"positional variant {name} has no model with Scalable Softmax")
    window = {"sliding_window": train_context_length} if variant.sliding_window else {}
    model_type = variant.ssmax_model if ssmax else variant.transformers_model
    config = AutoConfig.for_model(model_type, **{**variant.config, **window, **fields})
    config.train_context_length = train_context_length  # saved with the model, as BamLlama's
    return config


def variant_model(config: PretrainedConfig, **kwargs) -> PreTrainedModel:
    """A freshly initialised model of `config` (a `variant_config`); kwargs: `from_config`'s (attn_implementation,
    dtype)."""
    if isinstance(config, BamLlamaConfig):
        return BamLlamaForCausalLM._from_config(config, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)
