"""The comparison's settings: model sizes, training, the lengths and prompts of each phase, and the seeds that choose
(validation) apart from the seeds that report (test).

Light on purpose: standard library only, so the command's --help loads no PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

VALIDATION = "validation"  # seeds and keys the trials are judged on: every choice is made here
TEST = "test"  # seeds no choice used: the reported results
PHASES = (VALIDATION, TEST)


@dataclass(frozen=True)
class Study:
    train_length: int = 128
    scales: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # every encoding, both phases
    long_scales: tuple[int, ...] = (128, 256, 512)  # test phase, the encodings past `long_threshold` at 64x
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    steps: int = 2000  # a stage's; a trial may take twice (`Trial.steps_factor`)
    batch_size: int = 16
    warmup_steps: int = 100
    vocab_size: int = 4096
    shape_learning_rate: float = 5e-2  # a learned prior's (BAM's, KERPLE's) and the SSMax scales'
    ssmax_learning_rate: float | None = None  # the SSMax scales' own rate; None: the shape rate
    ssmax_scale_init: float | None = None  # the SSMax scales' start; None: the models' default (1, the reference's)
    passkey_share: float = 0.5  # passkey documents' share of the training characters; the Python corpus has the rest
    heldout_fraction: float = 0.05
    max_train_characters: int | None = None  # None: the whole training split
    extension_factor: int = 2  # the context extension trains at this times the training length ...
    extension_steps: int = 256  # ... for this many steps ...
    extension_batch_size: int = 8  # ... of this many rows (the tokens of a pretraining step) ...
    extension_rate_factor: float = 0.1  # ... at this times the stage's learning rates (where its cosine ended)
    extension_passkeys: int | None = None  # ... on the training texts (None), or on texts of their own whose passkey
    # documents are as long as rows of this many tokens hold (keys up to that far from the question)
    uniform_head_layer: int | None = None  # two stages of BAM's prior: stage one's flattest head of this layer (0 the
    # first) set to the uniform prior (theta_alpha = theta_beta = 0) before it is frozen; None: stage one's as learned
    validation_seeds: tuple[int, ...] = (100, 101)
    test_seeds: tuple[int, ...] = (3, 4, 5)
    validation_prompts: int = 20  # passkey prompts a length, 1x-64x
    test_prompts: int = 50  # 1x-64x
    long_prompts: int = 20  # 128x-512x
    validation_documents: int = 4  # never-trained documents for perplexity
    test_documents: int = 6  # every never-trained document as long as 512x (65,536 tokens) under a test seed's BPE
    selection_scales: tuple[int, ...] = (16, 32, 64)  # a trial's score: its strict passkey rate pooled over these
    long_threshold: float = 0.5  # past 64x: the encodings above this strict rate at 64x
    quick: bool = False

    def seeds(self, phase: str) -> tuple[int, ...]:
        return self.validation_seeds if phase == VALIDATION else self.test_seeds

    def prompts(self, phase: str, scale: int) -> int:
        if scale > max(self.scales):
            return self.long_prompts
        return self.validation_prompts if phase == VALIDATION else self.test_prompts

    def documents(self, phase: str) -> int:
        return self.validation_documents if phase == VALIDATION else self.test_documents

    def longest_scale(self, phase: str) -> int:
        return max(self.scales + (self.long_scales if phase == TEST else ()))

    @property
    def longest_common_length(self) -> int:
        """The longest prompt every encoding is evaluated at (64x the training length); past it only the encodings
        above `long_threshold` there."""
        return self.train_length * max(self.scales)

    @property
    def extension_length(self) -> int:
        return self.train_length * self.extension_factor

    def check(self) -> "Study":
        """The study, or a ValueError naming a setting that cannot hold."""
        layer = self.uniform_head_layer
        if layer is not None and not 0 <= layer < self.layers:
            raise ValueError(f"uniform_head_layer={layer}: a layer of the model's {self.layers}, counted from 0")
        passkeys = self.extension_passkeys
        if passkeys is not None and not self.train_length < passkeys <= self.extension_length:
            raise ValueError(f"extension_passkeys={passkeys}: the extension's passkey documents must be longer than "
                             f"the training length {self.train_length} and fit its rows of {self.extension_length}")
        return self


QUICK = Study(
    train_length=64, scales=(1, 2), long_scales=(4,), hidden_size=32, layers=2, heads=4, steps=12, batch_size=4,
    warmup_steps=0, vocab_size=600, max_train_characters=30_000, extension_steps=4, extension_batch_size=2,
    validation_seeds=(100, 101), test_seeds=(3,), validation_prompts=2, test_prompts=2, long_prompts=1,
    validation_documents=1, test_documents=1, selection_scales=(2,), quick=True,
)


def check_seeds(study: Study) -> None:
    """A ValueError where a seed is both a validation and a test seed: a test result must come from seeds no choice
    used."""
    shared = set(study.validation_seeds) & set(study.test_seeds)
    if shared:
        raise ValueError(f"seeds {sorted(shared)} are both validation and test seeds")


def with_seeds(study: Study, validation: tuple[int, ...] | None, test: tuple[int, ...] | None) -> Study:
    study = replace(study, **({"validation_seeds": validation} if validation else {}), **({"test_seeds": test} if test else {}))
    check_seeds(study)
    return study


# Settings a study may change with `--set FIELD=VALUE` (the seeds have flags of their own), each with what it holds.
SETTABLE = {field.name: field.type for field in fields(Study) if field.name not in ("validation_seeds", "test_seeds", "quick")}
FRACTIONS = ("passkey_share", "heldout_fraction", "long_threshold", "extension_rate_factor")
INDEXES = ("uniform_head_layer",)  # may be 0


def with_settings(study: Study, assignments: list[str]) -> Study:
    """The study with each `FIELD=VALUE` of `assignments` set (a study of its own, to run in an output folder of its
    own: `--resume` refuses a folder of other settings); a ValueError naming the first assignment that is not one."""
    changes = {}
    for assignment in assignments:
        name, equals, text = assignment.partition("=")
        if not equals or name.strip() not in SETTABLE:
            raise ValueError(f"--set {assignment!r}: expected FIELD=VALUE with FIELD among {', '.join(SETTABLE)}")
        name = name.strip()
        changes[name] = setting_value(name, SETTABLE[name], text.strip())
    return replace(study, **changes).check()


def setting_value(name: str, kind: str, text: str):
    """`text` read as the field's type: a positive number (a fraction in (0, 1] for FRACTIONS), `none` where the
    field may be None, positive integers separated by commas for a tuple."""
    if text.lower() == "none" and kind.endswith("| None"):
        return None
    try:
        if kind.startswith("tuple"):
            value = tuple(int(part) for part in text.split(","))
            numbers = value
        else:
            value = (float if kind.startswith("float") else int)(text)
            numbers = (value,)
    except ValueError:
        raise ValueError(f"--set {name}={text}: {name} takes {kind}") from None
    allowed = (lambda number: number >= 0) if name in INDEXES else (lambda number: number > 0)
    if not numbers or not all(map(allowed, numbers)) or (name in FRACTIONS and value > 1):
        bounds = "in (0, 1]" if name in FRACTIONS else ">= 0" if name in INDEXES else "positive"
        raise ValueError(f"--set {name}={text}: {name} must be {bounds}")
    return value


def changed_settings(study: Study) -> list[str]:
    """`FIELD=VALUE` for each setting (seeds aside) other than the default study's."""
    default = QUICK if study.quick else Study()
    return [f"{name}={getattr(study, name)}" for name in SETTABLE if getattr(study, name) != getattr(default, name)]
