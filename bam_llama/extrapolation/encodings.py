"""The positional encodings compared, and the trials each gets on the validation seeds.

An encoding is a `bam-pretrain --positional` variant, with or without Scalable Softmax, evaluated as trained or with
RoPE's own scaling (dynamic NTK, YaRN) set at evaluation. Encodings that differ only in that scaling share their
trained models (`Encoding.training`).

Every encoding gets the same number of trials (`TRIALS_EACH`): learning rates and, where the encoding has a learned
shape (BAM's prior, KERPLE's kernel, T5's bucket biases), the two stages the paper's recipe uses (the shape learned, then fresh weights
trained under it frozen); an encoding with a fixed shape gets the same training compute as twice the steps instead.
Every trial of a BamLlama encoding is also evaluated after the paper's context extension (`bam-finetune --full` at
twice the training length), so each such encoding has twice as many candidates to choose from.

Light on purpose: it imports only the light variant table, for --help.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..positional_variants import POSITIONAL_VARIANTS

TRAINED = "trained"  # a trial's model as its last stage left it
EXTENDED = "extended"  # after the context extension


@dataclass(frozen=True)
class Encoding:
    positional: str  # a POSITIONAL_VARIANTS name
    label: str
    ssmax: bool = False
    rope_scaling: str | None = None  # Transformers' rope_type set for each evaluation length: "dynamic" or "yarn"

    @property
    def training(self) -> str:
        """The name of the models it evaluates: the variant, with SSMax."""
        return self.positional + ("-ssmax" if self.ssmax else "")

    @property
    def learned_shape(self) -> bool:
        return POSITIONAL_VARIANTS[self.positional].prior_trains

    @property
    def extends(self) -> bool:
        """Whether its trials are also evaluated after the context extension (`bam-finetune` takes BamLlama)."""
        return POSITIONAL_VARIANTS[self.positional].is_bam_llama

    @property
    def candidates(self) -> tuple[str, ...]:
        return (TRAINED, EXTENDED) if self.extends else (TRAINED,)

    @property
    def trials(self) -> dict[str, Trial]:
        if not self.learned_shape:
            return FIXED_SHAPE_TRIALS
        return LEARNED_SHAPE_SSMAX_TRIALS if self.ssmax else LEARNED_SHAPE_TRIALS


@dataclass(frozen=True)
class Trial:
    learning_rate: float  # the weights'
    what: str
    steps_factor: int = 1  # times the study's steps
    stage_one: str | None = None  # two stages: the trial (same encoding and seed) whose learned shape this one freezes
    frozen_scales: bool = False  # two stages with SSMax: stage one's scales frozen too (else trained afresh)


ONE_STAGE = {
    "lr-1e-3": Trial(1e-3, "one stage at the weights' learning rate 1e-3"),
    "lr-2e-3": Trial(2e-3, "one stage at 2e-3"),
}
LEARNED_SHAPE_TRIALS = {
    **ONE_STAGE,
    "two-stage": Trial(1e-3, "lr-1e-3's learned shape frozen on fresh weights, trained at 1e-3", stage_one="lr-1e-3"),
    "two-stage-lr-2e-3": Trial(2e-3, "lr-2e-3's learned shape frozen on fresh weights, trained at 2e-3",
                               stage_one="lr-2e-3"),
}
LEARNED_SHAPE_SSMAX_TRIALS = {
    **ONE_STAGE,
    "two-stage": Trial(1e-3, "lr-1e-3's learned shape frozen on fresh weights, their SSMax scales trained afresh",
                       stage_one="lr-1e-3"),
    "two-stage-frozen-scales": Trial(1e-3, "lr-1e-3's learned shape and SSMax scales frozen on fresh weights",
                                     stage_one="lr-1e-3", frozen_scales=True),
}
FIXED_SHAPE_TRIALS = {
    **ONE_STAGE,
    "long": Trial(1e-3, "twice the steps at 1e-3 (the training of two stages)", steps_factor=2),
    "long-lr-2e-3": Trial(2e-3, "twice the steps at 2e-3", steps_factor=2),
}
TRIALS_EACH = 4

ENCODINGS = {
    "bam": Encoding("bam", "BAM"),
    "bam-ssmax": Encoding("bam", "BAM + SSMax", ssmax=True),
    "alibi": Encoding("alibi", "ALiBi"),
    "alibi-ssmax": Encoding("alibi", "ALiBi + SSMax", ssmax=True),
    "nope": Encoding("nope", "NoPE"),
    "nope-ssmax": Encoding("nope", "NoPE + SSMax", ssmax=True),
    "kerple": Encoding("kerple", "KERPLE (log)"),
    "t5": Encoding("t5", "T5 buckets"),
    "rope": Encoding("rope", "RoPE"),
    "rope-ntk": Encoding("rope", "RoPE + NTK scaling", rope_scaling="dynamic"),
    "rope-yarn": Encoding("rope", "RoPE + YaRN", rope_scaling="yarn"),
    "rope-local": Encoding("rope-local", "RoPE local"),
    "sinusoidal": Encoding("sinusoidal", "Sinusoidal"),
    "sinusoidal-ssmax": Encoding("sinusoidal", "Sinusoidal + SSMax", ssmax=True),
    "rope-ssmax": Encoding("rope", "RoPE + SSMax", ssmax=True),
    "rope-local-ssmax": Encoding("rope-local", "RoPE local + SSMax", ssmax=True),
}


def trainings(names) -> dict[str, list[str]]:
    """The trained models the encodings `names` need, each with the encodings it serves, in the order given."""
    served: dict[str, list[str]] = {}
    for name in names:
        served.setdefault(ENCODINGS[name].training, []).append(name)
    return served


def check_trials() -> None:
    """Every encoding gets TRIALS_EACH trials, and a two-stage trial freezes a one-stage trial of its own table."""
    for name, encoding in ENCODINGS.items():
        trials = encoding.trials
        if len(trials) != TRIALS_EACH:
            raise AssertionError(f"{name} has {len(trials)} trials, not {TRIALS_EACH}")
        for trial in trials.values():
            if trial.stage_one is not None and (trial.stage_one not in trials or trials[trial.stage_one].stage_one):
                raise AssertionError(f"{name}: a two-stage trial must freeze a one-stage trial of its table")
