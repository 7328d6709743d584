"""The prior's and Scalable Softmax's modules: `BamAttention`'s `prior` and `ssmax` submodules (`BamLlamaModel`'s
`prior` for a global prior; PEFT's `modules_to_save=["prior", "ssmax"]` names them), their per-head tensors, initial
values, and which of them the config trains. The math they compute is prior_bam.py's.
"""

import torch
from torch import nn

from .configuration_bam import BamLlamaConfig
from .prior_bam import (
    BUCKET_BIAS, SSMAX_PARAMETER, T5_BUCKETS, KeptPriorTable, alibi_slopes, distance_bias, relative_distance,
    ssmax_factor,
)
from .prior_tables_bam import module_table

try:
    from transformers import initialization as hf_init
except ImportError:  # older 5.x releases
    hf_init = None


def initial_prior_values(config: BamLlamaConfig) -> dict[str, torch.Tensor]:
    """Per-head initial theta_alpha / theta_beta / theta_mu from the config's init schemes; under T5's buckets,
    bucket_bias (H, t5_num_buckets) at 0 (every distance alike, as the GGD's uniform init; T5 itself draws them
    at random like its other weights)."""
    heads = config.num_attention_heads
    if config.prior_formula == T5_BUCKETS:
        return {BUCKET_BIAS: torch.zeros(heads, config.t5_num_buckets)}
    if config.theta_alpha_init == "alibi":
        theta_alpha = alibi_slopes(heads).log()
    else:
        theta_alpha = torch.full((heads,), float(config.theta_alpha_init))
    if config.theta_beta_init == "linear":
        theta_beta = torch.linspace(0.0, 1.0, heads)
    else:
        theta_beta = torch.full((heads,), float(config.theta_beta_init))
    theta_mu = torch.full((heads,), float(config.theta_mu_init))
    return {"theta_alpha": theta_alpha, "theta_beta": theta_beta, "theta_mu": theta_mu}


class KeptInFloat32(nn.Module):
    """A module whose floating tensors stay float32 when the model is cast to 16 bits (`model.to(torch.bfloat16)`,
    `.half()`): moved to the new device, never rounded. Loading keeps them float32 through the model's
    `_keep_in_fp32_modules_strict`; the attention reads them in float32 and combines the bias in its compute dtype."""

    def _apply(self, fn, recurse=True):
        def keep_float32(tensor: torch.Tensor) -> torch.Tensor:
            converted = fn(tensor)
            if tensor.dtype == torch.float32 and converted.dtype in (torch.float16, torch.bfloat16):
                return tensor.to(device=converted.device)
            return converted

        return super()._apply(keep_float32, recurse)


class BamPrior(KeptInFloat32):
    """The per-head positional prior: three scalars per head (the GGD, KERPLE), or T5's bucket biases (H,
    num_buckets), as the config's `prior_formula` says (`names`: its tensors, in the order `forward` returns them).

    A parameter the config freezes (`train_theta_mu=False` by default) is a buffer, not a Parameter: no wrapper
    (PEFT's `modules_to_save`, TRL, Trainer, `requires_grad_(True)`) can make it trainable. It is saved and loaded
    under the same name; `BamLlamaPreTrainedModel.apply_prior_trainability` follows a changed config.
    """

    def __init__(self, config: BamLlamaConfig):
        super().__init__()
        self.formula = config.prior_formula
        self.eps = config.prior_eps
        self.max_distance = config.t5_max_distance  # T5's buckets only
        initial = initial_prior_values(config)
        for name, trainable in prior_trainability(config).items():
            _register_prior_tensor(self, name, torch.zeros_like(initial[name], dtype=torch.float32), trainable)
        self.names = tuple(prior_trainability(config))
        self._kept_table = KeptPriorTable()  # see `table`
        self.reset_parameters(config)

    @torch.no_grad()
    def reset_parameters(self, config: BamLlamaConfig) -> None:
        for name, value in initial_prior_values(config).items():
            _copy_init(getattr(self, name), value)

    def forward(self) -> tuple[torch.Tensor, ...]:
        """(theta_alpha, theta_beta, theta_mu), each (H,), or (bucket_bias,) (H, num_buckets), on the device the
        prior computes on. Every use of the prior reads them through this call, so that the hooks that bring
        offloaded or sharded weights in (Accelerate's `device_map` offload, DeepSpeed ZeRO-3) run."""
        return tuple(getattr(self, name) for name in self.names)

    def table(self, last_position: int) -> torch.Tensor:
        """(H, P + 1) float32 prior at distances -P, ..., 0: every row of the bias is a window of it. On CPU without
        gradients (eager code) the table is kept for reuse (`prior_tables_bam.module_table`)."""
        return module_table(self(), self.formula, self.eps, last_position, self._kept_table, self.max_distance)

    def bias(self, query_positions: torch.Tensor, key_length: int) -> torch.Tensor:
        """(1, H, Lq, Lk) float32 prior for queries at absolute positions (Lq,) and keys 0..Lk-1."""
        parameters = self()
        distance = relative_distance(query_positions.to(parameters[0].device), key_length)
        return distance_bias(distance, parameters, self.formula, self.eps, self.max_distance)[None]

    def extra_repr(self) -> str:
        first = self()[0]
        if self.formula == T5_BUCKETS:
            return f"heads={first.shape[0]}, formula={self.formula}, buckets={first.shape[1]}, max_distance={self.max_distance}"
        return f"heads={first.numel()}, formula={self.formula}, eps={self.eps}"


