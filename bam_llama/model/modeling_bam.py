"""BamLlama: a Llama decoder without RoPE whose attention adds a learnable Generalized-Gaussian prior.

Attention logit for query i (absolute position p_i) and key j, head h:

    score_ij = c_i * (q_i.k_j / sqrt(d) + b_h(p_i, j))        (ssmax_prior, the reference default)
    b_h(p, j) = -exp(theta_alpha_h) * (|(j - p) - mu_h| + eps) ** theta_beta_h

with c_i = s_h * ln(n_i) under Scalable Softmax (n_i = keys visible to query i), else 1. The attention names the
config keeps ("eager", "sdpa", "bam_triton") select BAM's own implementations, dispatched in dispatch_bam.py. The
prior's and Scalable Softmax's modules are prior_modules_bam.py's. A config with `absolute_positions` adds an absolute
position embedding (absolute_positions_bam.py) to the token embeddings, at the positions the attention uses.
"""

import importlib
from collections.abc import Callable

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import find_packed_sequence_indices
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.auto import AutoModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .absolute_positions_bam import add_absolute_positions, positions_from_padding
from .configuration_bam import BamLlamaConfig
from .continuous_batching_bam import CONTINUOUS_BATCHING_ATTENTION, PagedRequests, is_paged_cache
from .dispatch_bam import (
    BAM_ATTENTION_FUNCTIONS,
    bam_attention_name,
    create_bam_causal_mask,
    default_attn_implementation,
    register_bam_attention,
)
from .prior_bam import KeptPriorTable, exporting
from .prior_modules_bam import BamPrior, BamScalableSoftmax, apply_config_trainability
from .prior_tables_bam import layer_tables
from .sequence_parallel_bam import active_sequence_parallel
from .triton_bam import TRITON_AVAILABLE


logger = logging.get_logger(__name__)


# --------------------------------------------------------------------------------------------------------
# The KV cache's name
# --------------------------------------------------------------------------------------------------------

# Transformers 5.24 renamed the KV cache `past_key_values` -> `cache`: in model arguments, output fields,
# `create_causal_mask` and the argument `GradientCheckpointingLayer` clears. The old name still works there, with a
# deprecation warning. BamLlama takes either and answers in the installed version's name.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
PAST_KEY_VALUES_REMOVAL = "5.40.0"  # the release Transformers 5.24's own models announce for `past_key_values`


def deprecated_past_key_values(forward: Callable) -> Callable:
    """Where the cache is named `cache` (Transformers >= 5.24), `past_key_values` passed to `forward` is renamed
    with the FutureWarning Transformers' own models give (their `deprecate_kwarg`). Earlier releases know only
    `past_key_values`: it passes through silently, and `_one_cache` takes it."""
    if CACHE_NAME == "past_key_values":
        return forward
    return deprecate_kwarg("past_key_values", PAST_KEY_VALUES_REMOVAL, new_name="cache")(forward)


