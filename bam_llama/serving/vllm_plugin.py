"""BamLlama for vLLM: a vLLM-native model whose attention adds BAM's prior over vLLM's paged KV cache.

Loaded only by vLLM, through the `vllm.general_plugins` entry point (`register`), in every vLLM process; nothing else
in the package imports this module, so the package and Hub remote code never need vLLM.

vLLM's attention backends take no positional bias beyond ALiBi slopes, so BAM's attention layer is its own
(`BamPagedAttention`, an `AttentionLayerBase` with its own backend `BamAttentionBackend`): it writes each token's
K/V into the paged cache at its slot, then, for every request of the batch, gathers the request's keys and values
from its blocks and attends with the package's own prior, Scalable Softmax and attention math (`bam_llama/model/`), in
plain PyTorch. Query positions are the absolute positions vLLM passes (the request's computed tokens, prefix-cache
hits included, plus the token's place in this step's chunk), so chunked prefill and prefix caching see the same
distances and the same SSMax counts n_i = position + 1 as a single full forward pass.

Shapes: T tokens of the step (all requests, flattened), H query heads and Hkv key/value heads on this tensor-parallel
rank, D head size, K keys of one request.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers.activations import ACT2FN
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ..model.prior_bam import ggd_bias, relative_distance, ssmax_factor
from ..model.reference_bam import bam_attention_reference

ARCHITECTURE = "BamLlamaForCausalLM"
QUERY_BLOCK = 512  # queries attended at once: bounds the (H, queries, K) score tensors of a long prefill


def register() -> None:
    """The `vllm.general_plugins` entry point: Transformers learns the `bam_llama` config (so no remote code is
    needed), vLLM learns the architecture."""
    from vllm import ModelRegistry

    from ..registration import register_config

    register_config()
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:BamLlamaForCausalLM")


# --------------------------------------------------------------------------------------------------------
# Attention backend: BAM's metadata and KV cache layout
# --------------------------------------------------------------------------------------------------------


@dataclass
class BamAttentionMetadata:
    """One step's batch, as the attention layers read it. Request r owns query rows
    query_start_loc[r]:query_start_loc[r + 1] and has seq_lens[r] tokens in the cache after this step."""

    num_actual_tokens: int
    query_start_loc: list[int]  # (R + 1,) on the host: the loop over requests runs there
    seq_lens: list[int]  # (R,)
    block_table: torch.Tensor  # (R, max blocks) int
    slot_mapping: torch.Tensor  # (T,) int: cache slot of every token, block * block_size + offset; < 0 = none


class BamAttentionMetadataBuilder(AttentionMetadataBuilder[BamAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> BamAttentionMetadata:
        metadata = common_attn_metadata
        requests = metadata.num_reqs
        return BamAttentionMetadata(
            num_actual_tokens=metadata.num_actual_tokens,
            query_start_loc=metadata.query_start_loc_cpu[: requests + 1].tolist(),
            seq_lens=metadata.seq_lens[:requests].tolist(),
            block_table=metadata.block_table_tensor[:requests],
            slot_mapping=metadata.slot_mapping[: metadata.num_actual_tokens],
        )


class BamAttentionImpl(AttentionImpl):
    """vLLM asks every backend for an implementation class; BAM's attention is computed by the layer itself."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def forward(self, *args, **kwargs):
        raise NotImplementedError("BamPagedAttention computes attention itself")


class BamAttentionBackend(AttentionBackend):
    """The cache of one layer is vLLM's logical (blocks, Hkv, block_size, 2 * D) view: K in the first D channels of a
    token's cell, V in the last D. The layer writes and reads it by logical index, whatever the physical layout."""

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


# --------------------------------------------------------------------------------------------------------
# BAM attention over the paged cache
# --------------------------------------------------------------------------------------------------------


