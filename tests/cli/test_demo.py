"""The embedded demo: its data, its baselines, and a --quick end-to-end run (the numbers of a quick run mean nothing)."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM
from waiting import HangGuard, WatchedProcess, run_within, scaled, wait_until, wait_within

from bam_llama import BamLlamaForCausalLM
from bam_llama.cli.demo import main, run_demo
from bam_llama.data.packing import IGNORE_INDEX
from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.demo.pipeline import DEMO_TEMPLATE, PasskeyRows, build_model, right_padded_batch
from bam_llama.demo.settings import DataConfig, ModelSize, default_settings
from bam_llama.evaluation.passkey import PasskeyKeys as PasskeyKeysOf, PasskeyResults
from helpers import checkout_environment


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def test_training_batch_fits_the_training_length_and_trains_only_on_the_answer_and_its_full_stop(tokenizer):
    data = DataConfig(train_length=96)
    rows = list(PasskeyRows(tokenizer, DEMO_TEMPLATE, data, seed=0, count=16))
    batch = right_padded_batch(rows, tokenizer.pad_token_id)
    assert batch["input_ids"].shape[0] == 16 and (batch["input_ids"][:, 0] == tokenizer.bos_token_id).all()
    assert batch["input_ids"].shape[1] <= data.train_length
    for input_ids, labels in zip(batch["input_ids"], batch["labels"]):
        answer = tokenizer.decode(labels[labels != IGNORE_INDEX])
        text = tokenizer.decode(input_ids, skip_special_tokens=True)
        # The key and its full stop: a model trained on the digits alone writes an untrained token after them
        # (often a sixth digit), and the evaluation counts a longer number as wrong.
        key = re.fullmatch(r" (\d+)\.", answer)
        assert key is not None, answer
        passkey = key.group(1)
        assert len(passkey) == data.num_digits
        assert DEMO_TEMPLATE.info.format(passkey=passkey) in text
        assert text.rstrip().endswith(DEMO_TEMPLATE.question + answer)


def test_baselines_share_the_recipe(tokenizer):
    size = ModelSize(hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    rope, alibi, bam = (build_model(name, size, train_length=64) for name in ("rope", "alibi", "bam"))
    assert type(rope) is LlamaForCausalLM and isinstance(bam, BamLlamaForCausalLM)
    assert sum(p.numel() for p in rope.parameters()) == sum(
        p.numel() for name, p in bam.named_parameters() if "prior" not in name and "ssmax" not in name
    )
    trainable = {name for name, p in alibi.named_parameters() if p.requires_grad}
    assert not any("theta" in name for name in trainable)
    betas = [p for name, p in alibi.state_dict().items() if name.endswith("theta_beta")]  # frozen: buffers
    assert betas and all(torch.all(beta == 1.0) for beta in betas)
    assert {name for name, p in bam.named_parameters() if p.requires_grad and "theta" in name}
    with pytest.raises(ValueError, match="unknown model"):
        build_model("gpt", size, train_length=64)


def test_quick_run_writes_table_plots_and_a_loadable_model(tmp_path, tokenizer, capsys):
    results = run_demo(["--quick", "--models", "bam,rope,alibi", "--output-dir", str(tmp_path)])

    assert set(results) == {"bam", "rope", "alibi"}
    assert all(isinstance(result, PasskeyResults) for result in results.values())
    printed = capsys.readouterr().out
    assert "| BAM (GGD prior) |" in printed and "| RoPE (Llama) |" in printed
    assert (tmp_path / "results.md").read_text().strip() in printed
    saved = json.loads((tmp_path / "results.json").read_text())
    assert PasskeyResults.from_dict(saved["bam"]).lengths == results["bam"].lengths
    for png in ["passkey-bam.png", "passkey-rope.png", "passkey-alibi.png", "prior.png"]:
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    assert sorted(os.listdir(tmp_path)) == ["bam-model", "passkey-alibi.png", "passkey-bam.png", "passkey-rope.png",
                                            "prior.png", "results.json", "results.md"]  # nothing of the training loop

    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "bam-model").stat().st_mode & 0o777 == 0o777 & ~umask  # not the 0700 of a temporary folder
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bam-model")
    input_ids = torch.tensor([tokenizer("The pass key is")["input_ids"]])
    assert isinstance(model, BamLlamaForCausalLM)
    assert torch.isfinite(model(input_ids).logits).all()
    assert model.config.ssmax is False  # the default recipe: BAM found every key to 64x without it, 80% with it


def test_estimate_takes_each_model_and_the_slowest_model_of_each_round(monkeypatch):
    """Models of a round run at once: a round lasts as long as its slowest model, rounds add up. bam's costs alone
    (the estimate once timed the first model only) would read 2 min of training and 3 of evaluation."""
    import bam_llama.demo.pipeline as demo

    seconds = {"bam": (60.0, 100.0), "rope": (50.0, 300.0), "alibi": (70.0, 10.0)}  # (training, evaluation)
    monkeypatch.setattr(demo, "model_seconds", lambda name, args, settings: seconds[name])
    estimate = demo.run_estimate(["bam", "rope", "alibi"], None, None, jobs=2)
    assert estimate.startswith("Estimate: training ~2 min, evaluation ~5 min at these lengths"), estimate
    estimate = demo.run_estimate(["bam", "rope", "alibi"], None, None, jobs=3)
    assert estimate.startswith("Estimate: training ~1 min, evaluation ~5 min at these lengths"), estimate


def test_quick_run_in_a_log_says_what_runs_first_and_writes_plain_progress_lines(tmp_path):
    """Output captured (a log, CI): before any progress, what the run trains and evaluates and an estimate of its
    time; then whole lines of progress per model (also from the model processes), no bar's carriage returns or
    cursor codes."""
    completed = run_within(
        [sys.executable, "-m", "bam_llama.cli.demo", "--quick", "--output-dir", str(tmp_path / "out")], 600,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=checkout_environment(),
    )
    output = completed.stdout
    assert completed.returncode == 0, output
    assert "\r" not in output and "\x1b" not in output
    assert "'loss':" not in output and "train_runtime" not in output  # Trainer's own log lines: the steps show once
    plan = re.search(r"bam-demo: training bam, rope .*8 steps.* at 64, 128 tokens \(2 prompts per length\)", output)
    estimate = re.search(r"Estimate: training ~\d+ s, evaluation ~\d+ s at these lengths \(from \d+ training steps", output)
    timing = re.search(r"Timing \d+ training steps and two prompts of each model for an estimate", output)
    assert plan and timing and estimate, output
    assert plan.end() < timing.start() < estimate.start()  # said before the seconds it takes
    for name in ("bam", "rope"):
        assert re.search(rf"^train {name}: 8/8 steps, loss \d+\.\d+, \d+\.\d min$", output, re.MULTILINE), output
        assert re.search(rf"^evaluate {name}: 4/4 prompts, length 128, accuracy .*min$", output, re.MULTILINE), output
    assert estimate.end() < output.index("train bam:")


def test_models_trained_at_once_give_the_results_of_one_at_a_time(tmp_path):
    """--jobs 2 trains BAM and RoPE in two processes of one thread each: the same numbers as one after the other."""
    one_at_a_time = run_demo(["--quick", "--jobs", "1", "--output-dir", str(tmp_path / "one")])
    at_once = run_demo(["--quick", "--jobs", "2", "--output-dir", str(tmp_path / "two")])
    for name in ("bam", "rope"):
        assert at_once[name].predictions == one_at_a_time[name].predictions and at_once[name].passkeys
    weights = [(tmp_path / run / "bam-model" / "model.safetensors").read_bytes() for run in ("one", "two")]
    assert weights[0] == weights[1]  # bit for bit: the same thread count, the same sums
    run = json.loads((tmp_path / "two" / "results.json").read_text())["run"]
    assert run["jobs"] == 2 and run["threads"] == 1
    assert "2 models at once, 1 thread each" in (tmp_path / "two" / "results.md").read_text()
    assert (tmp_path / "two" / "bam-model" / "config.json").is_file() and (tmp_path / "two" / "passkey-rope.png").is_file()


def test_each_model_runs_on_the_threads_asked(tmp_path, monkeypatch):
    from bam_llama.demo import pipeline as demo
    from bam_llama.cli.demo import parse_args

    seen = []
    monkeypatch.setattr(demo, "train_model", lambda *args, **kwargs: seen.append(torch.get_num_threads()))
    monkeypatch.setattr(demo, "save_bam", lambda *args: None)
    threads = torch.get_num_threads()
    try:
        args = parse_args(["--quick", "--models", "rope", "--threads", "3", "--output-dir", str(tmp_path)])
        demo.train_and_evaluate("rope", args, demo.settings_from_args(args), tmp_path)
    finally:
        torch.set_num_threads(threads)
    assert seen == [3, 3]  # the training, then --quick's context extension


def keys_in(labels: torch.Tensor, tokenizer) -> set[str]:
    """The passkeys a batch trains on: the digits of its answer labels."""
    answers = [tokenizer.decode([token for token in row.tolist() if token != IGNORE_INDEX]) for row in labels]
    return {key for answer in answers for key in re.findall(r"\d+", answer)}


@pytest.fixture
def trained_batches(monkeypatch):
    """Every batch a BamTrainer trains on, as (trainer, labels, each optimizer group's (learning rate, weight decay,
    parameter ids)) at that step; recorded at BamTrainer's training step."""
    from bam_llama.training.trainer import BamTrainer

    seen = []
    step = BamTrainer.training_step

    def recorded(self, model, inputs, *args, **kwargs):
        groups = [(group["lr"], group["weight_decay"], {id(parameter) for parameter in group["params"]})
                  for group in self.optimizer.param_groups]
        seen.append((self, inputs["labels"].clone(), groups))
        return step(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(BamTrainer, "training_step", recorded)
    return seen


def test_evaluation_keys_are_none_of_the_training_keys(tmp_path, tokenizer, trained_batches):
    """Two-digit keys (90 of them): 8 steps of 4 examples and 2 of the context extension train on about 30, and 40
    evaluation keys drawn blind would hit some. The training keys are read from the answer labels of the batches the
    loop trained on, the extension's included."""
    from bam_llama.demo import pipeline as demo
    from bam_llama.cli.demo import parse_args
    from bam_llama.evaluation.retrieval import DepthPlan

    args = parse_args(["--quick", "--models", "bam", "--output-dir", str(tmp_path)])
    settings = demo.settings_from_args(args)
    settings.data.num_digits, settings.num_depths = 2, DepthPlan(20)
    result = demo.train_and_evaluate("bam", args, settings, tmp_path)
    assert len(trained_batches) == 8 + 2
    trained = set().union(*(keys_in(labels, tokenizer) for _, labels, _ in trained_batches))
    evaluated = [key for row in result.passkeys for key in row]
    assert len(trained) > 15 and len(set(evaluated)) == len(evaluated) == 40
    assert not trained & set(evaluated) and result.keys_in_training == 0 and result.keys_redrawn > 0


def test_digits_set_the_length_of_every_training_and_evaluation_key(tmp_path, tokenizer, trained_batches):
    from bam_llama.cli.demo import parse_args
    from bam_llama.demo import pipeline as demo

    args = parse_args(["--quick", "--models", "bam", "--steps", "3", "--digits", "7", "--output-dir", str(tmp_path)])
    result = demo.train_and_evaluate("bam", args, demo.settings_from_args(args), tmp_path)
    answers = [tokenizer.decode([token for token in row.tolist() if token != IGNORE_INDEX])
               for _, labels, _ in trained_batches for row in labels if (row != IGNORE_INDEX).any()]
    assert len(answers) == 3 * 4 + 2 * 2  # training, then the quick run's context extension
    assert all(re.fullmatch(r" \d{7}\.", answer) for answer in answers), answers
    evaluated = [key for row in result.passkeys for key in row]
    assert len(evaluated) == 4 and all(re.fullmatch(r"[1-9]\d{6}", key) for key in evaluated)


def test_the_demo_trains_through_the_package_training_loop_with_its_recipe(tmp_path, tokenizer, trained_batches,
                                                                           monkeypatch):
    """bam-demo trains through bam-pretrain's loop (BamTrainer, a transformers.Trainer) with its own recipe: AdamW
    (betas 0.9, 0.95) at 2e-3 with weight decay 0.01, BAM's prior alone in a group at 5e-2 without decay, 2 of 5
    steps of linear warmup from 0 then cosine decay, the gradient norm clipped at 1; BAM and RoPE train on the same
    batches of the seed, and the keys the evaluation avoids are those of the batches trained on."""
    from transformers import Trainer

    from bam_llama.cli.demo import parse_args
    from bam_llama.demo import pipeline as demo

    avoided = []
    monkeypatch.setattr(demo, "PasskeyKeys", lambda seed, digits, excluded: avoided.append(set(excluded)) or
                        PasskeyKeysOf(seed, digits, excluded))
    monkeypatch.setattr(demo, "save_bam", lambda *args: None)
    args = parse_args(["--quick", "--models", "bam,rope", "--steps", "5", "--extension-steps", "0",
                       "--output-dir", str(tmp_path)])
    settings = demo.settings_from_args(args)
    settings.train.warmup_fraction = 0.4
    models = {}
    for name in ("bam", "rope"):
        first = len(trained_batches)
        demo.train_and_evaluate(name, args, settings, tmp_path)
        models[name] = trained_batches[first:]
    multipliers = [0.0, 0.5, 1.0, 0.75, 0.25]  # warmup s/2, then (1 + cos(pi * (s - 2) / 3)) / 2
    for name, steps in models.items():
        trainer = steps[0][0]
        assert isinstance(trainer, Trainer) and len(steps) == 5 and all(step[0] is trainer for step in steps)
        optimizer = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["betas"] == (0.9, 0.95)
        assert trainer.args.max_grad_norm == 1.0
        named = dict(trainer.model.named_parameters())
        prior = {id(p) for n, p in named.items() if n.endswith(("theta_alpha", "theta_beta"))}
        assert (len(prior) == 2 * 2) == (name == "bam")  # alpha and beta in each of 2 layers
        for step, (_, _, groups) in enumerate(steps):
            rates = {frozenset(ids): (lr, decay) for lr, decay, ids in groups}
            if prior:
                assert rates[frozenset(prior)] == pytest.approx((5e-2 * multipliers[step], 0.0), abs=1e-12)
            projection = id(named["model.layers.0.self_attn.q_proj.weight"])
            lr, decay = next(rate for ids, rate in rates.items() if projection in ids)
            assert (lr, decay) == pytest.approx((2e-3 * multipliers[step], 0.01), abs=1e-12)
    for (_, bam_labels, _), (_, rope_labels, _) in zip(models["bam"], models["rope"]):
        assert torch.equal(bam_labels, rope_labels)
    trained = set().union(*(keys_in(labels, tokenizer) for _, labels, _ in models["bam"]))
    assert len(trained) > 10 and avoided == [trained, trained]


def test_the_context_extension_follows_training_on_twice_as_long_documents_at_a_tenth_of_the_rates(
        tmp_path, tokenizer, trained_batches, monkeypatch):
    """--extension-steps 5 after 3 training steps of 4 documents of 64 tokens: a second loop of 5 steps of 2
    documents up to 128 tokens, at 2e-4 (the prior 5e-3) with the training's warmup and cosine; its documents are
    not the training's, and its keys are kept out of the evaluation too."""
    from bam_llama.cli.demo import parse_args
    from bam_llama.demo import pipeline as demo

    avoided = []
    monkeypatch.setattr(demo, "PasskeyKeys", lambda seed, digits, excluded: avoided.append(set(excluded)) or
                        PasskeyKeysOf(seed, digits, excluded))
    monkeypatch.setattr(demo, "save_bam", lambda *args: None)
    args = parse_args(["--quick", "--models", "bam", "--steps", "3", "--batch-size", "4", "--extension-steps", "5",
                       "--output-dir", str(tmp_path)])
    settings = demo.settings_from_args(args)
    assert settings.data.train_length == 64
    settings.train.warmup_fraction = 0.4
    demo.train_and_evaluate("bam", args, settings, tmp_path)

    training, extension = trained_batches[:3], trained_batches[3:]
    assert len(extension) == 5 and {step[0] for step in training} != {step[0] for step in extension}
    assert len({step[0] for step in extension}) == 1
    assert all(labels.shape[0] == 4 and labels.shape[1] <= 64 for _, labels, _ in training)
    assert all(labels.shape[0] == 2 and labels.shape[1] <= 128 for _, labels, _ in extension)
    assert max(labels.shape[1] for _, labels, _ in extension) > 64
    named = dict(extension[0][0].model.named_parameters())
    prior = frozenset(id(p) for n, p in named.items() if n.endswith(("theta_alpha", "theta_beta")))
    projection = id(named["model.layers.0.self_attn.q_proj.weight"])
    for multiplier, (_, _, groups) in zip([0.0, 0.5, 1.0, 0.75, 0.25], extension):
        rates = {frozenset(ids): (lr, decay) for lr, decay, ids in groups}
        assert rates[prior] == pytest.approx((5e-3 * multiplier, 0.0), abs=1e-12)
        lr, decay = next(rate for ids, rate in rates.items() if projection in ids)
        assert (lr, decay) == pytest.approx((2e-4 * multiplier, 0.01), abs=1e-12)
    training_keys = set().union(*(keys_in(labels, tokenizer) for _, labels, _ in training))
    extension_keys = set().union(*(keys_in(labels, tokenizer) for _, labels, _ in extension))
    assert extension_keys - training_keys and avoided == [training_keys | extension_keys]
    # a stream of its own: the training's stream again would open with the training's first document's key
    assert keys_in(extension[0][1][:1], tokenizer) != keys_in(training[0][1][:1], tokenizer)


@pytest.mark.parametrize("train_scale", [True, False])
def test_ssmax_scales_train_or_stay_at_one_as_asked(train_scale, tmp_path, trained_batches, monkeypatch):
    """--ssmax trains each head's scale s_h with the prior (5e-2, no decay); --no-train-ssmax-scale keeps it at 1,
    out of every optimizer group, and the saved model says so."""
    from bam_llama.cli.demo import parse_args
    from bam_llama.demo import pipeline as demo

    flag = "--train-ssmax-scale" if train_scale else "--no-train-ssmax-scale"
    args = parse_args(["--quick", "--models", "bam", "--ssmax", flag, "--extension-steps", "0",
                       "--output-dir", str(tmp_path)])
    demo.train_and_evaluate("bam", args, demo.settings_from_args(args), tmp_path)
    trainer = trained_batches[0][0]
    scales = {name: tensor for name, tensor in trainer.model.state_dict().items() if name.endswith("ssmax.scale")}
    assert len(scales) == 2  # one a layer
    trained_ids = {id(p) for n, p in trainer.model.named_parameters() if n.endswith("ssmax.scale")}
    assert bool(trained_ids) == train_scale
    optimized = [(lr, decay, ids) for lr, decay, ids in trained_batches[-1][2] if ids & trained_ids]
    assert bool(optimized) == train_scale and all(decay == 0.0 for _, decay, _ in optimized)
    moved = any(not torch.all(scale == 1.0) for scale in scales.values())
    assert moved == train_scale
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "bam-model")
    assert saved.config.ssmax and saved.config.train_ssmax_scale == train_scale


