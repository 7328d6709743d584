"""bam-finetune on tiny models and data made here: packing, data sources, bad input, LoRA / full training,
adapter reload and merge, resume, the CLI and a 2-process DDP run on CPU (gloo)."""

import json
import os
import random
import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    checkout_environment,
    created_optimizers,
    default_sigint,
    one_error_line,
    tiny_model,
    torch_threads_in_training,
    training_linear_dtypes,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from waiting import WatchedProcess, run_within, scaled

from bam_llama.cli.finetune import main
from bam_llama.data.documents import load_documents
from bam_llama.data.packing import collate_packed_rows, pack_documents
from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.training.checkpoints import resolve_checkpoint
from bam_llama.training.finetune import FinetuneArguments, finetune, prepare_model
from bam_llama.training.trainer import BamTrainer, training_arguments

TRAIN_LENGTH, TARGET_LENGTH = 32, 64
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def save_base_model(folder: Path, **overrides) -> Path:
    model = tiny_model("sdpa", vocab_size=259, train_context_length=TRAIN_LENGTH, **overrides)
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


def write_documents(path: Path, count: int = 60, seed: int = 0) -> Path:
    """Short repetitive documents (a key repeated around filler) that a tiny model learns in a few steps."""
    generator = random.Random(seed)
    documents = []
    for _ in range(count):
        key = generator.randint(100, 999)
        documents.append(f"key {key}. " + "abc " * generator.randint(3, 12) + f"key {key}.")
    path.write_text("\n\n".join(documents) + "\n")
    return path


def arguments(model: Path, data: Path, output_dir: Path, **overrides) -> FinetuneArguments:
    values = dict(
        model=str(model),
        data=str(data),
        output_dir=str(output_dir),
        context_length=TARGET_LENGTH,
        max_steps=12,
        save_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        prior_learning_rate=5e-2,
        lora_rank=4,
        eval_rows=4,
        logging_steps=100,
        disable_progress_bars=True,
    )
    values.update(overrides)
    return FinetuneArguments(**values)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    return {
        "base": save_base_model(root / "base"),
        "base_ssmax_layer": save_base_model(root / "base-ssmax-layer", ssmax=True, prior_scope="layer"),
        "data": write_documents(root / "documents.txt"),
        "root": root,
    }


@pytest.fixture(scope="module")
def lora_run(workspace):
    """LoRA with the prior (per layer) and SSMax scale in modules_to_save, merged at the end."""
    output_dir = workspace["root"] / "lora-run"
    args = arguments(workspace["base_ssmax_layer"], workspace["data"], output_dir, merge=True)
    return args, finetune(args)


# --------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------


def test_packing_restarts_positions_per_document_and_masks_document_starts():
    """Whole documents where they fit: the 6-token one is cut into 5 tokens and a piece opening on the 5th token
    (context, not a target), which fills the 3-token document's row."""
    rows = pack_documents([[1, 5, 6, 2], [1, 7, 2], [1, 8, 9, 10, 11, 2]], context_length=5, pad_token_id=0)
    assert [row["input_ids"] for row in rows] == [[1, 5, 6, 2, 0], [1, 7, 2, 11, 2], [1, 8, 9, 10, 11]]
    assert [row["position_ids"] for row in rows] == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert [row["labels"] for row in rows] == [
        [-100, 5, 6, 2, -100],
        [-100, 7, 2, -100, 2],
        [-100, 8, 9, 10, 11],
    ]
    batch = collate_packed_rows(rows)
    assert set(batch) == {"input_ids", "position_ids", "labels"}
    assert batch["input_ids"].shape == (3, 5) and batch["input_ids"].dtype == torch.long


def test_packed_rows_give_each_document_the_logits_it_has_alone():
    model = tiny_model("sdpa", vocab_size=259)
    documents = [[1, 40, 41, 42, 43, 2], [1, 50, 51, 52, 2], [1, 60, 61, 2]]
    rows = pack_documents(documents, context_length=16, pad_token_id=0)
    assert len(rows) == 1
    batch = collate_packed_rows(rows)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        start = 0
        for document in documents:
            alone = model(input_ids=torch.tensor([document])).logits[0]
            torch.testing.assert_close(packed[start : start + len(document)], alone, atol=1e-5, rtol=1e-5)
            start += len(document)


def test_documents_from_text_jsonl_folder_and_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    text = tmp_path / "corpus" / "a.txt"
    text.parent.mkdir()
    text.write_text("first document\nstill the first\n\n\nsecond document\n")
    (tmp_path / "corpus" / "b.jsonl").write_text('{"body": "third"}\n\n{"body": "fourth"}\n')
    assert load_documents(str(text)) == ["first document\nstill the first", "second document"]
    assert load_documents(str(tmp_path / "corpus" / "b.jsonl"), text_field="body") == ["third", "fourth"]
    with pytest.raises(ValueError, match="no field 'text'"):
        load_documents(str(tmp_path / "corpus" / "b.jsonl"))
    folder_documents = load_documents(str(tmp_path / "corpus"), text_field="body")
    assert folder_documents == ["first document\nstill the first", "second document", "third", "fourth"]

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x y", "", "z"]})}).save_to_disk(str(saved))
    assert load_documents(str(saved)) == ["x y", "z"]
    with pytest.raises(ValueError, match="no split 'validation'"):
        load_documents(str(saved), split="validation")


