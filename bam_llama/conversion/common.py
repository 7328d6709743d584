"""What every conversion shares: errors, safetensors read header by header and written shard by shard, dtypes,
BamLlama's parameter shapes, and the config, remote code, tokenizer and card of an output folder."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..data.tokenizers import TOKENIZER_FILES
from ..model_folders import check_finite_tensors
from .choices import DEFAULT_MAX_SHARD_SIZE, DTYPES, parse_size

if TYPE_CHECKING:  # PyTorch and the model are imported where used, so that --help does not load them
    import torch

    from ..model.configuration_bam import BamLlamaConfig


class SafetensorsShardWriter:
    """Writes named tensors into `model.safetensors`, or into numbered shards plus an index when they exceed
    `max_shard_size`. Holds at most one shard of tensors at a time."""

    def __init__(self, folder: Path, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE):
        self.folder = folder
        self.max_shard_bytes = parse_size(max_shard_size)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_storages: set[int] = set()
        self.pending_bytes = 0
        self.shard_names: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self.flush()
        storage = tensor.untyped_storage().data_ptr()
        if storage in self.pending_storages:
            tensor = tensor.clone()  # safetensors refuses tensors that share memory
            storage = tensor.untyped_storage().data_ptr()
        self.pending_storages.add(storage)
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        save_file(self.pending, self.folder / self._partial_name(len(self.shard_names)), metadata={"format": "pt"})
        self.shard_names.append(list(self.pending))
        self.pending, self.pending_storages, self.pending_bytes = {}, set(), 0

    def finish(self) -> list[str]:
        """Write the last shard, give the shards their final names and write the index; return the file names."""
        self.flush()
        if len(self.shard_names) == 1:
            os.replace(self.folder / self._partial_name(0), self.folder / "model.safetensors")
            return ["model.safetensors"]
        count = len(self.shard_names)
        files, weight_map = [], {}
        for index, names in enumerate(self.shard_names):
            file_name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self.folder / self._partial_name(index), self.folder / file_name)
            files.append(file_name)
            weight_map.update(dict.fromkeys(names, file_name))
        index_file = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2) + "\n")
        return files + ["model.safetensors.index.json"]

    @staticmethod
    def _partial_name(index: int) -> str:
        return f"shard-{index:05d}.safetensors.partial"


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
    from safetensors import safe_open

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
    from safetensors import safe_open

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


def is_per_head_parameter(bam_name: str) -> bool:
    """Prior and SSMax parameters (`prior_bam.is_prior_parameter`, imported on first use: it loads PyTorch, which
    --help does not need): (H,) in BamLlama, (1, H, 1, 1) in the reference code."""
    from ..model.prior_bam import is_prior_parameter

    return is_prior_parameter(bam_name)


def bam_parameter_shapes(config: BamLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every BamLlamaForCausalLM parameter for `config` (built on the meta device)."""
    import torch

    from ..model.modeling_bam import BamLlamaForCausalLM

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
    if dtype is None or not tensor.is_floating_point() or is_per_head_parameter(bam_name):
        return tensor
    return tensor.to(dtype)


def parse_dtype(name: str) -> torch.dtype | None:
    import torch

    if name not in DTYPES:
        raise ConversionError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return None if DTYPES[name] is None else getattr(torch, DTYPES[name])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def save_config_and_code(config: BamLlamaConfig, folder: Path) -> None:
    """config.json plus the modeling code, so the folder loads with trust_remote_code=True."""
    from transformers.dynamic_module_utils import custom_object_save

    from ..model.modeling_bam import REMOTE_CODE_AUTO_MAP, BamLlamaForCausalLM

    config.architectures = ["BamLlamaForCausalLM"]
    config.auto_map = dict(REMOTE_CODE_AUTO_MAP)
    custom_object_save(BamLlamaForCausalLM, folder)  # modeling_bam.py and the modules it imports relatively
    config.save_pretrained(folder)  # config.json and configuration_bam.py


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


def copy_files(files: Iterable[Path], folder: Path) -> None:
    for path in files:
        shutil.copyfile(path, folder / path.name)


def write_model_card(folder: Path, model_name: str, lines: list[str], base_model: str | None = None) -> None:
    """The package's Hub model card (metadata, architecture, prior), with how the folder was converted."""
    from ..hub.card import write_model_card as write_package_card

    write_package_card(folder, model_name=model_name, description="\n".join(lines), base_model=base_model)


def quiet(*args, **kwargs) -> None:
    pass
