"""The positional encodings a model can be trained with, one table: `bam-pretrain --positional`, `bam-demo --models`,
`bam-convert llama --prior` and the benchmarks read their names, labels and settings here.

A variant is either BamLlama with its prior set one way (`config`: BamLlamaConfig fields: where the prior starts,
which of its parameters train) or one of Transformers' own models (`transformers_model`: a model type
`AutoConfig.for_model` knows; `ssmax_model`: the same model with Scalable Softmax, for `bam-pretrain --ssmax`, which
BamLlama has as a config field). `positional_models.py` builds them. To add one: a row here, a line in
docs/pretraining.md ("Adding a positional variant") and its expected attention in
tests/model/test_positional_variants.py.

Light on purpose: it imports nothing of the package, nor `dataclasses` (it loads `inspect`): every command's --help
reads this table.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple


class PriorInit(NamedTuple):
    """Where BAM's prior starts: BamLlamaConfig's `theta_alpha_init` and `theta_beta_init` (theta_mu stays 0)."""

    config: Mapping
    description: str


# Also `bam-convert llama --prior`: the prior a converted Llama starts fine-tuning from (trained, whatever it is).
PRIOR_INITS = {
    "uniform": PriorInit(
        {"theta_alpha_init": 0.0, "theta_beta_init": 0.0},  # bias -1 at every distance
        "theta 0, no positional preference",
    ),
    "alibi": PriorInit(
        {"theta_alpha_init": "alibi", "theta_beta_init": 1.0},  # bias -slope_h * |j - i|: ALiBi
        "beta 1, ALiBi slopes",
    ),
}


def prior(init: str, trained: bool) -> dict:
    """BamLlamaConfig fields of a prior starting at PRIOR_INITS[init], with theta_alpha and theta_beta trained or
    fixed."""
    return {**PRIOR_INITS[init].config, "train_theta_alpha": trained, "train_theta_beta": trained}


T5_BUCKETS = "t5_buckets"  # BamLlamaConfig.prior_formula of T5's bucketed relative bias (model/prior_bam.py's)


class PositionalVariant(NamedTuple):
    """One positional encoding: BamLlama with `config`, or Transformers' `transformers_model` with `config`."""

    label: str  # in tables and plot titles
    description: str  # one line, in --help
    config: Mapping = MappingProxyType({})  # none
    transformers_model: str | None = None
    sliding_window: bool = False  # each query sees only the last training-length tokens, at any length
    ssmax_model: str | None = None  # Transformers' model with Scalable Softmax (baselines/ssmax_models.py)

    @property
    def is_bam_llama(self) -> bool:
        return self.transformers_model is None

    @property
    def takes_ssmax(self) -> bool:
        """Whether `bam-pretrain --ssmax` can add Scalable Softmax: BamLlama, or a model with an `ssmax_model`."""
        return self.is_bam_llama or self.ssmax_model is not None

    @property
    def prior_trains(self) -> bool:
        """A BamLlama prior whose shape is learned (`bam-pretrain --frozen-prior-from` can give it another's)."""
        if self.config.get("prior_formula") == T5_BUCKETS:
            return self.config["train_bucket_bias"]
        return self.is_bam_llama and self.config["train_theta_beta"]

    @property
    def prior_carries_position(self) -> bool:
        """A BamLlama prior that can tell distances apart: learned, or fixed with a slope (not flat). Only the prior:
        `sinusoidal`'s flat prior carries none, its position embedding all."""
        if not self.is_bam_llama:
            return False
        return self.prior_trains or self.config["theta_beta_init"] != 0


POSITIONAL_VARIANTS = {
    "bam": PositionalVariant(
        "BAM (GGD prior)", "learned GGD prior (paper init: uniform, alpha and beta trained)", prior("uniform", trained=True)
    ),
    "alibi": PositionalVariant("ALiBi", "the prior fixed to ALiBi's slopes", prior("alibi", trained=False)),
    "nope": PositionalVariant("NoPE", "the prior fixed flat (no position)", prior("uniform", trained=False)),
    "kerple": PositionalVariant(
        "KERPLE (log)", "KERPLE's learned log kernel -r1 ln(1 + r2 |i - j|) as the prior (r1 = r2 = 1 at the start)",
        {**prior("uniform", trained=True), "prior_formula": "kerple_log"},
    ),
    "t5": PositionalVariant(
        "T5 buckets", "T5's learned bias per bucket of distances (32 buckets to 128 tokens, causal) as the prior, 0 at the start",
        {"prior_formula": T5_BUCKETS, "train_bucket_bias": True},
    ),
    "rope": PositionalVariant("RoPE (Llama)", "Transformers' Llama", transformers_model="llama", ssmax_model="llama_ssmax"),
    "rope-local": PositionalVariant(
        "RoPE local", "RoPE with a sliding window of the training length (Transformers' Mistral)",
        transformers_model="mistral", sliding_window=True, ssmax_model="mistral_ssmax",
    ),
    "sinusoidal": PositionalVariant(
        "Sinusoidal", "Vaswani et al.'s fixed sinusoidal position embedding added to the token embeddings, the prior "
        "fixed flat", {**prior("uniform", trained=False), "absolute_positions": "sinusoidal"},
    ),
}


def describe_variants() -> str:
    """"bam: learned GGD prior ...; alibi: ...", for --help."""
    return "; ".join(f"{name}: {variant.description}" for name, variant in POSITIONAL_VARIANTS.items())


def describe_prior_inits(default: str) -> str:
    """"uniform (theta 0, ...; default) or alibi (...)", for --help."""
    described = [f"{name} ({init.description}{'; default' if name == default else ''})" for name, init in PRIOR_INITS.items()]
    return ", ".join(described[:-1]) + " or " + described[-1]
