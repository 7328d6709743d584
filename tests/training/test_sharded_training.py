"""Sharded data-parallel training gives the model of one process: FSDP2 (`fully_shard` on every decoder layer and
the root, which holds the global prior) and DeepSpeed ZeRO-2 / ZeRO-3 on 2 gloo CPU processes, each training on half
of the global batch, for full fine-tuning and for LoRA with the prior and SSMax trained. The sharded FSDP2 model
saves to an ordinary folder that reloads. Workers: tests/sharded_training_worker.py (one torchrun per engine)."""

import pytest
import torch
from distributed_launch import require_deepspeed, torchrun
from sharded_training_worker import (
    LEARNING_RATE,
    STEPS,
    VARIANTS,
    base_model,
    build_model,
    global_batch,
)

# float32; the sharded runs sum gradients in another order (per-rank halves, then an average over 2 ranks)
LOSS_TOLERANCE = 1e-5
PARAMETER_TOLERANCE = dict(rtol=1e-5, atol=1e-6)  # per element, after STEPS steps of SGD


def one_process(variant: str) -> dict:
    """The reference: the same model, optimizer and global batch in this process."""
    model = build_model(variant)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    losses = []
    for _ in range(STEPS):
        loss = model(**global_batch()).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    initial = build_model(variant).state_dict()
    return {"losses": losses, "model": model, "parameters": model.state_dict(), "initial": initial}


@pytest.fixture(scope="module")
def references():
    return {variant: one_process(variant) for variant in VARIANTS}


def sharded_run(engine: str, tmp_path_factory) -> dict:
    output_dir = tmp_path_factory.mktemp(engine)
    torchrun("training/sharded_training_worker.py", engine, str(output_dir), limit_s=800, DS_ACCELERATOR="cpu")
    return torch.load(output_dir / "results.pt")


def assert_same_training(got: dict, expected: dict) -> None:
    assert len(got["losses"]) == STEPS
    for step, (loss, reference) in enumerate(zip(got["losses"], expected["losses"])):
        assert abs(loss - reference) < LOSS_TOLERANCE, f"step {step}: {loss} != {reference}"
    parameters = expected["model"].named_parameters()
    trained = [name for name, parameter in parameters if parameter.requires_grad]
    assert any("prior" in name for name in trained) and any("ssmax" in name for name in trained)
    for name in trained:
        torch.testing.assert_close(got["parameters"][name].float(), expected["parameters"][name], **PARAMETER_TOLERANCE,
                                   msg=name)
        moved = (expected["parameters"][name] - expected["initial"][name]).abs().max()
        assert moved > 1e-4, f"{name} did not train: the comparison would be trivial"


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    return sharded_run("fsdp2", tmp_path_factory)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fsdp2_trains_the_one_process_model(fsdp2, references, variant):
    assert_same_training(fsdp2[variant], references[variant])


def test_fsdp2_model_saves_to_a_folder_that_reloads(fsdp2, references):
    from bam_llama import BamLlamaForCausalLM

    reloaded = BamLlamaForCausalLM.from_pretrained(fsdp2["full"]["saved"])
    expected = references["full"]["parameters"]
    for name, parameter in reloaded.state_dict().items():
        torch.testing.assert_close(parameter, expected[name], **PARAMETER_TOLERANCE, msg=name)


def test_fsdp2_lora_adapter_saves_and_reloads_onto_the_base_model(fsdp2, references):
    from peft import PeftModel

    reloaded = PeftModel.from_pretrained(base_model(), fsdp2["lora"]["saved"])
    expected = references["lora"]["model"]
    for name, parameter in expected.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(reloaded.get_parameter(name), parameter, **PARAMETER_TOLERANCE, msg=name)
    batch = global_batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**batch).logits, expected.eval()(**batch).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_trains_the_one_process_model(tmp_path_factory, references, stage):
    require_deepspeed()
    results = sharded_run(f"zero{stage}", tmp_path_factory)
    for variant in VARIANTS:
        assert_same_training(results[variant], references[variant])
