"""What stops `bam-eval` and `bam-card`: weights or a config that are not finite, a full disk, an unwritable folder.
Each is one line on stderr and a non-zero status, and leaves the earlier outputs byte for byte, with no partial or
hidden file beside them. (bam-convert: tests/conversion/test_convert.py; bam-finetune and bam-pretrain:
tests/training/.)

A full disk is an OSError(ENOSPC) raised after half a file was written, and, where this machine lets the suite
mount one (root with mount rights), a real 1 MiB tmpfs. An unwritable folder is chmod 0555, or an injected
PermissionError when the tests run as root (root writes anyway).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import SAFETENSORS_DISK_FULL_MESSAGES, disk_full_after_half, fill, one_error_line, small_tmpfs, snapshot, tiny_model, unwritable
from huggingface_hub import ModelCard
from matplotlib.figure import Figure
from safetensors.torch import load_file, save_file

from bam_llama.cli import card as card_cli
from bam_llama.cli import eval as eval_cli
from bam_llama.data.tokenizers import build_byte_tokenizer

EVAL_OPTIONS = ["--lengths", "40", "--depths", "2", "--chunk-size", "16", "--device", "cpu", "--quiet"]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved") / "tiny-bam"
    tiny_model(vocab_size=259).save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def model_dir(saved_model, tmp_path):
    return Path(shutil.copytree(saved_model, tmp_path / "tiny-bam"))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "text.txt"
    path.write_text("\n\n".join(f"Document {i}: the quick brown fox jumps over the lazy dog." * 3 for i in range(8)))
    return path


def run_command(main, argv, capsys) -> tuple[int, str]:
    """(exit status, stderr) of a command whose main exits only on failure."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


def set_weight(folder: Path, name: str, index: int, value: float) -> None:
    weights = load_file(folder / "model.safetensors")
    weights[name][index] = value
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


# ----------------------------------------------------------------------------------------- what cannot load


EVAL_COMMANDS = {
    "passkey": lambda model, data: ["passkey", str(model), *EVAL_OPTIONS],
    "perplexity": lambda model, data: ["perplexity", str(model), "--data", str(data), "--lengths", "32", "--window", "16",
                                       "--device", "cpu", "--quiet"],
    "prior": lambda model, data: ["prior", str(model), "--max-distance", "16"],
}


@pytest.mark.parametrize("command", sorted(EVAL_COMMANDS))
@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_bam_eval_refuses_weights_that_are_not_finite_naming_the_tensor(model_dir, text_file, tmp_path, capsys,
                                                                        command, value):
    set_weight(model_dir, "model.prior.theta_alpha", 2, value)
    out = tmp_path / "results"
    status, stderr = run_command(eval_cli.main, [*EVAL_COMMANDS[command](model_dir, text_file), "--out", str(out)], capsys)
    line = one_error_line(stderr, f"bam-eval {command}")
    assert status == 2
    assert "model.prior.theta_alpha" in line and "1 NaN or infinite value (of 4)" in line
    assert not out.exists()


def test_bam_card_refuses_weights_that_are_not_finite_and_keeps_the_card(model_dir, capsys):
    card_cli.main([str(model_dir)])
    set_weight(model_dir, "model.layers.1.self_attn.q_proj.weight", 0, float("inf"))
    before = snapshot(model_dir)
    status, stderr = run_command(card_cli.main, [str(model_dir)], capsys)
    assert status == 2 and "model.layers.1.self_attn.q_proj.weight" in one_error_line(stderr, "bam-card")
    assert snapshot(model_dir) == before


@pytest.mark.parametrize(
    "field, value",
    [("num_attention_heads", -4), ("rms_norm_eps", float("nan")), ("attention_dropout", float("inf")),
     ("prior_eps", float("nan")), ("theta_alpha_init", float("nan"))],
)
def test_a_config_field_that_is_not_valid_or_finite_is_refused_by_card_and_eval(model_dir, capsys, field, value):
    card_cli.main([str(model_dir)])
    edit_config(model_dir, **{field: value})  # json writes NaN and Infinity, and reads them back
    before = snapshot(model_dir)
    status, stderr = run_command(card_cli.main, [str(model_dir)], capsys)
    assert status == 2 and field in one_error_line(stderr, "bam-card")
    status, stderr = run_command(eval_cli.main, ["passkey", str(model_dir), *EVAL_OPTIONS], capsys)
    assert status == 2 and field in one_error_line(stderr, "bam-eval passkey")
    assert snapshot(model_dir) == before


# ------------------------------------------------------------------------------------------------ a full disk


def test_a_full_disk_keeps_the_earlier_evaluation_results(saved_model, tmp_path, monkeypatch, capsys):
    """bam-eval --out over an earlier result: the plot (written last) fails half-way; the earlier table, results
    and plot stay as they were, and nothing else is left in the folder."""
    out = tmp_path / "results"
    (out / "notes.txt").parent.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    eval_cli.main(["passkey", str(saved_model), *EVAL_OPTIONS, "--out", str(out)])
    before = snapshot(out)
    assert sorted(before) == ["notes.txt", "passkey.json", "passkey.md", "passkey.png"]

    monkeypatch.setattr(Figure, "savefig", disk_full_after_half(Figure.savefig))
    status, stderr = run_command(eval_cli.main, ["passkey", str(saved_model), *EVAL_OPTIONS, "--lengths", "48",
                                                  "--out", str(out)], capsys)
    line = one_error_line(stderr, "bam-eval passkey")
    assert status == 1 and "No space left on device" in line and "passkey.png" in line
    assert snapshot(out) == before


