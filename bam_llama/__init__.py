"""bam-llama: GGD-BAM (Bayesian Attention Mechanism) for Hugging Face Transformers.

Importing the package registers `bam_llama` with the Auto classes and BAM's attention implementations
("bam_eager", "bam_sdpa", "bam_triton") with Transformers' attention interfaces.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_bam import BamLlamaConfig
from .modeling_bam import BamLlamaForCausalLM, BamLlamaModel, BamLlamaPreTrainedModel, register_bam_attention


AutoConfig.register(BamLlamaConfig.model_type, BamLlamaConfig, exist_ok=True)
AutoModel.register(BamLlamaConfig, BamLlamaModel, exist_ok=True)
AutoModelForCausalLM.register(BamLlamaConfig, BamLlamaForCausalLM, exist_ok=True)

__version__ = "0.1.0"
__all__ = [
    "BamLlamaConfig",
    "BamLlamaForCausalLM",
    "BamLlamaModel",
    "BamLlamaPreTrainedModel",
    "register_bam_attention",
]
