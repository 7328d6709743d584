"""bam-llama: GGD-BAM (Bayesian Attention Mechanism) for Hugging Face Transformers.

Importing the package registers `bam_llama` with the Auto classes, and BAM's mask functions under private names
with Transformers' mask interface. A BamLlama's "eager", "sdpa" and "bam_triton" attention are BAM's own, chosen
inside the model: Transformers' global "eager" / "sdpa" stay as they are for every other model.

Light on purpose: every command imports the package root before it parses its arguments, so the import loads no
PyTorch: the classes are imported on first use, and the registration happens as soon as Transformers' Auto classes
are imported (at once when they already are), always before they can be used.
"""

import importlib

from .registration import register, register_config, register_now_or_on_auto_import

__version__ = "0.1.0"
__all__ = [
    "BamLlamaConfig",
    "BamLlamaForCausalLM",
    "BamLlamaForQuestionAnswering",
    "BamLlamaForSequenceClassification",
    "BamLlamaForTokenClassification",
    "BamLlamaModel",
    "BamLlamaPreTrainedModel",
    "register_bam_attention",
]
EXPORTED_FROM = {
    "BamLlamaConfig": "model.configuration_bam",
    "BamLlamaForCausalLM": "model.modeling_bam",
    "BamLlamaForQuestionAnswering": "model.modeling_bam",
    "BamLlamaForSequenceClassification": "model.modeling_bam",
    "BamLlamaForTokenClassification": "model.modeling_bam",
    "BamLlamaModel": "model.modeling_bam",
    "BamLlamaPreTrainedModel": "model.modeling_bam",
    "register_bam_attention": "model.dispatch_bam",
}


def __getattr__(name: str):
    if name not in EXPORTED_FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{EXPORTED_FROM[name]}", __name__), name)
    register()
    globals()[name] = value  # later look-ups skip __getattr__
    return value


register_now_or_on_auto_import()