def test_console_script_help():
    completed = run_within(["bam-demo", "--help"], 60)
    assert completed.returncode == 0 and "--quick" in completed.stdout


def test_main_reports_success_as_exit_status_zero_and_records_the_argv(tmp_path):
    argv = ["--quick", "--models", "bam", "--output-dir", str(tmp_path), "--lengths", "64,80"]
    assert main(argv) == 0
    assert (tmp_path / "results.md").is_file()
    run = json.loads((tmp_path / "results.json").read_text())["run"]
    assert run["argv"] == argv and run["settings"]["lengths"] == [64, 80]
    # the processor, in the JSON and on the page (issue 48): rows differ between processor models
    kernels = f"PyTorch CPU kernels: {torch.backends.cpu.get_cpu_capability()}"
    assert run["processor"].endswith(kernels) and kernels in (tmp_path / "results.md").read_text()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        family = re.search(r"^cpu family\s*:\s*(\d+)", cpuinfo.read_text(), re.M).group(1)
        model = re.search(r"^model\s*:\s*(\d+)", cpuinfo.read_text(), re.M).group(1)
        assert f"(family {family} model {model})" in run["processor"]


@pytest.mark.parametrize(
    "argv, argument",
    [
        (["--lengths", "64,abc"], "--lengths"),
        (["--lengths", "64,0"], "--lengths"),
        (["--lengths", "64,64"], "--lengths"),
        (["--steps", "0"], "--steps"),
        (["--train-length", "-8"], "--train-length"),
        (["--lr", "nan"], "--lr"),
        (["--device", "nonsense"], "--device"),
        (["--extension-steps", "-1"], "--extension-steps"),
        (["--no-train-ssmax-scale"], "--no-train-ssmax-scale"),
        (["--digits", "0"], "--digits"),
        (["--digits", "2"], "--digits"),  # 90 keys for the default evaluation's 170 prompts
        (["--quick", "--digits", "1", "--depths", "5"], "--digits"),  # 9 keys for 10 prompts
    ],
)
def test_a_bad_argument_is_one_line_naming_it(argv, argument, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv + ["--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("bam-demo: error: argument " + argument)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cuda"])
    assert exit_info.value.code == 2
    assert "argument --device: 'cuda': this PyTorch build" in capsys.readouterr().err


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert "(default: bam-demo-output)" in usage and "(default: bam,rope)" in usage
    settings = default_settings(quick=False)
    assert f"(default: {settings.train.steps}; with --quick: 8)" in usage
    assert f"(0: none) (default: {settings.extension.steps}; with --quick: 2)" in usage
    assert "(default: " + ",".join(map(str, settings.lengths)) + "; with --quick: 64,128)" in usage


