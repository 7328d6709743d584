import json
import os
import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from helpers import (
    FIXTURES_DIR,
    SAFETENSORS_DISK_FULL_MESSAGES,
    checkout_environment,
    default_sigint,
    disk_full_after_half,
    fill,
    one_error_line,
    require_reference_fixtures,
    small_tmpfs,
    snapshot,
    tiny_model,
    unwritable,
)
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM
from waiting import WatchedProcess, scaled

from bam_llama import BamLlamaConfig, BamLlamaForCausalLM
from bam_llama.cli.convert import main
from bam_llama.conversion.common import ConversionError, bam_parameter_shapes
from bam_llama.conversion.llama import convert_llama_checkpoint
from bam_llama.conversion.reference import (
    convert_bam_to_reference,
    convert_reference_checkpoint,
    reference_key_table,
)
from bam_llama.data.tokenizers import build_byte_tokenizer
from bam_llama.files.outputs import OutputError

# The documented reference -> BamLlama names, written out here independently of the converter's tables.
PRIOR_TO_BAM = {"shape": "theta_beta", "scale": "theta_alpha", "loc": "theta_mu"}
PRIOR_TO_BAM.update({name: name for name in PRIOR_TO_BAM.values()})
TOP_LEVEL_TO_BAM = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    **{f"prior.{name}": f"model.prior.{bam}" for name, bam in PRIOR_TO_BAM.items()},
}
LAYER_TO_BAM = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.seq_scale": "self_attn.ssmax.scale",
    **{f"attention.prior.{name}": f"self_attn.prior.{bam}" for name, bam in PRIOR_TO_BAM.items()},
}


def bam_name(reference_name: str) -> str:
    if reference_name in TOP_LEVEL_TO_BAM:
        return TOP_LEVEL_TO_BAM[reference_name]
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", reference_name).groups()
    return f"model.layers.{layer}.{LAYER_TO_BAM[rest]}"


def logits(model, input_ids, **kwargs):
    with torch.no_grad():
        return model(input_ids, use_cache=False, **kwargs).logits


