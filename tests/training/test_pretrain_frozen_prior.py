"""`bam-pretrain --frozen-prior-from MODEL`, the second stage of two: the fresh model takes MODEL's prior exactly (as
MODEL's safetensors hold it), trains every other weight with it frozen, and saves a config that keeps it frozen;
a MODEL whose prior would not fit is refused in one line before anything loads."""

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import one_error_line, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from bam_llama.cli.pretrain import main
from bam_llama.training.pretrain import PretrainArguments, run_pretraining
from bam_llama.training.trainer import BamTrainer

SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
PRIOR_NAME = re.compile(r"prior\.theta_(alpha|beta|mu)$")


def write_documents(path: Path) -> Path:
    path.write_text("\n\n".join(f"key {key}. " + "abc " * (key % 9 + 3) + f"key {key}." for key in range(100, 160)))
    return path


def stage_one_folder(folder: Path, **config) -> Path:
    """A saved BamLlama of SIZES whose prior is non-trivial: every layer's alpha and mu its own, mu non-zero."""
    model = tiny_model("sdpa", **{**SIZES, "num_key_value_heads": 4, **config})
    model.save_pretrained(folder)
    return folder


def saved_prior(folder: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for name, tensor in load_file(folder / "model.safetensors").items() if PRIOR_NAME.search(name)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_documents(tmp_path_factory.mktemp("frozen-prior-data") / "documents.txt")


@pytest.mark.parametrize("prior_scope, kv_heads", [("layer", 4), ("global", 4), ("layer", 2)],
                         ids=["layer", "global", "layer-gqa"])
def test_the_second_stage_trains_the_weights_around_the_first_stage_s_prior(data, tmp_path, monkeypatch, prior_scope,
                                                                            kv_heads):
    """Both stages of 4 heads; with GQA both have 2 key/value heads (the prior is a query head's)."""
    source = stage_one_folder(tmp_path / "stage-1", prior_scope=prior_scope, num_key_value_heads=kv_heads)
    reference = saved_prior(source)
    assert len(reference) == (3 * SIZES["num_hidden_layers"] if prior_scope == "layer" else 3)
    assert all(tensor.abs().min() > 0 for name, tensor in reference.items() if "theta_mu" in name)
    at_start, optimized = {}, []
    create_optimizer = BamTrainer.create_optimizer

    def record(self, model=None):
        at_start.update({name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()})
        optimized.extend(parameter for group in create_optimizer(self, model).param_groups for parameter in group["params"])
        return self.optimizer

    monkeypatch.setattr(BamTrainer, "create_optimizer", record)
    args = PretrainArguments(data=str(data), output_dir=str(tmp_path / "stage-2"), context_length=64, max_steps=3,
                             save_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, eval_rows=4,
                             disable_progress_bars=True, prior_scope=prior_scope, frozen_prior_from=str(source),
                             num_key_value_heads=kv_heads, **SIZES)
    summary, model, _ = run_pretraining(args)

    folder = tmp_path / "stage-2" / "model"
    trained = load_file(folder / "model.safetensors")
    assert {name: trained[name] for name in trained if PRIOR_NAME.search(name)}.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(trained[name], tensor), name  # exactly stage 1's, after the training steps
        assert torch.equal(at_start[name], tensor), name
    weights = [name for name, _ in model.named_parameters()]
    assert weights and not any("prior" in name for name in weights)
    for name in weights:
        assert not torch.equal(trained[name], at_start[name]), f"{name} did not train"
    prior_tensors = {id(tensor) for name, tensor in model.named_buffers() if PRIOR_NAME.search(name)}
    assert len(prior_tensors) == len(reference) and not prior_tensors & {id(parameter) for parameter in optimized}
    assert {id(parameter) for parameter in optimized} == {id(parameter) for parameter in model.parameters()}

    config = json.loads((folder / "config.json").read_text())
    assert (config["train_theta_alpha"], config["train_theta_beta"], config["train_theta_mu"]) == (False, False, False)
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert not any("prior" in name for name, _ in reloaded.named_parameters())
    assert {name: tensor for name, tensor in reloaded.state_dict().items() if PRIOR_NAME.search(name)}.keys() == reference.keys()
    for name, tensor in reloaded.state_dict().items():
        if PRIOR_NAME.search(name):
            assert torch.equal(tensor, reference[name]), name
    assert summary.frozen_prior_from == str(source)
    assert json.loads((tmp_path / "stage-2" / "summary.json").read_text())["frozen_prior_from"] == str(source)


@pytest.mark.parametrize("frozen_ssmax", [True, False], ids=["scales_frozen", "scales_trained"])
def test_the_second_stage_takes_the_ssmax_scales_frozen_only_when_asked(data, tmp_path, frozen_ssmax):
    source = stage_one_folder(tmp_path / "stage-1", prior_scope="layer", ssmax=True)
    scales = {name: tensor for name, tensor in load_file(source / "model.safetensors").items() if name.endswith("ssmax.scale")}
    with torch.no_grad():  # stage one's scales, each head its own and none the fresh model's 1.0
        scales = {name: torch.tensor([0.5, 0.75, 1.25, 1.5]) + layer for layer, name in enumerate(sorted(scales))}
    weights = {**load_file(source / "model.safetensors"), **scales}
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    args = PretrainArguments(data=str(data), output_dir=str(tmp_path / "stage-2"), context_length=64, max_steps=3,
                             save_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, eval_rows=4, ssmax=True,
                             disable_progress_bars=True, prior_scope="layer", frozen_prior_from=str(source),
                             frozen_ssmax=frozen_ssmax, **SIZES)
    _, model, _ = run_pretraining(args)
    trained = load_file(tmp_path / "stage-2" / "model" / "model.safetensors")
    assert len(scales) == SIZES["num_hidden_layers"]
    for name, tensor in scales.items():
        assert torch.equal(trained[name], tensor) == frozen_ssmax, name  # kept exactly, or trained from 1.0
    trainable = [name for name, _ in model.named_parameters()]
    assert any(name.endswith("ssmax.scale") for name in trainable) != frozen_ssmax
    config = json.loads((tmp_path / "stage-2" / "model" / "config.json").read_text())
    assert config["train_ssmax_scale"] != frozen_ssmax


def llama_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def folder_without_prior(folder: Path) -> Path:
    source = stage_one_folder(folder)
    weights = {name: tensor for name, tensor in load_file(source / "model.safetensors").items() if not PRIOR_NAME.search(name)}
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    return source


@pytest.mark.parametrize(
    "make_source,argv,said",
    [
        (lambda folder: folder, [], "no config.json"),  # a folder that does not exist
        (llama_folder, [], "not a BamLlama folder"),
        (stage_one_folder, ["--layers", "3"], "layers 2, the model to train has 3"),
        (stage_one_folder, ["--heads", "8"], "heads 4, the model to train has 8"),
        (stage_one_folder, ["--prior-scope", "layer"], "prior scope 'global', the model to train has 'layer'"),
        (lambda folder: stage_one_folder(folder, prior_formula="legacy"), [], "prior formula 'legacy'"),
        (folder_without_prior, [], "its weights hold no prior"),
        (stage_one_folder, ["--positional", "alibi"], "--positional must be one of bam"),
        (stage_one_folder, ["--frozen-ssmax"], "--frozen-ssmax takes the SSMax scales"),  # without --ssmax
        (stage_one_folder, ["--ssmax", "--frozen-ssmax"], "Scalable Softmax False, the model to train has True"),
        (lambda folder: stage_one_folder(folder, ssmax=True, ssmax_prior=False), ["--ssmax", "--frozen-ssmax"],
         "Scalable Softmax order (ssmax_prior) False, the model to train has True"),
    ],
)
def test_a_prior_that_would_not_fit_is_refused_in_one_line_before_any_data_loads(tmp_path, capsys, make_source, argv, said):
    source = make_source(tmp_path / "stage-1")
    missing_data = tmp_path / "no-such-data.txt"  # reaching the data would report this file instead
    with pytest.raises(SystemExit) as exit_info:  # argparse's own refusals exit, the later checks return 2
        raise SystemExit(main(["--data", str(missing_data), "--output-dir", str(tmp_path / "out"), "--hidden-size",
                               "32", "--layers", "2", "--heads", "4", *argv, "--frozen-prior-from", str(source)]))
    line = one_error_line(capsys.readouterr().err, "bam-pretrain")
    assert exit_info.value.code == 2 and "--frozen-prior-from" in line and said in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "saved, asked, said",
    [
        ((4, 2), (4, 2), None),
        ((4, 2), (4, 4), None),  # key/value heads do not shape the prior: a query head's
        ((4, 4), (4, 1), None),
        ((8, 4), (4, 4), "heads 8, the model to train has 4"),  # the same key/value heads, not the same heads
        ((4, 4), (8, 4), "heads 4, the model to train has 8"),
        ((4, 2), (2, 2), "heads 4, the model to train has 2"),
    ],
    ids=["gqa", "gqa-to-mha", "mha-to-mqa", "fewer-heads", "more-heads", "heads-as-kv-heads"],
)
def test_a_prior_fits_by_its_heads_whatever_the_key_value_heads(tmp_path, capsys, saved, asked, said):
    """Stage 1 of (heads, key/value heads) `saved`, stage 2 asking `asked`: the prior fits where the query heads
    agree (the run goes on: it then stops at its missing data, naming that file), and is refused in one line naming
    both head counts where they do not, before the data."""
    source = stage_one_folder(tmp_path / "stage-1", num_attention_heads=saved[0], num_key_value_heads=saved[1])
    missing_data = tmp_path / "no-such-data.txt"
    code = main(["--data", str(missing_data), "--output-dir", str(tmp_path / "out"), "--hidden-size", "32",
                 "--layers", "2", "--heads", str(asked[0]), "--kv-heads", str(asked[1]), "--frozen-prior-from",
                 str(source)])
    line = one_error_line(capsys.readouterr().err, "bam-pretrain")
    assert code == 2, line
    if said is None:
        assert "--frozen-prior-from" not in line and "no-such-data.txt" in line, line
    else:
        assert "--frozen-prior-from" in line and said in line, line
    assert not (tmp_path / "out").exists()


