"""Hugging Face LlamaForCausalLM folders to BamLlama folders: the same weights, RoPE dropped, a GGD prior added.

The result is a starting point for context-extension fine-tuning: without RoPE the attention is no longer
position-aware until the prior (and SSMax) are trained.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import LlamaConfig
from transformers.activations import ACT2FN

from ..data.tokenizers import TOKENIZER_FILES
from ..model.configuration_bam import PRIOR_SCOPES, BamLlamaConfig
from ..model.prior_bam import is_prior_parameter
from ..model.prior_modules_bam import BamPrior, BamScalableSoftmax
from ..positional_variants import PRIOR_INITS
from .common import (
    ConversionError,
    cast_weight,
    check_keys_and_shapes,
    config_model_type,
    dtype_name,
    iterate_safetensors,
    print_nothing,
    safetensors_files,
    safetensors_shapes,
    saved_parameter_shapes,
)
from .options import DEFAULT_MAX_SHARD_SIZE
from .writing import check_write_options, write_bam_folder

ROTARY_BUFFER_KEY = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def read_llama_config(llama_dir: Path) -> LlamaConfig:
    path, model_type = config_model_type(llama_dir)
    if model_type != "llama":
        raise ConversionError(f"{path} has model_type {model_type!r}; only Llama checkpoints (model_type 'llama') are supported")
    config = LlamaConfig.from_pretrained(llama_dir)
    unsupported = []
    if getattr(config, "attention_bias", False):
        unsupported.append("attention_bias=True (BamLlama's attention projections have no bias)")
    if getattr(config, "mlp_bias", False):
        unsupported.append("mlp_bias=True (BamLlama's MLP projections have no bias)")
    if config.hidden_act not in ACT2FN:
        unsupported.append(f"hidden_act={config.hidden_act!r} (not a Transformers activation)")
    if getattr(config, "quantization_config", None) is not None:
        unsupported.append("quantization_config (quantized weights; convert the unquantized checkpoint)")
    if unsupported:
        raise ConversionError(f"{path}: unsupported Llama settings: " + "; ".join(unsupported))
    return config


def bam_config_from_llama(
    llama: LlamaConfig,
    prior: str,
    ssmax: bool,
    train_context_length: int | None,
    prior_scope: str,
    ssmax_scale_init: float,
) -> BamLlamaConfig:
    if prior not in PRIOR_INITS:
        raise ConversionError(f"unknown prior initialisation {prior!r}; expected one of {', '.join(PRIOR_INITS)}")
    if prior_scope not in PRIOR_SCOPES:
        raise ConversionError(f"unknown prior scope {prior_scope!r}; expected one of {PRIOR_SCOPES}")
    train_context_length = train_context_length or llama.max_position_embeddings
    try:
        return BamLlamaConfig(
            vocab_size=llama.vocab_size,
            hidden_size=llama.hidden_size,
            intermediate_size=llama.intermediate_size,
            num_hidden_layers=llama.num_hidden_layers,
            num_attention_heads=llama.num_attention_heads,
            num_key_value_heads=llama.num_key_value_heads,
            head_dim=getattr(llama, "head_dim", None),
            hidden_act=llama.hidden_act,
            rms_norm_eps=llama.rms_norm_eps,
            initializer_range=llama.initializer_range,
            attention_dropout=llama.attention_dropout,
            tie_word_embeddings=llama.tie_word_embeddings,
            pad_token_id=llama.pad_token_id,
            bos_token_id=llama.bos_token_id,
            eos_token_id=llama.eos_token_id,
            train_context_length=train_context_length,
            prior_scope=prior_scope,
            ssmax=ssmax,
            ssmax_scale_init=ssmax_scale_init,
            **PRIOR_INITS[prior].config,
        )
    except (ValueError, TypeError) as error:
        raise ConversionError(f"the Llama config gives an invalid BamLlama config: {error}") from None


def initial_prior_state(config: BamLlamaConfig) -> dict[str, torch.Tensor]:
    """Freshly initialised prior (and SSMax) parameters by the schemes in `config`, under their BamLlama names."""
    prior = BamPrior(config).state_dict()
    state = {}
    if config.prior_scope == "global":
        state.update({f"model.prior.{name}": value for name, value in prior.items()})
    for layer in range(config.num_hidden_layers):
        if config.prior_scope == "layer":
            state.update({f"model.layers.{layer}.self_attn.prior.{name}": value.clone() for name, value in prior.items()})
        if config.ssmax:
            state[f"model.layers.{layer}.self_attn.ssmax.scale"] = BamScalableSoftmax(config).scale.detach().clone()
    return state


def llama_weights_with_prior(
    files: list[Path], dropped: list[str], dtype: torch.dtype | None, config: BamLlamaConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The Llama weights but `dropped`, cast to `dtype`, then the freshly initialised prior (and SSMax)."""
    for name, tensor in iterate_safetensors(files):
        if name not in dropped:
            yield name, cast_weight(name, tensor, dtype)
    yield from initial_prior_state(config).items()


