"""Helpers the tests share: tiny BamLlama models with a non-trivial prior, the environment of a subprocess that
imports this checkout, the reference implementation's fixtures, and a reading of needle prompts (the values their
question asks for, found in their text)."""

import os
import re
import signal
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES_DIR = REPO_ROOT.parent / "shared" / "fixtures" / "official-bam"


def default_sigint() -> None:
    """Popen's preexec_fn for a child the test interrupts: the suite run as a background job (`bash .ci/run &` in
    a non-interactive shell) hands its children an ignored SIGINT, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def checkout_environment(**variables: str) -> dict[str, str]:
    """os.environ for a subprocess that must import this checkout's bam_llama (first on PYTHONPATH)."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **variables}


def require_reference_fixtures(folder: Path = FIXTURES_DIR) -> Path:
    """The reference fixtures folder. Missing, the test is skipped, except under CI=true, where it fails: CI must
    not go green without its only external ground truth."""
    if not folder.exists():
        message = f"reference fixtures not found at {folder} (CI puts ../shared beside the clone)"
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"{message}; CI=true requires them", pytrace=False)
        pytest.skip(message)
    return folder


def tiny_config(**overrides):
    from bam_llama import BamLlamaConfig

    values = dict(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        train_context_length=16,
    )
    values.update(overrides)
    return BamLlamaConfig(**values)


def randomize_prior(model, seed: int = 0) -> None:
    """Give every prior / SSMax parameter distinct non-trivial values (negative beta, non-zero mu included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            heads = parameter.numel()
            if name.endswith("theta_alpha"):
                parameter.copy_(torch.rand(heads, generator=generator) * 2 - 1.5)
            elif name.endswith("theta_beta"):
                parameter.copy_(torch.linspace(-0.5, 1.2, heads))
            elif name.endswith("theta_mu"):
                parameter.copy_(torch.rand(heads, generator=generator) - 0.5)
            elif name.endswith("ssmax.scale"):
                parameter.copy_(0.8 + 0.4 * torch.rand(heads, generator=generator))


def tiny_model(attn_implementation: str = "eager", seed: int = 0, **overrides):
    from bam_llama import BamLlamaForCausalLM

    torch.manual_seed(seed)
    model = BamLlamaForCausalLM(tiny_config(**overrides))
    model.set_attn_implementation(attn_implementation)
    randomize_prior(model, seed)
    return model.eval()


# ---------------------------------------------------------------------------------- needle prompts, read back

NEEDLE_PATTERN = re.compile(r" The special magic number for (\w+) is (\d+)\.")
ASSIGNMENT_PATTERN = re.compile(r" VAR (\w+) = (?:VAR (\w+)|(\d+))\.")


def asked_values(text: str) -> list[str]:
    """The values the prompt's question asks for, read from the prompt's text alone."""
    question = text[text.rindex(" The "):]
    variable = re.fullmatch(r" The value of VAR (\w+) is", question)
    if variable:
        assignments = {label: (source, value) for label, source, value in ASSIGNMENT_PATTERN.findall(text)}
        label = variable.group(1)
        while assignments[label][0]:  # follow VAR x = VAR y to the number
            label = assignments[label][0]
        return [assignments[label][1]]
    needles = NEEDLE_PATTERN.findall(text)
    one = re.fullmatch(r" The special magic number for (\w+) is", question)
    if one:
        return [value for label, value in needles if label == one.group(1)]
    labels = re.fullmatch(r" The special magic numbers for (.+) are", question).group(1)
    labels = re.split(r", | and ", labels)
    if len(labels) == 1:  # one key, all its values in the order they appear
        return [value for label, value in needles if label == labels[0]]
    return [next(value for label, value in needles if label == asked) for asked in labels]
