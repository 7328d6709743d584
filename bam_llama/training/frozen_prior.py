"""`bam-pretrain --frozen-prior-from MODEL`, the second stage of two: a fresh BamLlama takes the prior a saved one
learned (every prior module's theta_alpha, theta_beta and theta_mu, read from MODEL's safetensors files) and trains
with it frozen. The config saved with the model says so (`FROZEN_PRIOR`), and the prior tensors are buffers, which no
optimizer sees.

MODEL must have the fresh model's layers, heads, prior scope (global or per layer) and prior formula: its prior
then means the same thing in the new model.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..model.configuration_bam import BamLlamaConfig
from .arguments import saved_bam_llama_config

FROZEN_PRIOR = {"train_theta_alpha": False, "train_theta_beta": False, "train_theta_mu": False}
PRIOR_TENSOR = re.compile(r"(^|\.)prior\.theta_(alpha|beta|mu)$")  # a global prior's and each layer's


def check_prior_source(folder: str, layers: int, heads: int, prior_scope: str) -> None:
    """A ValueError naming the first way `folder` cannot give its prior to a fresh model of `layers` x `heads` with
    `prior_scope` and the config's default formula. Reads config.json and the prior's tensors (a few numbers a head),
    no other weight."""
    config = saved_bam_llama_config(folder)
    fresh = BamLlamaConfig()
    expected = {"num_hidden_layers": (layers, "layers"), "num_attention_heads": (heads, "heads"),
                "prior_scope": (prior_scope, "prior scope"), "prior_formula": (fresh.prior_formula, "prior formula"),
                "prior_eps": (fresh.prior_eps, "prior eps")}
    for field, (value, what) in expected.items():
        saved = config.get(field, getattr(fresh, field))
        if saved != value:
            raise ValueError(f"{folder}: {what} {saved!r}, the model to train has {value!r}; its prior would not fit")
    names = {PRIOR_TENSOR.search(name).group(2) for name in saved_prior(folder)}
    if names != {"alpha", "beta", "mu"}:
        raise ValueError(f"{folder}: its weights hold no prior (prior.theta_alpha, theta_beta and theta_mu)")


def saved_prior(folder: str) -> dict[str, torch.Tensor]:
    """Every prior tensor of `folder`'s safetensors files, by its name in the model (`model.` prefix dropped)."""
    prior = {}
    for path in sorted(Path(folder).expanduser().glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                if PRIOR_TENSOR.search(name):
                    prior[name.removeprefix("model.")] = handle.get_tensor(name)
    return prior


def set_frozen_prior(model: torch.nn.Module, folder: str) -> None:
    """Copy `folder`'s prior into `model`, a fresh BamLlama whose config freezes its prior (`FROZEN_PRIOR`): every
    prior tensor of the model takes the saved one of the same name."""
    prior = saved_prior(folder)
    for name, tensor in model.named_buffers():
        if not PRIOR_TENSOR.search(name):
            continue
        saved = prior.get(name.removeprefix("model."))
        if saved is None or saved.shape != tensor.shape:
            found = "none" if saved is None else f"shape {tuple(saved.shape)}"
            raise ValueError(f"{folder}: the model's {name} of shape {tuple(tensor.shape)} has {found} among its weights")
        with torch.no_grad():
            tensor.copy_(saved)
