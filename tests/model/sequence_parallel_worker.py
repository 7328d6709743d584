"""torchrun worker for tests/model/test_sequence_parallel.py: every rank holds one chunk of every sequence (Ulysses).

Usage: torchrun --nproc_per_node=N sequence_parallel_worker.py OUTPUT.pt
Rank 0 writes, per case, the loss (each rank's sum over its tokens / all tokens, summed over ranks), the logits
(gathered chunks) and every parameter's gradient summed over ranks; and the error of every refused setup.
"""

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import tiny_model  # noqa: E402

LENGTH = 24  # two chunks of 12 on two ranks
# name: (attention implementation, config overrides, batch kind)
CASES = {
    "plain_layer_prior": ("sdpa", dict(prior_scope="layer"), "rows"),
    "plain_global_prior_eager": ("eager", dict(prior_scope="global"), "rows"),
    "packed_ssmax_prior_layer": ("sdpa", dict(prior_scope="layer", ssmax=True, ssmax_prior=True), "packed"),
    "packed_ssmax_prior_global": ("sdpa", dict(prior_scope="global", ssmax=True, ssmax_prior=True), "packed"),
    "packed_ssmax_eager": ("eager", dict(prior_scope="layer", ssmax=True, ssmax_prior=False), "packed"),
    "right_padding_ssmax": ("sdpa", dict(prior_scope="global", ssmax=True), "right_padded"),
    "one_kv_head_replicated": ("sdpa", dict(num_key_value_heads=1, ssmax=True), "packed"),
}


DEEPSPEED_CASE = "packed_ssmax_prior_global"


def build_model(name: str):
    implementation, overrides, _ = CASES[name]
    model = tiny_model(implementation, seed=3, **overrides).train()
    model.config.use_cache = False
    model.config.train_theta_mu = True  # mu too: every prior parameter gets a gradient to compare
    model.apply_prior_trainability()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model


def build_batch(name: str) -> dict[str, torch.Tensor]:
    """input_ids, position_ids, labels and, for padded rows, attention_mask: (2, LENGTH) each."""
    kind = CASES[name][2]
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(1, 97, (2, LENGTH), generator=generator)
    position_ids = torch.arange(LENGTH).repeat(2, 1)
    labels = input_ids.clone()
    batch = {}
    if kind == "packed":  # documents of 5 + 9 + 10 and 13 + 11 tokens: both cross the split at token 12
        for row, lengths in enumerate([(5, 9, 10), (13, 11)]):
            position_ids[row] = torch.cat([torch.arange(length) for length in lengths])
    elif kind == "right_padded":  # row 1 holds 17 tokens, then padding (on the second rank's chunk)
        batch["attention_mask"] = torch.ones(2, LENGTH, dtype=torch.long)
        batch["attention_mask"][1, 17:] = 0
        labels[1, 17:] = -100
    return dict(batch, input_ids=input_ids, position_ids=position_ids, labels=labels)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def run_case(name: str, rank: int, size: int) -> dict:
    from bam_llama.model.sequence_parallel_bam import enable_ulysses

    model = build_model(name)
    enable_ulysses(model)
    batch = build_batch(name)
    batch["shift_labels"] = shifted_labels(batch.pop("labels"))
    chunk = slice(rank * LENGTH // size, (rank + 1) * LENGTH // size)
    inputs = {key: value[:, chunk].contiguous() for key, value in batch.items()}
    count = (batch["shift_labels"] != -100).sum()
    output = model(**inputs, labels=inputs["shift_labels"], num_items_in_batch=count)
    output.loss.backward()
    loss = output.loss.detach().clone()
    dist.all_reduce(loss)
    logits = [torch.empty_like(output.logits) for _ in range(size)]
    dist.all_gather(logits, output.logits.detach().contiguous())
    gradients = {}
    for parameter_name, parameter in model.named_parameters():
        dist.all_reduce(parameter.grad)
        gradients[parameter_name] = parameter.grad
    return {"loss": loss, "logits": torch.cat(logits, dim=1), "gradients": gradients}


def run_deepspeed_ulysses(name: str, rank: int, size: int) -> dict:
    """As Accelerate wires `ParallelismConfig(sp_backend="deepspeed")`: DeepSpeed registers its Ulysses wrapper for
    the model's attention name and shards the batch with its data-loader adapter (shift_labels included); the
    loss is aggregated over the ranks by their token counts, as Trainer's `deepspeed_sp_compute_loss` does.
    Nothing tells BamLlama about it: the model finds DeepSpeed's group itself."""
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(name)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=size,
        micro_batch_size=2, seq_length_is_variable=True,
    )
    loader = torch.utils.data.DataLoader([build_batch(name)], batch_size=None)
    adapter = UlyssesSPDataLoaderAdapter(
        loader, sp_rank=mpu.get_sequence_parallel_rank(), sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=mpu.get_sequence_parallel_world_size(), device=torch.device("cpu"),
    )
    inputs = next(iter(adapter))  # this rank's chunk of the first rank's batch
    # Trainer moves the chunks (views, on the CPU) to the GPU, which makes them contiguous; ForCausalLMLoss needs that
    inputs = {key: value.contiguous() for key, value in inputs.items()}
    output = model(**inputs, labels=inputs["shift_labels"])
    tokens = (inputs["shift_labels"] != -100).sum()
    total = tokens.clone()
    dist.all_reduce(total)
    (output.loss * tokens / total).backward()
    loss = (output.loss * tokens / total).detach()
    dist.all_reduce(loss)
    gradients = {}
    for parameter_name, parameter in model.named_parameters():
        dist.all_reduce(parameter.grad)
        gradients[parameter_name] = parameter.grad
    return {"loss": loss, "gradients": gradients}


