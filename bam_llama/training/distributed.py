"""Sharded training of BamLlama outside Trainer's own wiring: FSDP2 (`fully_shard`), saving a sharded model as an
ordinary folder, and DeepSpeed ZeRO configs.

FSDP2 shards every decoder layer and then the root, which holds the embeddings, the final norm, the head and the
GLOBAL prior (one module used by every layer: it must not be wrapped with any single layer). On GPUs Trainer /
Accelerate do the same from `fsdp_transformer_layer_cls_to_wrap: BamDecoderLayer` (see the README); on CPU Accelerate
silently falls back to DDP, so `bam-finetune --fsdp` on CPU calls `shard_fsdp2` itself.

Nothing here imports DeepSpeed at module level (it is optional); `zero_config` only builds the dict it reads.
"""

import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

try:
    from torch.distributed.fsdp import fully_shard  # public from PyTorch 2.6
except ImportError:  # PyTorch 2.5, which the package supports
    from torch.distributed._composable.fsdp import fully_shard
try:  # Accelerate's Ulysses sequence parallelism, in newer releases only
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
except ImportError:
    ParallelismConfig = DeepSpeedSequenceParallelConfig = None

from ..files.outputs import staged_output_dir


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The BamDecoderLayer modules inside `model` (PEFT wrappers included), in order."""
    return [module for module in model.modules() if type(module).__name__ == "BamDecoderLayer"]


def shard_fsdp2(model: torch.nn.Module, mesh=None, **options) -> torch.nn.Module:
    """`fully_shard` on every decoder layer, then on the root (embeddings, norm, head, global prior), in place.

    options: passed to `fully_shard` (mp_policy, reshard_after_forward, ...). Returns `model`, now an FSDPModule.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"shard_fsdp2: {type(model).__name__} holds no BamDecoderLayer")
    for layer in layers:
        fully_shard(layer, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict of an FSDP2 model, on the CPU, on rank 0 (empty elsewhere). Collective."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_sharded_pretrained(model: torch.nn.Module, output_dir: str | Path, tokenizer=None) -> None:
    """Save an FSDP2-sharded BamLlama (or its PEFT adapter) as an ordinary folder that `from_pretrained` loads.

    Collective: every rank calls it. Rank 0 writes into a staging folder that becomes `output_dir` when complete.
    """
    state = full_state_dict(model)
    if dist.get_rank() == 0:
        with staged_output_dir(Path(output_dir), force=True) as staging:
            model.save_pretrained(staging, state_dict=state)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
    dist.barrier()


def end_distributed_run() -> None:
    """After a run launched by torchrun / accelerate finished on every rank: wait for all of them, then destroy the
    process group. Left to the interpreter's exit, gloo's threads and connections are torn down in no fixed order,
    which can abort (SIGABRT) a process whose results are already saved."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def zero_config(stage: int, micro_batch_size="auto", gradient_accumulation_steps="auto", bf16="auto") -> dict:
    """A DeepSpeed config for ZeRO stage 2 or 3 with the optimizer the caller passes (Trainer's, whose parameter
    groups give the prior its own learning rate). "auto" values are filled in by Trainer from its arguments; a
    direct `deepspeed.initialize` needs numbers. ZeRO-3 gathers the whole model when Trainer saves it."""
    if stage not in (2, 3):
        raise ValueError(f"ZeRO stage must be 2 or 3, not {stage}")
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": bf16},
        "gradient_clipping": "auto" if micro_batch_size == "auto" else 0.0,
        "steps_per_print": 10**9,
    }


ZERO_PRESETS = {"zero2": 2, "zero3": 3}


def parallel_training_arguments(
    *,
    fsdp: bool = False,
    deepspeed: str | None = None,
    sp_size: int = 1,
    attn_implementation: str | None = None,
    merge: bool = False,
    cuda_available: bool | None = None,
) -> dict:
    """The TrainingArguments fields of the sharded (FSDP2, DeepSpeed ZeRO) and Ulysses sequence-parallel modes.

    Args:
        fsdp: FSDP2 through Accelerate, wrapping every BamDecoderLayer (the root keeps the global prior).
        deepspeed: "zero2", "zero3" or a DeepSpeed JSON config file.
        sp_size: Ulysses sequence parallelism over this many GPUs (DeepSpeed's ALST, through ParallelismConfig).
    Raises:
        ValueError, one line, for what cannot run: any of them without CUDA (Accelerate runs FSDP and DeepSpeed on
        accelerators only; on CPU it would silently train with DDP), FSDP with DeepSpeed, sequence parallelism
        without DeepSpeed or with an attention name DeepSpeed does not wrap, merging a sharded model.
    """
    if not (fsdp or deepspeed or sp_size > 1):
        return {}
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        raise ValueError("--fsdp, --deepspeed and --sp-size need CUDA GPUs: Accelerate runs FSDP and DeepSpeed only "
                         "on accelerators (on CPU it would silently train with plain DDP)")
    if fsdp and deepspeed:
        raise ValueError("choose one of --fsdp and --deepspeed")
    if sp_size > 1 and not deepspeed:
        raise ValueError("--sp-size runs DeepSpeed's Ulysses sequence parallelism: add --deepspeed zero2|zero3|CONFIG")
    if sp_size > 1 and attn_implementation != "sdpa":
        raise ValueError("--sp-size needs --attn-implementation sdpa: DeepSpeed registers its Ulysses wrapper under a "
                         "Transformers attention name, and BamLlama runs its own 'sdpa' attention under it")
    if merge and (fsdp or deepspeed):
        raise ValueError("--merge needs the whole model on one process: merge the saved adapter afterwards, without "
                         "--fsdp / --deepspeed")
    fields = {}
    if fsdp:
        fields["fsdp"] = "full_shard auto_wrap"
        fields["fsdp_config"] = {"version": 2, "transformer_layer_cls_to_wrap": ["BamDecoderLayer"],
                                 "reshard_after_forward": True, "state_dict_type": "FULL_STATE_DICT"}
    if deepspeed:
        if importlib.util.find_spec("deepspeed") is None:
            raise ValueError("--deepspeed needs DeepSpeed: pip install 'bam-llama[deepspeed]'")
        if deepspeed in ZERO_PRESETS:
            fields["deepspeed"] = zero_config(ZERO_PRESETS[deepspeed])
        elif Path(deepspeed).is_file():
            fields["deepspeed"] = deepspeed
        else:
            raise ValueError(f"--deepspeed {deepspeed!r}: expected zero2, zero3 or a DeepSpeed JSON config file")
    if sp_size > 1:
        if ParallelismConfig is None:
            raise ValueError("--sp-size needs an Accelerate release with ParallelismConfig: pip install -U accelerate")
        handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
        fields["parallelism_config"] = ParallelismConfig(sp_backend="deepspeed", sp_size=sp_size, sp_handler=handler)
    return fields


def parameters_sharded(trainer) -> bool:
    """Whether Trainer's model is sharded over the ranks (FSDP, or ZeRO-3): its forward and its state dict are then
    collective, every rank must take part."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return True
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def gathered_state_dict(trainer) -> dict | None:
    """The whole state dict of Trainer's sharded model, on rank 0 (collective: every rank calls it); None when the
    model is not sharded (every rank holds all of it)."""
    if not parameters_sharded(trainer):
        return None
    return trainer.accelerator.get_state_dict(trainer.model_wrapped)