# --------------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------------


def test_empty_data_is_refused_naming_the_source(workspace, tmp_path):
    empty_file = tmp_path / "empty.txt"
    empty_file.write_text("\n\n  \n")
    with pytest.raises(ValueError, match=re.escape(str(empty_file))):
        finetune(arguments(workspace["base"], empty_file, tmp_path / "out"))
    empty_folder = tmp_path / "nothing"
    empty_folder.mkdir()
    with pytest.raises(ValueError, match=re.escape(str(empty_folder))):
        finetune(arguments(workspace["base"], empty_folder, tmp_path / "out"))
    assert not (tmp_path / "out" / "adapter").exists()


def test_context_length_below_the_training_length_is_refused(workspace, tmp_path):
    with pytest.raises(ValueError, match=rf"\(16\).*train_context_length={TRAIN_LENGTH}"):
        finetune(arguments(workspace["base"], workspace["data"], tmp_path / "out", context_length=16))


def test_a_llama_model_is_refused_with_the_conversion_command(workspace, tmp_path):
    llama_config = LlamaConfig(
        vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    LlamaForCausalLM(llama_config).save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match=r"'llama' model, not BamLlama.*bam-convert llama"):
        finetune(arguments(tmp_path / "llama", workspace["data"], tmp_path / "out"))


def test_a_missing_model_folder_is_named(workspace, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=f"no model folder at {re.escape(str(missing))}"):
        finetune(arguments(missing, workspace["data"], tmp_path / "out"))


def test_resume_latest_without_checkpoints_is_refused(tmp_path):
    args = FinetuneArguments(model="m", data="d", output_dir=str(tmp_path), context_length=64, resume_from_checkpoint="latest")
    with pytest.raises(ValueError, match="no checkpoint"):
        resolve_checkpoint(args)


# --------------------------------------------------------------------------------------------------------
# What trains
# --------------------------------------------------------------------------------------------------------


def trainable_names(model) -> set[str]:
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}


def test_lora_trains_adapters_and_the_prior_alpha_beta_only():
    model = prepare_model(tiny_model(vocab_size=259), FinetuneArguments("m", "d", "o", 64, lora_mlp=True))
    names = trainable_names(model)
    lora = {name for name in names if re.search(r"\.(q|k|v|o|gate|up|down)_proj\.lora_[AB]\.default\.weight$", name)}
    assert len(lora) == 2 * 7 * 2  # layers x projections x (A, B)
    assert names - lora == {
        "base_model.model.model.prior.modules_to_save.default.theta_alpha",
        "base_model.model.model.prior.modules_to_save.default.theta_beta",
    }


def test_lora_with_ssmax_and_layer_priors_trains_their_copies():
    model = prepare_model(
        tiny_model(vocab_size=259, ssmax=True, prior_scope="layer"), FinetuneArguments("m", "d", "o", 64)
    )
    non_lora = {name for name in trainable_names(model) if ".lora_" not in name}
    expected = {
        f"base_model.model.model.layers.{layer}.self_attn.{module}.modules_to_save.default.{parameter}"
        for layer in range(2)
        for module, parameter in (("prior", "theta_alpha"), ("prior", "theta_beta"), ("ssmax", "scale"))
    }
    assert non_lora == expected


def test_full_finetuning_trains_everything_but_theta_mu():
    model = prepare_model(tiny_model(vocab_size=259), FinetuneArguments("m", "d", "o", 64, lora=False))
    assert all(parameter.requires_grad for parameter in model.parameters())
    assert {name for name, _ in model.named_buffers()} == {"model.prior.theta_mu"}  # frozen: not a Parameter


def test_the_prior_gets_its_own_learning_rate_without_weight_decay(tmp_path):
    args = FinetuneArguments("m", "d", str(tmp_path), 64, learning_rate=1e-3, prior_learning_rate=0.07, weight_decay=0.1)
    model = prepare_model(tiny_model(vocab_size=259, ssmax=True), args)
    trainer = BamTrainer(model=model, args=training_arguments(args), prior_learning_rate=args.prior_learning_rate)
    groups = trainer.create_optimizer().param_groups
    prior_group = next(group for group in groups if group["lr"] == 0.07)
    assert prior_group["weight_decay"] == 0.0
    prior_ids = {id(parameter) for parameter in prior_group["params"]}
    named = dict(model.named_parameters())
    assert prior_ids == {
        id(named[f"base_model.model.model.{name}.modules_to_save.default.{parameter}"])
        for name, parameter in [("prior", "theta_alpha"), ("prior", "theta_beta")]
        + [(f"layers.{layer}.self_attn.ssmax", "scale") for layer in range(2)]
    }
    assert all(group["lr"] == 1e-3 for group in groups if group is not prior_group)


