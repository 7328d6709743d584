"""bam-llama: GGD-BAM (Bayesian Attention Mechanism) for Hugging Face Transformers."""

from .configuration_bam import BamLlamaConfig

__all__ = ["BamLlamaConfig"]
