"""bam-llama: GGD-BAM (Bayesian Attention Mechanism) for Hugging Face Transformers.

Importing the package registers `bam_llama` with the Auto classes, and BAM's mask functions under private names
with Transformers' mask interface. A BamLlama's "eager", "sdpa" and "bam_triton" attention are BAM's own, chosen
inside the model: Transformers' global "eager" / "sdpa" stay as they are for every other model.
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