def token_by_token_logits(model, input_ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        steps = [model(input_ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(input_ids.shape[1])]
    return torch.cat(steps, 1)


def load_bam(folder) -> BamLlamaForCausalLM:
    return BamLlamaForCausalLM.from_pretrained(folder).eval()


def folder_listing(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


# ---------------------------------------------------------------------------------------------- reference fixtures


def fixture_run(variant: str) -> Path:
    return require_reference_fixtures() / "logs" / "l6" / variant / "version_00"


def fixture_io(variant: str) -> dict:
    return torch.load(FIXTURES_DIR / f"{variant}_io.pt", weights_only=True)


def packed_position_ids(seq_codes: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 for every document of a packed row."""
    rows = []
    for row in seq_codes:
        lengths = torch.unique_consecutive(row, return_counts=True)[1]
        rows.append(torch.cat([torch.arange(length) for length in lengths]))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def converted_fixtures(tmp_path_factory):
    """The fixture runs converted once: bam and bam_ssmax (current formula) and bam with the legacy formula."""
    out = tmp_path_factory.mktemp("fixtures")
    folders = {}
    for name, variant, formula in [("bam", "bam", None), ("bam_ssmax", "bam_ssmax", None), ("bam_legacy", "bam", "legacy")]:
        folders[name] = convert_reference_checkpoint(fixture_run(variant), out / name, formula=formula, verbose=False)
    return folders


@pytest.mark.parametrize("variant", ["bam", "bam_ssmax"])
def test_reference_fixture_logits(converted_fixtures, variant):
    model, io = load_bam(converted_fixtures[variant]), fixture_io(variant)
    assert model.config.ssmax == (variant == "bam_ssmax")
    assert model.config.converted_from["variant"] == variant
    assert model.config.prior_formula == model.config.converted_from["prior_formula"] == "current"
    torch.testing.assert_close(logits(model, io["input_ids"]), io["logits"], atol=1e-4, rtol=0)
    packed = logits(model, io["input_ids"], position_ids=packed_position_ids(io["seq_codes"]))
    torch.testing.assert_close(packed, io["logits_packed"], atol=1e-4, rtol=0)


def test_reference_fixture_bam_ssmax_kv_cache(converted_fixtures):
    model, io = load_bam(converted_fixtures["bam_ssmax"]), fixture_io("bam_ssmax")
    for row in range(io["input_ids"].shape[0]):
        steps = token_by_token_logits(model, io["input_ids"][row : row + 1])
        torch.testing.assert_close(steps[0], io["inference_tbt_logits"][row], atol=1e-4, rtol=0)


def test_reference_fixture_bam_legacy_formula_matches_reference_inference(converted_fixtures):
    # The reference inference class for plain bam still uses the legacy formula (fixture README).
    model, io = load_bam(converted_fixtures["bam_legacy"]), fixture_io("bam")
    assert model.config.prior_formula == "legacy"
    assert model.config.converted_from["prior_formula_from"] == "--formula"
    full_pass = logits(model, io["input_ids"])
    torch.testing.assert_close(full_pass, io["inference_tbt_logits"], atol=1e-4, rtol=0)
    torch.testing.assert_close(token_by_token_logits(model, io["input_ids"][:1])[0], io["inference_tbt_logits"][0], atol=1e-4, rtol=0)
    assert (full_pass - io["logits"]).abs().max() > 1e-2  # the formula really changed the model


def test_reference_fixture_round_trip_is_exact(converted_fixtures, tmp_path):
    run_dir = fixture_run("bam_ssmax")
    back = convert_bam_to_reference(converted_fixtures["bam_ssmax"], tmp_path / "run", verbose=False)
    original = torch.load(run_dir / "model.pt", weights_only=True)
    restored = torch.load(back / "model.pt", weights_only=True)
    assert list(restored) == list(original)
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype and restored[name].shape == tensor.shape, name
        assert torch.equal(restored[name], tensor), name
    assert json.loads((back / "args.json").read_text()) == json.loads((run_dir / "args.json").read_text())


# ---------------------------------------------------------------------------------------------- synthetic reference runs


def write_reference_run(
    folder: Path,
    *,
    variant: str = "bam",
    per_layer_prior: bool = False,
    theta_names: bool = False,
    prefix: str = "",
    n_kv_heads: int | None = None,
    ffn_dim_multiplier: float | None = 2,
    multiple_of: int = 1,
    position_encoding: str | None = "default",
    drop: tuple[str, ...] = (),
    extra: dict | None = None,
    reshape: dict | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A reference run folder in the documented layout, with random weights. Returns the unprefixed state_dict."""
    dim, n_layers, n_heads, vocab = 32, 2, 4, 50
    kv_dim = (n_kv_heads or n_heads) * dim // n_heads
    hidden = dim if ffn_dim_multiplier is None else int(ffn_dim_multiplier * dim)
    hidden = multiple_of * -(-hidden // multiple_of)
    generator = torch.Generator().manual_seed(seed)

    def random(*shape):
        return torch.randn(*shape, generator=generator) * 0.2

    prior_names = ("theta_beta", "theta_alpha", "theta_mu") if theta_names else ("shape", "scale", "loc")
    prior_values = [random(1, n_heads, 1, 1) + 0.5, random(1, n_heads, 1, 1) - 0.5, random(1, n_heads, 1, 1)]
    state_dict = {"tok_embeddings.weight": random(vocab, dim)}
    for layer in range(n_layers):
        base = f"layers.{layer}."
        if variant == "bam_ssmax":
            state_dict[base + "attention.seq_scale"] = 1 + random(1, n_heads, 1, 1)
        state_dict[base + "attention.wq.weight"] = random(dim, dim)
        state_dict[base + "attention.wk.weight"] = random(kv_dim, dim)
        state_dict[base + "attention.wv.weight"] = random(kv_dim, dim)
        state_dict[base + "attention.wo.weight"] = random(dim, dim)
        if per_layer_prior:
            for name, value in zip(prior_names, prior_values):
                state_dict[f"{base}attention.prior.{name}"] = value + 0.1 * layer
        state_dict[base + "feed_forward.w1.weight"] = random(hidden, dim)
        state_dict[base + "feed_forward.w2.weight"] = random(dim, hidden)
        state_dict[base + "feed_forward.w3.weight"] = random(hidden, dim)
        state_dict[base + "attention_norm.weight"] = 1 + random(dim)
        state_dict[base + "ffn_norm.weight"] = 1 + random(dim)
    state_dict["norm.weight"] = 1 + random(dim)
    state_dict["output.weight"] = random(vocab, dim)
    if not per_layer_prior:
        state_dict.update({f"prior.{name}": value for name, value in zip(prior_names, prior_values)})
    for name in drop:
        del state_dict[name]
    for name, shape in (reshape or {}).items():
        state_dict[name] = random(*shape)
    state_dict.update(extra or {})

    train_flags = ("train_theta_beta", "train_theta_alpha", "train_theta_mu") if theta_names else ("train_shape", "train_scale", "train_loc")
    model_args = {
        "dim": dim, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "vocab_size": vocab,
        "multiple_of": multiple_of, "ffn_dim_multiplier": ffn_dim_multiplier, "norm_eps": 1e-5, "max_seq_len": 96,
        train_flags[0]: True, train_flags[1]: True, train_flags[2]: True,
        "global_positional_encoding": not per_layer_prior,
    }
    if variant == "bam_ssmax":
        model_args.update(seq_scale=False, ssmax_prior=True)
    args = {"model_size": "l6", "sequence_length": 64, "num_iterations": float("inf")}
    if position_encoding is not None:
        args["position_encoding"] = variant if position_encoding == "default" else position_encoding
    folder.mkdir(parents=True)
    torch.save({prefix + name: tensor for name, tensor in state_dict.items()}, folder / "model.pt")
    (folder / "args.json").write_text(json.dumps({"args": args, "dataset_args": {}, "model_args": model_args}, indent=4))
    return state_dict


SYNTHETIC_RUNS = {
    "per_layer_prior": dict(per_layer_prior=True),
    "theta_names": dict(theta_names=True),
    "ddp_prefix": dict(prefix="module."),
    "compile_prefix_ssmax": dict(prefix="_orig_mod.", variant="bam_ssmax"),
    "gqa_ssmax_per_layer_theta": dict(variant="bam_ssmax", n_kv_heads=2, per_layer_prior=True, theta_names=True, prefix="module._orig_mod."),
    "mqa_no_ffn_multiplier": dict(n_kv_heads=1, ffn_dim_multiplier=None, multiple_of=24),
}


@pytest.mark.parametrize("case", list(SYNTHETIC_RUNS))
def test_synthetic_reference_run_converts_and_round_trips(case, tmp_path):
    options = SYNTHETIC_RUNS[case]
    state_dict = write_reference_run(tmp_path / "run", **options)
    out = convert_reference_checkpoint(tmp_path / "run", tmp_path / "bam", verbose=False)

    model = load_bam(out)
    config = model.config
    assert config.num_key_value_heads == (options.get("n_kv_heads") or 4)
    assert config.prior_scope == ("layer" if options.get("per_layer_prior") else "global")
    assert config.ssmax == (options.get("variant") == "bam_ssmax")
    assert config.train_context_length == 64 and config.train_theta_mu and not config.tie_word_embeddings
    assert config.converted_from["prior_parameter_names"] == ("theta" if options.get("theta_names") else "shape-scale-loc")
    if config.ssmax:
        assert not config.train_ssmax_scale and not model.model.layers[0].self_attn.ssmax.scale.requires_grad
    converted = model.state_dict()
    assert sorted(converted) == sorted(bam_name(name) for name in state_dict)
    for name, tensor in state_dict.items():
        expected = tensor.reshape(-1) if tensor.dim() == 4 else tensor
        assert torch.equal(converted[bam_name(name)], expected), name
    output = logits(model, torch.randint(0, 50, (2, 12)))
    assert output.shape == (2, 12, 50) and torch.isfinite(output).all()

    prior_names = "theta" if options.get("theta_names") else "shape-scale-loc"
    back = convert_bam_to_reference(out, tmp_path / "back", prior_names=prior_names, verbose=False)
    restored = torch.load(back / "model.pt", weights_only=True)
    assert list(restored) == list(state_dict)
    assert all(torch.equal(restored[name], tensor) for name, tensor in state_dict.items())
    original_args = json.loads((tmp_path / "run" / "args.json").read_text())
    assert json.loads((back / "args.json").read_text()) == original_args


def edit_model_args(run_dir: Path, **changes) -> None:
    """Set (or, with None, remove) model_args fields of a reference run's args.json."""
    path = run_dir / "args.json"
    args = json.loads(path.read_text())
    for name, value in changes.items():
        if value is None:
            args["model_args"].pop(name, None)
        else:
            args["model_args"][name] = value
    path.write_text(json.dumps(args))


TRAINING_FIELDS = ("train_shape", "train_scale", "train_loc", "train_theta_beta", "train_theta_alpha",
                   "train_theta_mu", "seq_scale", "ssmax_prior", "norm_eps", "n_kv_heads", "multiple_of")


@pytest.mark.parametrize("theta_names", [False, True])
def test_args_json_without_training_flags_takes_the_reference_dataclass_defaults(tmp_path, theta_names):
    """The reference ModelArgs defaults (official-bam-details.md, section 1): shape and scale trained, loc not;
    bam_ssmax: seq_scale trained, ssmax_prior on; norm_eps 1e-5 (train.py's value); n_kv_heads = n_heads."""
    write_reference_run(tmp_path / "run", variant="bam_ssmax", theta_names=theta_names)
    edit_model_args(tmp_path / "run", **dict.fromkeys(TRAINING_FIELDS))
    config = BamLlamaConfig.from_pretrained(convert_reference_checkpoint(tmp_path / "run", tmp_path / "bam", verbose=False))
    assert (config.train_theta_beta, config.train_theta_alpha, config.train_theta_mu) == (True, True, False)
    assert config.train_ssmax_scale and config.ssmax_prior
    assert config.rms_norm_eps == 1e-5 and config.num_key_value_heads == config.num_attention_heads == 4


@pytest.mark.parametrize("theta_names", [False, True])
@pytest.mark.parametrize("frozen", [0, 1, 2])
def test_each_training_flag_of_args_json_is_read_under_its_own_name(tmp_path, theta_names, frozen):
    """One flag false, the others true (loc / theta_mu given true, against its default): each reaches its own
    parameter, under either generation's names."""
    flags = ("train_theta_beta", "train_theta_alpha", "train_theta_mu") if theta_names else ("train_shape", "train_scale", "train_loc")
    write_reference_run(tmp_path / "run", theta_names=theta_names)
    edit_model_args(tmp_path / "run", **{flag: index != frozen for index, flag in enumerate(flags)})
    model = load_bam(convert_reference_checkpoint(tmp_path / "run", tmp_path / "bam", verbose=False))
    prior = model.model.prior
    trained = [prior.theta_beta.requires_grad, prior.theta_alpha.requires_grad, prior.theta_mu.requires_grad]
    assert trained == [index != frozen for index in range(3)]


def test_reference_dtype_option_casts_weights_but_keeps_prior_precision(tmp_path):
    write_reference_run(tmp_path / "run", variant="bam_ssmax")
    out = convert_reference_checkpoint(tmp_path / "run", tmp_path / "bam", dtype="bfloat16", verbose=False)
    config = BamLlamaConfig.from_pretrained(out)
    assert config.dtype == torch.bfloat16
    model = BamLlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert torch.equal(model.model.prior.theta_beta, reference["prior.shape"].reshape(-1))
    assert torch.equal(model.model.layers[1].self_attn.ssmax.scale, reference["layers.1.attention.seq_scale"].reshape(-1))
    assert torch.equal(model.lm_head.weight, reference["output.weight"].bfloat16().float())
    assert not torch.equal(model.lm_head.weight, reference["output.weight"])


def test_reference_tokenizer_is_copied(tmp_path):
    write_reference_run(tmp_path / "run")
    build_byte_tokenizer().save_pretrained(tmp_path / "tokenizer")
    out = convert_reference_checkpoint(tmp_path / "run", tmp_path / "bam", tokenizer=tmp_path / "tokenizer", verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("ab").input_ids == build_byte_tokenizer()("ab").input_ids


def test_key_table_covers_the_model_for_every_layout():
    for overrides in [dict(), dict(ssmax=True, prior_scope="layer"), dict(num_key_value_heads=1, tie_word_embeddings=True)]:
        config = BamLlamaConfig(vocab_size=11, hidden_size=16, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, **overrides)
        for names in ("shape-scale-loc", "theta"):
            table = reference_key_table(config, names)
            assert sorted(table.values()) == sorted(bam_parameter_shapes(config))
            assert all(bam_name(reference) == bam for reference, bam in table.items() if names == "shape-scale-loc")


# ---------------------------------------------------------------------------------------------- bad reference input


def assert_conversion_error(tmp_path, expected_messages, **options):
    """Convert tmp_path/run; expect a ConversionError naming every `expected_messages` and nothing written."""
    before = folder_listing(tmp_path)
    with pytest.raises(ConversionError) as error:
        convert_reference_checkpoint(tmp_path / "run", tmp_path / "out" / "bam", verbose=False, **options)
    for message in expected_messages:
        assert message in str(error.value)
    assert folder_listing(tmp_path) == before
    return str(error.value)


@pytest.mark.parametrize(
    "run_options, convert_options, messages",
    [
        (dict(extra={"layers.0.attention.rope.freqs": torch.zeros(4)}), {}, ["unknown keys", "layers.0.attention.rope.freqs"]),
        (dict(drop=("layers.1.ffn_norm.weight", "prior.loc")), {}, ["missing keys", "layers.1.ffn_norm.weight", "prior.loc"]),
        (dict(reshape={"layers.0.attention.wk.weight": (16, 32)}), {}, ["layers.0.attention.wk.weight has shape (16, 32), expected (32, 32)"]),
        (dict(position_encoding=None), {}, ["cannot decide the variant", "--variant"]),
        (dict(position_encoding="rope"), {}, ["'rope'", "not a GGD-BAM variant"]),
        (dict(), dict(variant="bam_ssmax"), ["contradictory variants", "--variant says 'bam_ssmax'"]),
        (dict(variant="bam_ssmax", position_encoding="bam"), {}, ["has SSMax keys"]),
        (dict(extra={"prior.shape": torch.zeros(1, 4, 1, 1)}, per_layer_prior=True), {}, ["both a global prior"]),
        (dict(extra={"prior.theta_beta": torch.zeros(1, 4, 1, 1)}), {}, ["mixes the two prior parameter-name generations"]),
        (dict(extra={"module.norm.weight": torch.zeros(32)}), {}, ["'norm.weight' and 'module.norm.weight'"]),
    ],
    ids=["unknown_key", "missing_keys", "shape_mismatch", "undecidable_variant", "not_bam", "flag_contradicts_args",
         "keys_contradict_args", "global_and_layer_prior", "mixed_names", "duplicate_after_prefix"],
)
def test_bad_reference_input_is_named_and_leaves_nothing(tmp_path, run_options, convert_options, messages):
    write_reference_run(tmp_path / "run", **run_options)
    assert_conversion_error(tmp_path, messages, **convert_options)


def test_missing_variant_is_decided_by_the_flag(tmp_path):
    write_reference_run(tmp_path / "run", variant="bam_ssmax", position_encoding=None)
    out = convert_reference_checkpoint(tmp_path / "run", tmp_path / "bam", variant="bam_ssmax", verbose=False)
    assert BamLlamaConfig.from_pretrained(out).converted_from["variant_from"] == "--variant"


def test_prior_scope_contradicting_args_is_an_error(tmp_path):
    write_reference_run(tmp_path / "run", per_layer_prior=True)
    args_path = tmp_path / "run" / "args.json"
    run_args = json.loads(args_path.read_text())
    run_args["model_args"]["global_positional_encoding"] = True
    args_path.write_text(json.dumps(run_args))
    assert_conversion_error(tmp_path, ["global_positional_encoding is True", "per-layer priors"])


@pytest.mark.parametrize("missing", ["model.pt", "args.json"])
def test_missing_reference_file_is_named(tmp_path, missing):
    write_reference_run(tmp_path / "run")
    (tmp_path / "run" / missing).unlink()
    assert_conversion_error(tmp_path, ["missing file", missing])


def test_existing_output_needs_force(tmp_path):
    write_reference_run(tmp_path / "run")
    out = tmp_path / "bam"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="already exists; pass --force"):
        convert_reference_checkpoint(tmp_path / "run", out, verbose=False)
    assert folder_listing(out) == ["keep.txt"]
    convert_reference_checkpoint(tmp_path / "run", out, force=True, verbose=False)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bam", "run"]  # no staging or old folder left


def test_output_may_not_replace_the_input(tmp_path):
    write_reference_run(tmp_path / "run")
    with pytest.raises(OutputError, match="would replace the input"):
        convert_reference_checkpoint(tmp_path / "run", tmp_path, force=True, verbose=False)
    assert (tmp_path / "run" / "model.pt").is_file()


def test_failure_while_writing_leaves_nothing_behind(tmp_path, monkeypatch):
    from bam_llama.conversion import writing

    write_reference_run(tmp_path / "run")
    before = folder_listing(tmp_path)

    def fail(config, folder):
        assert any(folder.iterdir())  # the weights are already in the staging folder
        raise OSError("disk full")

    monkeypatch.setattr(writing, "save_config_and_code", fail)
    with pytest.raises(OSError, match="disk full"):
        convert_reference_checkpoint(tmp_path / "run", tmp_path / "new" / "parents" / "bam", verbose=False)
    assert folder_listing(tmp_path) == before


# ---------------------------------------------------------------------------------------------- Llama -> BamLlama


def save_tiny_llama(folder: Path, **overrides) -> LlamaForCausalLM:
    values = dict(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    )
    values.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**values)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(folder, max_shard_size="20KB")
    build_byte_tokenizer().save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama") / "llama"
    return folder, save_tiny_llama(folder)


def alibi_log_slopes_for_4_heads() -> torch.Tensor:
    return torch.tensor([2.0 ** (-8 * (k + 1) / 4) for k in range(4)]).log()


def test_llama_conversion_keeps_weights_and_sets_alibi_prior(tiny_llama, tmp_path):
    llama_dir, llama = tiny_llama
    assert (llama_dir / "model.safetensors.index.json").is_file()  # the source is sharded
    out = convert_llama_checkpoint(llama_dir, tmp_path / "bam", prior="alibi", base_model="org/tiny-llama", max_shard_size="30KB", verbose=False)
    assert (out / "model.safetensors.index.json").is_file()

    model = load_bam(out)
    config = model.config
    assert config.base_model == config.converted_from["base_model"] == "org/tiny-llama"
    assert "base_model: org/tiny-llama" in (out / "README.md").read_text()
    assert config.train_context_length == 256 and config.num_key_value_heads == 2 and config.rms_norm_eps == 1e-6
    assert not config.ssmax and config.prior_scope == "global"
    converted = model.state_dict()
    for name, tensor in llama.state_dict().items():
        assert torch.equal(converted[name], tensor), name
    torch.testing.assert_close(model.model.prior.theta_alpha, alibi_log_slopes_for_4_heads())
    assert torch.equal(model.model.prior.theta_beta, torch.ones(4))
    assert torch.equal(model.model.prior.theta_mu, torch.zeros(4))
    assert set(converted) - set(llama.state_dict()) == {f"model.prior.theta_{name}" for name in ("alpha", "beta", "mu")}

    # At the first position RoPE is the identity, so both models agree there (and only there).
    input_ids = torch.randint(0, 61, (2, 10))
    bam_logits, llama_logits = logits(model, input_ids), logits(llama, input_ids)
    torch.testing.assert_close(bam_logits[:, 0], llama_logits[:, 0], atol=1e-5, rtol=0)
    assert not torch.allclose(bam_logits[:, 1:], llama_logits[:, 1:], atol=1e-3)
    assert AutoTokenizer.from_pretrained(out)("hi").input_ids == build_byte_tokenizer()("hi").input_ids


def test_llama_conversion_uniform_prior_with_ssmax_per_layer(tiny_llama, tmp_path):
    llama_dir, _ = tiny_llama
    out = convert_llama_checkpoint(llama_dir, tmp_path / "bam", prior="uniform", ssmax=True, prior_scope="layer", train_context_length=64, verbose=False)
    model = load_bam(out)
    assert model.config.ssmax and model.config.prior_scope == "layer" and model.config.train_context_length == 64
    assert model.config.converted_from["source"] == str(llama_dir.resolve())
    for layer in model.model.layers:
        for name in ("theta_alpha", "theta_beta", "theta_mu"):
            assert torch.equal(getattr(layer.self_attn.prior, name), torch.zeros(4))
        assert torch.equal(layer.self_attn.ssmax.scale, torch.ones(4))
    assert torch.isfinite(logits(model, torch.randint(0, 61, (1, 9)))).all()


def test_llama_with_tied_embeddings_converts_and_round_trips_through_reference(tmp_path):
    save_tiny_llama(tmp_path / "llama", tie_word_embeddings=True, num_key_value_heads=4, intermediate_size=40)
    bam_dir = convert_llama_checkpoint(tmp_path / "llama", tmp_path / "bam", prior="alibi", verbose=False)
    model = load_bam(bam_dir)
    assert model.config.tie_word_embeddings and torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    run_dir = convert_bam_to_reference(bam_dir, tmp_path / "run", verbose=False)
    run_args = json.loads((run_dir / "args.json").read_text())
    assert run_args["args"]["position_encoding"] == "bam" and run_args["model_args"]["dim"] == 32
    again = load_bam(convert_reference_checkpoint(run_dir, tmp_path / "again", verbose=False))
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


@pytest.mark.parametrize(
    "overrides, message",
    [(dict(attention_bias=True), "attention_bias=True"), (dict(mlp_bias=True), "mlp_bias=True")],
)
def test_llama_with_unsupported_settings_is_rejected(tmp_path, overrides, message):
    save_tiny_llama(tmp_path / "llama", **overrides)
    with pytest.raises(ConversionError, match=message):
        convert_llama_checkpoint(tmp_path / "llama", tmp_path / "bam", verbose=False)
    assert not (tmp_path / "bam").exists()


def test_llama_input_errors(tiny_llama, tmp_path):
    llama_dir, _ = tiny_llama
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="missing file .*config.json"):
        convert_llama_checkpoint(tmp_path / "empty", tmp_path / "bam", verbose=False)
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "mistral"}))
    with pytest.raises(ConversionError, match="model_type 'mistral'"):
        convert_llama_checkpoint(tmp_path / "empty", tmp_path / "bam", verbose=False)
    (tmp_path / "empty" / "config.json").write_text((llama_dir / "config.json").read_text())
    with pytest.raises(ConversionError, match="missing weights"):
        convert_llama_checkpoint(tmp_path / "empty", tmp_path / "bam", verbose=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty"]


# ---------------------------------------------------------------------------------------------- command line


def test_command_line_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert all(command in usage for command in ("reference", "llama", "to-reference"))


def test_console_script_points_at_main():
    scripts = entry_points(group="console_scripts", name="bam-convert")
    if not scripts:
        pytest.skip("bam-llama is not installed, so there is no bam-convert script")
    assert next(iter(scripts)).load() is main


@pytest.mark.parametrize(
    "command, options",
    [
        ("reference", ["--tokenizer", "--formula", "--variant", "--force", "--dtype"]),
        ("llama", ["--prior", "--ssmax", "--train-context-length", "--force"]),
        ("to-reference", ["--prior-names", "--force"]),
    ],
)
def test_subcommand_help(capsys, command, options):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    usage = capsys.readouterr().out
    assert all(option in usage for option in options)


def test_command_line_converts_and_reports_errors(tmp_path, capsys):
    write_reference_run(tmp_path / "run", variant="bam_ssmax")
    assert main(["reference", str(tmp_path / "run"), str(tmp_path / "bam"), "--formula", "legacy"]) == 0
    printed = capsys.readouterr().out
    assert "variant bam_ssmax" in printed and "prior formula legacy" in printed
    assert BamLlamaConfig.from_pretrained(tmp_path / "bam").prior_formula == "legacy"

    assert main(["reference", str(tmp_path / "run"), str(tmp_path / "bam")]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["to-reference", str(tmp_path / "missing"), str(tmp_path / "back")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["to-reference", str(tmp_path / "bam"), str(tmp_path / "back"), "--prior-names", "theta"]) == 0
    assert "prior.theta_beta" in torch.load(tmp_path / "back" / "model.pt", weights_only=True)


# ---------------------------------------------------------------------------------------------- interruptions, bad settings


CONVERT_THEN_WAIT = """
import sys, time
from bam_llama.cli import convert as convert_cli
from bam_llama.conversion import writing

finish = writing.SafetensorsShardWriter.finish

def finish_then_wait(self):
    files = finish(self)
    print("staged", flush=True)
    time.sleep(float(sys.argv[1]))  # until the test's signal
    return files

writing.SafetensorsShardWriter.finish = finish_then_wait
sys.exit(convert_cli.main(sys.argv[2:]))
"""


def test_sigterm_during_bam_convert_leaves_no_partial_folder(tmp_path):
    import signal
    import sys

    write_reference_run(tmp_path / "run")
    (tmp_path / "convert.py").write_text(CONVERT_THEN_WAIT)
    process = WatchedProcess(
        [sys.executable, str(tmp_path / "convert.py"), str(scaled(600)), "reference", str(tmp_path / "run"),
         str(tmp_path / "out" / "bam")],
        env=checkout_environment(),
    )
    process.wait_for_line("staged", 300)
    assert any(path.name.endswith(".partial") for path in (tmp_path / "out").iterdir())
    process.process.send_signal(signal.SIGTERM)
    assert process.wait(60, "bam-convert's exit after SIGTERM") == 128 + signal.SIGTERM
    assert sorted(path.name for path in tmp_path.iterdir()) == ["convert.py", "run"]  # nor the parent it created


def test_missing_ffn_dim_multiplier_points_at_args_json(tmp_path):
    write_reference_run(tmp_path / "run", ffn_dim_multiplier=2)
    args_path = tmp_path / "run" / "args.json"
    run_args = json.loads(args_path.read_text())
    del run_args["model_args"]["ffn_dim_multiplier"]
    args_path.write_text(json.dumps(run_args))
    message = assert_conversion_error(tmp_path, ["feed-forward width 64", "no ffn_dim_multiplier", "give 32", "args.json"])
    assert "shape mismatches" not in message


def test_a_nan_ssmax_scale_is_refused_before_writing(tiny_llama, tmp_path, capsys):
    llama_dir, _ = tiny_llama
    status = main(["llama", str(llama_dir), str(tmp_path / "bam"), "--ssmax", "--ssmax-scale-init", "nan"])
    assert status == 2
    error = capsys.readouterr().err.strip()
    assert "ssmax_scale_init" in error and "finite" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "bam").exists()


def test_an_unwritable_output_parent_is_one_line_and_status_2(tmp_path, monkeypatch, capsys):
    from bam_llama.files import outputs

    write_reference_run(tmp_path / "run")

    def refuse(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr(outputs.tempfile, "mkdtemp", refuse)
    assert main(["reference", str(tmp_path / "run"), str(tmp_path / "bam")]) == 2
    error = capsys.readouterr().err.strip()
    assert error == f"bam-convert: error: cannot create {tmp_path / 'bam'}: no permission to write in {tmp_path}"


def test_unknown_formula_and_prior_scope_are_one_line_errors(tiny_llama, tmp_path, capsys):
    write_reference_run(tmp_path / "run")
    assert main(["reference", str(tmp_path / "run"), str(tmp_path / "bam"), "--formula", "newest"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bam-convert: error: unknown prior formula 'newest'; expected one of ('current', 'legacy')"
    )
    llama_dir, _ = tiny_llama
    assert main(["llama", str(llama_dir), str(tmp_path / "bam"), "--prior-scope", "head"]) == 2
    assert "unknown prior scope 'head'; expected one of ('global', 'layer')" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]


# ---------------------------------------------------------------------------------------------- weights that are not finite, a full disk


def write_tiny_llama_with(folder: Path, name: str, value: float) -> None:
    save_tiny_llama(folder)
    weights = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights = load_file(path)
        if name in weights:
            weights[name].view(-1)[3] = value
            save_file(weights, path, metadata={"format": "pt"})
            return
    raise AssertionError(f"{name} is in no shard")


def test_weights_that_are_not_finite_are_refused_by_every_conversion(tmp_path, capsys):
    """One line naming the tensor and its file, status 2, nothing written: a Llama folder, a reference run and a
    BamLlama folder (to-reference)."""
    write_tiny_llama_with(tmp_path / "llama", "model.layers.1.mlp.up_proj.weight", float("nan"))
    state_dict = write_reference_run(tmp_path / "run")
    state_dict["layers.0.attention.wk.weight"][0, 0] = float("-inf")
    torch.save(state_dict, tmp_path / "run" / "model.pt")
    write_reference_run(tmp_path / "good-run")
    assert main(["reference", str(tmp_path / "good-run"), str(tmp_path / "bam")]) == 0
    bam_weights = load_file(tmp_path / "bam" / "model.safetensors")
    bam_weights["model.prior.theta_beta"][1] = float("inf")
    save_file(bam_weights, tmp_path / "bam" / "model.safetensors", metadata={"format": "pt"})
    before = folder_listing(tmp_path)
    cases = [
        (["llama", str(tmp_path / "llama"), str(tmp_path / "out-llama")], "model.layers.1.mlp.up_proj.weight in"),
        (["reference", str(tmp_path / "run"), str(tmp_path / "out-reference")],
         f"layers.0.attention.wk.weight in {tmp_path / 'run' / 'model.pt'}"),
        (["to-reference", str(tmp_path / "bam"), str(tmp_path / "out-run")],
         f"model.prior.theta_beta in {tmp_path / 'bam' / 'model.safetensors'}"),
    ]
    for argv, named in cases:
        capsys.readouterr()
        assert main(argv) == 2, argv
        line = one_error_line(capsys.readouterr().err, "bam-convert")
        assert named in line and "NaN or infinite" in line, line
    assert folder_listing(tmp_path) == before


def test_a_full_disk_during_a_conversion_keeps_the_earlier_output(tiny_llama, tmp_path, monkeypatch, capsys):
    llama_dir, _ = tiny_llama
    out = tmp_path / "out" / "bam"
    assert main(["llama", str(llama_dir), str(out), "--max-shard-size", "30KB"]) == 0
    before = snapshot(tmp_path / "out")
    monkeypatch.setattr("bam_llama.conversion.writing.save_file", disk_full_after_half(save_file))  # writes each shard
    capsys.readouterr()
    assert main(["llama", str(llama_dir), str(out), "--force", "--prior", "alibi"]) == 1
    assert "No space left on device" in one_error_line(capsys.readouterr().err, "bam-convert")
    assert snapshot(tmp_path / "out") == before  # the earlier conversion, and no staging folder beside it


@pytest.mark.parametrize("message", SAFETENSORS_DISK_FULL_MESSAGES)
def test_a_full_disk_that_safetensors_reports_its_own_way_is_one_line_and_keeps_the_earlier_output(
    tiny_llama, tmp_path, monkeypatch, capsys, message
):
    """safetensors raises SafetensorError, not OSError: it is still a full disk, status 1, one line naming the
    output, and the earlier conversion stays (issue 47: it ended in a traceback)."""
    from safetensors import SafetensorError

    llama_dir, _ = tiny_llama
    out = tmp_path / "out" / "bam"
    assert main(["llama", str(llama_dir), str(out)]) == 0
    before = snapshot(tmp_path / "out")
    monkeypatch.setattr("bam_llama.conversion.writing.save_file", disk_full_after_half(save_file, SafetensorError(message)))
    capsys.readouterr()
    assert main(["llama", str(llama_dir), str(out), "--force", "--prior", "alibi"]) == 1
    line = one_error_line(capsys.readouterr().err, "bam-convert")
    assert line == f"bam-convert: error: No space left on device ({out.resolve()})"
    assert snapshot(tmp_path / "out") == before


def test_a_real_disk_with_room_for_one_copy_refuses_a_forced_conversion_in_one_line(tiny_llama, tmp_path, capsys,
                                                                                     monkeypatch):
    """A tmpfs (where the suite may mount one) holding one conversion and less than one shard of free space: the
    --force conversion fails in safetensors' own writer, in one line, status 1; the earlier output stays whole."""
    from bam_llama.conversion import writing

    llama_dir, _ = tiny_llama
    raised = []

    def save_file_recorded(*args, **kwargs):
        try:
            return save_file(*args, **kwargs)
        except Exception as error:
            raised.append(type(error).__name__)
            raise

    with small_tmpfs(tmp_path, "2m") as disk:
        out = disk / "bam"
        assert main(["llama", str(llama_dir), str(out), "--max-shard-size", "30KB"]) == 0
        before = snapshot(out)
        fill(disk, leave=8 * 1024)  # less than one 30 KB shard
        monkeypatch.setattr(writing, "save_file", save_file_recorded)
        capsys.readouterr()
        assert main(["llama", str(llama_dir), str(out), "--force", "--max-shard-size", "30KB"]) == 1
        line = one_error_line(capsys.readouterr().err, "bam-convert")
        assert raised == ["SafetensorError"], raised  # the real library's error, not an injected one
        assert line == f"bam-convert: error: No space left on device ({out})"
        assert snapshot(out) == before and sorted(os.listdir(disk)) == ["bam", "filler"]


def test_an_unwritable_output_folder_is_one_line_for_llama_and_gguf_sources(tiny_llama, tmp_path, monkeypatch, capsys):
    llama_dir, _ = tiny_llama
    (tmp_path / "out").mkdir()
    with unwritable(tmp_path / "out", monkeypatch):
        assert main(["llama", str(llama_dir), str(tmp_path / "out" / "bam")]) == 2
    line = one_error_line(capsys.readouterr().err, "bam-convert")
    assert "Permission denied" in line or "no permission" in line
    assert list((tmp_path / "out").iterdir()) == []


def test_a_bad_shard_size_is_refused_before_anything_is_printed(tiny_llama, tmp_path, capsys):
    llama_dir, _ = tiny_llama
    with pytest.raises(SystemExit) as exit_info:
        main(["llama", str(llama_dir), str(tmp_path / "bam"), "--max-shard-size", "0"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    assert "--max-shard-size: cannot read the shard size '0'" in captured.err.splitlines()[-1]
    with pytest.raises(OutputError, match="shard size 0"):
        convert_llama_checkpoint(llama_dir, tmp_path / "bam", max_shard_size=0)
    assert capsys.readouterr().out == "" and not (tmp_path / "bam").exists()


def test_ctrl_c_during_bam_convert_is_one_line_and_keeps_the_earlier_output(tmp_path):
    import signal
    import sys

    write_reference_run(tmp_path / "run")
    out = tmp_path / "out" / "bam"
    assert main(["reference", str(tmp_path / "run"), str(out)]) == 0
    before = snapshot(tmp_path / "out")
    (tmp_path / "convert.py").write_text(CONVERT_THEN_WAIT)
    process = WatchedProcess(
        [sys.executable, str(tmp_path / "convert.py"), str(scaled(600)), "reference", str(tmp_path / "run"), str(out),
         "--force", "--dtype", "bfloat16"],
        env=checkout_environment(), preexec_fn=default_sigint,
    )
    process.wait_for_line("staged", 300)
    process.process.send_signal(signal.SIGINT)
    status = process.wait(60, "bam-convert's exit after SIGINT")
    stderr = process.error_output(last=None)
    assert status == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("bam-convert: interrupted") and "Traceback" not in stderr
    assert snapshot(tmp_path / "out") == before


@pytest.mark.parametrize("formula", ["t5_buckets", "kerple_log"])
def test_a_prior_the_reference_code_lacks_is_refused_before_anything_is_written(tmp_path, formula):
    """The reference code's prior is the GGD: T5's buckets (no thetas at all) and KERPLE's kernel (the thetas of
    another formula) would not be the same model there."""
    tiny_model("sdpa", prior_formula=formula).save_pretrained(tmp_path / "bam")
    with pytest.raises(ConversionError, match=f"prior_formula '{formula}' \\(the reference code's prior is the GGD"):
        convert_bam_to_reference(tmp_path / "bam", tmp_path / "run", verbose=False)
    assert not (tmp_path / "run").exists()