def test_ssmax_learning_rate_gives_exactly_the_scales_their_own_rate(workspace, tmp_path, monkeypatch):
    """--ssmax-learning-rate in a full fine-tune: the SSMax scales of every layer in a group of their own at that rate,
    the prior's thetas at --prior-learning-rate, every other weight at --learning-rate."""
    created = created_optimizers(monkeypatch)
    args = arguments(workspace["base_ssmax_layer"], workspace["data"], tmp_path / "out", lora=False,
                     prior_learning_rate=0.03, ssmax_learning_rate=0.3, max_steps=1, save_steps=1)
    finetune(args)
    model = AutoModelForCausalLM.from_pretrained(workspace["base_ssmax_layer"])  # the names the optimizer saw
    layers = range(model.config.num_hidden_layers)
    sizes = {}  # learning rate: the sizes of its parameters, over every group (with and without weight decay)
    for group in created[0].param_groups:
        sizes.setdefault(group["initial_lr"], []).extend(parameter.numel() for parameter in group["params"])
    heads = model.config.num_attention_heads
    assert sorted(sizes[0.3]) == [heads] * len(layers)  # one scale vector a layer, nothing else
    assert sorted(sizes[0.03]) == [heads] * (2 * len(layers))  # theta_alpha and theta_beta a layer
    weights = sum(parameter.numel() for name, parameter in model.named_parameters()
                  if ".prior." not in name and ".ssmax." not in name)
    assert sum(sizes[1e-2]) == weights


def test_a_t5_bucket_model_is_extended_whole_and_its_summary_names_each_head_s_largest_bucket_change(
        workspace, tmp_path, capsys):
    """The context extension of a model whose prior is T5's table of bucket biases (with SSMax): it ends, and the
    printed summary gives each head's largest bucket-bias change, read here from the saved weights."""
    base = save_base_model(tmp_path / "t5", prior_formula="t5_buckets", train_bucket_bias=True, ssmax=True,
                           prior_scope="layer")
    args = arguments(base, workspace["data"], tmp_path / "out", lora=False, max_steps=2, save_steps=2)
    finetune(args)
    printed = capsys.readouterr().out
    before, after = load_file(base / "model.safetensors"), load_file(tmp_path / "out" / "model" / "model.safetensors")
    for layer in range(2):
        name = f"model.layers.{layer}.self_attn.prior.bucket_bias"
        largest = (after[name].double() - before[name].double()).abs().amax(dim=1)  # (heads,)
        assert largest.min() > 0  # every head's table moved, so the figure below is not a zero by default
        section = printed.split(f"model.layers.{layer}.self_attn.prior\n")[1].split("model.layers")[0]
        shown = [float(value) for value in re.findall(r"bucket_bias largest change (\d+\.\d+)", section)]
        assert shown == pytest.approx(largest.tolist(), abs=6e-5), f"layer {layer}"


def test_ssmax_learning_rate_without_scalable_softmax_is_refused(workspace, tmp_path):
    with pytest.raises(ValueError, match=r"--ssmax-learning-rate: .* has no Scalable Softmax"):
        finetune(arguments(workspace["base"], workspace["data"], tmp_path / "out", ssmax_learning_rate=0.3))
    assert not (tmp_path / "out" / "adapter").exists()


# --------------------------------------------------------------------------------------------------------
# A LoRA run: loss, what changed, adapter and merge, resume
# --------------------------------------------------------------------------------------------------------


def test_lora_run_lowers_the_loss_and_writes_the_summary(lora_run):
    args, summary = lora_run
    assert summary.steps == 12 and summary.resumed_from_step == 0
    assert summary.loss_after < summary.loss_before - 0.2
    assert 12 * 4 * TARGET_LENGTH / 2 < summary.tokens_seen <= 12 * 4 * TARGET_LENGTH  # 12 batches of 4 rows, less padding
    assert summary.context_length == TARGET_LENGTH and summary.train_context_length_before == TRAIN_LENGTH
    written = json.loads((Path(args.output_dir) / "summary.json").read_text())
    assert written["loss_after"] == pytest.approx(summary.loss_after)
    assert set(written["prior_after"]) == {
        "model.layers.0.self_attn.prior", "model.layers.1.self_attn.prior",
        "model.layers.0.self_attn.ssmax", "model.layers.1.self_attn.ssmax",
    }
    table = summary.format_table()
    assert "tokens seen" in table and "head   3  theta_alpha" in table and "scale" in table
    # The packing's fill: byte tokens with <s> and </s>; each document over a row is two pieces sharing one token
    lengths = [len(text.encode()) + 2 for text in Path(args.data).read_text().strip().split("\n\n")]
    split = sum(length > TARGET_LENGTH for length in lengths)
    assert max(lengths) < 2 * TARGET_LENGTH and written["split_documents"] == split > 0
    rows = written["train_rows"] + written["eval_rows"]
    assert written["padding_share"] == pytest.approx(1 - (sum(lengths) + split) / (rows * TARGET_LENGTH))
    assert f"({split} longer than a row, cut)" in table and f"{summary.padding_share:.2%} padding" in table
    assert not any(name.startswith(".") for name in os.listdir(args.output_dir)), "staging folders left behind"


