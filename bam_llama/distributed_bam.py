"""Sharded training of BamLlama outside Trainer's own wiring: FSDP2 (`fully_shard`), saving a sharded model as an
ordinary folder, and DeepSpeed ZeRO configs.

FSDP2 shards every decoder layer and then the root, which holds the embeddings, the final norm, the head and the
GLOBAL prior (one module used by every layer: it must not be wrapped with any single layer). On GPUs Trainer /
Accelerate do the same from `fsdp_transformer_layer_cls_to_wrap: BamDecoderLayer` (see the README); on CPU Accelerate
silently falls back to DDP, so `bam-finetune --fsdp` on CPU calls `shard_fsdp2` itself.

Nothing here imports DeepSpeed at module level (it is optional); `zero_config` only builds the dict it reads.
"""

from pathlib import Path

import torch
import torch.distributed as dist


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The BamDecoderLayer modules inside `model` (PEFT wrappers included), in order."""
    return [module for module in model.modules() if type(module).__name__ == "BamDecoderLayer"]


def shard_fsdp2(model: torch.nn.Module, mesh=None, **options) -> torch.nn.Module:
    """`fully_shard` on every decoder layer, then on the root (embeddings, norm, head, global prior), in place.

    options: passed to `fully_shard` (mp_policy, reshard_after_forward, ...). Returns `model`, now an FSDPModule.
    """
    from torch.distributed.fsdp import fully_shard

    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"shard_fsdp2: {type(model).__name__} holds no BamDecoderLayer")
    for layer in layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict of an FSDP2 model, on the CPU, on rank 0 (empty elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded_pretrained(model: torch.nn.Module, output_dir: str | Path, tokenizer=None) -> None:
    """Save an FSDP2-sharded BamLlama (or its PEFT adapter) as an ordinary folder that `from_pretrained` loads.

    Collective: every rank calls it. Rank 0 writes into a staging folder that becomes `output_dir` when complete.
    """
    from .io_bam import staged_output_dir

    state = full_state_dict(model)
    if dist.get_rank() == 0:
        with staged_output_dir(Path(output_dir), force=True) as staging:
            model.save_pretrained(staging, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
    dist.barrier()


def zero_config(stage: int, micro_batch_size: int, gradient_accumulation_steps: int = 1, bf16: bool = False) -> dict:
    """A DeepSpeed config for ZeRO stage 2 or 3 with the optimizer the caller passes (the prior's own learning
    rate lives in its parameter group). The README shows the file form of the same settings."""
    if stage not in (2, 3):
        raise ValueError(f"ZeRO stage must be 2 or 3, not {stage}")
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
