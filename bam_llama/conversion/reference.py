"""Reference GGD-BAM runs (model.pt + args.json, the paper's code) to BamLlama folders, and back.

Inputs are checked completely (keys, shapes, variant) before anything is written. The reference `model.pt` is
memory-mapped and the output written shard by shard into a staging folder that becomes OUT_DIR only once complete
(see `writing.py`). reference -> BamLlama -> reference is exact.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..files.model_folders import check_finite_tensors
from ..files.outputs import check_output_dir, staged_output_dir
from ..model.configuration_bam import BamLlamaConfig
from ..model.prior_bam import REFERENCE_FORMULAS
from ..model.prior_bam import is_prior_parameter
from .common import (
    ConversionError,
    bam_parameter_shapes,
    cast_weight,
    check_keys_and_shapes,
    config_model_type,
    dtype_name,
    format_names,
    iterate_safetensors,
    print_nothing,
    safetensors_files,
    safetensors_shapes,
    saved_parameter_shapes,
    tokenizer_files_at,
)
from .options import DEFAULT_MAX_SHARD_SIZE, PRIOR_NAME_GENERATIONS, VARIANTS
from .writing import check_write_options, write_bam_folder

# Reference (Meta Llama layout) names -> BamLlama names.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
REFERENCE_ATTENTION_WEIGHTS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
REFERENCE_FEED_FORWARD_WEIGHTS = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
PRIOR_TRAIN_FLAGS = {  # model_args flag per generation, for theta_beta, theta_alpha, theta_mu
    "shape-scale-loc": ("train_shape", "train_scale", "train_loc"),
    "theta": ("train_theta_beta", "train_theta_alpha", "train_theta_mu"),
}
REFERENCE_PRIOR_KEY = re.compile(r"(?:layers\.(\d+)\.attention\.)?prior\.(\w+)")


# --------------------------------------------------------------------------------------------------------
# Reference <-> BamLlama key table
# --------------------------------------------------------------------------------------------------------


def reference_key_table(config: BamLlamaConfig, prior_names: str = "shape-scale-loc") -> dict[str, str]:
    """Reference state-dict name -> BamLlama name for every parameter, in the reference code's order."""
    prior = PRIOR_NAME_GENERATIONS[prior_names]
    table = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    for layer in range(config.num_hidden_layers):
        reference, bam = f"layers.{layer}.", f"model.layers.{layer}."
        if config.ssmax:
            table[reference + "attention.seq_scale"] = bam + "self_attn.ssmax.scale"
        for reference_name, bam_name in REFERENCE_ATTENTION_WEIGHTS.items():
            table[reference + reference_name] = bam + bam_name
        if config.prior_scope == "layer":
            for reference_name, bam_name in prior.items():
                table[f"{reference}attention.prior.{reference_name}"] = f"{bam}self_attn.prior.{bam_name}"
        for reference_name, bam_name in REFERENCE_FEED_FORWARD_WEIGHTS.items():
            table[reference + reference_name] = bam + bam_name
    table["norm.weight"] = "model.norm.weight"
    table["output.weight"] = "lm_head.weight"
    if config.prior_scope == "global":
        for reference_name, bam_name in prior.items():
            table[f"prior.{reference_name}"] = f"model.prior.{bam_name}"
    return table


def checked_reference_key_table(config: BamLlamaConfig, prior_names: str) -> tuple[dict[str, str], dict[str, tuple]]:
    """The key table and the BamLlama shapes, after checking the table still covers the model exactly."""
    table = reference_key_table(config, prior_names)
    shapes = bam_parameter_shapes(config)
    if set(table.values()) != set(shapes):
        drift = sorted(set(table.values()) ^ set(shapes))
        raise RuntimeError(f"the conversion's key table no longer matches BamLlamaForCausalLM: {format_names(drift)}")
    return table, shapes


def reference_shape(bam_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1, shape[0], 1, 1) if is_prior_parameter(bam_name) else shape