def test_lora_run_changes_only_the_adapted_weights_and_the_prior(lora_run, workspace):
    args, _ = lora_run
    base = load_file(workspace["base_ssmax_layer"] / "model.safetensors")
    merged = load_file(Path(args.output_dir) / "merged" / "model.safetensors")
    assert set(base) == set(merged)
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    expected = {f"model.layers.{layer}.self_attn.{target}.weight" for layer in range(2) for target in LORA_TARGETS}
    expected |= {
        f"model.layers.{layer}.self_attn.{name}"
        for layer in range(2)
        for name in ("prior.theta_alpha", "prior.theta_beta", "ssmax.scale")
    }
    assert changed == expected  # theta_mu, embeddings, MLP, norms and the head untouched


def test_adapter_reloads_and_merges_to_the_same_logits(lora_run, workspace):
    from peft import PeftModel

    args, _ = lora_run
    input_ids = torch.randint(3, 259, (2, 2 * TARGET_LENGTH), generator=torch.Generator().manual_seed(1))
    base = AutoModelForCausalLM.from_pretrained(workspace["base_ssmax_layer"]).eval()
    with torch.no_grad():
        base_logits = base(input_ids).logits
        adapted = PeftModel.from_pretrained(base, Path(args.output_dir) / "adapter").eval()
        adapter_logits = adapted(input_ids).logits
        merged = AutoModelForCausalLM.from_pretrained(Path(args.output_dir) / "merged").eval()
        merged_logits = merged(input_ids).logits
    assert not torch.allclose(base_logits, adapter_logits, atol=1e-3)
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-5, rtol=1e-5)
    assert merged.config.train_context_length == TARGET_LENGTH
    assert merged.config.base_model == str(workspace["base_ssmax_layer"])
    assert (Path(args.output_dir) / "merged" / "tokenizer.json").is_file()


def test_merged_model_gets_a_bam_card_naming_its_base(lora_run, workspace):
    from huggingface_hub import ModelCard

    args, _ = lora_run
    card = ModelCard.load(Path(args.output_dir) / "merged" / "README.md")
    assert card.data.library_name == "transformers" and "bam" in card.data.tags
    assert card.data.base_model is None  # a local path is named in the text, not in the Hub metadata
    assert f"Context extension of `{workspace['base_ssmax_layer']}` with `bam-finetune`" in card.text
    assert f"fine-tuned at {TARGET_LENGTH} tokens" in card.text


def resume_from_step(lora_run, output_dir: Path, step: int = 6, **overrides) -> FinetuneArguments:
    """The LoRA run's arguments, resuming in a fresh `output_dir` from a copy of its checkpoint-`step`."""
    args, _ = lora_run
    output_dir.mkdir()
    shutil.copytree(Path(args.output_dir) / f"checkpoint-{step}", output_dir / f"checkpoint-{step}")
    return arguments(
        Path(args.model), Path(args.data), output_dir, resume_from_checkpoint="latest", eval_rows=args.eval_rows,
        **overrides,
    )


def test_resume_continues_from_the_saved_step(lora_run, tmp_path):
    args, _ = lora_run
    output_dir = tmp_path / "resumed"
    summary = finetune(resume_from_step(lora_run, output_dir))
    assert summary.resumed_from_step == 6 and summary.steps == 12
    assert summary.tokens_seen == lora_run[1].tokens_seen  # restored from the checkpoint, then 6 more steps
    uninterrupted = load_file(Path(args.output_dir) / "adapter" / "adapter_model.safetensors")
    resumed = load_file(output_dir / "adapter" / "adapter_model.safetensors")
    assert set(resumed) == set(uninterrupted)
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------------------
# Full fine-tuning, CLI, DDP
# --------------------------------------------------------------------------------------------------------


def test_full_finetuning_with_gradient_checkpointing(workspace, tmp_path):
    args = arguments(
        workspace["base"], workspace["data"], tmp_path / "full", lora=False, learning_rate=3e-3, max_steps=8,
        save_steps=100, gradient_checkpointing=True,
    )
    summary = finetune(args)
    assert summary.mode == "full" and summary.loss_after < summary.loss_before
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "model")
    assert model.config.train_context_length == TARGET_LENGTH
    assert model.config.max_position_embeddings == 65536  # the declared length, unchanged: 64K > TARGET_LENGTH
    base = load_file(workspace["base"] / "model.safetensors")
    torch.testing.assert_close(model.model.prior.theta_mu.detach(), base["model.prior.theta_mu"], atol=0, rtol=0)
    assert not torch.equal(model.model.embed_tokens.weight.detach(), base["model.embed_tokens.weight"])
    assert "(full fine-tuning)" in (tmp_path / "full" / "model" / "README.md").read_text()