class BamScalableSoftmax(KeptInFloat32):
    """Scalable Softmax: row factor c_i = s_h * ln(n_i), n_i the number of keys query i sees. A scale the config
    freezes is a buffer (see `BamPrior`)."""

    def __init__(self, config: BamLlamaConfig):
        super().__init__()
        self.prior_scaled = config.ssmax_prior
        scale = torch.zeros(config.num_attention_heads, dtype=torch.float32)
        _register_prior_tensor(self, SSMAX_PARAMETER, scale, config.train_ssmax_scale)
        self.reset_parameters(config)

    @torch.no_grad()
    def reset_parameters(self, config: BamLlamaConfig) -> None:
        _copy_init(self.scale, torch.full_like(self.scale, float(config.ssmax_scale_init)))

    def forward(self) -> torch.Tensor:
        """(H,) scale s_h, read through a module call (see `BamPrior.forward`)."""
        return self.scale

    def row_factor(self, visible_counts: torch.Tensor) -> torch.Tensor:
        """(B, Lq) counts -> (B, H, Lq, 1) float32 factor."""
        return ssmax_factor(visible_counts, self())


def prior_trainability(config: BamLlamaConfig) -> dict[str, bool]:
    """The prior's tensors under the config's formula, and which of them it trains."""
    if config.prior_formula == T5_BUCKETS:
        return {BUCKET_BIAS: config.train_bucket_bias}
    return {
        "theta_alpha": config.train_theta_alpha,
        "theta_beta": config.train_theta_beta,
        "theta_mu": config.train_theta_mu,
    }


def apply_config_trainability(
    module: BamPrior | BamScalableSoftmax, config: BamLlamaConfig, frozen_copy: bool
) -> None:
    """Make each of `module`'s tensors a trainable Parameter or a frozen buffer, as the config says. A `frozen_copy`
    (PEFT's `original_module`, which the trained copy replaces) keeps its Parameters without gradient."""
    if isinstance(module, BamPrior):
        flags = prior_trainability(config)
    else:
        flags = {SSMAX_PARAMETER: config.train_ssmax_scale}
    for name, trainable in flags.items():
        _set_prior_trainability(module, name, trainable)
        if trainable and frozen_copy:
            getattr(module, name).requires_grad_(False)


def _register_prior_tensor(module: nn.Module, name: str, value: torch.Tensor, trainable: bool) -> None:
    """`name` as a Parameter when it trains, else as a (saved) buffer: a frozen value no optimizer can reach."""
    if trainable:
        module.register_parameter(name, nn.Parameter(value))
    else:
        module.register_buffer(name, value)


def _set_prior_trainability(module: nn.Module, name: str, trainable: bool) -> None:
    """Turn `name` into a Parameter or a buffer as `trainable` says, keeping its value; a Parameter that stays one
    is kept (an optimizer may hold it) and set to require gradients."""
    if (name in module._parameters) == trainable:
        if trainable:
            module._parameters[name].requires_grad_(True)
        return
    value = getattr(module, name).detach()
    delattr(module, name)
    _register_prior_tensor(module, name, value, trainable)


def _copy_init(parameter: torch.Tensor, value: torch.Tensor) -> None:
    value = value.to(device=parameter.device, dtype=parameter.dtype)
    if hf_init is not None:
        hf_init.copy_(parameter, value)
    elif parameter.device.type != "meta":
        parameter.copy_(value)