def reference_ffn_hidden_size(model_args: dict) -> int:
    """The reference FeedForward width: dim, times ffn_dim_multiplier when given, rounded up to multiple_of."""
    hidden = model_args["dim"]
    if model_args.get("ffn_dim_multiplier") is not None:
        hidden = int(model_args["ffn_dim_multiplier"] * hidden)
    multiple_of = model_args.get("multiple_of") or 1
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# --------------------------------------------------------------------------------------------------------
# Reference run -> BamLlama
# --------------------------------------------------------------------------------------------------------


def read_run_args(run_dir: Path) -> dict:
    """args.json of a reference run ({"args", "dataset_args", "model_args"}); `Infinity` is accepted."""
    path = run_dir / "args.json"
    if not path.is_file():
        raise ConversionError(f"missing file {path} (the reference run's arguments, written beside model.pt)")
    try:
        run_args = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(run_args, dict) or not isinstance(run_args.get("model_args"), dict):
        raise ConversionError(f"{path} has no model_args section; the model cannot be rebuilt without it")
    if not isinstance(run_args.get("args", {}), dict):
        raise ConversionError(f"{path}: 'args' is not a JSON object")
    for field in ("dim", "n_layers", "n_heads", "vocab_size"):
        if not isinstance(run_args["model_args"].get(field), int):
            raise ConversionError(f"{path}: model_args.{field} is missing or not an integer")
    return run_args


