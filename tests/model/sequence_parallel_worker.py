"""torchrun worker for tests/model/test_sequence_parallel.py: every rank holds one chunk of every sequence (Ulysses).

Usage: torchrun --nproc_per_node=N sequence_parallel_worker.py OUTPUT.pt
Runs the cases for N ranks (2 or 4). Rank 0 writes, per case, the logits (gathered chunks) and, in training, the loss
(each rank's sum over its tokens / all tokens, summed over ranks) and every parameter's gradient summed over ranks;
with 2 ranks also the error of every refused setup.
"""

import importlib.util
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from distributed_launch import finish_worker  # noqa: E402
from helpers import tiny_model  # noqa: E402

LENGTH = 24  # chunks of 12 on two ranks, of 6 on four


class Case(NamedTuple):
    attention: str  # attention implementation
    overrides: dict  # config overrides
    batch: str  # "rows", "packed" or "right_padded" (build_batch)
    ranks: int = 2
    mode: str = "train"  # "train"; "eval": sharded inference; "eval_unsharded": disable_in_eval, whole sequences


GROUPED = dict(num_attention_heads=8, num_key_value_heads=2)  # 4 ranks: each KV head copied to 2 ranks
CASES = {
    "plain_layer_prior": Case("sdpa", dict(prior_scope="layer"), "rows"),
    "plain_global_prior_eager": Case("eager", dict(prior_scope="global"), "rows"),
    "packed_ssmax_prior_layer": Case("sdpa", dict(prior_scope="layer", ssmax=True, ssmax_prior=True), "packed"),
    "packed_ssmax_prior_global": Case("sdpa", dict(prior_scope="global", ssmax=True, ssmax_prior=True), "packed"),
    "packed_ssmax_eager": Case("eager", dict(prior_scope="layer", ssmax=True, ssmax_prior=False), "packed"),
    "right_padding_ssmax": Case("sdpa", dict(prior_scope="global", ssmax=True), "right_padded"),
    "packed_sinusoidal_positions": Case("sdpa", dict(prior_scope="layer", absolute_positions="sinusoidal"), "packed"),
    "one_kv_head_replicated": Case("sdpa", dict(num_key_value_heads=1, ssmax=True), "packed"),
    "eval_packed_ssmax": Case("sdpa", dict(prior_scope="global", ssmax=True), "packed", mode="eval"),
    "eval_right_padding_eager": Case("eager", dict(prior_scope="layer", ssmax=True), "right_padded", mode="eval"),
    # right padding: a sharded run on every rank's whole sequences would see the padding of one copy before the
    # tokens of the next (packed documents would hide it: each copy is a document of its own)
    "eval_unsharded_when_disabled": Case("sdpa", dict(prior_scope="global", ssmax=True), "right_padded",
                                         mode="eval_unsharded"),
    "grouped_kv_4_ranks_packed": Case("sdpa", dict(GROUPED, prior_scope="layer", ssmax=True), "packed", ranks=4),
    "grouped_kv_4_ranks_padded_eager": Case("eager", dict(GROUPED, prior_scope="global", ssmax=True), "right_padded",
                                            ranks=4),
    "grouped_kv_4_ranks_eval": Case("sdpa", dict(GROUPED, prior_scope="global", ssmax=True), "packed", ranks=4,
                                    mode="eval"),
}


DEEPSPEED_CASE = "packed_ssmax_prior_global"


def build_model(name: str):
    case = CASES[name]
    model = tiny_model(case.attention, seed=3, **case.overrides).train(case.mode == "train")
    model.config.use_cache = False
    model.config.train_theta_mu = True  # mu too: every prior parameter gets a gradient to compare
    model.apply_prior_trainability()
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model


def build_batch(name: str) -> dict[str, torch.Tensor]:
    """input_ids, position_ids, labels and, for padded rows, attention_mask: (2, LENGTH) each."""
    kind = CASES[name].batch
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(1, 97, (2, LENGTH), generator=generator)
    position_ids = torch.arange(LENGTH).repeat(2, 1)
    labels = input_ids.clone()
    batch = {}
    if kind == "packed":  # documents of 5 + 9 + 10 and 13 + 11 tokens: both cross the split at token 12
        for row, lengths in enumerate([(5, 9, 10), (13, 11)]):
            position_ids[row] = torch.cat([torch.arange(length) for length in lengths])
    elif kind == "right_padded":  # row 1 holds 17 tokens, then padding (on the last rank's chunk)
        batch["attention_mask"] = torch.ones(2, LENGTH, dtype=torch.long)
        batch["attention_mask"][1, 17:] = 0
        labels[1, 17:] = -100
    return dict(batch, input_ids=input_ids, position_ids=position_ids, labels=labels)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=-100)[:, 1:]


def run_case(name: str, rank: int, size: int) -> dict:
    if CASES[name].mode != "train":
        return run_eval_case(name, rank, size)
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


@torch.no_grad()
def run_eval_case(name: str, rank: int, size: int) -> dict:
    """Logits of a model in eval mode: sharded like training ("eval"), or, with `disable_in_eval` (as Accelerate
    registers DeepSpeed's wrapper: its evaluation batches are not sharded), of the whole sequences every rank holds."""
    from bam_llama.model.sequence_parallel_bam import enable_ulysses

    model = build_model(name)
    unsharded = CASES[name].mode == "eval_unsharded"
    enable_ulysses(model, disable_in_eval=unsharded)
    batch = build_batch(name)
    batch.pop("labels")
    if unsharded:
        return {"logits": model(**batch).logits}
    chunk = slice(rank * LENGTH // size, (rank + 1) * LENGTH // size)
    logits = model(**{key: value[:, chunk].contiguous() for key, value in batch.items()}).logits
    gathered = [torch.empty_like(logits) for _ in range(size)]
    dist.all_gather(gathered, logits.contiguous())
    return {"logits": torch.cat(gathered, dim=1)}


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
    results = {name: run_case(name, rank, size) for name, case in CASES.items() if case.ranks == size}
    if size == 2:
        results["refusals"] = refusals(rank, size)
        if importlib.util.find_spec("deepspeed") is not None:  # last: DeepSpeed's wrapper stays registered
            results["deepspeed:" + DEEPSPEED_CASE] = run_deepspeed_ulysses(DEEPSPEED_CASE, rank, size)
    finish_worker(rank, results, Path(sys.argv[1]))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
