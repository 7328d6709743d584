"""torchrun worker for tests/training/test_sharded_training.py: data-parallel training with sharded parameters.

Usage: torchrun --nproc_per_node=2 sharded_training_worker.py ENGINE OUTPUT_DIR
ENGINE: fsdp2 | zero2 | zero3. Each rank trains on its half of the global batch (rows), for STEPS SGD steps, for
every variant (full fine-tuning; LoRA with the prior and SSMax trained). Rank 0 writes OUTPUT_DIR/results.pt: per
variant the global loss of every step (mean over ranks) and every parameter after training (gathered), and for
fsdp2 the folder the sharded model saved.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from distributed_launch import finish_worker  # noqa: E402
from helpers import tiny_model  # noqa: E402

STEPS = 3
LEARNING_RATE = 0.2
ROWS, LENGTH = 4, 16
VARIANTS = ("full", "lora")


def base_model():
    model = tiny_model("sdpa", seed=5, prior_scope="global", ssmax=True, train_theta_mu=True)
    model.config.use_cache = False
    return model


def build_model(variant: str):
    """A tiny BamLlama with SSMax on the prior and the global prior: all of it trained, or LoRA on the attention
    with the prior and SSMax trained (PEFT's modules_to_save)."""
    from peft import LoraConfig, get_peft_model

    model = base_model()
    if variant == "full":
        return model.requires_grad_(True).train()
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      modules_to_save=["prior", "ssmax"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    model.get_base_model().apply_prior_trainability()
    if variant == "lora":  # LoRA's B starts at 0: give it values, so that A's gradient is not 0 too
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    return model.train()


def global_batch() -> dict[str, torch.Tensor]:
    """ROWS packed rows: documents of 6 + 10 tokens and one of 16."""
    generator = torch.Generator().manual_seed(11)
    input_ids = torch.randint(1, 97, (ROWS, LENGTH), generator=generator)
    position_ids = torch.arange(LENGTH).repeat(ROWS, 1)
    position_ids[::2] = torch.cat([torch.arange(6), torch.arange(10)])
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": input_ids.clone()}


def rank_batch(rank: int, size: int) -> dict[str, torch.Tensor]:
    rows = slice(rank * ROWS // size, (rank + 1) * ROWS // size)
    return {key: value[rows] for key, value in global_batch().items()}


def global_loss(loss: torch.Tensor) -> float:
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return loss.item() / dist.get_world_size()


def train_fsdp2(variant: str, rank: int, size: int, output_dir: Path) -> dict:
    from bam_llama.training.distributed import (
        full_state_dict,
        save_sharded_pretrained,
        shard_fsdp2,
    )

    model = shard_fsdp2(build_model(variant))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    losses = []
    for _ in range(STEPS):
        loss = model(**rank_batch(rank, size)).loss
        loss.backward()  # FSDP2 averages the gradients over the ranks
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_loss(loss))
    parameters = full_state_dict(model)
    saved = output_dir / f"saved-{variant}"
    save_sharded_pretrained(model, saved)
    return {"losses": losses, "parameters": parameters, "saved": str(saved)}


def train_zero(stage: int, variant: str, rank: int, size: int) -> dict:
    import deepspeed

    from bam_llama.training.distributed import zero_config

    model = build_model(variant)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=zero_config(stage, ROWS // size, 1, False))
    losses = []
    for _ in range(STEPS):
        loss = engine(**rank_batch(rank, size)).loss
        engine.backward(loss)  # averaged over the ranks
        engine.step()
        losses.append(global_loss(loss))
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named]):  # ZeRO-3 holds shards only
        parameters = {name: p.detach().clone() for name, p in named}
    return {"losses": losses, "parameters": parameters}


def main():
    engine, output_dir = sys.argv[1], Path(sys.argv[2])
    if engine == "fsdp2":
        dist.init_process_group("gloo")
    else:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {}
    for variant in VARIANTS:
        if engine == "fsdp2":
            results[variant] = train_fsdp2(variant, rank, size, output_dir)
        else:
            results[variant] = train_zero(int(engine[-1]), variant, rank, size)
    finish_worker(rank, results, output_dir / "results.pt")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
