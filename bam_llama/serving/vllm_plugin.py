"""BamLlama for vLLM: a vLLM-native model whose attention adds BAM's prior over vLLM's paged KV cache.

Loaded only by vLLM, through the `vllm.general_plugins` entry point (`register`), in every vLLM process; nothing else
in the package imports this module, so the package and Hub remote code never need vLLM.

vLLM's attention backends take no positional bias beyond ALiBi slopes, so BAM's attention layer is its own
(`BamPagedAttention`, an `AttentionLayerBase` with its own backend `BamAttentionBackend`). Its work is one custom op,
`vllm::bam_paged_attention` (opaque to torch.compile, and a splitting op wherever vLLM splits its graphs at
attention): write the step's K/V into the paged cache, then attend with BAM's prior and Scalable Softmax through
paged_attention.py (a fused CPU path, Triton kernels on CUDA), given the step's metadata and the layer's terms as
paged_batch.py holds them. Query positions are absolute (each request's tokens in the cache, prefix-cache hits
included), so chunked prefill and prefix caching see the same distances and SSMax counts n = position + 1 as one
forward pass over the whole sequence. The prior is a per-head table over distances, built once the weights are
loaded (`BamLlamaForCausalLM.process_weights_after_loading`).

Shapes: T tokens of the step (all requests, flattened), H query heads and Hkv key/value heads on this tensor-parallel
rank, D head size.
"""

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from transformers.activations import ACT2FN
from vllm import ModelRegistry
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationMode, VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.utils.torch_utils import LayerNameType, _encode_layer_name, _resolve_layer_name, direct_register_custom_op
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout

from ..model.absolute_positions_bam import add_absolute_positions
from ..registration import register_config
from .paged_attention import paged_attention, write_cache
from .paged_batch import BamTerms, PagedBatch, prior_parameter_shapes, prior_table

ARCHITECTURE = "BamLlamaForCausalLM"
ATTENTION_OP = "vllm::bam_paged_attention"
VLLM_ATTENTION_OP = "vllm::unified_attention_with_output"  # where vLLM splits its graphs for ordinary models


def register() -> None:
    """The `vllm.general_plugins` entry point: Transformers learns the `bam_llama` config (so no remote code is
    needed), vLLM learns the architecture."""
    register_config()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:BamLlamaForCausalLM")


# --------------------------------------------------------------------------------------------------------
# Attention backend: the step's metadata (built from device tensors only) and the cache layout
# --------------------------------------------------------------------------------------------------------


class BamAttentionMetadataBuilder(AttentionMetadataBuilder[PagedBatch]):
    """Slices of vLLM's common metadata, no host sync and no per-step allocation: a decoding step (every request one
    query) can be captured whole in a CUDA graph; other steps run the op between captured pieces."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> PagedBatch:
        metadata = common_attn_metadata
        requests = metadata.num_reqs
        return PagedBatch(
            query_start_loc=metadata.query_start_loc[: requests + 1],
            seq_lens=metadata.seq_lens[:requests],
            block_table=metadata.block_table_tensor[:requests],
            slot_mapping=metadata.slot_mapping[: metadata.num_actual_tokens],
            num_tokens=metadata.num_actual_tokens,
            max_query_len=metadata.max_query_len,
            block_size=self.block_size,
            query_start_loc_cpu=metadata.query_start_loc_cpu[: requests + 1],
        )


class BamAttentionImpl(AttentionImpl):
    """vLLM asks every backend for an implementation class; BAM's attention is computed by the layer's op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def forward(self, *args, **kwargs):
        raise NotImplementedError("BamPagedAttention computes attention in its custom op")


