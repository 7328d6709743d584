"""What every conversion shares: errors, safetensors read header by header, dtypes, BamLlama's parameter shapes,
and the tokenizer files of an input."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from ..data.tokenizers import TOKENIZER_FILES
from ..files.model_folders import check_finite_tensors
from ..model.configuration_bam import BamLlamaConfig
from ..model.modeling_bam import BamLlamaForCausalLM
from ..model.prior_bam import is_prior_parameter
from .options import DTYPES


class ConversionError(Exception):
    """Bad input. The message names the file, key or setting at fault; nothing has been written."""


def config_model_type(folder: Path) -> tuple[Path, str | None]:
    """The path of `folder`'s config.json and the model_type it declares; a ConversionError when it is missing or
    not a JSON object."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConversionError(f"missing file {path}")
    try:
        return path, json.loads(path.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as error:
        raise ConversionError(f"{path} is not a JSON config: {error}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a Transformers folder: the shards named by the index, or model.safetensors."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ConversionError(f"{index_path} has no readable weight_map ({error})") from None
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise ConversionError(f"missing shard files listed in {index_path}: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    hint = " (only PyTorch .bin weights found: save them as safetensors first)" if any(folder.glob("*.bin")) else ""
    raise ConversionError(f"missing weights: no model.safetensors or model.safetensors.index.json in {folder}{hint}")


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, read from the shard headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as shard:
                for name in shard.keys():
                    if name in shapes:
                        raise ConversionError(f"tensor {name!r} appears in more than one shard ({path.name} and another)")
                    shapes[name] = tuple(shard.get_slice(name).get_shape())
        except ConversionError:
            raise
        except Exception as error:
            raise ConversionError(f"cannot read {path}: {error}") from None
    return shapes


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors one at a time, opening one shard at a time; one holding NaN or infinity is refused (NonFiniteError)."""
    for path in files:
        with safe_open(path, framework="pt") as shard:
            for name in shard.keys():
                tensor = shard.get_tensor(name)
                check_finite_tensors([(name, tensor)], str(path))
                yield name, tensor


def format_names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def check_keys_and_shapes(found: Mapping[str, tuple], expected: Mapping[str, tuple], source: str, layout: str) -> None:
    """Raise a ConversionError naming every unknown key, missing key and shape mismatch."""
    unknown = [name for name in found if name not in expected]
    missing = [name for name in expected if name not in found]
    mismatched = [
        f"{name} has shape {tuple(found[name])}, expected {tuple(expected[name])}"
        for name in expected
        if name in found and tuple(found[name]) != tuple(expected[name])
    ]
    problems = []
    if unknown:
        problems.append(f"unknown keys: {format_names(unknown)}")
    if missing:
        problems.append(f"missing keys: {format_names(missing)}")
    if mismatched:
        problems.append(f"shape mismatches: {format_names(mismatched)}")
    if problems:
        raise ConversionError(f"{source} does not match {layout}:\n  " + "\n  ".join(problems))


def bam_parameter_shapes(config: BamLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every BamLlamaForCausalLM parameter for `config` (built on the meta device)."""
    with torch.device("meta"):
        model = BamLlamaForCausalLM(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def saved_parameter_shapes(config: BamLlamaConfig) -> dict[str, tuple[int, ...]]:
    """As `bam_parameter_shapes`, without the output head when it is tied to the embedding (not saved)."""
    shapes = bam_parameter_shapes(config)
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    return shapes


def cast_weight(bam_name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Cast to `dtype`, except the small prior / SSMax parameters, which keep their precision."""
    if dtype is None or not tensor.is_floating_point() or is_prior_parameter(bam_name):
        return tensor
    return tensor.to(dtype)


def parse_dtype(name: str) -> torch.dtype | None:
    if name not in DTYPES:
        raise ConversionError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return None if DTYPES[name] is None else getattr(torch, DTYPES[name])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tokenizer_files_at(path: Path) -> list[Path]:
    """A tokenizer file, or the tokenizer files of a folder."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [path / name for name in TOKENIZER_FILES if (path / name).is_file()]
        if not files:
            raise ConversionError(f"no tokenizer files in {path} (looked for {', '.join(TOKENIZER_FILES)})")
        return files
    raise ConversionError(f"the tokenizer path {path} does not exist")


def print_nothing(*args, **kwargs) -> None:
    """What a conversion that is not verbose calls instead of `print`."""