def test_cli_lora_with_reentrant_checkpointing_trains_as_without(workspace, tmp_path):
    """`--reentrant-checkpointing` (use_reentrant=True, as PEFT / QLoRA recipes pass) on the default global,
    trained prior: the Trainer takes the reentrant path and the run trains the adapters and the prior as the same
    run without checkpointing does."""
    reentrant = arguments(workspace["base"], workspace["data"], tmp_path / "reentrant", max_steps=3, save_steps=100,
                          reentrant_checkpointing=True)
    settings = vars(training_arguments(reentrant))  # 5.24 keeps gradient_* as an alias of activation_*
    kwargs = [value for name, value in settings.items() if name.endswith("checkpointing_kwargs")]
    assert kwargs and all(value == {"use_reentrant": True} for value in kwargs)
    flags = ["--model", reentrant.model, "--data", reentrant.data, "--context-length", str(TARGET_LENGTH), "--max-steps", "3",
             "--save-steps", "100", "--batch-size", "4", "--learning-rate", "1e-2", "--prior-learning-rate", "5e-2",
             "--lora-rank", "4", "--eval-rows", "4", "--disable-progress-bars"]
    assert main([*flags, "--output-dir", reentrant.output_dir, "--reentrant-checkpointing"]) == 0
    assert main([*flags, "--output-dir", str(tmp_path / "plain")]) == 0
    plain = load_file(tmp_path / "plain" / "adapter" / "adapter_model.safetensors")
    checkpointed = load_file(tmp_path / "reentrant" / "adapter" / "adapter_model.safetensors")
    assert checkpointed.keys() == plain.keys() and any("theta_alpha" in name for name in plain)
    for name, tensor in plain.items():
        torch.testing.assert_close(checkpointed[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_bf16_on_a_cpu_trains_the_prior_and_ssmax(tmp_path):
    """Transformers' own `Trainer(bf16=True)` (Accelerate's CPU bf16 autocast; Transformers asks for use_cpu
    without a GPU) on the default "sdpa" attention, trained prior and SSMax scale."""
    model = tiny_model("sdpa", ssmax=True).train()
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 97, (8, 24), generator=generator)]
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, max_steps=3, learning_rate=5e-2,
                             per_device_train_batch_size=4, save_strategy="no", report_to="none", logging_steps=1)
    with training_linear_dtypes() as dtypes:
        result = Trainer(model=model, args=args, train_dataset=rows).train()
    assert dtypes == {torch.bfloat16} and torch.isfinite(torch.tensor(result.training_loss))
    unchanged = [name for name, p in model.named_parameters() if name in before and torch.equal(p, before[name])]
    assert not unchanged
    assert {"model.prior.theta_alpha", "model.prior.theta_beta", "model.layers.0.self_attn.ssmax.scale"} <= before.keys()


def test_cli_bf16_on_a_cpu_trains_under_autocast(workspace, tmp_path):
    """`bam-finetune --bf16` without a GPU trains (LoRA and the prior) under the CPU's bf16 autocast."""
    flags = ["--model", str(workspace["base"]), "--data", str(workspace["data"]), "--output-dir", str(tmp_path / "run"),
             "--context-length", str(TARGET_LENGTH), "--max-steps", "3", "--save-steps", "100", "--batch-size", "4",
             "--learning-rate", "1e-2", "--lora-rank", "4", "--eval-rows", "4", "--disable-progress-bars", "--bf16"]
    with training_linear_dtypes() as dtypes:
        assert main(flags) == 0
    assert dtypes == {torch.bfloat16}
    adapter = load_file(tmp_path / "run" / "adapter" / "adapter_model.safetensors")
    base = load_file(workspace["base"] / "model.safetensors")
    alpha = next(tensor for name, tensor in adapter.items() if name.endswith("prior.theta_alpha"))
    assert not torch.equal(alpha, base["model.prior.theta_alpha"])


def test_cli_threads_set_torchs_threads_for_the_run(workspace, tmp_path, monkeypatch):
    flags = ["--model", str(workspace["base"]), "--data", str(workspace["data"]), "--context-length", str(TARGET_LENGTH),
             "--max-steps", "1", "--save-steps", "100", "--batch-size", "4", "--lora-rank", "4", "--eval-rows", "4",
             "--disable-progress-bars"]
    with torch_threads_in_training(monkeypatch) as threads:
        assert main([*flags, "--output-dir", str(tmp_path / "default")]) == 0
    assert threads == {1}  # on a CPU without OMP_NUM_THREADS
    with torch_threads_in_training(monkeypatch) as threads:
        assert main([*flags, "--output-dir", str(tmp_path / "two"), "--threads", "2"]) == 0
    assert threads == {2}


def test_cli_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--context-length", "--full", "--lora-mlp", "--prior-learning-rate", "--resume-from-checkpoint", "--merge"):
        assert option in text