class BamAttentionBackend(AttentionBackend):
    """The cache of one layer is vLLM's logical (blocks, Hkv, block_size, 2 * D) view: K in the first D channels of a
    token's cell, V in the last D, stored head-major (every block of a head together: a run of consecutive blocks is
    one strided matrix per head, which the CPU path reads in place; the Triton kernels take any strides)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float32", "float16", "bfloat16"]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[BamAttentionImpl]:
        return BamAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[BamAttentionMetadataBuilder]:
        return BamAttentionMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LHBNC,)


# --------------------------------------------------------------------------------------------------------
# BAM attention over the paged cache: one custom op
# --------------------------------------------------------------------------------------------------------


def bam_paged_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor, layer_name: LayerNameType
) -> None:
    """query (T, H * D), key / value (T, Hkv * D) -> output (T, H * D), for the layer named `layer_name`."""
    layer = get_forward_context().no_compile_layers[_resolve_layer_name(layer_name)]
    layer.attend(query, key, value, output)


direct_register_custom_op(op_name=ATTENTION_OP.split("::")[1], op_func=bam_paged_attention, mutates_args=["output"])


class BamPagedAttention(nn.Module, AttentionLayerBase):
    """Writes K/V into vLLM's paged cache and attends with BAM's prior and Scalable Softmax:

    score_pj = c_p * (q_p.k_j * scaling + b_h(j - p))   (ssmax_prior), or c_p * q_p.k_j * scaling + b_h(j - p),
    for keys j <= p of the query's own request; p and j are absolute positions in that request.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5
        self.layer_name = prefix
        self.encoded_name = _encode_layer_name(prefix)
        self.dtype = vllm_config.model_config.dtype
        self.terms: BamTerms | None = None  # the prior table and SSMax scale, once the weights are loaded (`bind`)
        self.kv_cache = torch.tensor([])  # replaced by vLLM (`bind_kv_cache`) once the cache is allocated
        self.kv_sharing_target_layer_name = None
        self.impl = BamAttentionImpl()
        compilation = vllm_config.compilation_config
        if prefix in compilation.static_forward_context:
            raise ValueError(f"Duplicate attention layer name: {prefix}")
        compilation.static_forward_context[prefix] = self
        split_graphs_at_bam_attention(compilation)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return BamAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )

    def bind(self, table: torch.Tensor, ssmax_scale: torch.Tensor | None, ssmax_prior: bool) -> None:
        """The loaded prior (as a table over distances) and SSMax scale of this rank's heads."""
        scale = None if ssmax_scale is None else ssmax_scale.detach().float().contiguous()
        self.terms = BamTerms(table, scale, ssmax_prior, self.scaling)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query (T, H * D), key / value (T, Hkv * D) -> (T, H * D)."""
        output = torch.empty_like(query)
        torch.ops.vllm.bam_paged_attention(query, key, value, output, self.encoded_name)
        return output

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor) -> None:
        batch = self._metadata()
        if batch is None:  # vLLM's profiling and warm-up runs have no batch
            output.zero_()
            return
        write_cache(key, value, self.kv_cache, batch)
        paged_attention(query, self.kv_cache, batch, self.terms, output)

    def _metadata(self) -> PagedBatch | None:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # speculative decoding: [0] is the target model's
            metadata = metadata[0]
        if isinstance(metadata, dict):
            metadata = metadata.get(self.layer_name)
        return metadata


def split_graphs_at_bam_attention(compilation) -> None:
    """Where vLLM compiles piecewise (splitting its graphs at attention, to capture the rest in CUDA graphs), split
    at BAM's attention op too. Read when the model is compiled, after it is built."""
    splitting_ops = compilation.splitting_ops
    if compilation.mode == CompilationMode.VLLM_COMPILE and splitting_ops and VLLM_ATTENTION_OP in splitting_ops:
        if ATTENTION_OP not in splitting_ops:
            splitting_ops.append(ATTENTION_OP)


class BamPriorParameters(nn.Module):
    """A prior module's tensors for all heads (the checkpoint's shapes, `prior_parameter_shapes`: theta_alpha /
    theta_beta / theta_mu, or T5's bucket_bias); this rank uses its own heads."""

    def __init__(self, config, heads: slice):
        super().__init__()
        self.heads = heads
        shapes = prior_parameter_shapes(config)
        self.names = tuple(shapes)
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape, dtype=torch.float32), requires_grad=False))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name)[self.heads] for name in self.names)

    def table(self, config, max_len: int) -> torch.Tensor:
        """(this rank's H, max_len) prior at distances -(max_len-1)..0 (paged_batch.prior_table)."""
        return prior_table(self.tensors(), config.prior_formula, config.prior_eps, max_len, config.t5_max_distance)


class BamScalableSoftmaxScale(nn.Module):
    def __init__(self, total_heads: int, heads: slice):
        super().__init__()
        self.heads = heads
        self.scale = nn.Parameter(torch.zeros(total_heads, dtype=torch.float32), requires_grad=False)

    def local(self) -> torch.Tensor:
        return self.scale[self.heads]


def rank_heads(total_heads: int) -> slice:
    """The query heads of this tensor-parallel rank (QKVParallelLinear splits them in contiguous runs)."""
    per_rank = total_heads // get_tensor_model_parallel_world_size()
    start = get_tensor_model_parallel_rank() * per_rank
    return slice(start, start + per_rank)