def _one_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The KV cache passed under either name (before 5.24 `cache` is BamLlama's own forward-compatible name);
    both at once is an error there. From 5.24 `deprecated_past_key_values` has already renamed it."""
    if past_key_values is None:
        return cache
    if cache is not None:
        raise ValueError("Pass the KV cache once: as `cache` or as `past_key_values` (its name before Transformers "
                         "5.24), not both")
    return past_key_values


# --------------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------------


class BamRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class BamMLP(nn.Module):
    def __init__(self, config: BamLlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class BamAttention(nn.Module):
    """Multi-head (GQA) attention without RoPE; position enters only through the GGD prior."""

    def __init__(self, config: BamLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.prior = BamPrior(config) if config.prior_scope == "layer" else None
        self.ssmax = BamScalableSoftmax(config) if config.ssmax else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        query_positions: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        shared_prior: BamPrior | None = None,
        document_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, Lq, D)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, Lq, D)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        paged_requests = kwargs.pop("paged_requests", None)
        if paged_requests is not None:  # continuous batching (continuous_batching_bam.py)
            key_states, value_states = paged_requests.update_cache(cache, key_states, value_states, self.layer_idx, kwargs)
        elif cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = BAM_ATTENTION_FUNCTIONS[self._implementation_for_call(kwargs)]
        sequence_parallel = kwargs.pop("sequence_parallel", None)
        if sequence_parallel is not None:  # the whole sequence for this rank's heads (sequence_parallel_bam.py)
            attention_interface = sequence_parallel.wrap(attention_interface)
        if paged_requests is not None:  # request by request, each at its own positions
            attention_interface = paged_requests.wrap(attention_interface)
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            query_positions=query_positions,
            prior=self.prior if self.prior is not None else shared_prior,
            document_ids=document_ids,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def _implementation_for_call(self, kwargs: dict) -> str:
        """The config's implementation, or "eager" when attention weights are requested: only eager computes them."""
        implementation = bam_attention_name(self.config._attn_implementation)
        if implementation != "eager" and kwargs.get("output_attentions", self.config.output_attentions):
            logger.warning_once(
                f"BamLlama's {implementation!r} attention computes no attention weights: with output_attentions=True "
                "every layer runs BAM's 'eager' attention instead (same result, slower). Load the model with "
                "attn_implementation='eager' to make this the default."
            )
            return "eager"
        return implementation


class BamDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: BamLlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = BamAttention(config, layer_idx)
        self.mlp = BamMLP(config)
        self.input_layernorm = BamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = BamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        query_positions: torch.Tensor,
        prior_table: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        shared_prior: BamPrior | None = None,
        document_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """prior_table: this layer's `table(P)` where the model computed it (`BamLlamaModel._prior_tables`). It comes
        positionally, like hidden_states: gradient checkpointing hands positional arguments to `checkpoint` as the
        layer's inputs, so a reentrant replay returns the table's gradient instead of backpropagating through the
        graph all layers share (which fails on the second layer). The cache comes as `cache` or, before
        Transformers 5.24, as `past_key_values`: the name the installed `GradientCheckpointingLayer` clears when it
        recomputes the layer (see `CACHE_NAME`)."""
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            query_positions=query_positions,
            attention_mask=attention_mask,
            cache=_one_cache(cache, past_key_values),
            shared_prior=shared_prior,
            document_ids=document_ids,
            prior_table=prior_table,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states


# --------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------


class BamLlamaPreTrainedModel(PreTrainedModel):
    config_class = BamLlamaConfig
    config: BamLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BamDecoderLayer"]
    # not moved by Accelerate's hooks: the KV cache, and the global prior module every layer gets (a module with
    # offloaded weights cannot be moved; its own call brings them in)
    _skip_keys_device_placement = ["cache", "past_key_values", "shared_prior"]
    # The prior's and SSMax's few per-head scalars stay float32 under 16-bit loads (`dtype=torch.bfloat16`): at long
    # distances a rounded theta_beta moves the bias by percents. `model.to(dtype)` keeps them too (`KeptInFloat32`).
    # Every model has a prior; `__init__` adds "ssmax" where the config builds it (a name must match a module).
    _keep_in_fp32_modules_strict = ["prior"]
    _supports_sdpa = True
    # Flash / flex / paged / Hub-kernel backends would silently drop the prior: only BAM's own implementations can be
    # selected (see `get_correct_attn_implementation`), so the model is safe as a backend and for padding-free batches.
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": BamDecoderLayer,
        "attentions": BamAttention,
    }

    def __init__(self, config: BamLlamaConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        if config.ssmax:  # read by `post_init` and by `from_pretrained`'s dtype plan, on the instance
            self._keep_in_fp32_modules_strict = [*type(self)._keep_in_fp32_modules_strict, "ssmax"]

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """None -> the fastest available; "eager", "sdpa", "bam_triton" (and the old "bam_eager" / "bam_sdpa", kept
        as "eager" / "sdpa") select BAM's implementations; anything else is refused."""
        if requested_attention is None:
            return default_attn_implementation()
        implementation = bam_attention_name(requested_attention)
        if implementation == "bam_triton" and not TRITON_AVAILABLE:
            raise ValueError("attn_implementation='bam_triton' needs the `triton` package, which is not installed")
        return implementation

    def _check_and_adjust_attn_implementation(
        self, attn_implementation: str | None, is_init_check: bool = False, allow_all_kernels: bool = False
    ) -> str:
        """Refuse unsupported names before Transformers tries to fetch a kernel from the Hub or a flash fallback."""
        return self.get_correct_attn_implementation(attn_implementation, is_init_check)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """BamAttention dispatches on `config._attn_implementation` at every call, so switching is always possible."""
        return True

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading_info) with output_loading_info
        model.apply_prior_trainability()
        return loaded

    def apply_prior_trainability(self) -> None:
        """Make every prior and SSMax tensor a trainable Parameter or a frozen buffer, as the config says: after a
        change of `train_theta_*` / `train_ssmax_scale` (loading does it). Nothing else is needed under PEFT, TRL or
        Trainer: a frozen one is not a Parameter they could unfreeze. PEFT's `original_module` copies stay frozen."""
        for module_name, module in self.named_modules():
            if isinstance(module, (BamPrior, BamScalableSoftmax)):
                apply_config_trainability(module, self.config, frozen_copy=".original_module" in module_name)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save weights, config and the remote code, with an `auto_map` for AutoConfig and every Auto model class
        (`REMOTE_CODE_AUTO_MAP`)."""
        self.config.auto_map = dict(REMOTE_CODE_AUTO_MAP)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload config, weights, remote code and the BamLlama model card (`bam_llama.hub.publish`) in one commit.
        Where `bam_llama` is not installed (this file loaded as remote code), Transformers' generic card is used.
        The publisher is imported by name, not relatively, so save_pretrained does not ship it as remote code."""
        try:
            publish = importlib.import_module("bam_llama.hub.publish")
        except ImportError:
            return super().push_to_hub(repo_id, **kwargs)
        return publish.push_pretrained_model(self, repo_id, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (BamPrior, BamScalableSoftmax)):
            module.reset_parameters(self.config)
        else:
            super()._init_weights(module)