def test_the_second_stage_of_t5_buckets_keeps_stage_one_s_bucket_bias(data, tmp_path):
    """--positional t5: stage two takes every layer's bucket_bias (H, 32) exactly and never trains it."""
    source = stage_one_folder(tmp_path / "stage-1", prior_scope="layer", prior_formula="t5_buckets")
    bucket_name = re.compile(r"prior\.bucket_bias$")
    reference = {name: tensor for name, tensor in load_file(source / "model.safetensors").items()
                 if bucket_name.search(name)}
    assert len(reference) == SIZES["num_hidden_layers"] and all(t.shape == (4, 32) and t.abs().min() > 0
                                                                  for t in reference.values())
    args = PretrainArguments(data=str(data), output_dir=str(tmp_path / "stage-2"), context_length=64, max_steps=3,
                             save_steps=3, per_device_train_batch_size=4, learning_rate=1e-2, eval_rows=4,
                             disable_progress_bars=True, prior_scope="layer", positional="t5",
                             frozen_prior_from=str(source), num_key_value_heads=4, **SIZES)
    _, model, _ = run_pretraining(args)
    folder = tmp_path / "stage-2" / "model"
    trained = load_file(folder / "model.safetensors")
    assert {name for name in trained if bucket_name.search(name)} == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(trained[name], tensor), name
    assert not any("prior" in name for name, _ in model.named_parameters())
    config = json.loads((folder / "config.json").read_text())
    assert (config["prior_formula"], config["train_bucket_bias"]) == ("t5_buckets", False)


@pytest.mark.parametrize(
    "stage_one, said",
    [
        (dict(), "prior formula 'current', the model to train has 't5_buckets'"),
        (dict(prior_formula="t5_buckets", t5_num_buckets=16), "T5 buckets 16, the model to train has 32"),
        (dict(prior_formula="t5_buckets", t5_max_distance=64), "T5 max distance 64, the model to train has 128"),
    ],
    ids=["ggd-to-t5", "other-buckets", "other-max-distance"],
)
def test_a_prior_that_would_not_fit_t5_buckets_is_refused_in_one_line(tmp_path, capsys, stage_one, said):
    source = stage_one_folder(tmp_path / "stage-1", **stage_one)
    code = main(["--data", str(tmp_path / "no-such-data.txt"), "--output-dir", str(tmp_path / "out"), "--hidden-size",
                 "32", "--layers", "2", "--heads", "4", "--positional", "t5", "--frozen-prior-from", str(source)])
    line = one_error_line(capsys.readouterr().err, "bam-pretrain")
    assert code == 2 and "--frozen-prior-from" in line and said in line, line