def test_cli_reports_bad_input_without_a_traceback(workspace, tmp_path, capsys):
    argv = ["--model", str(workspace["base"]), "--data", str(workspace["data"]), "--output-dir", str(tmp_path)]
    assert main(argv + ["--context-length", "8"]) == 2
    assert f"below the length the model was trained at (train_context_length={TRAIN_LENGTH})" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, value",
    [
        ("--context-length", "0"), ("--context-length", "-128"), ("--lora-rank", "0"), ("--lora-alpha", "-1"),
        ("--lora-dropout", "1.5"), ("--learning-rate", "0"), ("--prior-learning-rate", "nan"),
        ("--weight-decay", "-0.1"), ("--warmup-steps", "-1"), ("--batch-size", "0"), ("--num-train-epochs", "0"),
        ("--gradient-accumulation-steps", "0"), ("--save-steps", "0"), ("--save-total-limit", "0"),
        ("--logging-steps", "x"), ("--eval-rows", "0"),
    ],
)
def test_a_bad_number_is_one_line_naming_the_option_before_anything_loads(tmp_path, capsys, option, value):
    """The model path does not exist: the argument check must come first."""
    argv = ["--model", str(tmp_path / "missing"), "--data", str(tmp_path / "missing.txt"),
            "--output-dir", str(tmp_path / "out"), "--context-length", "64", option, value]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert option in error and "Traceback" not in error
    assert not (tmp_path / "out").exists()