class BamLlamaModel(BamLlamaPreTrainedModel):
    def __init__(self, config: BamLlamaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([BamDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = BamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.prior = BamPrior(config) if config.prior_scope == "global" else None
        self._layer_tables = KeptPriorTable()  # a prior per layer: all layers' tables, kept (see `_prior_tables`)
        self.sequence_parallel = None  # Ulysses state (sequence_parallel_bam.enable_ulysses), not saved
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @deprecated_past_key_values
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """`output_hidden_states` / `output_attentions` (kwargs or config) are collected by `capture_outputs`;
        `use_cache` defaults to the config's (off under gradient checkpointing). The KV cache is `cache` or, its
        name before Transformers 5.24, `past_key_values` (deprecated from 5.24 on, with Transformers' warning)."""
        cache = _one_cache(cache, past_key_values)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if is_paged_cache(cache):  # continuous batching: positions come from what the cache holds for each request
            return self._paged_forward(inputs_embeds, cache, **kwargs)
        kwargs.pop("cache_position", None)  # positions come from the cache length (`_positions_and_mask`)
        inputs_embeds = self._add_absolute_positions(inputs_embeds, attention_mask, position_ids, cache)
        sequence_parallel = active_sequence_parallel(self)
        if sequence_parallel is not None:  # training only: no cache
            kwargs["sequence_parallel"], use_cache = sequence_parallel, False
        query_positions, last_position, document_ids, causal_mask = self._positions_and_mask(
            inputs_embeds, attention_mask, position_ids, cache, sequence_parallel
        )
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        hidden_states = inputs_embeds
        for decoder_layer, prior_table in zip(self.layers, self._prior_tables(last_position)):
            hidden_states = decoder_layer(
                hidden_states,
                query_positions,
                prior_table,  # positional: an input of each checkpointed layer (see BamDecoderLayer.forward)
                attention_mask=causal_mask,
                shared_prior=self.prior,
                document_ids=document_ids,
                last_position=last_position,
                **{CACHE_NAME: cache},
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_NAME: cache if use_cache else None})

    def _paged_forward(self, inputs_embeds: torch.Tensor, cache, **kwargs) -> BaseModelOutputWithPast:
        """Continuous batching: every request of the step packed in one row over Transformers' paged cache, each
        attending at its own positions (continuous_batching_bam.py). A layer's table is computed once, for the longest
        request (`_prior_tables`); every request's is a window of it."""
        requests = PagedRequests.from_kwargs(kwargs)
        positions = requests.token_positions(inputs_embeds.shape[1], inputs_embeds.device)
        hidden_states = add_absolute_positions(self.config.absolute_positions, inputs_embeds, positions)
        for decoder_layer, prior_table in zip(self.layers, self._prior_tables(requests.last_position)):
            hidden_states = decoder_layer(
                hidden_states, None, prior_table, shared_prior=self.prior, paged_requests=requests, cache=cache, **kwargs
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))

    def _add_absolute_positions(self, inputs_embeds, attention_mask, position_ids, cache) -> torch.Tensor:
        """The token embeddings plus the config's absolute position embedding (`absolute_positions`), if any, at
        each token's absolute position: `position_ids` where given (packed documents restart at 0; `generate`
        numbers them from the padding mask; under sequence parallelism, this rank's chunk), else the real tokens
        before it in a 2D padding mask (a left-padded row's first real token at 0), else the cache length plus its
        index, the positions the attention gives the queries (`_positions_and_mask`)."""
        kind = self.config.absolute_positions
        if kind is None:
            return inputs_embeds
        length = inputs_embeds.shape[1]
        if position_ids is not None:
            positions = position_ids
        elif attention_mask is not None and attention_mask.dim() == 2:
            positions = positions_from_padding(attention_mask, length)
        else:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            positions = torch.arange(length, device=inputs_embeds.device) + past_seen_tokens
        return add_absolute_positions(kind, inputs_embeds, positions)

    def _prior_tables(self, last_position: int | None) -> list[torch.Tensor | None]:
        """The (H, P + 1) prior table of each layer, where one computation serves several layers (None: the layer's
        attention asks its own prior). The global prior depends on j - i only: one table for all layers. A prior per
        layer, without gradients in eager code: every layer's table a window of one kept for all of them
        (`prior_tables_bam.layer_tables`)."""
        no_table = [None] * len(self.layers)
        if last_position is None:
            return no_table
        if self.prior is not None:
            return [self.prior.table(last_position)] * len(self.layers)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return no_table
        parameters = [layer.self_attn.prior() for layer in self.layers]  # module calls: offload hooks run
        config = self.config
        tables = layer_tables(
            parameters, config.prior_formula, config.prior_eps, last_position, self._layer_tables, config.t5_max_distance
        )
        return no_table if tables is None else tables

    def _positions_and_mask(self, inputs_embeds, attention_mask, position_ids, cache, sequence_parallel):
        """The absolute query positions (Lq,), read from the cache BEFORE any layer updates it; the last one as an
        int (see `_last_query_position`); each token's document where rows are packed, else None; the causal mask."""
        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        mask_embeds = inputs_embeds
        if sequence_parallel is not None:
            # each rank holds one chunk of every sequence: masks, documents and positions are the whole sequence's
            position_ids, attention_mask = sequence_parallel.gather_inputs(
                position_ids, attention_mask, past_seen_tokens
            )
            mask_embeds = inputs_embeds[:, :1].expand(-1, position_ids.shape[1], -1)  # what the masks read
        query_positions = torch.arange(mask_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        last_position = _last_query_position(past_seen_tokens, mask_embeds.shape[1])
        if position_ids is None:  # positions the model numbers itself are one sequence a row: nothing is packed
            position_ids, document_ids = query_positions.unsqueeze(0), None
        else:
            document_ids = self._packed_document_ids(mask_embeds, attention_mask, position_ids, cache)
        causal_mask = create_bam_causal_mask(
            self.config, mask_embeds, attention_mask, cache, position_ids, query_positions
        )
        return query_positions, last_position, document_ids, causal_mask

    @staticmethod
    def _packed_document_ids(inputs_embeds, attention_mask, position_ids, cache) -> torch.Tensor | None:
        """Document index per token when several sequences are packed in a row (position_ids restart at 0).

        Like Transformers' own detection, only without a padding mask and without a cache.
        """
        if attention_mask is not None or cache is not None:
            return None
        return find_packed_sequence_indices(position_ids.expand(inputs_embeds.shape[0], -1))


def _last_query_position(past_seen_tokens: int | torch.Tensor, query_length: int) -> int | None:
    """The last query's absolute position as a Python int, read from the cache length before any layer updates
    it: the attention plans its blocks from it, never from tensor values. A static cache keeps its length in a
    tensor: eager code reads it (one host read a forward), a traced graph cannot and gets None (the attention then
    works from the position tensor). An exported program gets None too: its length may be dynamic, and blocks
    planned from it (a Python loop over the queries) would fix the program to the example's length."""
    if exporting():
        return None
    if isinstance(past_seen_tokens, torch.Tensor):
        if torch.compiler.is_compiling():
            return None
        past_seen_tokens = int(past_seen_tokens)
    return past_seen_tokens + query_length - 1


class BamLlamaForCausalLM(BamLlamaPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BamLlamaConfig):
        super().__init__(config)
        self.model = BamLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def init_continuous_batching(self, *args, **kwargs):
        """Transformers' continuous batching (also behind `generate_batch` and `transformers serve
        --continuous-batching`), with BAM's attention over its paged cache (continuous_batching_bam.py). What cannot
        keep the prior is refused here, before any request runs: in the worker thread it would only mark every
        request failed."""
        implementation = bam_attention_name(self.config._attn_implementation)
        if implementation not in CONTINUOUS_BATCHING_ATTENTION:
            raise ValueError(
                f"Continuous batching runs BamLlama's {' or '.join(map(repr, CONTINUOUS_BATCHING_ATTENTION))} attention "
                f"over Transformers' paged KV cache; the fused {implementation!r} kernels do not read that cache. Call "
                "model.set_attn_implementation('sdpa') first."
            )
        manager = super().init_continuous_batching(*args, **kwargs)
        resolved = manager.continuous_batching_config
        if any(resolved.cuda_graph_booleans) or (resolved.max_blocks_per_request or 0) > 0:
            raise ValueError(
                "BamLlama's paged attention reads each request's length on the host at every step, which CUDA graphs "
                "(and the block-table decode path, flash attention only) cannot capture: pass "
                "ContinuousBatchingConfig(use_cuda_graph=False)"
            )
        return manager

    @deprecated_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """`return_dict=False` (kwarg or config) gives the tuple of the non-None fields, like any Transformers model.
        The KV cache is `cache` or, its name before Transformers 5.24, `past_key_values` (deprecated from 5.24 on,
        with Transformers' warning)."""
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=_one_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,  # whatever config.return_dict says; `can_return_tuple` converts at the end
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )


# --------------------------------------------------------------------------------------------------------
# Task heads, as Transformers writes Llama's: Transformers' generic head over a BamLlamaModel under `model`
# --------------------------------------------------------------------------------------------------------


class BaseModelFromAutoModel:
    """Transformers' generic heads build their base model with `AutoModel.from_config(config)`. As Hub remote code
    the config's class is the copy Transformers imported with the config alone (a module of its own), which AutoModel
    does not know: it learns that BamLlamaModel is that config's model, instead of asking for trust_remote_code a
    second time inside the head's `__init__`."""

    def __init__(self, config: BamLlamaConfig):
        AutoModel.register(type(config), BamLlamaModel, exist_ok=True)
        super().__init__(config)


class BamLlamaForSequenceClassification(
    BaseModelFromAutoModel, GenericForSequenceClassification, BamLlamaPreTrainedModel
): ...


class BamLlamaForQuestionAnswering(BaseModelFromAutoModel, GenericForQuestionAnswering, BamLlamaPreTrainedModel): ...


class BamLlamaForTokenClassification(BaseModelFromAutoModel, GenericForTokenClassification, BamLlamaPreTrainedModel): ...


# The Auto class of each model. Saved folders carry this code (`auto_map`), so they load with trust_remote_code=True
# where bam_llama is not installed; `bam_llama.registration` registers the same classes on `import bam_llama`.
AUTO_CLASSES = {
    "AutoModel": BamLlamaModel,
    "AutoModelForCausalLM": BamLlamaForCausalLM,
    "AutoModelForSequenceClassification": BamLlamaForSequenceClassification,
    "AutoModelForTokenClassification": BamLlamaForTokenClassification,
    "AutoModelForQuestionAnswering": BamLlamaForQuestionAnswering,
}
REMOTE_CODE_AUTO_MAP = {
    "AutoConfig": "configuration_bam.BamLlamaConfig",
    **{auto_class: f"modeling_bam.{model.__name__}" for auto_class, model in AUTO_CLASSES.items()},
}
BamLlamaConfig.register_for_auto_class()
for auto_class, model_class in AUTO_CLASSES.items():
    model_class.register_for_auto_class(auto_class)


__all__ = [
    "BamLlamaForCausalLM",
    "BamLlamaForQuestionAnswering",
    "BamLlamaForSequenceClassification",
    "BamLlamaForTokenClassification",
    "BamLlamaModel",
    "BamLlamaPreTrainedModel",
    "BamPrior",  # prior_modules_bam.py's, the model's building blocks: importable from here as before
    "BamScalableSoftmax",
    "register_bam_attention",  # dispatch_bam.py's, importable from here as before
]
