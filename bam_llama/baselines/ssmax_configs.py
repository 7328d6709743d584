"""The configs of Transformers' Llama and Mistral with Scalable Softmax: `llama_ssmax` and `mistral_ssmax`, the
models `bam-pretrain --positional rope --ssmax` and `--positional rope-local --ssmax` train (`ssmax_models.py`).

Each is its Transformers config plus the per-head scale's initial value and whether it trains, under a model type of
its own, so that a saved folder loads back as the model with its scales. `registration.register_config` registers them
with AutoConfig on `import bam_llama`; building one registers the models too (as BamLlamaConfig does), so that
`AutoModelForCausalLM.from_pretrained` of a saved folder finds them.
"""

import math
import sys

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig, MistralConfig


class ScalableSoftmaxFields:
    """Scalable Softmax's fields, read by `BamScalableSoftmax` as it reads BamLlamaConfig's:

    Args:
        ssmax_scale_init (`float`, defaults to 1.0): every head's initial scale `s_h`.
        train_ssmax_scale (`bool`, defaults to `True`): the scales train (else they are fixed buffers).
    """

    ssmax_prior = False  # a class attribute, never saved: there is no prior for the factor to scale

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if not math.isfinite(self.ssmax_scale_init):
            raise ValueError(f"ssmax_scale_init must be a finite number, got {self.ssmax_scale_init}")
        register_models = getattr(sys.modules.get(__name__.partition(".")[0]), "register", None)
        if register_models is not None:  # the package's `register` (no import: registration imports this module)
            register_models()


@strict
class LlamaSsmaxConfig(ScalableSoftmaxFields, LlamaConfig):
    """[`LlamaConfig`] with Scalable Softmax: each query row's logits times `s_h * ln(n_i)`, `n_i` the keys it sees."""

    model_type = "llama_ssmax"
    ssmax_scale_init: float = 1.0
    train_ssmax_scale: bool = True


@strict
class MistralSsmaxConfig(ScalableSoftmaxFields, MistralConfig):
    """[`MistralConfig`] with Scalable Softmax; `n_i` counts only the keys inside the sliding window."""

    model_type = "mistral_ssmax"
    ssmax_scale_init: float = 1.0
    train_ssmax_scale: bool = True


SSMAX_CONFIGS = (LlamaSsmaxConfig, MistralSsmaxConfig)
