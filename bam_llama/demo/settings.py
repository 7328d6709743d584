"""bam-demo's settings: the data, the training recipe, the model size and the evaluation, with their defaults and
those of --quick; which positional variants it trains.

Light on purpose (it imports only the light `evaluation/depth_plan.py`): `bam-demo --help` shows these defaults
without loading PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..evaluation.depth_plan import DepthPlan

MODEL_NAMES = ("bam", "rope", "alibi")  # the positional variants (`positional_variants`) the demo trains
DEFAULT_MODELS = ("bam", "rope")


@dataclass
class DataConfig:
    train_length: int = 128
    passkey_fraction: float = 1.0
    answer_only_loss: bool = True
    add_bos: bool = True
    num_digits: int = 5


@dataclass
class ModelSize:
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int | None = None


@dataclass
class TrainConfig:
    # 1,500 steps lost keys from 4x-16x on 3 of 18 seeds (a digit wrong, or no answer); on validation seeds 6,000
    # recovered both that failed and kept one that passed (benchmarks/results/demo-cpu.md's screen).
    steps: int = 6000
    batch_size: int = 32
    lr: float = 2e-3
    # The prior has a handful of scalars per head that must travel several units (theta_alpha ~ 2, theta_beta ~ -2
    # for a sharp head): at the weights' rate they barely move in a short run.
    prior_lr: float | None = 5e-2
    warmup_fraction: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0


@dataclass
class ExtensionConfig:
    """The paper's light context extension after training (0 steps: none): every weight and the prior trained
    `steps` more steps on documents of `factor` times the training length, as many tokens a step (`factor` times
    fewer documents), at `rate_factor` times the training's learning rates, with its warmup and cosine decay."""

    steps: int = 0
    factor: int = 2
    rate_factor: float = 0.1


@dataclass
class DemoSettings:
    data: DataConfig
    train: TrainConfig
    size: ModelSize
    lengths: list[int]
    num_depths: DepthPlan  # prompts per length, fewer at the longest (where one costs the most)
    extension: ExtensionConfig = field(default_factory=ExtensionConfig)


# 1x-64x at 20 prompts, then 10 at each of 128x, 256x and 512x of the 128-byte training length (10 is the fewest
# prompts whose rate says something at 512x: 10 of 10 is 69-100%): one prompt at 64K bytes takes about 100 s on one
# thread (against 1.8 s at 8K), so 512x at 20 prompts would take 33 min alone.
LENGTHS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
DEPTHS = DepthPlan(20, {16384: 10, 32768: 10, 65536: 10})


def default_settings(quick: bool) -> DemoSettings:
    if quick:
        return DemoSettings(
            data=DataConfig(train_length=64),
            train=TrainConfig(steps=8, batch_size=4),
            size=ModelSize(hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
            lengths=[64, 128],
            num_depths=DepthPlan(2),
            extension=ExtensionConfig(steps=2),
        )
    return DemoSettings(data=DataConfig(), train=TrainConfig(), size=ModelSize(), lengths=list(LENGTHS), num_depths=DEPTHS)