def test_unknown_model_is_refused():
    with pytest.raises(SystemExit):
        main(["--models", "bam,gpt"])


# bam-demo --quick that stops where it saves the BAM model (its heatmap already written) and waits for SIGINT.
DEMO_INTERRUPTED_WHILE_SAVING = """
import sys, time
from bam_llama.demo import pipeline as demo
from bam_llama.cli import demo as demo_cli

def save_bam_then_wait(*args, **kwargs):
    print("saving", flush=True)
    deadline = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit("no SIGINT came while saving")

demo.save_bam = save_bam_then_wait
sys.exit(demo_cli.main(sys.argv[2:]))
"""


def folder_contents(folder):
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("earlier_result", [False, True])
def test_ctrl_c_leaves_no_partial_result_and_keeps_an_earlier_one(tmp_path, earlier_result):
    """Ctrl-C in the middle of a run (a heatmap already written): one line on stderr, no traceback, exit 130, no
    output folder (or the earlier complete result, byte for byte) and nothing staged left beside it."""
    import signal

    from helpers import checkout_environment, default_sigint

    output = tmp_path / "runs" / "bam-demo-output"
    output.parent.mkdir()
    if earlier_result:
        output.mkdir()
        (output / "results.json").write_text('{"run": {"earlier": true}}')
        (output / "results.md").write_text("earlier table\n")
        (output / "passkey-bam.png").write_bytes(b"\x89PNG earlier")
    before = folder_contents(output) if earlier_result else None
    (tmp_path / "demo.py").write_text(DEMO_INTERRUPTED_WHILE_SAVING)
    process = WatchedProcess(
        [sys.executable, str(tmp_path / "demo.py"), str(scaled(600)), "--quick", "--models", "bam",
         "--output-dir", str(output)],
        env=checkout_environment(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1"),
        preexec_fn=default_sigint,
    )
    try:
        process.wait_for_line("saving", 300)
        staged = [path.name for path in output.parent.iterdir() if path.name.endswith(".partial")]
        assert len(staged) == 1 and any((output.parent / staged[0]).glob("passkey-bam.png"))  # a partial result
    finally:
        process.process.send_signal(signal.SIGINT)
        returncode = process.wait(120, "the demo's exit after SIGINT")
    stderr = process.error_output(last=None)
    assert returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == "bam-demo: interrupted; nothing was written (an earlier complete result is kept)"
    assert "Traceback" not in stderr
    assert sorted(path.name for path in output.parent.iterdir()) == (["bam-demo-output"] if earlier_result else [])
    if earlier_result:
        assert folder_contents(output) == before


def test_ctrl_c_stops_the_model_processes_and_leaves_nothing(tmp_path):
    """Ctrl-C while two models train in their own processes: exit 130, the processes gone, no output."""
    import signal

    from helpers import checkout_environment, child_processes, default_sigint, still_running

    output = tmp_path / "bam-demo-output"
    process = subprocess.Popen(
        [sys.executable, "-m", "bam_llama.cli.demo", "--quick", "--steps", "100000", "--jobs", "2",
         "--output-dir", str(output)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=checkout_environment(),
        preexec_fn=default_sigint,
    )
    chunks = []  # stderr, read as it comes: the models' progress bars show both are training
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: process.stderr.read(256), "")), daemon=True)
    reader.start()
    children = []
    guard = HangGuard(300, "both models' processes training")
    while guard.left() > 0 and process.poll() is None:
        time.sleep(0.5)
        children = child_processes(process.pid)
        if len(children) >= 2 and len(set(re.findall(r"train (\w+): ", "".join(chunks)))) >= 2:
            break
    process.send_signal(signal.SIGINT)
    wait_within(process, 120, "the demo's exit after SIGINT")
    reader.join(timeout=scaled(30))  # the pipe closes when the demo's processes are gone
    stderr = "".join(chunks)
    assert len(children) >= 2, stderr[-3000:]
    assert process.returncode == 130, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("bam-demo: interrupted")
    assert "Warning" not in stderr and "Traceback" not in stderr, stderr[-3000:]  # e.g. a leaked semaphore
    wait_until(lambda: not still_running(children), 30, f"the model processes {children} to end")
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_a_folder_of_other_files_is_not_replaced(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["--quick", "--models", "bam", "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"bam-demo: error: --output-dir {tmp_path} holds files that are not a bam-demo result (no results.json), "
        "which a run would replace: choose another folder"
    )
    assert os.listdir(tmp_path) == ["notes.txt"]
