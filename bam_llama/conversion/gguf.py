"""GGUF checkpoints for `bam-convert llama`.

    bam-convert llama MODEL.gguf OUT_DIR
    bam-convert llama FOLDER OUT_DIR --gguf-file MODEL.gguf

Transformers' GGUF loader dequantizes the weights (to float32, or to `--dtype`) and builds the tokenizer stored in the
GGUF metadata; both are saved as an ordinary Llama folder in a temporary directory, which `convert_llama_checkpoint`
then converts. Peak memory is one dequantized copy of the model; the temporary folder (one more copy on disk) is
removed afterwards. Reading GGUF needs the optional dependency `gguf` (`pip install 'bam-llama[gguf]'`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from ..files.outputs import disk_full_named, leftover_prefix
from .common import ConversionError, dtype_name, print_nothing
from .llama import convert_llama_checkpoint
from .options import DEFAULT_MAX_SHARD_SIZE
from .writing import check_write_options


GGUF_SUFFIX = ".gguf"
SUPPORTED_ARCHITECTURES = ("llama",)


class MissingDependencyError(ConversionError):
    """An optional dependency needed for this input is not installed."""


def gguf_source(llama_dir: str | os.PathLike, gguf_file: str | None = None) -> Path | None:
    """The GGUF file to convert: `llama_dir` itself when it names a .gguf file, `llama_dir/gguf_file` when
    `gguf_file` is given, None for an ordinary Llama folder."""
    if gguf_file is not None:
        return Path(llama_dir) / gguf_file
    if Path(llama_dir).suffix.lower() == GGUF_SUFFIX:
        return Path(llama_dir)
    return None


def require_gguf() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "reading a GGUF checkpoint needs the optional dependency `gguf`: pip install 'bam-llama[gguf]' (or pip install gguf)"
        ) from None


def read_gguf_metadata(path: Path) -> dict:
    """The scalar metadata of a GGUF file (architecture, name, file type, ...), without its tensors or vocabulary."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:
        raise ConversionError(f"{path} is not a readable GGUF file: {error}") from None
    return {key: field.contents() for key, field in reader.fields.items() if len(field.data) <= 1}


def check_gguf_file(path: Path) -> dict:
    """Check that `path` is a GGUF file holding a Llama model; return its metadata."""
    if path.is_dir():
        raise ConversionError(f"{path} is a folder; name the .gguf file in it with --gguf-file")
    if not path.is_file():
        raise ConversionError(f"the GGUF file {path} does not exist")
    require_gguf()
    metadata = read_gguf_metadata(path)
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"{path} holds a {architecture!r} model; only Llama GGUF checkpoints ('llama') are supported")
    if "tokenizer.ggml.model" not in metadata:
        raise ConversionError(f"{path} stores no tokenizer (no tokenizer.ggml.model metadata)")
    return metadata


def quantization_name(metadata: dict) -> str | None:
    """The GGUF file type (e.g. Q4_1, F16) recorded in `general.file_type`."""
    import gguf

    file_type = metadata.get("general.file_type")
    try:
        return gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        return str(file_type)


def dequantize_to_llama_folder(path: Path, folder: Path, dtype: torch.dtype) -> None:
    """Save the model and tokenizer Transformers builds from the GGUF `path` as a Llama folder (safetensors,
    config, generation config, tokenizer files)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as error:
        raise ConversionError(f"cannot build the tokenizer stored in {path}: {error}") from None
    try:
        model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    except Exception as error:
        raise ConversionError(f"cannot load the Llama weights in {path}: {error}") from None
    # The weights are dequantized: the folder is an ordinary Llama checkpoint, not a quantized one.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def convert_gguf_checkpoint(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    base_model: str | None = None,
    dtype: str = "auto",
    force: bool = False,
    verbose: bool = True,
    **llama_options,
) -> Path:
    """Convert a Llama GGUF checkpoint into a BamLlama folder, as `convert_llama_checkpoint` converts a Llama folder.

    The quantized weights are dequantized to float32 (or `dtype`); the tokenizer, tied embeddings, grouped-query
    attention and the generation config carry over. `llama_options` are passed to `convert_llama_checkpoint`.
    """
    log = print if verbose else print_nothing
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir).resolve()
    max_shard_size = llama_options.get("max_shard_size", DEFAULT_MAX_SHARD_SIZE)
    weights_dtype = check_write_options(out_dir, force, (gguf_path,), dtype, max_shard_size) or torch.float32
    metadata = check_gguf_file(gguf_path)
    quantization = quantization_name(metadata)
    log(f"GGUF model {gguf_path} ({quantization or 'unknown file type'}): dequantizing to {dtype_name(weights_dtype)}")

    work_parent = out_dir.parent if out_dir.parent.is_dir() else None
    with tempfile.TemporaryDirectory(prefix=leftover_prefix(out_dir), suffix=".work", dir=work_parent) as work:
        llama_dir = Path(work) / "llama"
        with disk_full_named(out_dir):  # the scratch folder lies beside it
            dequantize_to_llama_folder(gguf_path, llama_dir, weights_dtype)
        return convert_llama_checkpoint(
            llama_dir,
            out_dir,
            base_model=base_model or gguf_path.name,
            dtype=dtype,
            force=force,
            verbose=verbose,
            source={"format": "gguf", "source": str(gguf_path), "gguf_file_type": quantization},
            **llama_options,
        )


__all__ = ["MissingDependencyError", "convert_gguf_checkpoint", "gguf_source"]