def source_dtype(llama: LlamaConfig, files: list[Path]) -> torch.dtype:
    dtype = getattr(llama, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    with safe_open(files[0], framework="pt") as shard:
        return shard.get_tensor(next(iter(shard.keys()))).dtype


def convert_llama_checkpoint(
    llama_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    prior: str = "uniform",
    ssmax: bool = False,
    train_context_length: int | None = None,
    prior_scope: str = "global",
    ssmax_scale_init: float = 1.0,
    base_model: str | None = None,
    dtype: str = "auto",
    force: bool = False,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    verbose: bool = True,
    source: dict | None = None,
) -> Path:
    """Convert a Hugging Face LlamaForCausalLM folder into a BamLlama folder: same weights, RoPE dropped.

    The result is a starting point for context-extension fine-tuning, not a drop-in replacement: without RoPE the
    attention is no longer position-aware until the prior (and SSMax) are trained.

    Args:
        prior: "uniform" (theta 0: a constant bias, no positional preference) or "alibi" (theta_beta 1,
            theta_alpha = log ALiBi slopes: exactly ALiBi).
        ssmax: add Scalable Softmax with scale `ssmax_scale_init`.
        train_context_length: recorded in the config; defaults to the Llama max_position_embeddings.
        base_model: the source recorded in the config and model card (e.g. its Hub id); defaults to the folder.
        source: overrides of the provenance recorded in `config.converted_from` (e.g. the GGUF file it came from).
    """
    log = print if verbose else print_nothing
    llama_dir, out_dir = Path(llama_dir).resolve(), Path(out_dir).resolve()
    target_dtype = check_write_options(out_dir, force, (llama_dir,), dtype, max_shard_size)
    if not llama_dir.is_dir():
        raise ConversionError(f"the Llama folder {llama_dir} does not exist")

    llama = read_llama_config(llama_dir)
    files = safetensors_files(llama_dir)
    found = safetensors_shapes(files)
    config = bam_config_from_llama(llama, prior, ssmax, train_context_length, prior_scope, ssmax_scale_init)
    dropped = checked_dropped_weights(found, config, llama_dir)

    base_model = base_model or str(llama_dir)
    config.dtype = dtype_name(target_dtype or source_dtype(llama, files))
    config.base_model = base_model
    config.converted_from = {**llama_provenance(llama_dir, llama, base_model, prior, ssmax), **(source or {})}
    extra_files = [llama_dir / name for name in (*TOKENIZER_FILES, "generation_config.json") if (llama_dir / name).is_file()]
    log(f"Llama model {llama_dir} ({len(files)} weight file{'s' if len(files) > 1 else ''})")
    log(f"  RoPE dropped; prior {prior} ({prior_scope}); SSMax {'on' if ssmax else 'off'}; train_context_length {config.train_context_length}")
    log("  note: without RoPE the model must be fine-tuned before use")

    written = write_bam_folder(
        out_dir,
        config,
        llama_weights_with_prior(files, dropped, target_dtype, config),
        inputs=(llama_dir,),
        force=force,
        max_shard_size=max_shard_size,
        copied_files=extra_files,
        card_lines=llama_card_lines(base_model, prior, prior_scope, ssmax),
        base_model=base_model,
    )
    log(f"wrote {out_dir} ({', '.join(written + [path.name for path in extra_files])})")
    return out_dir


def checked_dropped_weights(found: dict[str, tuple[int, ...]], config: BamLlamaConfig, llama_dir: Path) -> list[str]:
    """The Llama weights BamLlama has no place for (RoPE's buffers; a head tied to the embedding, as Transformers
    loads it), after checking that the others are exactly BamLlama's but the prior."""
    expected = {name: shape for name, shape in saved_parameter_shapes(config).items() if not is_prior_parameter(name)}
    dropped = [name for name in found if ROTARY_BUFFER_KEY.fullmatch(name)]
    if config.tie_word_embeddings and "lm_head.weight" in found:
        dropped.append("lm_head.weight")
    kept = {name: shape for name, shape in found.items() if name not in dropped}
    check_keys_and_shapes(kept, expected, f"the weights in {llama_dir}", "the Llama layout of its config.json")
    return dropped


def llama_provenance(llama_dir: Path, llama: LlamaConfig, base_model: str, prior: str, ssmax: bool) -> dict:
    """Where a converted model came from and what the conversion changed (`config.converted_from`)."""
    rope = getattr(llama, "rope_parameters", None)
    return {
        "format": "llama",
        "source": str(llama_dir),
        "base_model": base_model,
        "prior_init": prior,
        "ssmax": ssmax,
        "dropped": "RoPE" + (f" (rope_parameters {rope})" if rope else ""),
    }


def llama_card_lines(base_model: str, prior: str, prior_scope: str, ssmax: bool) -> list[str]:
    return [
        f"Converted by `bam-convert llama` from `{base_model}`: the Llama weights unchanged, RoPE removed, a",
        f"GGD-BAM positional prior added (initialised `{prior}`, {prior_scope})" + (" and Scalable Softmax." if ssmax else "."),
        "",
        "It has not been trained with the prior yet: fine-tune it (e.g. for context extension) before use.",
    ]
