"""Configuration of BamLlama: a Llama decoder without RoPE whose attention adds a GGD positional prior."""

import math
import sys

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.utils import logging

from .absolute_positions_bam import ABSOLUTE_POSITIONS
from .prior_bam import KERPLE_LOG, PRIOR_FORMULAS, SCALE_OUTSIDE_POWER, T5_BUCKETS, T5_MAX_DISTANCE, T5_NUM_BUCKETS

logger = logging.get_logger(__name__)


PRIOR_SCOPES = ("global", "layer")
THETA_ALPHA_SCHEMES = ("alibi",)
THETA_BETA_SCHEMES = ("linear",)
LOG_FLOAT32_MAX = math.log(3.4028234663852886e38)  # 88.72: exp of more overflows float32
# Distances up to which the initial prior must stay finite: generation may run far past max_position_embeddings.
PRIOR_FINITE_HORIZON = 1 << 20
# `transformers serve` (5.24) loads a model as `getattr(transformers, config.architectures[0])` in this module, not
# through the Auto classes (`expose_on_transformers`).
SERVE_MODEL_MANAGER = "transformers.cli.serving.model_manager"
# max_position_embeddings of earlier releases, which meant "no limit": a saved config holding it is read as unset.
LEGACY_UNLIMITED_POSITIONS = 1 << 20
# The length a BamLlama declares it serves and is evaluated at, unless trained longer or set: 64K tokens, the longest
# that bam-demo and the text benchmark evaluate (512x of their 128-token training). What tools read as the model's
# length (`max_position_embeddings`): vLLM's longest accepted `--max-model-len`, lm-eval's window and batch probe.
SERVING_LENGTH = 1 << 16


