"""`bam-pretrain --frozen-prior-from MODEL`, the second stage of two: a fresh BamLlama takes the prior a saved one
learned (every prior module's theta_alpha, theta_beta and theta_mu, or under T5's buckets its bucket_bias, read from
MODEL's safetensors files) and trains with it frozen; with `--frozen-ssmax` it takes MODEL's Scalable-Softmax scales too, frozen. The config saved with the
model says so (`FROZEN_PRIOR`, `FROZEN_SSMAX`), and the frozen tensors are buffers, which no optimizer sees.

MODEL must have the fresh model's layers, heads, prior scope (global or per layer), prior formula and eps, T5's
buckets (and, for its scales, Scalable Softmax in the same order): what it learned then means the same thing in the new model.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..model.configuration_bam import BamLlamaConfig
from ..model.prior_bam import BUCKET_BIAS, T5_BUCKETS, THETA_PARAMETERS
from .arguments import saved_bam_llama_config

FROZEN_PRIOR = {"train_theta_alpha": False, "train_theta_beta": False, "train_theta_mu": False,
                "train_bucket_bias": False}
FROZEN_SSMAX = {"train_ssmax_scale": False}
# a global prior's and each layer's
PRIOR_TENSOR = re.compile(r"(^|\.)prior\.(theta_alpha|theta_beta|theta_mu|bucket_bias)$")
SSMAX_TENSOR = re.compile(r"(^|\.)ssmax\.scale$")


def check_prior_source(folder: str, fresh: BamLlamaConfig, with_ssmax: bool = False) -> None:
    """A ValueError naming the first way `folder` cannot give its prior (and with `with_ssmax` its SSMax scales) to
    a fresh model of config `fresh`. Reads config.json and those tensors (a few numbers a head), no other weight."""
    config = saved_bam_llama_config(folder)
    default = BamLlamaConfig()
    expected = {"num_hidden_layers": "layers", "num_attention_heads": "heads", "prior_scope": "prior scope",
                "prior_formula": "prior formula", "prior_eps": "prior eps"}
    if fresh.prior_formula == T5_BUCKETS:
        expected.update(t5_num_buckets="T5 buckets", t5_max_distance="T5 max distance")
    if with_ssmax:
        expected.update(ssmax="Scalable Softmax", ssmax_prior="Scalable Softmax order (ssmax_prior)")
    for field, what in expected.items():
        saved, value = config.get(field, getattr(default, field)), getattr(fresh, field)
        if saved != value:
            raise ValueError(f"{folder}: {what} {saved!r}, the model to train has {value!r}; what it learned would not fit")
    names = {PRIOR_TENSOR.search(name).group(2) for name in saved_tensors(folder, PRIOR_TENSOR)}
    wanted = {BUCKET_BIAS} if fresh.prior_formula == T5_BUCKETS else set(THETA_PARAMETERS)
    if names != wanted:
        raise ValueError(f"{folder}: its weights hold no prior ({', '.join(f'prior.{name}' for name in sorted(wanted))})")
    if with_ssmax and not saved_tensors(folder, SSMAX_TENSOR):
        raise ValueError(f"{folder}: its weights hold no Scalable-Softmax scales (ssmax.scale)")


def saved_tensors(folder: str, pattern: re.Pattern) -> dict[str, torch.Tensor]:
    """Every tensor of `folder`'s safetensors files whose name matches `pattern`, by its name in the model (`model.`
    prefix dropped)."""
    found = {}
    for path in sorted(Path(folder).expanduser().glob("*.safetensors")):
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                if pattern.search(name):
                    found[name.removeprefix("model.")] = handle.get_tensor(name)
    return found


def set_frozen_prior(model: torch.nn.Module, folder: str, with_ssmax: bool = False) -> None:
    """Copy `folder`'s prior (and with `with_ssmax` its SSMax scales) into `model`, a fresh BamLlama whose config
    freezes them (`FROZEN_PRIOR`, `FROZEN_SSMAX`): every such buffer of the model takes the saved tensor of its name."""
    patterns = (PRIOR_TENSOR, SSMAX_TENSOR) if with_ssmax else (PRIOR_TENSOR,)
    for pattern in patterns:
        saved = saved_tensors(folder, pattern)
        for name, tensor in model.named_buffers():
            if not pattern.search(name):
                continue
            value = saved.get(name.removeprefix("model."))
            if value is None or value.shape != tensor.shape:
                found = "none" if value is None else f"shape {tuple(value.shape)}"
                raise ValueError(f"{folder}: the model's {name} of shape {tuple(tensor.shape)} has {found} among its weights")
            with torch.no_grad():
                tensor.copy_(value)
