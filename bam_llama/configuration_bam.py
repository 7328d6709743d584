"""Configuration of BamLlama: a Llama decoder without RoPE whose attention adds a GGD positional prior."""

from transformers import PreTrainedConfig
from transformers.utils import logging


logger = logging.get_logger(__name__)


PRIOR_SCOPES = ("global", "layer")
PRIOR_FORMULAS = ("current", "legacy")
THETA_ALPHA_SCHEMES = ("alibi",)
THETA_BETA_SCHEMES = ("linear",)


class BamLlamaConfig(PreTrainedConfig):
    r"""
    Configuration for [`BamLlamaModel`] and [`BamLlamaForCausalLM`].

    The Llama fields keep their Transformers meaning. There is no RoPE: position enters only through the
    Generalized-Gaussian prior added to every attention logit,

        b_h(i, j) = -exp(theta_alpha_h) * (|(j - i) - mu_h| + prior_eps) ** theta_beta_h,
        mu_h = exp(theta_mu_h) - exp(-theta_mu_h),

    optionally with Scalable Softmax (`ssmax`), which multiplies each query row by `s_h * ln(n_i)`.

    Args:
        prior_scope (`str`, defaults to `"global"`): `"global"` shares one prior between all layers,
            `"layer"` gives every layer its own.
        prior_formula (`str`, defaults to `"current"`): `"current"` is the formula above; `"legacy"` is the
            reference code's pre-May-2025 form `-(|((j - i) - mu) * exp(theta_alpha)| + eps) ** theta_beta`,
            needed by checkpoints trained with it.
        theta_alpha_init (`float` or `"alibi"`): initial log-multiplier; `"alibi"` uses log ALiBi slopes.
        theta_beta_init (`float` or `"linear"`): initial exponent; `"linear"` spreads the heads over [0, 1].
        theta_mu_init (`float`): initial offset parameter (mu = 2 sinh(theta_mu)).
        train_theta_alpha / train_theta_beta / train_theta_mu (`bool`): which prior parameters train.
        prior_eps (`float`, defaults to 1e-5): added to |distance - mu| before the power.
        ssmax (`bool`): Scalable Softmax on or off.
        ssmax_prior (`bool`, defaults to `True`): the SSMax factor also scales the prior
            (`c_i * (q.k / sqrt(d) + b)`); `False` gives `c_i * q.k / sqrt(d) + b`.
        ssmax_scale_init (`float`) / train_ssmax_scale (`bool`): the per-head SSMax scale `s_h`.
        train_context_length (`int`): the length the model was (or will be) trained at; informational, never
            used to truncate.
        max_position_embeddings (`int`): an upper bound reported to generation tools. The prior has no length
            limit, so this is large by default.
    """

    model_type = "bam_llama"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32768,
        hidden_size: int = 768,
        intermediate_size: int = 1536,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        attention_dropout: float = 0.0,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        max_position_embeddings: int = 1 << 20,
        train_context_length: int = 512,
        prior_scope: str = "global",
        prior_formula: str = "current",
        theta_alpha_init: float | str = 0.0,
        theta_beta_init: float | str = 0.0,
        theta_mu_init: float = 0.0,
        train_theta_alpha: bool = True,
        train_theta_beta: bool = True,
        train_theta_mu: bool = False,
        prior_eps: float = 1e-5,
        ssmax: bool = False,
        ssmax_prior: bool = True,
        ssmax_scale_init: float = 1.0,
        train_ssmax_scale: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = head_dim
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.attention_dropout = attention_dropout
        self.use_cache = use_cache
        self.max_position_embeddings = max_position_embeddings
        self.train_context_length = train_context_length
        self.prior_scope = prior_scope
        self.prior_formula = prior_formula
        self.theta_alpha_init = theta_alpha_init
        self.theta_beta_init = theta_beta_init
        self.theta_mu_init = theta_mu_init
        self.train_theta_alpha = train_theta_alpha
        self.train_theta_beta = train_theta_beta
        self.train_theta_mu = train_theta_mu
        self.prior_eps = prior_eps
        self.ssmax = ssmax
        self.ssmax_prior = ssmax_prior
        self.ssmax_scale_init = ssmax_scale_init
        self.train_ssmax_scale = train_ssmax_scale
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)
        self.validate_bam()

    def validate_bam(self) -> None:
        """Raise a ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BamLlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) when head_dim is not given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not isinstance(self.num_key_value_heads, int) or self.num_key_value_heads <= 0:
            raise ValueError(f"num_key_value_heads must be a positive integer, got {self.num_key_value_heads!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.prior_scope not in PRIOR_SCOPES:
            raise ValueError(f"prior_scope must be one of {PRIOR_SCOPES}, got {self.prior_scope!r}")
        if self.prior_formula not in PRIOR_FORMULAS:
            raise ValueError(f"prior_formula must be one of {PRIOR_FORMULAS}, got {self.prior_formula!r}")
        _check_init("theta_alpha_init", self.theta_alpha_init, THETA_ALPHA_SCHEMES)
        _check_init("theta_beta_init", self.theta_beta_init, THETA_BETA_SCHEMES)
        _check_init("theta_mu_init", self.theta_mu_init, ())
        if not self.prior_eps > 0:
            raise ValueError(f"prior_eps must be > 0, got {self.prior_eps!r}")
        if self.train_context_length <= 0:
            raise ValueError(f"train_context_length must be positive, got {self.train_context_length!r}")
        if self.max_position_embeddings < self.train_context_length:
            # Only a limit reported to generation tools: a config lowered on purpose must still save and reload.
            logger.warning(
                f"max_position_embeddings ({self.max_position_embeddings}) is below train_context_length "
                f"({self.train_context_length}): generation tools will stop there, though BAM extrapolates"
            )


def _check_init(name: str, value, schemes: tuple[str, ...]) -> None:
    if isinstance(value, str):
        if value not in schemes:
            allowed = f"a number or one of {schemes}" if schemes else "a number"
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")


__all__ = ["BamLlamaConfig"]
