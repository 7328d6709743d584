"""What the config freezes (theta_mu by default; here the SSMax scale too) stays frozen whoever wraps the model, with
no call of ours in between: PEFT's `modules_to_save` copies, Trainer, TRL's SFTTrainer with a `peft_config`, and
`requires_grad_(True)` on everything. What it trains does train."""

import datasets
import pytest
import torch
from helpers import tiny_model
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

from bam_llama.data.tokenizers import BYTE_VOCAB_SIZE, build_byte_tokenizer

FROZEN = ("theta_mu", "ssmax.scale")
TRAINED = ("theta_alpha", "theta_beta")


def model_with_frozen_parts():
    return tiny_model("sdpa", ssmax=True, vocab_size=BYTE_VOCAB_SIZE, train_ssmax_scale=False).train()


def lora_config() -> LoraConfig:
    return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["prior", "ssmax"], task_type="CAUSAL_LM")


def prior_values(model) -> dict[str, torch.Tensor]:
    """Every prior / SSMax tensor the model computes with (PEFT's trained copies, not its originals)."""
    values = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        name = name.replace(".modules_to_save.default", "").removeprefix("base_model.model.")
        if name.endswith((*FROZEN, *TRAINED)) and ".original_module" not in name:
            values[name] = tensor.detach().clone()
    return values


def training_rows(count: int = 8, length: int = 12) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(3, BYTE_VOCAB_SIZE, (count, length), generator=generator).tolist()
    return [{"input_ids": row, "labels": row} for row in rows]


def trainer_arguments(output_dir) -> dict:
    return dict(output_dir=str(output_dir), max_steps=3, learning_rate=0.05, per_device_train_batch_size=4,
                report_to=[], save_strategy="no", use_cpu=True, weight_decay=0.1, logging_strategy="no")


def assert_frozen_kept_and_trained_moved(before, after):
    assert before.keys() == after.keys()
    assert {name.rpartition(".")[2] for name in before} == {"theta_alpha", "theta_beta", "theta_mu", "scale"}
    for name in before:
        if name.endswith(FROZEN):
            assert torch.equal(after[name], before[name]), f"{name} trained though the config freezes it"
        else:
            assert not torch.equal(after[name], before[name]), f"{name} did not train"


def test_peft_modules_to_save_copies_no_frozen_parameter():
    model = get_peft_model(model_with_frozen_parts(), lora_config())
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    assert any(name.endswith("modules_to_save.default.theta_alpha") for name in trainable)
    assert not [name for name in trainable if name.endswith(FROZEN)]
    assert not [name for name in trainable if ".original_module." in name]


def test_trainer_on_a_peft_model_trains_only_what_the_config_trains(tmp_path):
    model = get_peft_model(model_with_frozen_parts(), lora_config())
    before = prior_values(model)
    Trainer(model=model, args=TrainingArguments(**trainer_arguments(tmp_path)), train_dataset=training_rows()).train()
    assert_frozen_kept_and_trained_moved(before, prior_values(model))


def test_trainer_after_requires_grad_on_everything(tmp_path):
    model = model_with_frozen_parts()
    model.requires_grad_(True)
    before = prior_values(model)
    Trainer(model=model, args=TrainingArguments(**trainer_arguments(tmp_path)), train_dataset=training_rows()).train()
    assert_frozen_kept_and_trained_moved(before, prior_values(model))


def test_trl_sft_trainer_with_a_peft_config(tmp_path):
    """TRL (a dev extra): SFTTrainer wraps the model with PEFT itself, so no user code runs in between."""
    trl = pytest.importorskip("trl")
    model = model_with_frozen_parts()
    before = prior_values(model)
    trainer = trl.SFTTrainer(
        model=model,
        # bf16 autocast, as TRL trains by default where the device has bf16 (Accelerate's CPU bf16 here)
        args=trl.SFTConfig(**trainer_arguments(tmp_path), max_length=12, packing=False, bf16=True),
        train_dataset=datasets.Dataset.from_list([{"input_ids": row["input_ids"]} for row in training_rows()]),
        processing_class=build_byte_tokenizer(),
        peft_config=lora_config(),
    )
    trainer.train()
    assert_frozen_kept_and_trained_moved(before, prior_values(trainer.model))


def test_a_changed_config_makes_a_frozen_parameter_trainable():
    model = model_with_frozen_parts()
    assert "model.prior.theta_mu" not in dict(model.named_parameters())
    value = model.model.prior.theta_mu.clone()
    model.config.train_theta_mu = True
    model.apply_prior_trainability()
    theta_mu = dict(model.named_parameters())["model.prior.theta_mu"]
    assert theta_mu.requires_grad and torch.equal(theta_mu.detach(), value)
    model.config.train_theta_mu = False
    model.apply_prior_trainability()
    assert "model.prior.theta_mu" in dict(model.named_buffers()) and torch.equal(model.model.prior.theta_mu, value)