# --------------------------------------------------------------------------------------------------------
# Decoder
# --------------------------------------------------------------------------------------------------------


class BamAttention(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        if total_heads % tp_size or (total_kv_heads % tp_size and tp_size % total_kv_heads):
            raise ValueError(
                f"tensor_parallel_size {tp_size} must divide num_attention_heads ({total_heads}) and divide or be a "
                f"multiple of num_key_value_heads ({total_kv_heads})"
            )
        self.head_dim = config.head_dim
        self.num_heads = total_heads // tp_size
        self.num_kv_heads = max(1, total_kv_heads // tp_size)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        heads = rank_heads(total_heads)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias=False, prefix=f"{prefix}.qkv_proj"
        )
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, bias=False, prefix=f"{prefix}.o_proj"
        )
        self.prior = BamPriorParameters(config, heads) if config.prior_scope == "layer" else None
        self.ssmax = BamScalableSoftmaxScale(total_heads, heads) if config.ssmax else None
        self.attn = BamPagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, vllm_config, prefix=f"{prefix}.attn"
        )

    def bind_prior(self, config, shared_table: torch.Tensor | None, max_len: int) -> None:
        """Give the attention its prior table (its own, or the model's global one) and SSMax scale."""
        table = shared_table if self.prior is None else self.prior.table(config, max_len)
        self.attn.bind(table, None if self.ssmax is None else self.ssmax.local(), config.ssmax_prior)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        output, _ = self.o_proj(self.attn(query, key, value))
        return output


class BamMLP(nn.Module):
    def __init__(self, config, prefix: str):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate_up_proj"
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size, config.hidden_size, bias=False, prefix=f"{prefix}.down_proj"
        )
        self.act_fn = ACT2FN[config.hidden_act]  # the activation Transformers' BamMLP applies

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(hidden_states)
        gate, up = gate_up.chunk(2, dim=-1)
        output, _ = self.down_proj(self.act_fn(gate) * up)
        return output


class BamDecoderLayer(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.self_attn = BamAttention(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = BamMLP(config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class BamLlamaModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.absolute_positions = config.absolute_positions
        self.layers = nn.ModuleList(
            [BamDecoderLayer(config, vllm_config, prefix=f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        heads = config.num_attention_heads
        self.prior = BamPriorParameters(config, rank_heads(heads)) if config.prior_scope == "global" else None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`positions` (T,), each token's absolute position in its request, place the absolute position embedding
        where the config has one; the attention reads them from its metadata (a request's queries are the last
        query_length of its seq_len positions)."""
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        hidden_states = add_absolute_positions(self.absolute_positions, hidden_states, positions)
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return self.norm(hidden_states)

    def bind_priors(self, config, max_len: int) -> None:
        shared_table = None if self.prior is None else self.prior.table(config, max_len)
        for layer in self.layers:
            layer.self_attn.bind_prior(config, shared_table, max_len)


class BamLlamaForCausalLM(nn.Module):
    """vLLM's BamLlamaForCausalLM: the same parameter names as Transformers' (q/k/v and gate/up fused on load)."""

    STACKED_PARAMETERS = (  # (vLLM parameter, checkpoint name, shard)
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.max_len = vllm_config.model_config.max_model_len
        self.model = BamLlamaModel(vllm_config=vllm_config, prefix=f"{prefix}.model" if prefix else "model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def process_weights_after_loading(self) -> None:
        """vLLM's hook once every weight is in place: the prior tables over distances up to max_model_len."""
        self.model.bind_priors(self.config, self.max_len)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        parameters = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, shard = self._parameter_name(name)
            if target not in parameters:
                raise ValueError(f"BamLlama checkpoint tensor {name!r} has no parameter in vLLM's BamLlama")
            parameter = parameters[target]
            loader = getattr(parameter, "weight_loader", default_weight_loader)
            if shard is None:
                loader(parameter, tensor)
            else:
                loader(parameter, tensor, shard)
            loaded.add(target)
        missing = {name for name in parameters if name not in loaded} - self._tied_names()
        if missing:
            raise ValueError(f"BamLlama checkpoint lacks {sorted(missing)}")
        return loaded | self._tied_names()

    def _parameter_name(self, name: str) -> tuple[str, str | int | None]:
        for fused, part, shard in self.STACKED_PARAMETERS:
            if part in name:
                return name.replace(part, fused), shard
        return name, None

    def _tied_names(self) -> set[str]:
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()