def test_ddp_on_two_cpu_processes(workspace, tmp_path):
    output_dir = tmp_path / "ddp"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "bam_llama.cli.finetune",
        "--model", str(workspace["base"]), "--data", str(workspace["data"]), "--output-dir", str(output_dir),
        "--context-length", str(TARGET_LENGTH), "--max-steps", "4", "--batch-size", "2", "--save-steps", "2",
        "--learning-rate", "1e-2", "--lora-rank", "4", "--merge", "--disable-progress-bars",
    ]
    environment = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    result = run_within(command, 600, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bam-finetune: rank 0 of 2 finished" in result.stdout
    assert "bam-finetune: rank 1 of 2 finished" in result.stdout
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    # Both ranks' batches are counted: more tokens than one process could have seen.
    assert summary["tokens_seen"] > 4 * 2 * TARGET_LENGTH
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    merged = AutoModelForCausalLM.from_pretrained(output_dir / "merged")
    assert merged.config.train_context_length == TARGET_LENGTH
    with torch.no_grad():
        assert torch.isfinite(merged(torch.tensor([[1, 40, 41, 42]])).logits).all()

    # The same command again: every rank refuses the finished run's folder (none waits for a rank that quit)
    again = run_within(command, 600, env=environment)
    assert again.returncode != 0
    assert f"bam-finetune: error: {output_dir} holds the results of an earlier run" in again.stderr, again.stderr[-3000:]
    assert json.loads((output_dir / "summary.json").read_text()) == summary


# --------------------------------------------------------------------------------------------------------
# Interruptions, bad data, stale outputs
# --------------------------------------------------------------------------------------------------------


def write_checkpoint_state(folder: Path, step: int) -> None:
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def test_resume_latest_skips_incomplete_checkpoints_and_says_so(tmp_path, caplog):
    write_checkpoint_state(tmp_path / "checkpoint-6", 6)
    write_checkpoint_state(tmp_path / "checkpoint-9", 9)
    (tmp_path / "checkpoint-9" / "trainer_state.json").write_text('{"global_st')  # cut off while written
    (tmp_path / "checkpoint-12").mkdir()  # interrupted before its trainer_state.json
    args = FinetuneArguments(model="m", data="d", output_dir=str(tmp_path), context_length=64, resume_from_checkpoint="latest")
    assert resolve_checkpoint(args) == str(tmp_path / "checkpoint-6")
    assert "checkpoint-12: it is incomplete" in caplog.text and "checkpoint-9: it is incomplete" in caplog.text
    shutil.rmtree(tmp_path / "checkpoint-6")
    with pytest.raises(ValueError, match=r"only incomplete checkpoints \(checkpoint-12, checkpoint-9\)"):
        resolve_checkpoint(args)
    args.resume_from_checkpoint = str(tmp_path / "checkpoint-12")
    with pytest.raises(ValueError, match="checkpoint-12 is incomplete"):
        resolve_checkpoint(args)


# Runs bam-finetune with the second checkpoint save stopped half-way (weights written into its staging folder, no
# trainer_state.json): it prints "saving" and waits there for the test's SIGINT (KeyboardInterrupt from the sleep),
# at most the seconds it is given (WAIT_SECONDS twice, at the machine's load: only if the test never signals).
FINETUNE_INTERRUPTED_WHILE_SAVING = """
import sys, time
from transformers import Trainer
from bam_llama.cli import finetune as finetune_cli

save_rng_state, saves = Trainer._save_rng_state, []

def save_rng_state_then_wait(self, output_dir):
    saves.append(output_dir)
    if len(saves) == 2:
        print("saving", flush=True)
        deadline = time.monotonic() + float(sys.argv[1])
        while time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit("no SIGINT came while saving")
    return save_rng_state(self, output_dir)

Trainer._save_rng_state = save_rng_state_then_wait
sys.exit(finetune_cli.main(sys.argv[2:]))
"""
WAIT_SECONDS = 300


def test_ctrl_c_while_saving_a_checkpoint_then_resume_latest(workspace, tmp_path, capsys):
    """The child stops inside its second checkpoint save and waits for SIGINT. Meanwhile a second bam-finetune
    into the same folder is refused, naming the running one. The interrupt is one line and status 130, and leaves
    no checkpoint-4 (it was staged), nor its staging folder; `latest` resumes from checkpoint-2."""
    output_dir = tmp_path / "out"
    (tmp_path / "finetune.py").write_text(FINETUNE_INTERRUPTED_WHILE_SAVING)
    options = [
        "--model", str(workspace["base"]), "--data", str(workspace["data"]), "--output-dir", str(output_dir),
        "--context-length", str(TARGET_LENGTH), "--max-steps", "6", "--save-steps", "2", "--batch-size", "4",
        "--lora-rank", "4", "--eval-rows", "4", "--disable-progress-bars",
    ]
    environment = checkout_environment(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    command = [sys.executable, str(tmp_path / "finetune.py"), str(scaled(2 * WAIT_SECONDS)), *options]
    child = WatchedProcess(command, env=environment, preexec_fn=default_sigint)
    try:
        child.wait_for_line("saving", WAIT_SECONDS)
        capsys.readouterr()
        assert main(options) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"bam-finetune: error: {output_dir} is in use by another run (bam-finetune, pid "
                                f"{child.process.pid} on "), error
        assert "\n" not in error
    finally:
        child.process.send_signal(signal.SIGINT)
    assert child.wait(120, "its exit after SIGINT") == 130, child.error_output()  # the signal, not its own deadline (exit 1)
    last_line = child.error_output().strip().splitlines()[-1]
    assert last_line.startswith("bam-finetune: interrupted") and "Traceback" not in child.error_output()
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-2"]

    summary = finetune(arguments(workspace["base"], workspace["data"], output_dir, max_steps=6, save_steps=2,
                                 resume_from_checkpoint="latest"))
    assert summary.resumed_from_step == 2 and summary.steps == 6


def test_a_new_run_over_earlier_results_is_refused_unless_asked_to_overwrite(workspace, tmp_path, capsys):
    """A finished run's folder: a second run without --resume-from-checkpoint / --overwrite-output-dir is refused
    before anything loads (the model path does not even exist here); with --overwrite-output-dir and bad input,
    nothing is deleted; with --overwrite-output-dir, the earlier results are replaced, never mixed."""
    output_dir = tmp_path / "out"
    (output_dir / "checkpoint-6").mkdir(parents=True)
    (output_dir / "checkpoint-6" / "trainer_state.json").write_text(json.dumps({"global_step": 6}))
    (output_dir / "adapter").mkdir()
    (output_dir / "summary.json").write_text('{"earlier": true}')
    argv = ["--data", str(workspace["data"]), "--output-dir", str(output_dir), "--context-length", str(TARGET_LENGTH),
            "--max-steps", "2", "--save-steps", "2", "--batch-size", "4", "--lora-rank", "4", "--eval-rows", "4",
            "--disable-progress-bars"]
    before = sorted(os.listdir(output_dir))
    assert main(["--model", str(tmp_path / "missing"), *argv]) == 2
    error = capsys.readouterr().err.strip()
    assert error == (f"bam-finetune: error: {output_dir} holds the results of an earlier run (adapter, checkpoint-6, "
                     "summary.json): pass --resume-from-checkpoint latest to continue that run, --overwrite-output-dir "
                     "to replace them, or choose another --output-dir")
    assert main(["--model", str(tmp_path / "missing"), "--overwrite-output-dir", *argv]) == 2
    assert "missing" in capsys.readouterr().err and sorted(os.listdir(output_dir)) == before

    assert main(["--model", str(workspace["base"]), "--overwrite-output-dir", *argv]) == 0
    assert sorted(os.listdir(output_dir)) == ["adapter", "checkpoint-2", "summary.json"]
    assert json.loads((output_dir / "summary.json").read_text())["steps"] == 2


def test_a_run_resumed_from_its_last_checkpoint_trains_nothing_more(lora_run, tmp_path):
    """Stopped after checkpoint-12 of 12 steps (before its summary): resumed, it ends at step 12 with the adapter
    the uninterrupted run saved. Transformers' Trainer alone would train a 13th step."""
    args, uninterrupted_summary = lora_run
    output_dir = tmp_path / "resumed"
    summary = finetune(resume_from_step(lora_run, output_dir, step=12))
    assert summary.resumed_from_step == 12 and summary.steps == 12
    assert summary.tokens_seen == uninterrupted_summary.tokens_seen
    assert summary.loss_after == pytest.approx(uninterrupted_summary.loss_after, abs=1e-6)
    uninterrupted = load_file(Path(args.output_dir) / "adapter" / "adapter_model.safetensors")
    resumed = load_file(output_dir / "adapter" / "adapter_model.safetensors")
    assert set(resumed) == set(uninterrupted)
    for name in uninterrupted:
        assert torch.equal(resumed[name], uninterrupted[name]), name


def test_a_resumed_run_whose_checkpoint_is_rotated_away_still_writes_its_summary(lora_run, tmp_path):
    output_dir = tmp_path / "resumed"
    summary = finetune(resume_from_step(lora_run, output_dir, save_total_limit=1))
    assert not (output_dir / "checkpoint-6").exists()  # rotated away by checkpoint-12
    assert summary.resumed_from_step == 6
    assert json.loads((output_dir / "summary.json").read_text())["resumed_from_step"] == 6


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "ok"', "is not valid JSON"),
        ('{"text": null}', "field 'text' is null"),
        ('{"text": 12345}', "field 'text' is int"),
        ('{"text": ["a", "b"]}', "field 'text' is list"),
    ],
)
def test_a_bad_jsonl_line_is_named_with_file_and_line(tmp_path, line, message):
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "first document"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3") + ".*" + re.escape(message)):
        load_documents(str(path))


