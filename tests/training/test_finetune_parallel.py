"""bam-finetune's sharded and sequence-parallel modes: the Trainer fields they set, and one-line refusals (exit 2,
before data or weights load) of what cannot run. The training equality itself: test_sharded_training.py and
test_sequence_parallel.py."""

import pytest
from helpers import tiny_model
from peft import LoraConfig, get_peft_model

from bam_llama.cli.finetune import main
from bam_llama.training.distributed import parallel_training_arguments
from bam_llama.training.finetune import prior_values


def test_no_mode_sets_nothing():
    assert parallel_training_arguments(cuda_available=False) == {}


def test_fsdp2_wraps_every_decoder_layer():
    fields = parallel_training_arguments(fsdp=True, cuda_available=True)
    assert fields["fsdp"] == "full_shard auto_wrap"
    assert fields["fsdp_config"]["version"] == 2
    assert fields["fsdp_config"]["transformer_layer_cls_to_wrap"] == ["BamDecoderLayer"]


@pytest.mark.parametrize("preset, stage", [("zero2", 2), ("zero3", 3)])
def test_deepspeed_presets_and_ulysses(preset, stage):
    pytest.importorskip("deepspeed")
    fields = parallel_training_arguments(deepspeed=preset, sp_size=2, attn_implementation="sdpa", cuda_available=True)
    assert fields["deepspeed"]["zero_optimization"]["stage"] == stage
    assert fields["deepspeed"]["train_micro_batch_size_per_gpu"] == "auto"  # filled in by Trainer
    parallelism = fields["parallelism_config"]
    assert (parallelism.sp_backend, parallelism.sp_size) == ("deepspeed", 2)
    assert parallelism.sp_handler.sp_attn_implementation == "sdpa" and parallelism.sp_handler.sp_seq_length_is_variable


@pytest.mark.parametrize(
    "options, words",
    [
        (dict(fsdp=True, cuda_available=False), "need CUDA"),
        (dict(fsdp=True, deepspeed="zero3"), "one of --fsdp and --deepspeed"),
        (dict(sp_size=2, attn_implementation="sdpa"), "add --deepspeed"),
        (dict(sp_size=2, deepspeed="zero3", attn_implementation="bam_triton"), "--attn-implementation sdpa"),
        (dict(sp_size=2, deepspeed="zero3"), "--attn-implementation sdpa"),
        (dict(fsdp=True, merge=True), "--merge"),
        (dict(deepspeed="zero4"), "expected zero2, zero3 or a DeepSpeed JSON"),
    ],
)
def test_what_cannot_run_is_refused(options, words):
    if options.get("deepspeed") == "zero4":
        pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match=words.replace("-", r"\-")) as error:
        parallel_training_arguments(**{"cuda_available": True, **options})
    assert "\n" not in str(error.value)


def test_cli_refuses_fsdp_on_cpu_before_loading_data(tmp_path, capsys):
    model = tmp_path / "model"
    tiny_model("sdpa", train_context_length=16).save_pretrained(model)
    argv = ["--model", str(model), "--data", str(tmp_path / "missing.txt"), "--output-dir", str(tmp_path / "out"),
            "--context-length", "32", "--fsdp"]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("bam-finetune: error: --fsdp, --deepspeed and --sp-size need CUDA GPUs")
    assert not (tmp_path / "out").exists()


def test_prior_values_read_from_a_gathered_state_dict_are_the_models():
    model = get_peft_model(tiny_model("sdpa", ssmax=True), LoraConfig(target_modules=["q_proj"],
                                                                      modules_to_save=["prior", "ssmax"]))
    from_state = prior_values(model, model.state_dict())
    assert from_state == prior_values(model) and len(from_state) == 3  # the global prior, 2 layers' SSMax