class BamLlamaConfig(PreTrainedConfig):
    r"""
    Configuration for [`BamLlamaModel`] and [`BamLlamaForCausalLM`].

    The Llama fields keep their Transformers meaning. There is no RoPE: position enters through the
    Generalized-Gaussian prior added to every attention logit (and, with `absolute_positions`, an embedding of each
    token's absolute position added to its token embedding),

        b_h(i, j) = -exp(theta_alpha_h) * (|(j - i) - mu_h| + prior_eps) ** theta_beta_h,
        mu_h = exp(theta_mu_h) - exp(-theta_mu_h),

    optionally with Scalable Softmax (`ssmax`), which multiplies each query row by `s_h * ln(n_i)`.

    Args:
        prior_scope (`str`, defaults to `"global"`): `"global"` shares one prior between all layers,
            `"layer"` gives every layer its own.
        prior_formula (`str`, defaults to `"current"`): `"current"` is the formula above; `"legacy"` is the
            reference code's pre-May-2025 form `-(|((j - i) - mu) * exp(theta_alpha)| + eps) ** theta_beta`,
            needed by checkpoints trained with it; `"kerple_log"` is the KERPLE baseline's log kernel of the same
            parameters, `-exp(theta_alpha) * ln(1 + exp(theta_beta) * |(j - i) - mu|)`; `"t5_buckets"` is T5's
            bucketed relative bias (causal): a learned `bucket_bias[h, bucket(i - j)]` in place of the three
            parameters, bucket(n) = n below `t5_num_buckets // 2`, then logarithmic up to `t5_max_distance`, where
            the last bucket takes every longer distance.
        t5_num_buckets (`int`, defaults to 32) / t5_max_distance (`int`, defaults to 128): T5's buckets, read under
            `"t5_buckets"` only.
        train_bucket_bias (`bool`, defaults to `True`): whether T5's bucket biases train (they start at 0: no
            positional preference).
        theta_alpha_init (`float` or `"alibi"`): initial log-multiplier; `"alibi"` uses log ALiBi slopes.
        theta_beta_init (`float` or `"linear"`): initial exponent; `"linear"` spreads the heads over [0, 1].
        theta_mu_init (`float`): initial offset parameter (mu = 2 sinh(theta_mu)).
        train_theta_alpha / train_theta_beta / train_theta_mu (`bool`): which prior parameters train.
        prior_eps (`float`, defaults to 1e-5): added to |distance - mu| before the power.
        ssmax (`bool`): Scalable Softmax on or off.
        ssmax_prior (`bool`, defaults to `True`): the SSMax factor also scales the prior
            (`c_i * (q.k / sqrt(d) + b)`); `False` gives `c_i * q.k / sqrt(d) + b`.
        ssmax_scale_init (`float`) / train_ssmax_scale (`bool`): the per-head SSMax scale `s_h`.
        absolute_positions (`str`, optional): `"sinusoidal"` adds Vaswani et al.'s fixed sinusoidal embedding of each
            token's absolute position (`position_ids` where given, else the count of real tokens before it in a 2D
            attention mask, else cache length plus index) to its token embedding, unscaled; `None` (default) adds
            nothing. The "Sinusoidal" baseline pairs it with a flat, fixed prior.
        train_context_length (`int`): the length the model was (or will be) trained at; informational, never
            used to truncate.
        max_position_embeddings (`int`, defaults to `max(train_context_length, 65536)`): the length the model
            declares it serves and is evaluated at, read by tools as for any Transformers model: vLLM's default and
            longest `max_model_len`, lm-evaluation-harness' window and its batch-size probe, `generate`'s default
            cap and its "maximum length" reminder. The model itself has no limit: generating past it (with
            `max_new_tokens`) works, after Transformers' one-time reminder. Saved configs of earlier releases
            holding 2**20 ("no limit") read it as unset.
    """

    model_type = "bam_llama"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]  # the KV cache output, named `cache` from Transformers 5.24

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
        max_position_embeddings: int | None = None,
        train_context_length: int = 512,
        prior_scope: str = "global",
        prior_formula: str = SCALE_OUTSIDE_POWER,
        theta_alpha_init: float | str = 0.0,
        theta_beta_init: float | str = 0.0,
        theta_mu_init: float = 0.0,
        train_theta_alpha: bool = True,
        train_theta_beta: bool = True,
        train_theta_mu: bool = False,
        t5_num_buckets: int = T5_NUM_BUCKETS,
        t5_max_distance: int = T5_MAX_DISTANCE,
        train_bucket_bias: bool = True,
        prior_eps: float = 1e-5,
        ssmax: bool = False,
        ssmax_prior: bool = True,
        ssmax_scale_init: float = 1.0,
        train_ssmax_scale: bool = True,
        absolute_positions: str | None = None,
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
        self.train_context_length = train_context_length
        self.max_position_embeddings = (
            serving_length(train_context_length) if max_position_embeddings is None else max_position_embeddings
        )
        self.prior_scope = prior_scope
        self.prior_formula = prior_formula
        self.theta_alpha_init = theta_alpha_init
        self.theta_beta_init = theta_beta_init
        self.theta_mu_init = theta_mu_init
        self.train_theta_alpha = train_theta_alpha
        self.train_theta_beta = train_theta_beta
        self.train_theta_mu = train_theta_mu
        self.t5_num_buckets = t5_num_buckets
        self.t5_max_distance = t5_max_distance
        self.train_bucket_bias = train_bucket_bias
        self.prior_eps = prior_eps
        self.ssmax = ssmax
        self.ssmax_prior = ssmax_prior
        self.ssmax_scale_init = ssmax_scale_init
        self.train_ssmax_scale = train_ssmax_scale
        self.absolute_positions = absolute_positions
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(**kwargs)
        self.validate_bam()
        _register_models_with_the_auto_classes(getattr(self, "auto_map", None))

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """A saved config (`from_pretrained`, `AutoConfig`); one of an earlier release says "no limit" with 2**20,
        which tools took for a context length: it becomes the default, `serving_length(train_context_length)`."""
        if config_dict.get("max_position_embeddings") == LEGACY_UNLIMITED_POSITIONS:
            logger.info(
                f"max_position_embeddings {LEGACY_UNLIMITED_POSITIONS} (\"no limit\" in earlier bam-llama releases) is "
                f"read as the default serving length, max(train_context_length, {SERVING_LENGTH}); the model still runs "
                "past it"
            )
            config_dict = {**config_dict, "max_position_embeddings": None}
        return super().from_dict(config_dict, **kwargs)

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
        if not _is_positive_int(self.head_dim):
            raise ValueError(f"BamLlamaConfig.head_dim must be a positive integer, got {self.head_dim!r}")
        if not _is_positive_int(self.num_key_value_heads):
            raise ValueError(f"num_key_value_heads must be a positive integer, got {self.num_key_value_heads!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_key_value_heads ({self.num_key_value_heads}) must divide num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            raise ValueError(f"BamLlamaConfig.hidden_act {self.hidden_act!r} is not a Transformers activation (e.g. 'silu')")
        if not _is_positive_int(self.train_context_length):
            raise ValueError(f"BamLlamaConfig.train_context_length must be a positive integer, got {self.train_context_length!r}")
        if not _is_positive_int(self.max_position_embeddings):
            raise ValueError(
                f"BamLlamaConfig.max_position_embeddings must be a positive integer, got {self.max_position_embeddings!r}"
            )
        if self.prior_scope not in PRIOR_SCOPES:
            raise ValueError(f"prior_scope must be one of {PRIOR_SCOPES}, got {self.prior_scope!r}")
        if self.prior_formula not in PRIOR_FORMULAS:
            raise ValueError(f"prior_formula must be one of {PRIOR_FORMULAS}, got {self.prior_formula!r}")
        self._check_t5_buckets()
        if self.absolute_positions is not None and self.absolute_positions not in ABSOLUTE_POSITIONS:
            raise ValueError(
                f"absolute_positions must be None (no absolute position embedding) or one of {ABSOLUTE_POSITIONS}, "
                f"got {self.absolute_positions!r}"
            )
        _check_init("theta_alpha_init", self.theta_alpha_init, THETA_ALPHA_SCHEMES)
        _check_init("theta_beta_init", self.theta_beta_init, THETA_BETA_SCHEMES)
        _check_init("theta_mu_init", self.theta_mu_init, ())
        _check_init("ssmax_scale_init", self.ssmax_scale_init, ())
        if not _is_number(self.rms_norm_eps) or not 0 < self.rms_norm_eps < math.inf:
            raise ValueError(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps!r}")
        if not _is_number(self.attention_dropout) or not 0 <= self.attention_dropout < 1:
            raise ValueError(f"attention_dropout must be a probability in [0, 1), got {self.attention_dropout!r}")
        if not _is_number(self.initializer_range) or not 0 <= self.initializer_range < math.inf:
            raise ValueError(f"initializer_range must be a finite number >= 0, got {self.initializer_range!r}")
        if not _is_number(self.prior_eps) or not self.prior_eps > 0 or math.isinf(self.prior_eps):
            raise ValueError(f"prior_eps must be a finite number > 0, got {self.prior_eps!r}")
        if self.max_position_embeddings < self.train_context_length:
            # Only the length tools plan for: a config lowered on purpose must still save and reload.
            logger.warning(
                f"max_position_embeddings ({self.max_position_embeddings}) is below train_context_length "
                f"({self.train_context_length}): tools will plan for less than the model was trained on"
            )
        self._check_initial_prior_is_finite()

    def _check_t5_buckets(self) -> None:
        """T5's buckets: at least 2 (half of them exact), reaching past the exact ones."""
        if not _is_positive_int(self.t5_num_buckets) or self.t5_num_buckets < 2:
            raise ValueError(f"t5_num_buckets must be an integer >= 2, got {self.t5_num_buckets!r}")
        exact = self.t5_num_buckets // 2
        if not _is_positive_int(self.t5_max_distance) or self.t5_max_distance <= exact:
            raise ValueError(
                f"t5_max_distance must be an integer above t5_num_buckets // 2 = {exact} (the exact buckets), got "
                f"{self.t5_max_distance!r}"
            )
        if not isinstance(self.train_bucket_bias, bool):
            raise ValueError(f"train_bucket_bias must be True or False, got {self.train_bucket_bias!r}")

    def _check_initial_prior_is_finite(self) -> None:
        """The initial prior times the SSMax factor must stay finite in float32 at every distance the model may
        see: up to PRIOR_FINITE_HORIZON, or max_position_embeddings / train_context_length when longer. An infinite
        bias makes eager, SDPA and Triton disagree (or give NaN). T5's bucket biases start at 0."""
        if self.prior_formula == T5_BUCKETS:
            return
        longest = max(PRIOR_FINITE_HORIZON, self.max_position_embeddings, self.train_context_length)
        alpha = 0.0 if self.theta_alpha_init == "alibi" else float(self.theta_alpha_init)  # ALiBi: log slopes <= 0
        betas = (0.0, 1.0) if self.theta_beta_init == "linear" else (float(self.theta_beta_init),)
        mu = 2 * math.sinh(min(abs(float(self.theta_mu_init)), 700.0))
        spans = (self.prior_eps, longest + mu + self.prior_eps)  # extremes of |distance - mu| + eps
        log_prior = max(log_prior_extent(self.prior_formula, alpha, beta, span, self.prior_eps)
                        for beta in betas for span in spans)
        ssmax_factor = abs(self.ssmax_scale_init) * math.log(longest) if self.ssmax and self.ssmax_prior else 1.0
        log_extent = log_prior + math.log(max(ssmax_factor, 1e-30))
        if log_extent >= LOG_FLOAT32_MAX:
            bound = alpha - (log_extent - LOG_FLOAT32_MAX)
            raise ValueError(
                f"theta_alpha_init={self.theta_alpha_init!r} makes the initial prior overflow float32: with "
                f"theta_beta_init={self.theta_beta_init!r} and distances up to {longest}, |prior| (times the SSMax "
                f"factor) reaches exp({log_extent:.1f}) and float32 ends at exp({LOG_FLOAT32_MAX:.2f}); keep "
                f"theta_alpha_init below {bound:.2f}"
            )


def log_prior_extent(formula: str, alpha: float, beta: float, span: float, eps: float) -> float:
    """ln |prior| at |distance - mu| + eps = `span` (a bound of it for "legacy"), without overflowing."""
    if formula == SCALE_OUTSIDE_POWER:
        return alpha + beta * math.log(span)
    if formula == KERPLE_LOG:  # ln(exp(alpha) * ln(1 + exp(beta) * span))
        inner = beta + math.log(span)
        return alpha + (math.log(inner + math.log1p(math.exp(-inner))) if inner > 30 else math.log(math.log1p(math.exp(inner))))
    return max(alpha, beta * math.log(math.exp(min(alpha, 700.0)) * span + eps))


def serving_length(train_context_length: int) -> int:
    """The default `max_position_embeddings`: SERVING_LENGTH, or the training length where that is longer."""
    if not _is_positive_int(train_context_length):
        return train_context_length  # validate_bam names it
    return max(train_context_length, SERVING_LENGTH)


def _register_models_with_the_auto_classes(auto_map: dict | None) -> None:
    """Installed as `bam_llama.model.configuration_bam`, whose package import registers only this config with
    AutoConfig (to stay light): register the models too, before an Auto model class looks for them, through the
    top-level package's `register`. Hub remote code's top-level package (`transformers_modules`) has no `register`:
    Transformers registers what it loads there itself, except for `transformers serve --trust-remote-code`, which
    looks the model up on the `transformers` module. There each model's name is its Auto class (from the saved
    `auto_map`), whose `from_pretrained(..., trust_remote_code=True)` loads the folder's model."""
    package = sys.modules.get(__name__.partition(".")[0])
    modeling = sys.modules.get(f"{__name__.rpartition('.')[0]}.modeling_bam")
    if getattr(getattr(modeling, "__spec__", None), "_initializing", False):
        return
    if getattr(package, "register", None) is not None:
        package.register()
    elif SERVE_MODEL_MANAGER in sys.modules and auto_map:
        transformers = sys.modules["transformers"]
        expose_on_transformers(
            {reference.rpartition(".")[2]: getattr(transformers, auto_class) for auto_class, reference in auto_map.items()
             if auto_class.startswith("AutoModel")}
        )


def expose_on_transformers(named: dict) -> None:
    """Put each object on the `transformers` module under its name, where `transformers serve` looks a model up
    (`getattr(transformers, config.architectures[0])`). Serve's model manager may hold an older `transformers`
    module object than `sys.modules` (importing `transformers.processing_utils` executes the package's `__init__`
    again): both get them. Transformers' own names are never replaced."""
    modules = [sys.modules["transformers"]]
    manager = sys.modules.get(SERVE_MODEL_MANAGER)
    if manager is not None and getattr(manager, "transformers", modules[0]) is not modules[0]:
        modules.append(manager.transformers)
    for module in modules:
        for name, value in named.items():
            if not hasattr(module, name):
                setattr(module, name, value)


def _check_init(name: str, value, schemes: tuple[str, ...]) -> None:
    if isinstance(value, str):
        if value not in schemes:
            allowed = f"a finite number or one of {schemes}" if schemes else "a finite number"
            raise ValueError(f"{name} must be {allowed}, got {value!r}")
    elif not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


__all__ = ["BamLlamaConfig"]