def test_a_full_disk_keeps_the_earlier_card_and_plots(model_dir, tmp_path, monkeypatch, capsys):
    plot = tmp_path / "prior.png"
    plot.write_bytes(b"first plot")
    card_cli.main([str(model_dir), "--plot", str(plot)])
    before = snapshot(model_dir)
    assert "README.md" in before and before["plots/prior.png"] == b"first plot"

    plot.write_bytes(b"second plot")
    monkeypatch.setattr(ModelCard, "save", disk_full_after_half(ModelCard.save))
    status, stderr = run_command(card_cli.main, [str(model_dir), "--plot", str(plot), "--description", "new"], capsys)
    assert status == 1 and "No space left on device" in one_error_line(stderr, "bam-card")
    assert snapshot(model_dir) == before  # the old README.md and the old plot, nothing half-copied


def test_a_real_full_disk_keeps_the_earlier_results_and_card(saved_model, tmp_path, capsys):
    with small_tmpfs(tmp_path, "2m") as disk:
        model_dir = Path(shutil.copytree(saved_model, disk / "tiny-bam"))
        out = disk / "results"
        eval_cli.main(["passkey", str(model_dir), *EVAL_OPTIONS, "--out", str(out)])
        card_cli.main([str(model_dir)])
        before = {"results": snapshot(out), "model": snapshot(model_dir)}
        fill(disk, leave=4096)

        status, stderr = run_command(eval_cli.main, ["passkey", str(model_dir), *EVAL_OPTIONS, "--out", str(out)], capsys)
        assert status in (1, 2) and "No space left on device" in one_error_line(stderr, "bam-eval passkey")
        status, stderr = run_command(card_cli.main, [str(model_dir), "--description", "x" * 8192], capsys)
        assert status in (1, 2) and "No space left on device" in one_error_line(stderr, "bam-card")
        assert {"results": snapshot(out), "model": snapshot(model_dir)} == before


def test_a_full_disk_no_staged_output_named_is_still_one_line_and_a_bug_still_a_traceback(capsys):
    """reporting's last net, for a writer outside the staged outputs: a library's own full-disk error is status 1
    and one line; an error that says nothing of the disk is not swallowed."""
    from safetensors import SafetensorError

    from bam_llama.cli.reporting import run_reported

    def write():
        raise SafetensorError(SAFETENSORS_DISK_FULL_MESSAGES[1])

    assert run_reported("bam-x", write) == 1
    assert one_error_line(capsys.readouterr().err, "bam-x") == "bam-x: error: No space left on device"

    def bug():
        raise RuntimeError("unexpected pos 576 vs 534")

    with pytest.raises(RuntimeError, match="unexpected pos"):
        run_reported("bam-x", bug)


# ------------------------------------------------------------------------------------------ an unwritable folder


def test_an_unwritable_model_folder_gets_no_card_and_one_line(model_dir, monkeypatch, capsys):
    before = snapshot(model_dir)
    with unwritable(model_dir, monkeypatch):
        status, stderr = run_command(card_cli.main, [str(model_dir)], capsys)
    line = one_error_line(stderr, "bam-card")
    assert status == 2 and "Permission denied" in line and str(model_dir) in line
    assert snapshot(model_dir) == before


def test_an_unwritable_results_folder_is_one_line(saved_model, tmp_path, monkeypatch, capsys):
    out = tmp_path / "results"
    out.mkdir()
    with unwritable(out, monkeypatch):
        status, stderr = run_command(eval_cli.main, ["passkey", str(saved_model), *EVAL_OPTIONS, "--out", str(out)], capsys)
    assert status == 2 and "Permission denied" in one_error_line(stderr, "bam-eval passkey")
    assert list(out.iterdir()) == []


def test_the_shared_check_names_the_first_tensor_that_is_not_finite():
    from bam_llama.files.model_folders import NonFiniteError, check_finite_tensors

    check_finite_tensors([("a", torch.ones(3)), ("ids", torch.tensor([1, 2]))], "here")
    with pytest.raises(NonFiniteError, match=r"^b in here holds 2 NaN or infinite values \(of 3\)"):
        check_finite_tensors([("a", torch.ones(3)), ("b", torch.tensor([1.0, float("nan"), -float("inf")])),
                              ("c", torch.tensor([float("nan")]))], "here")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("place", ["parameter", "buffer"])
def test_every_floating_dtype_and_buffers_are_checked_for_finite_values(dtype, place):
    """A 16-bit model (what most checkpoints hold) and a buffer (a frozen prior tensor is one) are checked too."""
    from bam_llama.files.model_folders import NonFiniteError, check_finite_model

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(2, 3, dtype=dtype))
    module.register_buffer("theta_mu", torch.zeros(3, dtype=dtype))
    module.register_buffer("token_ids", torch.arange(3))
    check_finite_model(module, "the model")
    broken = module.weight if place == "parameter" else module.theta_mu
    with torch.no_grad():
        broken.view(-1)[1] = float("inf")
    name = "weight" if place == "parameter" else "theta_mu"
    with pytest.raises(NonFiniteError, match=rf"^{name} in the model holds 1 NaN or infinite value \(of"):
        check_finite_model(module, "the model")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_loss_that_is_infinite_or_nan_stops_the_run(value, dtype):
    """An infinite loss diverged as surely as a NaN one (the next update would make every weight NaN)."""
    from bam_llama.files.model_folders import TrainingDiverged, check_finite_loss

    check_finite_loss(torch.tensor(2.5, dtype=dtype), step=3)
    with pytest.raises(TrainingDiverged, match=rf"^the training loss became {value} at step 3;"):
        check_finite_loss(torch.tensor(value, dtype=dtype), step=3)
