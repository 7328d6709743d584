"""Ulysses sequence parallelism for BamLlama, and the guard against parallel schemes that would drop the prior.

Under Ulysses (DeepSpeed's "ALST", wired by Transformers / Accelerate through
`ParallelismConfig(sp_backend="deepspeed", sp_size=N)`), each of the N ranks of a sequence-parallel group holds one
contiguous chunk of every sequence. Around attention, an all-to-all trades the chunks for heads: each rank attends
over the WHOLE sequence for H / N of the heads, then a second all-to-all gives back its chunk for all heads.

DeepSpeed wraps Transformers' attention registry, which BamLlama never calls (its attention is looked up in its own
table, see `dispatch_bam.BAM_ATTENTION_FUNCTIONS`), and its wrapper could not carry BAM's inputs anyway. So the
exchange is done here, with torch.distributed (any backend, gloo included), on the group DeepSpeed created:

- positions, document ids, padding and SSMax counts come from the GATHERED `position_ids` / attention mask, so every
  rank sees the positions (and the visible-key counts n_i) of one process holding the whole sequence;
- a rank attends with the prior and SSMax parameters of its own heads (slices of the parameters, so gradients reach
  only those entries; summing gradients over the group gives the full ones).

A model enters this mode by `enable_ulysses(model, group)`, or by itself when DeepSpeed's Ulysses wrapper is
registered for the attention name the model's config carries (what `Accelerator.prepare` does with a
`ParallelismConfig(sp_backend="deepspeed")`). Refused with one error: sequence parallelism without `position_ids`,
left padding, head counts the group size does not divide, a KV cache, ring-attention context parallelism (PyTorch's
`context_parallel`, patched into SDPA: it would drop the prior), and any other wrapper replacing the attention function
of the model's attention name. Nothing here imports DeepSpeed: it is read from `sys.modules` only if already loaded.
"""

import sys

import torch
import torch.distributed as dist
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .prior_bam import ssmax_factor

ULYSSES_HINT = (
    "use Ulysses sequence parallelism (bam_llama.model.sequence_parallel_bam.enable_ulysses, or Accelerate's "
    "ParallelismConfig(sp_backend='deepspeed', sp_size=N))"
)


