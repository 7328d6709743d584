"""bam-pretrain on tiny configs: every positional choice trains, saves a folder that reloads with the same logits,
keeps fixed priors exactly fixed, resumes from the latest checkpoint; bad arguments stop before any data loads."""

import json
import logging
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
    disk_full_after_half,
    one_error_line,
    snapshot,
    tiny_model,
    torch_threads_in_training,
    training_linear_dtypes,
)
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)
from waiting import WatchedProcess, run_within, scaled

from bam_llama import BamLlamaForCausalLM
from bam_llama.baselines.ssmax_models import LlamaSsmaxForCausalLM, MistralSsmaxForCausalLM
from bam_llama.cli.pretrain import main
from bam_llama.data.packing import collate_packed_rows, pack_documents
from bam_llama.data.tokenizers import train_bpe_tokenizer
from bam_llama.training.output_hold import hold_output_dir
from bam_llama.training.pretrain import PretrainArguments, run_pretraining

CONTEXT_LENGTH = 64
TINY_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def write_documents(path: Path, count: int = 80, seed: int = 0) -> Path:
    generator = random.Random(seed)
    documents = []
    for _ in range(count):
        key = generator.randint(100, 999)
        documents.append(f"key {key}. " + "abc " * generator.randint(3, 12) + f"key {key}.")
    path.write_text("\n\n".join(documents) + "\n")
    return path


def arguments(data: Path, output_dir: Path, **overrides) -> PretrainArguments:
    values = dict(
        data=str(data),
        output_dir=str(output_dir),
        context_length=CONTEXT_LENGTH,
        max_steps=12,
        save_steps=6,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        eval_rows=4,
        logging_steps=100,
        disable_progress_bars=True,
        **TINY_SIZES,
    )
    values.update(overrides)
    return PretrainArguments(**values)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("pretrain-data") / "documents.txt")


def reloaded_logits_match(model, folder: Path) -> torch.nn.Module:
    """Reload `folder` with the Auto classes and check its logits equal the trained model's on a packed batch."""
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = [tokenizer("key 123. abc abc key 123.")["input_ids"], tokenizer("key 9. abc")["input_ids"]]
    batch = collate_packed_rows(pack_documents(ids, CONTEXT_LENGTH, 0))
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        actual = reloaded(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    return reloaded


def prior_of(model) -> dict[str, torch.Tensor]:
    return {name: getattr(model.model.prior, name).detach().clone() for name in ("theta_alpha", "theta_beta", "theta_mu")}


TRANSFORMERS_MODELS = {
    ("rope", False): (LlamaForCausalLM, "llama"), ("rope-local", False): (MistralForCausalLM, "mistral"),
    ("rope", True): (LlamaSsmaxForCausalLM, "llama_ssmax"), ("rope-local", True): (MistralSsmaxForCausalLM, "mistral_ssmax"),
}


@pytest.mark.parametrize(
    "positional,ssmax",
    [("bam", False), ("bam", True), ("alibi", False), ("nope", False), ("rope", False), ("rope-local", False),
     ("rope", True), ("rope-local", True), ("sinusoidal", True)],
)
def test_each_positional_choice_learns_and_saves_a_folder_that_reloads(data, tmp_path, positional, ssmax):
    args = arguments(data, tmp_path / "run", positional=positional, ssmax=ssmax)
    summary, model, _ = run_pretraining(args)
    assert summary.steps == 12
    assert summary.loss_after < summary.loss_before - 1.0, (summary.loss_before, summary.loss_after)
    lengths = [len(text.encode()) + 2 for text in data.read_text().strip().split("\n\n")]  # bytes, <s> and </s>
    assert summary.split_documents == sum(length > CONTEXT_LENGTH for length in lengths) and 0 < summary.padding_share < 1
    folder = tmp_path / "run" / "model"
    config = json.loads((folder / "config.json").read_text())
    assert config["train_context_length"] == CONTEXT_LENGTH
    assert config["hidden_size"] == 32 and config["num_hidden_layers"] == 2 and config["tie_word_embeddings"] is False
    reloaded = reloaded_logits_match(model, folder)
    heads = TINY_SIZES["num_attention_heads"]
    if positional in ("rope", "rope-local"):  # Transformers' Llama / Mistral, with SSMax their llama_ssmax / mistral_ssmax
        model_class, model_type = TRANSFORMERS_MODELS[positional, ssmax]
        assert type(reloaded) is model_class and config["model_type"] == model_type
        assert config["rope_parameters"]["rope_theta"] == 500_000  # the reference's RoPE baselines
        assert config.get("sliding_window") == (CONTEXT_LENGTH if positional == "rope-local" else None)
        if ssmax:  # the scales trained from 1, saved and loaded back
            scales = [layer.self_attn.ssmax.scale.detach() for layer in model.model.layers]
            assert all(not torch.equal(scale, torch.ones(heads)) for scale in scales)
            assert all(torch.equal(layer.self_attn.ssmax.scale, scale) for layer, scale in zip(reloaded.model.layers, scales))
        return
    assert config["model_type"] == "bam_llama" and config["ssmax"] is ssmax
    prior = prior_of(model)
    assert torch.equal(prior["theta_mu"], torch.zeros(heads))  # mu frozen at 0 in every BamLlama choice
    if positional == "bam":
        assert prior["theta_alpha"].abs().min() > 0 and prior["theta_beta"].abs().min() > 0  # trained from 0
    if positional == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (head + 1) / heads) for head in range(heads)])
        assert torch.equal(prior["theta_alpha"], slopes.log())
        assert torch.equal(prior["theta_beta"], torch.ones(heads))
    assert config.get("absolute_positions") == ("sinusoidal" if positional == "sinusoidal" else None)
    if positional in ("nope", "sinusoidal"):
        assert torch.equal(prior["theta_alpha"], torch.zeros(heads)) and torch.equal(prior["theta_beta"], torch.zeros(heads))


