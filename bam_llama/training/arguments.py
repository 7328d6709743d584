"""The run settings of `bam-finetune` and `bam-pretrain` (their flags: `cli/arguments.py`, `cli/finetune.py`,
`cli/pretrain.py`), with the paper's model sizes.

Light on purpose (standard library only): the commands read the defaults here for --help without loading PyTorch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

# hidden size, layers, heads of the paper's models (the reference code's presets); SwiGLU width 2x hidden.
PRESETS = {
    "l6": (512, 6, 16),
    "l8": (768, 8, 16),
    "l12": (768, 12, 16),
    "l15": (1152, 15, 24),
    "l18": (1536, 18, 32),
    "l24": (2048, 24, 64),
}
DEFAULT_PRESET = "l12"
PRIOR_SCOPES = ("global", "layer")  # BamLlamaConfig's; written out, so that --help loads no transformers
REFERENCE_ROPE_THETA = 500_000.0  # the reference's RoPE baselines (and Llama 3); Transformers' LlamaConfig: 10,000


def describe_preset(name: str, vocab_sizes: tuple[int, ...] = ()) -> str:
    """"768 hidden, 12 layers, 16 heads", with the parameter count of the preset's model at each vocabulary size."""
    hidden, layers, heads = PRESETS[name]
    text = f"{hidden} hidden, {layers} layers, {heads} heads"
    for vocab_size in vocab_sizes:
        text += f"; {preset_parameters(name, vocab_size) / 1e6:.0f}M parameters with {vocab_size} tokens"
    return text


def preset_parameters(name: str, vocab_size: int) -> int:
    """Parameters of a preset's model (multi-head attention, SwiGLU of 2x the width, untied embeddings)."""
    hidden, layers, _ = PRESETS[name]
    per_layer = 4 * hidden * hidden + 3 * hidden * (2 * hidden) + 2 * hidden
    return layers * per_layer + 2 * vocab_size * hidden + hidden


@dataclasses.dataclass(kw_only=True)
class TrainingRunArguments:
    """The fields `bam-finetune` and `bam-pretrain` share with the same defaults (keyword-only, so each command's
    own arguments dataclass keeps its required fields first); their flags come from `cli.arguments`' `add_*_arguments`."""

    text_field: str = "text"
    dataset_config: str | None = None
    dataset_split: str = "train"
    eval_rows: int = 8
    warmup_steps: int = 0
    lr_scheduler_type: str = "cosine"
    num_train_epochs: float = 1.0
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: bool = False
    reentrant_checkpointing: bool = False  # torch's reentrant variant; implies gradient_checkpointing
    bf16: bool | None = None
    attn_implementation: str | None = None
    save_total_limit: int | None = 2
    resume_from_checkpoint: str | None = None
    overwrite_output_dir: bool = False
    fsdp: bool = False
    deepspeed: str | None = None
    sp_size: int = 1
    seed: int = 42
    threads: int | None = None  # None: cpu_threads.default_threads
    disable_progress_bars: bool = False


@dataclasses.dataclass
class FinetuneArguments(TrainingRunArguments):
    """What `bam-finetune` needs; the CLI flags are these names with dashes."""

    model: str
    data: str
    output_dir: str
    context_length: int
    lora: bool = True
    lora_mlp: bool = False
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    learning_rate: float | None = None
    prior_learning_rate: float = 1e-2
    ssmax_learning_rate: float | None = None  # a model with Scalable Softmax only; None: the prior's learning rate
    weight_decay: float = 0.0
    max_steps: int = 256
    per_device_train_batch_size: int = 1
    save_steps: int = 64
    merge: bool = False
    logging_steps: int = 8

    @property
    def resolved_learning_rate(self) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        return 2e-4 if self.lora else 2e-5


@dataclasses.dataclass
class PretrainArguments(TrainingRunArguments):
    """What `bam-pretrain` needs; the CLI flags are these names with dashes (`--layers`, `--heads`, `--kv-heads`
    for the three size fields)."""

    data: str
    output_dir: str
    context_length: int = 512
    positional: str = "bam"  # a name of positional_variants.POSITIONAL_VARIANTS
    ssmax: bool = False
    ssmax_prior: bool | None = None  # --ssmax only; None: the config's default (True: the factor scales the prior)
    ssmax_scale_init: float | None = None  # --ssmax only; None: the config's default (1.0)
    ssmax_learning_rate: float | None = None  # --ssmax only; None: the prior's learning rate
    prior_scope: str = "global"
    frozen_prior_from: str | None = None  # a learned prior's variant: a saved BamLlama whose prior the fresh model takes, frozen
    frozen_ssmax: bool = False  # with frozen_prior_from and ssmax: its SSMax scales too
    rope_theta: float | None = None  # RoPE only; None: REFERENCE_ROPE_THETA
    preset: str | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    tokenizer: str = "byte"
    vocab_size: int = 8192
    learning_rate: float = 1e-3
    prior_learning_rate: float | None = None
    weight_decay: float = 0.1
    max_steps: int = 1000
    per_device_train_batch_size: int = 8
    save_steps: int = 250
    report_to: str = "none"
    logging_steps: int = 25

    @property
    def resolved_learning_rate(self) -> float:
        return self.learning_rate

    @property
    def resolved_prior_learning_rate(self) -> float:
        return self.learning_rate if self.prior_learning_rate is None else self.prior_learning_rate

    def model_sizes(self) -> dict[str, int]:
        """hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size: the preset's
        (default l12) with every size flag given replacing its field."""
        hidden, layers, heads = PRESETS[self.preset or DEFAULT_PRESET]
        hidden = self.hidden_size or hidden
        heads = self.num_attention_heads or heads
        return {
            "hidden_size": hidden,
            "num_hidden_layers": self.num_hidden_layers or layers,
            "num_attention_heads": heads,
            "num_key_value_heads": self.num_key_value_heads or heads,
            "intermediate_size": self.intermediate_size or 2 * hidden,
        }


def saved_bam_llama_config(folder: str) -> dict:
    """The config.json of a saved BamLlama folder (a `bam-pretrain` model/ or checkpoint-N/ folder, a converted
    model): a ValueError naming what is wrong where it is not one. Reads no weights."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder}: not a saved model folder (no config.json there)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable config ({error})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "bam_llama":
        raise ValueError(f"{folder}: not a BamLlama folder (its config's model_type is {model_type!r}, not 'bam_llama')")
    return config