class UlyssesAttention:
    """The sequence-parallel state of one BamLlama model: its group, and this rank's heads.

    Args:
        group: the sequence-parallel process group (the ranks that share each sequence, in chunk order).
        config: the model's BamLlamaConfig.
        disable_in_eval: run the ordinary (unsharded) attention when the model is in eval mode, as DeepSpeed's
            wrapper does when Accelerate registers it (its evaluation batches are not sharded).
    """

    def __init__(self, group, config, disable_in_eval: bool = False):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.disable_in_eval = disable_in_eval
        check_heads_divisible(config.num_attention_heads, config.num_key_value_heads, self.size)
        local_heads = config.num_attention_heads // self.size
        self.heads = slice(self.rank * local_heads, (self.rank + 1) * local_heads)
        # fewer key/value heads than ranks: each rank gets a copy of the one its query heads share
        self.kv_replication = max(1, self.size // config.num_key_value_heads)

    def __deepcopy__(self, memo):
        return self  # a copied model stays in the same group (a process group cannot be copied)

    def active(self, training: bool) -> bool:
        return training or not self.disable_in_eval

    def gather_inputs(
        self, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, past_seen_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole sequences' (B, N * Lc) position ids and 2D attention mask (None when nothing is padded) from
        every rank's chunk (B, Lc). Refuses what sharded attention cannot reproduce."""
        if position_ids is None:
            raise ValueError(
                "Sequence parallelism needs `position_ids` in every forward call (each rank holds one chunk of every "
                "sequence; without them positions would restart at 0 on every rank): pass position_ids, e.g. through "
                "DeepSpeed's UlyssesSPDataLoaderAdapter, which shards them with the batch"
            )
        if past_seen_tokens:
            raise ValueError("Sequence parallelism is for training: generation with a KV cache is not supported; "
                             "generate on one process without sequence parallelism")
        position_ids = _gather_sequence(position_ids, self.group, self.size)
        if attention_mask is None:
            return position_ids, None
        if attention_mask.dim() != 2:
            raise ValueError("Sequence parallelism takes a 2D padding mask (or none), not a custom 4D mask")
        attention_mask = _gather_sequence(attention_mask, self.group, self.size).bool()
        if bool(attention_mask.all()):
            return position_ids, None
        if bool((attention_mask[:, 1:] & ~attention_mask[:, :-1]).any()):
            raise ValueError(
                "Sequence parallelism does not support left padding (a padded token before a real one): pad on the "
                "right (tokenizer.padding_side = 'right') or pack the sequences without padding"
            )
        return position_ids, attention_mask

    def wrap(self, attention_function):
        """`attention_function` (one of BAM's, same signature) on the whole sequence for this rank's heads; takes
        and returns the rank's chunk: query (B, H, Lc, D), key/value (B, Hkv, Lc, D) -> (B, Lc, H, D)."""

        def sequence_parallel_attention(module, query, key, value, attention_mask, *args, prior, **kwargs):
            query = _sequence_to_heads(query, self.group, self.size)
            key = _sequence_to_heads(_replicate_heads(key, self.kv_replication), self.group, self.size)
            value = _sequence_to_heads(_replicate_heads(value, self.kv_replication), self.group, self.size)
            if kwargs.get("prior_table") is not None:
                kwargs["prior_table"] = kwargs["prior_table"][self.heads]
            output, weights = attention_function(
                _AttentionHeads(module, self.heads), query, key, value, attention_mask, *args,
                prior=_PriorHeads(prior, self.heads), **kwargs,
            )
            return _heads_to_sequence(output, self.group, self.size), weights

        return sequence_parallel_attention


def check_heads_divisible(heads: int, kv_heads: int, size: int) -> None:
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"Sequence parallelism over {size} ranks splits the attention heads: num_attention_heads={heads} must be "
            f"divisible by {size}, and num_key_value_heads={kv_heads} must divide or be divisible by it; choose an "
            "sp_size that divides the head counts"
        )


def enable_ulysses(model: torch.nn.Module, group=None, disable_in_eval: bool = False) -> UlyssesAttention:
    """Turn Ulysses sequence parallelism on for every BamLlama base model inside `model` (PEFT or engine wrappers
    included). group: the sequence-parallel process group (default: the whole world). Returns the state."""
    state = None
    for module in model.modules():
        if "sequence_parallel" in vars(module):  # a BamLlamaModel
            state = UlyssesAttention(group or dist.group.WORLD, module.config, disable_in_eval)
            module.sequence_parallel = state
    if state is None:
        raise ValueError(f"enable_ulysses: {type(model).__name__} holds no BamLlama model")
    return state


def active_sequence_parallel(model: torch.nn.Module) -> UlyssesAttention | None:
    """The Ulysses state `model` (a BamLlamaModel) runs under in this forward call, or None. Refuses every
    parallel scheme it would silently get wrong. DeepSpeed's Ulysses registered for the model's attention name
    (`Accelerator.prepare` with a ParallelismConfig(sp_backend='deepspeed')) turns it on with DeepSpeed's group."""
    refuse_context_parallel()
    state = model.sequence_parallel
    if state is None:
        ulysses = _deepspeed_ulysses(model.config._attn_implementation)
        if ulysses is not None:
            state = model.sequence_parallel = UlyssesAttention(
                ulysses.process_group, model.config, getattr(ulysses, "disable_in_eval", False)
            )
        else:
            refuse_unhandled_attention_wrapper(model.config._attn_implementation)
    return state if state is not None and state.active(model.training) else None


def refuse_context_parallel() -> None:
    """PyTorch's ring-attention context parallelism (`context_parallel`, used by Accelerate / Trainer with
    `ParallelismConfig(cp_size=N)`) replaces SDPA while it runs, and refuses or drops an attention bias."""
    attention = sys.modules.get("torch.distributed.tensor.experimental._context_parallel._attention")
    if attention is None:
        return
    replaced = getattr(attention, "_replaced_functions", {})
    if torch.nn.functional.scaled_dot_product_attention in replaced:
        raise ValueError(
            "BamLlama cannot run under ring-attention context parallelism (cp_size > 1): it patches SDPA and drops "
            f"the positional prior's bias; {ULYSSES_HINT} instead"
        )


def refuse_unhandled_attention_wrapper(name: str) -> None:
    """A function registered in Transformers' attention registry under the model's attention name, from outside
    Transformers, is a wrapper (sequence parallelism, ...) that expects the model to call it; BamLlama never does."""
    wrapper = ALL_ATTENTION_FUNCTIONS.get(name)
    if wrapper is None or getattr(wrapper, "__module__", "").startswith("transformers."):
        return
    raise ValueError(
        f"Transformers' attention function for {name!r} was replaced by {getattr(wrapper, '__qualname__', wrapper)!r} "
        f"from {getattr(wrapper, '__module__', '?')!r}; BamLlama runs its own attention (the positional prior) and "
        f"would bypass that wrapper. For sequence parallelism {ULYSSES_HINT}"
    )


def _deepspeed_ulysses(name: str):
    """DeepSpeed's UlyssesSPAttentionHF registered for `name` (DeepSpeed's `register_with_transformers` puts its
    wrapper, a closure over that object, into Transformers' registry), or None."""
    if "deepspeed.runtime.sequence_parallel.ulysses_sp" not in sys.modules:
        return None
    wrapper = ALL_ATTENTION_FUNCTIONS.get(name)
    ulysses_class = sys.modules["deepspeed.runtime.sequence_parallel.ulysses_sp"].UlyssesSPAttentionHF
    for cell in getattr(wrapper, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(content, ulysses_class):
            return content
    return None


class _PriorHeads:
    """The prior of some heads: what BAM's attention functions read from a BamPrior, sliced."""

    def __init__(self, prior, heads: slice):
        self.prior, self.heads = prior, heads
        self.formula, self.eps = prior.formula, prior.eps

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(parameter[self.heads] for parameter in self.prior())

    def table(self, last_position: int) -> torch.Tensor:
        return self.prior.table(last_position)[self.heads]

    def bias(self, query_positions: torch.Tensor, key_length: int) -> torch.Tensor:
        return self.prior.bias(query_positions, key_length)[:, self.heads]


class _ScalableSoftmaxHeads:
    """Scalable Softmax of some heads (see `BamScalableSoftmax`)."""

    def __init__(self, ssmax, heads: slice):
        self.ssmax, self.heads = ssmax, heads
        self.prior_scaled = ssmax.prior_scaled

    def __call__(self) -> torch.Tensor:
        return self.ssmax()[self.heads]

    def row_factor(self, visible_counts: torch.Tensor) -> torch.Tensor:
        return ssmax_factor(visible_counts, self())


class _AttentionHeads:
    """A BamAttention module as its attention function sees it, with the SSMax parameters of some heads."""

    def __init__(self, module, heads: slice):
        self._module = module
        self.ssmax = None if module.ssmax is None else _ScalableSoftmaxHeads(module.ssmax, heads)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


class _AllToAll(torch.autograd.Function):
    """all_to_all along dim 0 of a (group size, ...) tensor: out[s] = rank s's input[own rank]. Its adjoint is the
    same exchange, so the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(tensor, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def _all_to_all(tensor: torch.Tensor, group) -> torch.Tensor:
    tensor = tensor.contiguous()
    output = torch.empty_like(tensor)
    dist.all_to_all_single(output, tensor, group=group)
    return output


def _sequence_to_heads(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """(B, H, Lc, D) chunk of the sequence, all heads -> (B, H / size, size * Lc, D) whole sequence, own heads."""
    batch, heads, length, head_dim = tensor.shape
    by_destination = tensor.view(batch, size, heads // size, length, head_dim).transpose(0, 1)
    by_source = _AllToAll.apply(by_destination, group)  # [s]: chunk s of the sequence
    return by_source.permute(1, 2, 0, 3, 4).reshape(batch, heads // size, size * length, head_dim)


def _heads_to_sequence(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """(B, L, H / size, D) whole sequence, own heads -> (B, L / size, H, D) own chunk, all heads."""
    batch, length, heads, head_dim = tensor.shape
    by_destination = tensor.reshape(batch, size, length // size, heads, head_dim).transpose(0, 1)
    by_source = _AllToAll.apply(by_destination, group)  # [s]: the heads of rank s
    return by_source.permute(1, 2, 0, 3, 4).reshape(batch, length // size, size * heads, head_dim)


def _replicate_heads(tensor: torch.Tensor, times: int) -> torch.Tensor:
    return tensor if times == 1 else tensor.repeat_interleave(times, dim=1)


def _gather_sequence(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """(B, Lc) chunks of every rank -> (B, size * Lc), in rank order (no gradient: ids and masks)."""
    tensor = tensor.contiguous()
    chunks = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(chunks, tensor, group=group)
    return torch.cat(chunks, dim=1)