def test_nope_prior_is_the_same_bias_at_every_distance():
    """NoPE's flat prior (theta_beta = 0) adds one constant to every logit of a query row, which softmax ignores:
    its size (theta_alpha) cannot change the output, while any slope (theta_beta != 0) does."""
    model = tiny_model("sdpa", vocab_size=64).eval()
    ids = torch.tensor([[1, 5, 9, 7, 3, 8, 4, 6]])
    with torch.no_grad():
        model.model.prior.theta_alpha.zero_()
        model.model.prior.theta_beta.zero_()
        flat = model(input_ids=ids).logits
        model.model.prior.theta_alpha.fill_(1.5)
        flat_larger = model(input_ids=ids).logits
        model.model.prior.theta_beta.fill_(0.5)
        sloped = model(input_ids=ids).logits
    torch.testing.assert_close(flat_larger, flat, atol=1e-5, rtol=1e-5)
    assert (sloped - flat).abs().max() > 1e-3


def test_resume_from_latest_continues_to_the_same_weights(data, tmp_path):
    common = dict(lr_scheduler_type="constant", positional="bam")
    _, straight, _ = run_pretraining(arguments(data, tmp_path / "straight", **common))
    run_pretraining(arguments(data, tmp_path / "resumed", max_steps=6, **common))
    summary, resumed, _ = run_pretraining(
        arguments(data, tmp_path / "resumed", resume_from_checkpoint="latest", **common)
    )
    assert summary.resumed_from_step == 6 and summary.steps == 12
    for (name, expected), actual in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-4, msg=name)
    # A restart from scratch would also reach those weights: shift a weight in a copy of checkpoint-6 and the
    # resumed run must end with the shift.
    shifted = tmp_path / "shifted" / "checkpoint-6"
    shutil.copytree(tmp_path / "resumed" / "checkpoint-6", shifted)
    weights = load_file(shifted / "model.safetensors")
    weights["model.norm.weight"] += 0.5
    save_file(weights, shifted / "model.safetensors", metadata={"format": "pt"})
    _, continued, _ = run_pretraining(arguments(data, tmp_path / "shifted", resume_from_checkpoint="latest", **common))
    shift = continued.model.norm.weight.detach() - straight.model.norm.weight.detach()
    assert shift.min() > 0.3, shift