def load_reference_state_dict(run_dir: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """model.pt memory-mapped, with DDP / torch.compile prefixes stripped; also returns the prefixes found."""
    path = run_dir / "model.pt"
    if not path.is_file():
        raise ConversionError(f"missing file {path} (the reference checkpoint)")
    try:
        state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # files from the legacy (non-zip) serialization cannot be memory-mapped
        try:
            state_dict = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:
            raise ConversionError(f"cannot read {path} as a state_dict: {error}") from None
    if not isinstance(state_dict, Mapping):
        raise ConversionError(f"{path} holds a {type(state_dict).__name__}, not a state_dict")
    not_tensors = [str(name) for name, value in state_dict.items() if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise ConversionError(f"{path} is not a plain state_dict; entries that are not tensors: {format_names(not_tensors)}")
    return strip_wrapper_prefixes(state_dict, path)


def strip_wrapper_prefixes(state_dict: Mapping[str, torch.Tensor], path: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    stripped: dict[str, torch.Tensor] = {}
    original_names: dict[str, str] = {}
    prefixes_found: set[str] = set()
    for original_name, tensor in state_dict.items():
        name = original_name
        while prefix := next((prefix for prefix in WRAPPER_PREFIXES if name.startswith(prefix)), None):
            name = name[len(prefix) :]
            prefixes_found.add(prefix)
        if name in stripped:
            raise ConversionError(
                f"{path} holds both {original_names[name]!r} and {original_name!r}, the same parameter once the "
                f"wrapper prefixes {WRAPPER_PREFIXES} are stripped"
            )
        stripped[name] = tensor
        original_names[name] = original_name
    return stripped, sorted(prefixes_found)


def detect_prior_names(names: Iterable[str]) -> str:
    """Which prior parameter-name generation the checkpoint uses: 'shape-scale-loc' or 'theta'."""
    parameters = {match.group(2) for name in names if (match := REFERENCE_PRIOR_KEY.fullmatch(name))}
    generations = [generation for generation, known in PRIOR_NAME_GENERATIONS.items() if parameters & known.keys()]
    if not parameters:
        raise ConversionError(
            "model.pt has no positional-prior parameters (prior.shape/scale/loc, prior.theta_*, or "
            "layers.N.attention.prior.*): it is not a GGD-BAM checkpoint"
        )
    if len(generations) > 1:
        raise ConversionError(f"model.pt mixes the two prior parameter-name generations: {sorted(parameters)}")
    if not generations:
        raise ConversionError(
            f"unknown prior parameter names {sorted(parameters)}; expected shape/scale/loc or theta_beta/theta_alpha/theta_mu"
        )
    return generations[0]


def detect_prior_scope(names: Iterable[str], model_args: dict) -> str:
    """'global' (prior.*) or 'layer' (layers.N.attention.prior.*), checked against global_positional_encoding."""
    layers = {match.group(1) for name in names if (match := REFERENCE_PRIOR_KEY.fullmatch(name))}
    if None in layers and len(layers) > 1:
        raise ConversionError("model.pt has both a global prior (prior.*) and per-layer priors (layers.N.attention.prior.*)")
    scope = "global" if None in layers else "layer"
    declared = model_args.get("global_positional_encoding")
    if declared is not None and bool(declared) != (scope == "global"):
        found = "a global prior (prior.*)" if scope == "global" else "per-layer priors (layers.N.attention.prior.*)"
        raise ConversionError(
            f"args.json model_args.global_positional_encoding is {declared} but model.pt has {found}"
        )
    return scope


def decide_variant(requested: str | None, run_args: dict, names: Iterable[str]) -> tuple[str, str]:
    """The variant and where it came from: --variant and args.json must agree, and the seq_scale keys must fit."""
    declared = {}
    if requested is not None:
        declared["--variant"] = requested
    encoding = run_args.get("args", {}).get("position_encoding")
    if encoding is not None:
        declared["args.json args.position_encoding"] = encoding
    for source, value in declared.items():
        if value not in VARIANTS:
            raise ConversionError(f"{source} is {value!r}, which is not a GGD-BAM variant ({' or '.join(VARIANTS)})")
    has_ssmax = any(name.endswith("attention.seq_scale") for name in names)
    if not declared:
        likely = "bam_ssmax (model.pt has seq_scale keys)" if has_ssmax else "bam (model.pt has no seq_scale keys)"
        raise ConversionError(
            "cannot decide the variant: args.json has no args.position_encoding and --variant was not given; "
            f"pass --variant (probably {likely})"
        )
    if len(set(declared.values())) > 1:
        raise ConversionError("contradictory variants: " + ", ".join(f"{s} says {v!r}" for s, v in declared.items()))
    source, variant = next(iter(declared.items()))
    if has_ssmax != (variant == "bam_ssmax"):
        keys = "has SSMax keys" if has_ssmax else "has no SSMax keys"
        raise ConversionError(f"{source} says {variant!r} but model.pt {keys} (layers.N.attention.seq_scale)")
    return variant, source


def reference_train_context_length(run_args: dict) -> int | None:
    """The training sequence length: args.sequence_length (newer runs set max_seq_len to 1.5x it), else max_seq_len."""
    for value in (run_args.get("args", {}).get("sequence_length"), run_args["model_args"].get("max_seq_len")):
        if isinstance(value, int) and value > 0:
            return value
    return None


def train_flag(model_args: dict, index: int, default: bool) -> bool:
    """A prior parameter's train flag under either generation's name (index: 0 beta, 1 alpha, 2 mu)."""
    for flags in PRIOR_TRAIN_FLAGS.values():
        if model_args.get(flags[index]) is not None:
            return bool(model_args[flags[index]])
    return default


def reference_config(run_args: dict, variant: str, prior_scope: str, formula: str) -> BamLlamaConfig:
    """The BamLlamaConfig of a reference run, from args.json's model_args."""
    model_args = run_args["model_args"]
    heads = model_args["n_heads"]
    values = dict(
        vocab_size=model_args["vocab_size"],
        hidden_size=model_args["dim"],
        intermediate_size=reference_ffn_hidden_size(model_args),
        num_hidden_layers=model_args["n_layers"],
        num_attention_heads=heads,
        num_key_value_heads=model_args.get("n_kv_heads") or heads,
        rms_norm_eps=model_args.get("norm_eps", 1e-5),
        tie_word_embeddings=False,
        bos_token_id=1,  # Mistral v0.3 tokenizer
        eos_token_id=2,
        prior_scope=prior_scope,
        prior_formula=formula,
        train_theta_beta=train_flag(model_args, 0, default=True),
        train_theta_alpha=train_flag(model_args, 1, default=True),
        train_theta_mu=train_flag(model_args, 2, default=False),
        ssmax=variant == "bam_ssmax",
        ssmax_prior=bool(model_args.get("ssmax_prior", True)),
        train_ssmax_scale=bool(model_args.get("seq_scale", True)),
    )
    train_context_length = reference_train_context_length(run_args)
    if train_context_length is not None:
        values["train_context_length"] = train_context_length
    try:
        return BamLlamaConfig(**values)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"args.json model_args describe an invalid model: {error}") from None


@dataclass
class ReferenceRun:
    """A reference run read and checked against the BamLlama model it makes: where each choice came from, for the
    log, the config's provenance and the card."""

    folder: Path
    run_args: dict
    state_dict: dict[str, torch.Tensor]
    stripped_prefixes: list[str]
    prior_names: str
    prior_scope: str
    variant: str
    variant_source: str
    formula: str
    formula_source: str
    config: BamLlamaConfig
    key_table: dict[str, str]


def convert_reference_checkpoint(
    run_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    formula: str | None = None,
    variant: str | None = None,
    dtype: str = "auto",
    force: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    verbose: bool = True,
) -> Path:
    """Convert a reference GGD-BAM run folder (model.pt + args.json) into a BamLlama folder.

    Args:
        formula: "current" (default) or "legacy" (the pre-May-2025 prior, scale inside the power). The weights
            cannot tell them apart; the choice is recorded in `config.prior_formula` and `config.converted_from`.
        variant: "bam" or "bam_ssmax"; must agree with args.json's position_encoding when both are given.
        dtype: "auto" keeps the stored dtype; otherwise every weight but the prior / SSMax parameters is cast.
    """
    log = print if verbose else print_nothing
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir).resolve()
    tokenizer = Path(tokenizer).resolve() if tokenizer is not None else None
    inputs = (run_dir,) if tokenizer is None else (run_dir, tokenizer)
    target_dtype = check_write_options(out_dir, force, inputs, dtype, max_shard_size)
    if formula is not None and formula not in REFERENCE_FORMULAS:
        raise ConversionError(f"unknown prior formula {formula!r}; expected one of {REFERENCE_FORMULAS}")
    if not run_dir.is_dir():
        raise ConversionError(f"the reference run folder {run_dir} does not exist")

    run = read_reference_run(run_dir, variant, formula)
    tokenizer_files = tokenizer_files_at(tokenizer) if tokenizer is not None else []
    record_reference_provenance(run, target_dtype)
    log_reference_run(log, run)
    files = write_bam_folder(
        out_dir,
        run.config,
        bam_weights_of_reference(run.state_dict, run.key_table, target_dtype, str(run_dir / "model.pt")),
        inputs=inputs,
        force=force,
        max_shard_size=max_shard_size,
        copied_files=tokenizer_files,
        card_lines=reference_card_lines(run),
    )
    log(f"wrote {out_dir} ({', '.join(files)}{', tokenizer' if tokenizer_files else ''})")
    return out_dir


def read_reference_run(run_dir: Path, variant: str | None, formula: str | None) -> ReferenceRun:
    """args.json and model.pt, the variant, prior names, scope and formula they (or the options) give, and the
    BamLlama config they make; every key and shape checked against it."""
    run_args = read_run_args(run_dir)
    state_dict, prefixes = load_reference_state_dict(run_dir)
    prior_names = detect_prior_names(state_dict)
    prior_scope = detect_prior_scope(state_dict, run_args["model_args"])
    variant, variant_source = decide_variant(variant, run_args, state_dict)
    formula_source = "--formula" if formula is not None else "default: the reference code's formula since May 2025"
    formula = formula or "current"
    config = reference_config(run_args, variant, prior_scope, formula)
    table, shapes = checked_reference_key_table(config, prior_names)
    expected = {name: reference_shape(bam_name, shapes[bam_name]) for name, bam_name in table.items()}
    found = {name: tuple(tensor.shape) for name, tensor in state_dict.items()}
    check_feed_forward_width(found, config, run_args["model_args"])
    check_keys_and_shapes(found, expected, f"{run_dir / 'model.pt'}", describe_reference_layout(config, prior_names))
    return ReferenceRun(run_dir, run_args, state_dict, prefixes, prior_names, prior_scope, variant, variant_source,
                        formula, formula_source, config, table)


def record_reference_provenance(run: ReferenceRun, target_dtype: torch.dtype | None) -> None:
    """The weights' dtype and where the model came from, in its config (`converted_from`)."""
    run.config.dtype = dtype_name(target_dtype or run.state_dict["tok_embeddings.weight"].dtype)
    run.config.converted_from = {
        "format": "bam-reference",
        "source": str(run.folder),
        "variant": run.variant,
        "variant_from": run.variant_source,
        "prior_formula": run.formula,
        "prior_formula_from": run.formula_source,
        "prior_parameter_names": run.prior_names,
        "stripped_prefixes": run.stripped_prefixes,
        "run_args": run.run_args,
    }


def log_reference_run(log, run: ReferenceRun) -> None:
    config = run.config
    log(f"reference run {run.folder}")
    log(f"  variant {run.variant} (from {run.variant_source}); {run.prior_scope} prior; parameter names {run.prior_names}")
    log(f"  prior formula {run.formula} ({run.formula_source})")
    if run.formula == "legacy" and run.prior_names == "theta":
        log("  note: theta_* names come from upstream code newer than the legacy formula; check --formula")
    if run.stripped_prefixes:
        log(f"  stripped key prefixes: {', '.join(run.stripped_prefixes)}")
    if config.num_key_value_heads != config.num_attention_heads:
        log(f"  grouped-query attention: {config.num_key_value_heads} key/value heads for {config.num_attention_heads} heads")


def reference_card_lines(run: ReferenceRun) -> list[str]:
    return [
        f"Converted by `bam-convert reference` from `{run.folder}`.",
        "",
        f"- variant: `{run.variant}` (from {run.variant_source})",
        f"- prior: {run.prior_scope}, formula `{run.formula}` ({run.formula_source})",
        f"- reference parameter names: {run.prior_names}",
        f"- weights dtype: {run.config.dtype}",
    ]


def bam_weights_of_reference(
    state_dict: Mapping[str, torch.Tensor], table: dict[str, str], dtype: torch.dtype | None, source: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The reference weights under their BamLlama names, in the key table's order, each checked finite; prior and
    SSMax parameters (1, H, 1, 1) -> (H,), the others cast to `dtype`."""
    for reference_name, bam_name in table.items():
        tensor = state_dict[reference_name]
        check_finite_tensors([(reference_name, tensor)], source)
        if is_prior_parameter(bam_name):
            tensor = tensor.reshape(-1)
        yield bam_name, cast_weight(bam_name, tensor, dtype)


def check_feed_forward_width(found: Mapping[str, tuple], config: BamLlamaConfig, model_args: dict) -> None:
    """The FFN width is the one size args.json gives only indirectly (dim, ffn_dim_multiplier, multiple_of): when it
    disagrees with model.pt, say so instead of listing every feed-forward weight as a shape mismatch."""
    shape = found.get("layers.0.feed_forward.w1.weight")
    if shape is None or len(shape) != 2 or shape[0] == config.intermediate_size:
        return
    multiplier = model_args.get("ffn_dim_multiplier")
    given = "no ffn_dim_multiplier" if multiplier is None else f"ffn_dim_multiplier {multiplier}"
    raise ConversionError(
        f"model.pt has feed-forward width {shape[0]}, but args.json model_args (dim {model_args['dim']}, {given}, "
        f"multiple_of {model_args.get('multiple_of') or 1}) give {config.intermediate_size}: args.json does not "
        "describe this checkpoint; check model_args.ffn_dim_multiplier (missing or wrong?)"
    )


def describe_reference_layout(config: BamLlamaConfig, prior_names: str) -> str:
    variant = "bam_ssmax" if config.ssmax else "bam"
    return (
        f"the reference {variant} layout with a {config.prior_scope} prior ({prior_names} names), "
        f"{config.num_hidden_layers} layers, dim {config.hidden_size}, {config.num_attention_heads} heads, "
        f"{config.num_key_value_heads} kv heads, FFN {config.intermediate_size}, vocab {config.vocab_size}"
    )


# --------------------------------------------------------------------------------------------------------
# BamLlama -> reference run
# --------------------------------------------------------------------------------------------------------


def read_bam_config(bam_dir: Path) -> BamLlamaConfig:
    path, model_type = config_model_type(bam_dir)
    if model_type != BamLlamaConfig.model_type:
        raise ConversionError(f"{path} has model_type {model_type!r}, not {BamLlamaConfig.model_type!r}")
    try:
        return BamLlamaConfig.from_pretrained(bam_dir)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"{path} is not a valid BamLlama config: {error}") from None


def check_reference_compatible(config: BamLlamaConfig) -> None:
    problems = []
    if config.prior_formula not in REFERENCE_FORMULAS:
        problems.append(
            f"prior_formula {config.prior_formula!r} (the reference code's prior is the GGD, {' or '.join(REFERENCE_FORMULAS)})"
        )
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        problems.append(f"head_dim {config.head_dim} x {config.num_attention_heads} heads != hidden_size {config.hidden_size}")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (the reference FeedForward is SwiGLU with silu)")
    if config.absolute_positions is not None:
        problems.append(f"absolute_positions {config.absolute_positions!r} (the reference BAM model adds no absolute "
                        "position embedding to its token embeddings)")
    if problems:
        raise ConversionError("the reference code cannot represent this model: " + "; ".join(problems))


def ffn_dim_multiplier_for(hidden_size: int, intermediate_size: int) -> float:
    """A multiplier m with int(m * hidden_size) == intermediate_size, as the reference FeedForward computes it."""
    multiplier = intermediate_size / hidden_size
    while int(multiplier * hidden_size) < intermediate_size:
        multiplier = math.nextafter(multiplier, math.inf)
    return multiplier


def synthesized_model_args(config: BamLlamaConfig, prior_names: str) -> dict:
    """model_args for the reference ModelArgs dataclass, from a BamLlama config."""
    beta_flag, alpha_flag, mu_flag = PRIOR_TRAIN_FLAGS[prior_names]
    model_args = {
        "dim": config.hidden_size,
        "n_layers": config.num_hidden_layers,
        "n_heads": config.num_attention_heads,
        "n_kv_heads": None if config.num_key_value_heads == config.num_attention_heads else config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "multiple_of": 1,
        "ffn_dim_multiplier": ffn_dim_multiplier_for(config.hidden_size, config.intermediate_size),
        "norm_eps": config.rms_norm_eps,
        "max_seq_len": config.train_context_length,
        beta_flag: config.train_theta_beta,
        alpha_flag: config.train_theta_alpha,
        mu_flag: config.train_theta_mu,
        "global_positional_encoding": config.prior_scope == "global",
    }
    if config.ssmax:
        model_args.update(seq_scale=config.train_ssmax_scale, ssmax_prior=config.ssmax_prior)
    return model_args


ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "prior_scope", "ssmax", "ssmax_prior",
)


def recorded_run_args(config: BamLlamaConfig, prior_names: str) -> dict | None:
    """The args.json recorded at conversion, if it still describes this model with these parameter names."""
    recorded = getattr(config, "converted_from", None)
    if not isinstance(recorded, dict) or recorded.get("format") != "bam-reference":
        return None
    if recorded.get("prior_parameter_names") != prior_names or not isinstance(recorded.get("run_args"), dict):
        return None
    run_args = recorded["run_args"]
    variant = "bam_ssmax" if config.ssmax else "bam"
    try:
        rebuilt = reference_config(run_args, variant, config.prior_scope, config.prior_formula)
    except (ConversionError, KeyError, TypeError):
        return None
    if run_args.get("args", {}).get("position_encoding", variant) != variant:
        return None
    if any(getattr(rebuilt, field) != getattr(config, field) for field in ARCHITECTURE_FIELDS):
        return None
    return run_args


def reference_run_args(config: BamLlamaConfig, prior_names: str) -> tuple[dict, str]:
    """args.json for the reference loader (it reads args.position_encoding and model_args), and its origin."""
    recorded = recorded_run_args(config, prior_names)
    if recorded is not None:
        return recorded, "recorded at conversion"
    args = {
        "position_encoding": "bam_ssmax" if config.ssmax else "bam",
        "sequence_length": config.train_context_length,
        "global_prior": config.prior_scope == "global",
    }
    return {"args": args, "dataset_args": {}, "model_args": synthesized_model_args(config, prior_names)}, "synthesized"


def convert_bam_to_reference(
    bam_dir: str | os.PathLike,
    out_run_dir: str | os.PathLike,
    *,
    prior_names: str = "shape-scale-loc",
    force: bool = False,
    verbose: bool = True,
) -> Path:
    """Write a BamLlama folder as a reference run (model.pt + args.json); reference -> BamLlama -> reference is exact.

    Args:
        prior_names: "shape-scale-loc" (the names of the reference code that produced the published checkpoints)
            or "theta" (newer upstream code: theta_beta / theta_alpha / theta_mu).
    """
    log = print if verbose else print_nothing
    bam_dir, out_run_dir = Path(bam_dir).resolve(), Path(out_run_dir).resolve()
    check_output_dir(out_run_dir, force, (bam_dir,))
    if prior_names not in PRIOR_NAME_GENERATIONS:
        raise ConversionError(f"unknown prior names {prior_names!r}; expected one of {', '.join(PRIOR_NAME_GENERATIONS)}")
    if not bam_dir.is_dir():
        raise ConversionError(f"the BamLlama folder {bam_dir} does not exist")

    config = read_bam_config(bam_dir)
    check_reference_compatible(config)
    files = safetensors_files(bam_dir)
    table, _ = checked_reference_key_table(config, prior_names)
    check_keys_and_shapes(safetensors_shapes(files), saved_parameter_shapes(config), f"the weights in {bam_dir}", "its config.json")
    run_args, args_origin = reference_run_args(config, prior_names)

    log(f"BamLlama model {bam_dir} -> reference {'bam_ssmax' if config.ssmax else 'bam'} run, parameter names {prior_names}")
    log(f"  args.json {args_origin}")
    if config.prior_formula == "legacy":
        log("  note: this model uses the legacy prior formula; the reference training code since May 2025 uses the current one")
    if config.tie_word_embeddings:
        log("  note: tied embeddings are written as separate tok_embeddings and output weights")

    tensors = dict(iterate_safetensors(files))  # torch.save needs the whole state_dict at once
    state_dict = {}
    for reference_name, bam_name in table.items():
        tensor = tensors[bam_name] if bam_name in tensors else tensors["model.embed_tokens.weight"]  # tied head
        state_dict[reference_name] = tensor.reshape(1, -1, 1, 1) if is_prior_parameter(bam_name) else tensor
    with staged_output_dir(out_run_dir, force, (bam_dir,)) as staging:
        torch.save(state_dict, staging / "model.pt")
        (staging / "args.json").write_text(json.dumps(run_args, indent=4))
    log(f"wrote {out_run_dir} (model.pt, args.json)")
    return out_run_dir