class BamPagedAttention(nn.Module, AttentionLayerBase):
    """Writes K/V into vLLM's paged cache and attends with BAM's prior and Scalable Softmax.

    score_ij = c_i * (q_i.k_j * scaling + b_h(i, j))   (ssmax_prior), or c_i * q_i.k_j * scaling + b_h(i, j),
    for keys j <= i of the query's own request; i and j are absolute positions in that request.
    """

    def __init__(self, config, num_heads: int, num_kv_heads: int, head_dim: int, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5
        self.prior_formula = config.prior_formula
        self.prior_eps = config.prior_eps
        self.ssmax_prior = config.ssmax_prior
        self.layer_name = prefix
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache = torch.tensor([])  # replaced by vLLM (`bind_kv_cache`) once the cache is allocated
        self.kv_sharing_target_layer_name = None
        self.impl = BamAttentionImpl()
        forward_context = vllm_config.compilation_config.static_forward_context
        if prefix in forward_context:
            raise ValueError(f"Duplicate attention layer name: {prefix}")
        forward_context[prefix] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return BamAttentionBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> FullAttentionSpec:
        return FullAttentionSpec(
            block_size=vllm_config.cache_config.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_dim,
            dtype=self.dtype,
        )

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, prior: "BamPriorParameters",
        ssmax_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """query (T, H * D), key / value (T, Hkv * D) -> (T, H * D)."""
        output = torch.zeros_like(query)
        metadata = self._metadata()
        if metadata is None:  # vLLM's profiling and warm-up runs have no batch
            return output
        tokens = metadata.num_actual_tokens
        query = query[:tokens].view(tokens, self.num_heads, self.head_dim)
        key = key[:tokens].view(tokens, self.num_kv_heads, self.head_dim)
        value = value[:tokens].view(tokens, self.num_kv_heads, self.head_dim)
        self._write_cache(key, value, metadata.slot_mapping)
        starts = metadata.query_start_loc
        for request, seq_len in enumerate(metadata.seq_lens):
            rows = slice(starts[request], starts[request + 1])
            if rows.stop > rows.start:
                cached_key, cached_value = self._read_cache(metadata.block_table[request], seq_len)
                attended = self._attend(query[rows], cached_key, cached_value, seq_len, prior, ssmax_scale)
                output[rows] = attended.reshape(rows.stop - rows.start, -1)
        return output

    def _metadata(self) -> BamAttentionMetadata | None:
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # speculative decoding: [0] is the target model's
            metadata = metadata[0]
        if isinstance(metadata, dict):
            metadata = metadata.get(self.layer_name)
        return metadata

    def _write_cache(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Token t's K and V go to cache[slot // block_size, :, slot % block_size]."""
        block_size = self.kv_cache.shape[2]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        blocks, offsets = slots // block_size, slots % block_size
        self.kv_cache[blocks, :, offsets, : self.head_dim] = key[valid].to(self.kv_cache.dtype)
        self.kv_cache[blocks, :, offsets, self.head_dim :] = value[valid].to(self.kv_cache.dtype)

    def _read_cache(self, block_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's first seq_len tokens from its blocks: key, value (1, Hkv, K, D)."""
        block_size = self.kv_cache.shape[2]
        blocks = self.kv_cache[block_ids[: -(-seq_len // block_size)].long()]  # (n, Hkv, block_size, 2D)
        cells = blocks.transpose(0, 1).reshape(self.num_kv_heads, -1, 2 * self.head_dim)[:, :seq_len]
        return cells[None, ..., : self.head_dim], cells[None, ..., self.head_dim :]

    def _attend(self, query, key, value, seq_len, prior, ssmax_scale) -> torch.Tensor:
        """One request's queries (Lq, H, D), the last Lq of its seq_len positions -> (Lq, H, D).

        Query blocks see only the keys up to their last position (the rest are causally hidden)."""
        query_length = query.shape[0]
        outputs = []
        for start in range(0, query_length, QUERY_BLOCK):
            block = query[start : start + QUERY_BLOCK]
            first = seq_len - query_length + start
            positions = torch.arange(first, first + block.shape[0], device=query.device)
            keys = first + block.shape[0]
            distance = relative_distance(positions, keys)  # (Lq, keys): j - i
            bias = ggd_bias(distance, *prior.tensors(), self.prior_formula, self.prior_eps)[None]
            visible = (distance <= 0)[None, None]
            row_factor = None if ssmax_scale is None else ssmax_factor(positions[None] + 1, ssmax_scale)
            # The materialized reference, as Transformers' eager: bam_attention_sdpa (SSMax folded into the
            # queries and the mask) drifts up to 3e-4 in log-probability from eager at 777-1,500 tokens.
            output, _ = bam_attention_reference(
                block.transpose(0, 1)[None], key[:, :, :keys], value[:, :, :keys], visible, bias, self.scaling,
                row_factor, self.ssmax_prior,
            )
            outputs.append(output[0].transpose(0, 1))
        return torch.cat(outputs)


class BamPriorParameters(nn.Module):
    """theta_alpha / theta_beta / theta_mu for all heads (the checkpoint's shape); this rank uses its own heads."""

    def __init__(self, total_heads: int, heads: slice):
        super().__init__()
        self.heads = heads
        self.theta_alpha = nn.Parameter(torch.zeros(total_heads, dtype=torch.float32), requires_grad=False)
        self.theta_beta = nn.Parameter(torch.zeros(total_heads, dtype=torch.float32), requires_grad=False)
        self.theta_mu = nn.Parameter(torch.zeros(total_heads, dtype=torch.float32), requires_grad=False)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.theta_alpha[self.heads], self.theta_beta[self.heads], self.theta_mu[self.heads]


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
        self.prior = BamPriorParameters(total_heads, heads) if config.prior_scope == "layer" else None
        self.ssmax = BamScalableSoftmaxScale(total_heads, heads) if config.ssmax else None
        self.attn = BamPagedAttention(
            config, self.num_heads, self.num_kv_heads, self.head_dim, vllm_config, prefix=f"{prefix}.attn"
        )

    def forward(self, hidden_states: torch.Tensor, shared_prior: BamPriorParameters | None) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        query, key, value = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        prior = self.prior if self.prior is not None else shared_prior
        ssmax_scale = self.ssmax.local() if self.ssmax is not None else None
        output, _ = self.o_proj(self.attn(query, key, value, prior, ssmax_scale))
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

    def forward(self, hidden_states: torch.Tensor, shared_prior: BamPriorParameters | None) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), shared_prior)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class BamLlamaModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [BamDecoderLayer(config, vllm_config, prefix=f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        heads = config.num_attention_heads
        self.prior = BamPriorParameters(heads, rank_heads(heads)) if config.prior_scope == "global" else None

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, self.prior)
        return self.norm(hidden_states)


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
        """`positions` are not needed: every layer reads the requests' absolute positions from the attention
        metadata (they are the last query_length of seq_len positions of each request)."""
        return self.model(input_ids, inputs_embeds)

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