def test_rope_llama_masks_packed_documents_like_bam():
    """Packed rows (positions restarting, no attention_mask) give each document the logits it has alone, for the
    RoPE baseline (Transformers' packed-sequence detection, training mode: no cache) as for BamLlama."""
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, max_position_embeddings=32, **TINY_SIZES)).eval()
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, sliding_window=16, num_key_value_heads=4, **TINY_SIZES)).eval()  # rope-local
    bam = tiny_model("sdpa", vocab_size=64).eval()
    documents = [[1, 40, 41, 42, 43, 2], [1, 50, 51, 52, 2], [1, 60, 61, 2]]
    batch = collate_packed_rows(pack_documents(documents, context_length=16, pad_token_id=0))
    for model in (llama, mistral, bam):
        with torch.no_grad():
            packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
            start = 0
            for document in documents:
                alone = model(input_ids=torch.tensor([document]), use_cache=False).logits[0]
                torch.testing.assert_close(packed[start : start + len(document)], alone, atol=1e-5, rtol=1e-5)
                start += len(document)


def test_bpe_tokenizer_splits_digits_one_per_token_and_round_trips():
    documents = ["The pass key is 12345. Remember it."] * 20 + ["def function(argument): return argument + 1"] * 20
    tokenizer = train_bpe_tokenizer(documents, vocab_size=300)
    assert len(tokenizer) == 300
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "The pass key is 98765.\n  é"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    pieces = [tokenizer.decode([token]) for token in ids]
    assert [piece for piece in pieces if any(character.isdigit() for character in piece)] == list("98765")
    assert len(ids) < len(text.encode())  # merges were learned


@pytest.mark.parametrize("positional", ["bam", "alibi"])
def test_a_prior_per_layer_trains_each_layer_apart_or_stays_fixed(data, tmp_path, positional):
    """--prior-scope layer: one prior per layer and head (none shared); bam trains each layer's own way, alibi keeps
    every layer at ALiBi's slopes."""
    args = arguments(data, tmp_path / "run", positional=positional, prior_scope="layer")
    summary, model, _ = run_pretraining(args)
    assert summary.loss_after < summary.loss_before - 1.0
    assert model.model.prior is None
    layers = [layer.self_attn.prior for layer in model.model.layers]
    heads = TINY_SIZES["num_attention_heads"]
    if positional == "bam":
        assert all(prior.theta_beta.abs().min() > 0 for prior in layers)
        assert not torch.equal(layers[0].theta_beta, layers[1].theta_beta)  # not one prior seen twice
    else:
        slopes = torch.tensor([2.0 ** (-8.0 * (head + 1) / heads) for head in range(heads)])
        for prior in layers:
            assert torch.equal(prior.theta_alpha.detach(), slopes.log()) and torch.equal(prior.theta_beta.detach(), torch.ones(heads))
    config = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert config["prior_scope"] == "layer"
    reloaded_logits_match(model, tmp_path / "run" / "model")


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--positional", "no-such-encoding"], "--positional"),
        (["--preset", "l99"], "--preset"),
        (["--positional", "rope", "--ssmax", "--no-ssmax-prior"], "--ssmax-prior"),  # no prior to order with
        (["--positional", "rope-local", "--ssmax", "--attn-implementation", "flash_attention_2"], "--attn-implementation"),
        (["--no-ssmax-prior"], "--ssmax-prior"),  # a Scalable Softmax setting without --ssmax
        (["--ssmax-scale-init", "0.2"], "--ssmax-scale-init"),
        (["--ssmax-learning-rate", "0.1"], "--ssmax-learning-rate"),
        (["--ssmax", "--ssmax-scale-init", "nan"], "--ssmax-scale-init"),
        (["--positional", "rope", "--prior-scope", "layer"], "--prior-scope"),
        (["--prior-scope", "head"], "--prior-scope"),
        (["--hidden-size", "30", "--heads", "4"], "--hidden-size"),
        (["--heads", "4", "--kv-heads", "3", "--hidden-size", "32"], "--kv-heads"),
        (["--positional", "rope", "--hidden-size", "36", "--heads", "4"], "head size"),
        (["--positional", "rope", "--attn-implementation", "bam_triton"], "--attn-implementation"),
        (["--rope-theta", "10000"], "--rope-theta"),  # bam has no rotary embedding
        (["--positional", "rope", "--rope-theta", "0"], "--rope-theta"),
        (["--tokenizer", "./no-such-tokenizer"], "--tokenizer"),
        (["--tokenizer", "TOKENIZER_DIR"], "--tokenizer"),
        (["--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size"),
        (["--report-to", "no-such-tracker"], "--report-to"),
        (["--context-length", "0"], "--context-length"),
        (["--layers", "-2"], "--layers"),
        (["--resume-from-checkpoint", "latest"], "--resume-from-checkpoint"),
        (["--fsdp"], "--fsdp"),  # on CPU Accelerate would silently fall back to DDP
        (["--deepspeed", "zero3", "--sp-size", "2"], "--sp-size"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_before_any_data_loads(tmp_path, capsys, argv, named):
    missing_data = tmp_path / "no-such-data.txt"  # reaching the data would report this file instead
    (tmp_path / "empty-folder").mkdir()
    argv = [str(tmp_path / "empty-folder") if value == "TOKENIZER_DIR" else value for value in argv]
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["--data", str(missing_data), "--output-dir", str(tmp_path / "out"), *argv]))
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and named in errors[0] and "no-such-data" not in errors[0], errors
    assert not (tmp_path / "out" / "model").exists()