def test_a_non_text_dataset_value_is_named_with_its_row(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"text": "fine"}, {"text": 7}]))
    with pytest.raises(ValueError, match=r"data.json row 1: field 'text' is int"):
        load_documents(str(path))


@pytest.mark.parametrize("data", ["./missing.txt", "missing.jsonl", "no/such/folder", "{tmp}/data.json"])
def test_a_mistyped_local_data_path_is_named_without_asking_the_hub(workspace, tmp_path, capsys, data):
    data = data.format(tmp=tmp_path)
    argv = ["--model", str(workspace["base"]), "--data", data, "--output-dir", str(tmp_path / "out"), "--context-length", "64"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"bam-finetune: error: no training data at {data} (the file or folder does not exist)"


def test_a_stale_merged_model_is_refused_before_training(workspace, tmp_path):
    """Resuming without --merge would leave the earlier merged/ beside the new adapter."""
    (tmp_path / "out" / "merged").mkdir(parents=True)
    write_checkpoint_state(tmp_path / "out" / "checkpoint-6", 6)
    with pytest.raises(ValueError, match=r"merged holds a merged model from an earlier run.*--merge"):
        finetune(arguments(workspace["base"], workspace["data"], tmp_path / "out", resume_from_checkpoint="latest"))
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["checkpoint-6", "merged"]


@pytest.mark.parametrize("name", ["notes.txt", "records.jsonl"])
def test_a_binary_file_in_a_data_folder_is_named(workspace, tmp_path, capsys, name):
    """A data folder with a non-UTF-8 file: the error names the file and line (as the JSON-lines errors do), one
    line, exit 2. Before: "'utf-8' codec can't decode byte 0xd0 in position 24", naming neither."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("a fine first document\n\nand a second one\n")
    binary = folder / name
    binary.write_bytes(b'{"text": "fine"}\n{"text": "x"}\n\xd0\xcf\x11\xe0 binary \x00\xff')
    with pytest.raises(ValueError, match=re.escape(f"{binary}:3 is not UTF-8 text (byte 0xd0 at offset 31)")):
        load_documents(str(folder))
    argv = ["--model", str(workspace["base"]), "--data", str(folder), "--output-dir", str(tmp_path / "out"),
            "--context-length", str(TARGET_LENGTH)]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"bam-finetune: error: {binary}:3 is not UTF-8 text") and "\n" not in error
    assert not (tmp_path / "out").exists()


def test_full_fine_tuning_with_merge_is_refused_before_anything_loads(tmp_path, capsys):
    """--merge merges a LoRA adapter: with --full it would be ignored, so it is refused (the model path does not even
    exist here)."""
    argv = ["--model", str(tmp_path / "missing"), "--data", str(tmp_path / "missing.txt"), "--output-dir",
            str(tmp_path / "out"), "--context-length", "64", "--full", "--merge"]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err, "bam-finetune")
    assert "--merge" in line and "--full" in line
    assert not (tmp_path / "out").exists()


def test_a_base_model_whose_weights_are_not_finite_is_refused(workspace, tmp_path, capsys):
    base = Path(shutil.copytree(workspace["base"], tmp_path / "base"))
    weights = load_file(base / "model.safetensors")
    weights["model.prior.theta_beta"][0] = float("nan")
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    argv = ["--model", str(base), "--data", str(workspace["data"]), "--output-dir", str(tmp_path / "out"),
            "--context-length", str(TARGET_LENGTH), "--max-steps", "2", "--disable-progress-bars"]
    assert main(argv) == 2
    line = one_error_line(capsys.readouterr().err, "bam-finetune")
    assert f"model.prior.theta_beta in {base}" in line
    assert not (tmp_path / "out").exists()