def refusals(rank: int, size: int) -> dict[str, str]:
    """The one-line error of every setup that would see wrong positions or drop the prior."""
    from bam_llama.model.sequence_parallel_bam import enable_ulysses

    chunk = slice(rank * LENGTH // size, (rank + 1) * LENGTH // size)
    batch = build_batch("plain_layer_prior")
    errors = {}

    def expect_error(key, run):
        try:
            run()
        except ValueError as error:
            errors[key] = str(error)
        else:
            errors[key] = None

    model = build_model("plain_layer_prior")
    enable_ulysses(model)
    expect_error("no_position_ids", lambda: model(input_ids=batch["input_ids"][:, chunk]))
    left_padding = torch.ones(2, LENGTH, dtype=torch.long)
    left_padding[0, :15] = 0  # the pads reach into the second chunk
    expect_error("left_padding", lambda: model(
        input_ids=batch["input_ids"][:, chunk], position_ids=batch["position_ids"][:, chunk],
        attention_mask=left_padding[:, chunk],
    ))
    for heads, kv_heads in [(3, 3), (6, 3)]:
        odd = tiny_model("sdpa", num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8)
        expect_error(f"heads_{heads}_{kv_heads}", lambda: enable_ulysses(odd))
    expect_error("context_parallel", lambda: ring_attention(build_model("plain_layer_prior"), batch, size))
    return errors


def ring_attention(model, batch, size):
    """The model under PyTorch's ring-attention context parallelism, as Accelerate / Trainer run it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (size,))
    input_ids, position_ids = batch["input_ids"].clone(), batch["position_ids"].clone()
    with context_parallel(mesh, buffers=[input_ids, position_ids], buffer_seq_dims=[1, 1]):
        model(input_ids=input_ids, position_ids=position_ids)


def main():
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {name: run_case(name, rank, size) for name in CASES}
    results["refusals"] = refusals(rank, size)
    if importlib.util.find_spec("deepspeed") is not None:  # last: DeepSpeed's wrapper stays registered
        results["deepspeed:" + DEEPSPEED_CASE] = run_deepspeed_ulysses(DEEPSPEED_CASE, rank, size)
    if rank == 0:
        torch.save(results, sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