def test_bf16_on_a_cpu_trains_the_prior_under_autocast(data, tmp_path):
    """`--bf16` without a GPU: Accelerate's CPU bf16 autocast (the GPU default, run on the CPU) on the default
    "sdpa" attention, whose prior and SSMax scale train through BAM's own backward."""
    argv = ["--data", str(data), "--output-dir", str(tmp_path / "run"), "--context-length", str(CONTEXT_LENGTH),
            "--max-steps", "3", "--save-steps", "100", "--per-device-train-batch-size", "4", "--eval-rows", "4",
            "--hidden-size", "32", "--layers", "2", "--heads", "4", "--intermediate-size", "64", "--ssmax",
            "--disable-progress-bars", "--bf16"]
    with training_linear_dtypes() as dtypes:
        assert main(argv) == 0
    assert dtypes == {torch.bfloat16}
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model")
    assert trained.model.prior.theta_alpha.abs().min() > 0 and trained.model.prior.theta_beta.abs().min() > 0
    assert not torch.equal(trained.model.layers[0].self_attn.ssmax.scale, torch.ones(4))  # trained from 1


def test_ddp_on_two_cpu_processes_with_a_bpe_trained_once(data, tmp_path):
    output_dir = tmp_path / "ddp"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "bam_llama.cli.pretrain", "--data", str(data), "--output-dir", str(output_dir),
        "--context-length", str(CONTEXT_LENGTH), "--hidden-size", "32", "--layers", "2", "--heads", "4",
        "--tokenizer", "bpe", "--vocab-size", "300", "--max-steps", "4", "--batch-size", "2", "--save-steps", "4",
        "--disable-progress-bars",
    ]
    environment = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    result = run_within(command, 600, env=environment)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "bam-pretrain: rank 0 of 2 finished" in result.stdout and "bam-pretrain: rank 1 of 2 finished" in result.stdout
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert summary["tokens_seen"] > 4 * 2 * CONTEXT_LENGTH  # both ranks' batches
    trained = json.loads((output_dir / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    saved = json.loads((output_dir / "model" / "tokenizer.json").read_text())["model"]["vocab"]
    assert trained == saved and 259 < len(saved) == summary["vocab_size"] <= 300  # the tiny data has few merges


def test_an_earlier_run_is_kept_unless_overwritten_and_a_held_folder_is_refused(data, tmp_path, capsys):
    output_dir = tmp_path / "run"
    run_pretraining(arguments(data, output_dir, max_steps=2, save_steps=2))
    weights = (output_dir / "model" / "model.safetensors").read_bytes()
    argv = ["--data", str(data), "--output-dir", str(output_dir), "--context-length", str(CONTEXT_LENGTH),
            "--hidden-size", "32", "--layers", "1", "--heads", "4", "--max-steps", "1", "--disable-progress-bars"]

    assert main(argv) == 2  # a new run over the earlier one's results
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and str(output_dir) in errors[0] and "--overwrite-output-dir" in errors[0], errors
    assert (output_dir / "model" / "model.safetensors").read_bytes() == weights

    with hold_output_dir(output_dir, "another run"):  # a live run holds the folder
        assert main([*argv, "--overwrite-output-dir"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "another run" in errors[0], errors
    assert (output_dir / "model" / "model.safetensors").read_bytes() == weights

    assert main([*argv, "--overwrite-output-dir"]) == 0
    assert (output_dir / "model" / "model.safetensors").read_bytes() != weights
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-1"]


def test_prior_scope_choices_are_the_configs():
    from bam_llama.model.configuration_bam import PRIOR_SCOPES
    from bam_llama.training import arguments

    assert arguments.PRIOR_SCOPES == PRIOR_SCOPES


@pytest.mark.parametrize("theta", [None, 1000.0])
def test_rope_theta_reaches_the_rotary_frequencies(tmp_path, theta):
    from bam_llama.training.pretrain import build_config

    args = arguments(tmp_path / "data.txt", tmp_path / "run", positional="rope", rope_theta=theta)
    config = build_config(args, vocab_size=300, token_ids={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    model = LlamaForCausalLM(config)
    head_dim = TINY_SIZES["hidden_size"] // TINY_SIZES["num_attention_heads"]
    base = 500_000.0 if theta is None else theta
    expected = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.double(), expected, rtol=1e-6, atol=0)


def test_rope_local_sees_exactly_the_last_context_length_tokens(tmp_path):
    """One layer, so a logit depends on the tokens its query attends to and no others: at a length 3x the training
    length, the last position moves with a token CONTEXT_LENGTH - 1 back and not with one CONTEXT_LENGTH back."""
    from bam_llama.training.pretrain import build_config, build_model

    sizes = {**TINY_SIZES, "num_hidden_layers": 1}
    args = arguments(tmp_path / "data.txt", tmp_path / "run", positional="rope-local", **sizes)
    torch.manual_seed(0)
    model = build_model(args, build_config(args, vocab_size=64, token_ids={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})).eval()
    length = 3 * CONTEXT_LENGTH
    tokens = torch.randint(3, 64, (1, length), generator=torch.Generator().manual_seed(1))

    def last_logits(position_changed=None):
        changed = tokens.clone()
        if position_changed is not None:
            changed[0, position_changed] = 3 + (changed[0, position_changed] - 3 + 1) % 61
        with torch.no_grad():
            return model(input_ids=changed).logits[0, -1]

    reference = last_logits()
    assert not torch.allclose(last_logits(length - CONTEXT_LENGTH), reference, atol=1e-6)  # distance W - 1: seen
    torch.testing.assert_close(last_logits(length - CONTEXT_LENGTH - 1), reference, atol=0, rtol=0)  # distance W
    torch.testing.assert_close(last_logits(0), reference, atol=0, rtol=0)


def test_help_states_the_default_model_and_every_default():
    from bam_llama.cli.pretrain import build_parser

    help_text = build_parser().format_help()
    text = " ".join(help_text.split())
    hidden, layers, heads = 768, 12, 16  # the l12 preset
    parameters = layers * (4 * hidden**2 + 3 * hidden * 2 * hidden + 2 * hidden) + hidden  # without embeddings
    byte_model = (parameters + 2 * 259 * hidden) / 1e6
    assert f"{hidden} hidden, {layers} layers, {heads} heads; {byte_model:.0f}M parameters with 259 tokens" in text
    assert "at 512 tokens for 1000 steps of 8 rows" in text
    options = {}  # "--flag METAVAR" -> its help, one line
    for block in re.split(r"\n(?=  -)", help_text.split("options:")[1]):
        head, _, rest = block.strip().partition("  ")
        options[head.strip()] = " ".join(rest.split())
    for flag, default in [("--context-length CONTEXT_LENGTH", "512"), ("--warmup-steps WARMUP_STEPS", "0"),
                          ("--learning-rate LEARNING_RATE", "0.001"), ("--max-steps MAX_STEPS", "1000")]:
        assert f"(default: {default})" in options[flag], (flag, options.get(flag))


# --------------------------------------------------------------------------------------------------------
# What stops a run: a loss that diverges, broken weights to resume, a full disk, Ctrl-C
# --------------------------------------------------------------------------------------------------------


def cli_arguments(data: Path, output_dir: Path, *extra: str) -> list[str]:
    return ["--data", str(data), "--output-dir", str(output_dir), "--context-length", str(CONTEXT_LENGTH),
            "--hidden-size", "32", "--layers", "1", "--heads", "4", "--batch-size", "4", "--eval-rows", "4",
            "--disable-progress-bars", *extra]


def test_a_loss_that_turns_nan_stops_the_run_and_saves_nothing_new(data, tmp_path, capsys):
    """A learning rate of 1e30 gives a finite loss at step 1 (saved as checkpoint-1), NaN at step 2: one line, status
    1, and neither checkpoint-2, the model nor a summary (Trainer's own filter would have carried on and reported a
    train_loss of 0.0)."""
    output_dir = tmp_path / "out"
    status = main(cli_arguments(data, output_dir, "--max-steps", "4", "--save-steps", "1", "--learning-rate", "1e30"))
    line = one_error_line(capsys.readouterr().err, "bam-pretrain")
    assert status == 1 and "the training loss became nan at step 2" in line
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-1"]


def test_resuming_from_weights_that_are_not_finite_is_refused(data, tmp_path, capsys):
    output_dir = tmp_path / "out"
    assert main(cli_arguments(data, output_dir, "--max-steps", "2", "--save-steps", "2")) == 0
    weights_path = output_dir / "checkpoint-2" / "model.safetensors"
    weights = load_file(weights_path)
    weights["model.layers.0.mlp.down_proj.weight"][0, 1] = float("nan")
    save_file(weights, weights_path, metadata={"format": "pt"})
    before = snapshot(output_dir)
    capsys.readouterr()
    status = main(cli_arguments(data, output_dir, "--max-steps", "4", "--save-steps", "2", "--resume-from-checkpoint", "latest"))
    line = one_error_line(capsys.readouterr().err, "bam-pretrain")
    assert status == 2 and f"model.layers.0.mlp.down_proj.weight in {weights_path}" in line
    assert snapshot(output_dir) == before


@pytest.mark.parametrize("said", ["oserror", "torch-zip-writer"])
def test_a_full_disk_while_saving_a_checkpoint_leaves_no_partial_checkpoint(data, tmp_path, monkeypatch, capsys, said):
    """The optimizer state of checkpoint-4 fails half-way (ENOSPC, or PyTorch's zip writer's own "unexpected pos",
    which names no reason, on a disk with 4 KiB left): one line, status 1; checkpoint-2 stays, no checkpoint-4 nor
    its staging folder is left, and the run resumes from checkpoint-2."""
    output_dir = tmp_path / "out"
    real_save = torch.save
    error = None
    if said == "torch-zip-writer":
        error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        real_disk_usage = shutil.disk_usage
        nearly_full = lambda path: real_disk_usage(path)._replace(free=4096)  # noqa: E731
        monkeypatch.setattr(shutil, "disk_usage", nearly_full)

    def save(obj, path, *args, **kwargs):
        if "checkpoint-4" in str(path):
            return disk_full_after_half(real_save, error)(obj, path, *args, **kwargs)
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    status = main(cli_arguments(data, output_dir, "--max-steps", "6", "--save-steps", "2"))
    line = one_error_line(capsys.readouterr().err, "bam-pretrain")
    assert status == 1 and "No space left on device" in line
    assert said == "oserror" or line.endswith(f"({output_dir / 'checkpoint-4'})")
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-2"]
    monkeypatch.undo()
    assert main(cli_arguments(data, output_dir, "--max-steps", "6", "--save-steps", "2", "--resume-from-checkpoint", "latest")) == 0
    assert json.loads((output_dir / "summary.json").read_text())["resumed_from_step"] == 2


# Runs bam-pretrain (argv after WHERE N), stopping at the Nth call of WHERE until the test's signal: "tokenizer" once
# the BPE is written (the data's tokenization), "step" inside a training step, "checkpoint" inside a checkpoint save.
PRETRAIN_STOPPED_AT = """
import sys, time
from transformers import Trainer
from bam_llama.cli import pretrain as pretrain_cli
from bam_llama.training import pretrain, trainer

where, count = sys.argv[1], int(sys.argv[2])
owner, name = {"tokenizer": (pretrain, "tokenize_documents"), "step": (trainer.BamTrainer, "training_step"),
               "checkpoint": (Trainer, "_save_rng_state")}[where]
original, calls = getattr(owner, name), []

def stop_there(*args, **kwargs):
    calls.append(name)
    if len(calls) == count:
        print(f"stopped at {where} {count}", flush=True)
        time.sleep(float(sys.argv[3]))
        sys.exit("no signal came")
    return original(*args, **kwargs)

setattr(owner, name, stop_there)
sys.exit(pretrain_cli.main(sys.argv[4:]))
"""


def stopped_pretrain(tmp_path: Path, where: str, count: int, signum: int, argv: list[str]) -> tuple[int, str]:
    """bam-pretrain `argv` in a process of its own, sent `signum` at the `count`th call of `where`; its exit status
    and stderr."""
    (tmp_path / "stopped_pretrain.py").write_text(PRETRAIN_STOPPED_AT)
    process = WatchedProcess(
        [sys.executable, str(tmp_path / "stopped_pretrain.py"), where, str(count), str(scaled(600)), *argv],
        preexec_fn=default_sigint,
        env=checkout_environment(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"),
    )
    try:
        process.wait_for_line(f"stopped at {where} {count}", 600)
        process.process.send_signal(signum)
        status = process.wait(120, f"bam-pretrain's exit after signal {signum}")
    finally:
        process.process.kill()
    return status, process.error_output(last=None)


def test_ctrl_c_while_saving_a_checkpoint_is_one_line_and_leaves_no_partial_checkpoint(data, tmp_path):
    output_dir = tmp_path / "out"
    status, errors = stopped_pretrain(tmp_path, "checkpoint", 2, signal.SIGINT,
                                      cli_arguments(data, output_dir, "--max-steps", "6", "--save-steps", "2"))
    assert status == 130, errors[-3000:]
    assert errors.strip().splitlines()[-1].startswith("bam-pretrain: interrupted") and "Traceback" not in errors
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-2"]


def run_as_advised(argv: list[str], capsys) -> tuple[str | None, int]:
    """bam-pretrain `argv` as a user runs it again: where it is refused, with the first option its error line
    offers ("pass --FLAG [VALUE] to ..."). The advice followed (None if the run was not refused) and the status."""
    capsys.readouterr()
    status = main(argv)
    if status != 2:
        return None, status
    line = one_error_line(capsys.readouterr().err, "bam-pretrain")
    advice = re.search(r"pass (--[\w-]+(?: \w+)?) to ", line)
    assert advice, line
    return advice.group(1), main([*argv, *advice.group(1).split()])


@pytest.mark.parametrize(
    "where,count,signum,left,advice",
    [
        ("tokenizer", 1, signal.SIGTERM, ["tokenizer"], None),
        ("step", 1, signal.SIGINT, ["tokenizer"], None),
        ("checkpoint", 1, signal.SIGKILL, [".bam-run.lock", ".checkpoint-2.staging", "tokenizer"], None),
        ("step", 3, signal.SIGTERM, ["checkpoint-2", "tokenizer"], "--resume-from-checkpoint latest"),
    ],
    ids=["sigterm-tokenizer-written", "ctrl-c-mid-step", "sigkill-mid-checkpoint", "sigterm-after-a-checkpoint"],
)
def test_a_killed_run_restarts_or_resumes_with_the_advice_the_command_gives(data, tmp_path, capsys, where, count, signum,
                                                                             left, advice):
    """Killed before its first checkpoint, the same command starts afresh (the tokenizer, the lock file and a staged
    checkpoint are no results); killed after one, it is refused with advice to continue, which continues it."""
    output_dir = tmp_path / "out"
    argv = cli_arguments(data, output_dir, "--tokenizer", "bpe", "--vocab-size", "300", "--max-steps", "4",
                         "--save-steps", "2")
    status, errors = stopped_pretrain(tmp_path, where, count, signum, argv)
    assert status == {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGKILL: -signal.SIGKILL}[signum], errors[-3000:]
    assert sorted(path.name for path in output_dir.iterdir()) == left

    assert run_as_advised(argv, capsys) == (advice, 0)
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["resumed_from_step"] == (2 if advice else 0)
    assert sorted(path.name for path in output_dir.iterdir()) == ["checkpoint-2", "checkpoint-4", "model", "summary.json",
                                                                  "tokenizer"]


def test_resume_latest_without_a_checkpoint_says_to_start_without_it(data, tmp_path, capsys):
    """As Trainer's resume_from_checkpoint=True: nothing to continue is an error, whose advice starts the run."""
    output_dir = tmp_path / "out"
    (output_dir / "tokenizer").mkdir(parents=True)  # what a run stopped before its first checkpoint leaves
    argv = cli_arguments(data, output_dir, "--max-steps", "2", "--save-steps", "2")
    assert main([*argv, "--resume-from-checkpoint", "latest"]) == 2
    line = one_error_line(capsys.readouterr().err, "bam-pretrain")
    assert "no checkpoint-* folder" in line and "starts again without --resume-from-checkpoint" in line
    assert main(argv) == 0


@pytest.mark.parametrize(
    "flag,omp_num_threads,expected",
    [((), None, 1), (("--threads", "2"), None, 2), ((), "3", 3), (("--threads", "2"), "3", 2)],
    ids=["cpu-default", "flag", "omp-num-threads", "flag-over-omp-num-threads"],
)
def test_threads_are_one_on_a_cpu_unless_threads_or_omp_num_threads_say_otherwise(data, tmp_path, monkeypatch, caplog,
                                                                                  flag, omp_num_threads, expected):
    argv = cli_arguments(data, tmp_path / "out", "--max-steps", "1", "--save-steps", "1", *flag)
    caplog.set_level(logging.INFO, logger="bam_llama")
    with torch_threads_in_training(monkeypatch, omp_num_threads) as threads:
        assert main(argv) == 0
    assert threads == {expected}
    assert f"cpu, {expected} torch thread(s)" in caplog.text


def test_threads_on_a_gpu_are_left_to_torch_and_the_help_gives_the_measurement(monkeypatch, capsys):
    from bam_llama.runtime.cpu_threads import use_threads

    with torch_threads_in_training(monkeypatch):
        assert use_threads(None, "cuda") == 4 and use_threads(None, "cpu") == 1 and use_threads(3, "cuda") == 3
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--threads THREADS torch threads (default: on a CPU 1, or OMP_NUM_THREADS where it is set" in help_text
    assert "s per step" in help_text


def test_ssmax_order_init_and_learning_rate_reach_the_model_and_the_optimizer(data, tmp_path, monkeypatch):
    """--no-ssmax-prior and --ssmax-scale-init set the config; --ssmax-learning-rate puts exactly the SSMax scales in a
    group of their own at that rate, the prior keeps --prior-learning-rate."""
    args = arguments(data, tmp_path / "run", ssmax=True, ssmax_prior=False, ssmax_scale_init=0.25, prior_scope="layer",
                     prior_learning_rate=0.03, ssmax_learning_rate=0.3, max_steps=1, save_steps=1)
    created = created_optimizers(monkeypatch)
    _, model, _ = run_pretraining(args)
    assert model.config.ssmax_prior is False and model.config.ssmax_scale_init == 0.25
    named = dict(model.named_parameters())
    groups = {group["initial_lr"]: {id(parameter) for parameter in group["params"]} for group in created[0].param_groups}
    layers = range(TINY_SIZES["num_hidden_layers"])
    assert groups[0.3] == {id(named[f"model.layers.{layer}.self_attn.ssmax.scale"]) for layer in layers}
    assert groups[0.03] == {
        id(named[f"model.layers.{layer}.self_attn.prior.{name}"]) for layer in layers for name in ("theta_alpha", "theta_beta")
    }
    fresh = BamLlamaForCausalLM(model.config)
    assert torch.equal(fresh.model.layers[0].self_attn.ssmax.scale.detach(), torch.full((TINY_SIZES["num_attention_heads"],), 0.25))
