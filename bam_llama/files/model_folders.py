"""Checks of a model folder (or Hub id) before Transformers reads it, and of the weights every command loads (no NaN
or infinity), with errors that name what is wrong."""

import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


def check_model_path(path) -> None:
    """A path that can only be local (absolute, ./ or ../, more than one '/') must exist: Transformers would
    otherwise report it as an invalid Hub repo id."""
    text = str(path)
    looks_local = isinstance(path, Path) or text.startswith((os.sep, ".", "~")) or text.count("/") > 1
    if looks_local and not Path(text).expanduser().exists():
        raise FileNotFoundError(f"no model folder at {text}")


def check_safetensors_files(model_path) -> None:
    """Every safetensors file of a local model folder must open: a corrupt or truncated one is named (safetensors
    itself only says "Error while deserializing header")."""
    folder = Path(model_path)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file, probably corrupt or truncated ({error})") from None


class NonFiniteError(ValueError):
    """Weights (or a training loss) that hold NaN or infinity; the message names the tensor and where it is."""


class TrainingDiverged(RuntimeError):
    """The training loss turned NaN or infinite; the run stops before that step's update is saved."""


def check_finite_loss(loss, step: int) -> None:
    """Stop a run whose loss (a tensor) is no longer finite, naming the step."""
    if not torch.isfinite(loss).all():
        raise TrainingDiverged(
            f"the training loss became {loss.float().mean().item()} at step {step}; stopped without saving that step "
            "(earlier checkpoints are kept): lower the learning rate or check the data"
        )


def check_finite_tensors(named_tensors, where: str) -> None:
    """Refuse the first floating-point tensor of (name, tensor) pairs that holds NaN or an infinity, naming it."""
    for name, tensor in named_tensors:
        if tensor.is_floating_point() or tensor.is_complex():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise NonFiniteError(
                    f"{name} in {where} holds {bad} NaN or infinite value{'s' if bad > 1 else ''} (of {tensor.numel()}): "
                    "these weights are broken (a diverged run?); refusing to use them"
                )


def check_finite_model(model, where) -> None:
    """Every parameter and buffer of a loaded model must be finite."""
    check_finite_tensors((*model.named_parameters(), *model.named_buffers()), str(where))


def check_finite_weights(model_path) -> None:
    """Every tensor of a local folder's safetensors files must be finite (read one tensor at a time)."""
    folder = Path(model_path)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            check_finite_tensors(((name, handle.get_tensor(name)) for name in handle.keys()), str(path))
