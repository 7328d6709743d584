"""The one write step of the conversions to BamLlama: its options checked before a conversion reads anything
(`check_write_options`), then weights shard by shard, config.json and the remote code, the tokenizer and other copied
files, and the model card, in a folder staged beside OUT_DIR and renamed into place only once complete."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers.dynamic_module_utils import custom_object_save

from ..files.outputs import check_output_dir, staged_output_dir
from ..hub.card import write_model_card
from ..model.configuration_bam import BamLlamaConfig
from ..model.modeling_bam import REMOTE_CODE_AUTO_MAP, BamLlamaForCausalLM
from .common import parse_dtype
from .options import DEFAULT_MAX_SHARD_SIZE, parse_size


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


def save_config_and_code(config: BamLlamaConfig, folder: Path) -> None:
    """config.json plus the modeling code, so the folder loads with trust_remote_code=True."""
    config.architectures = ["BamLlamaForCausalLM"]
    config.auto_map = dict(REMOTE_CODE_AUTO_MAP)
    custom_object_save(BamLlamaForCausalLM, folder)  # modeling_bam.py and the modules it imports relatively
    config.save_pretrained(folder)  # config.json and configuration_bam.py


def copy_files(files: Iterable[Path], folder: Path) -> None:
    for path in files:
        shutil.copyfile(path, folder / path.name)


def check_write_options(
    out_dir: Path, force: bool, inputs: tuple[Path, ...], dtype: str, max_shard_size: str | int
) -> torch.dtype | None:
    """Refuse what the write step would refuse, before anything is read: an `out_dir` that exists (without `force`)
    or holds an input, an unknown dtype, a shard size that is not one. Returns the weights' dtype (None: as stored)."""
    check_output_dir(out_dir, force, inputs)
    target_dtype = parse_dtype(dtype)
    parse_size(max_shard_size)
    return target_dtype


def write_bam_folder(
    out_dir: Path,
    config: BamLlamaConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    inputs: tuple[Path, ...],
    force: bool,
    max_shard_size: str | int,
    copied_files: Iterable[Path],
    card_lines: list[str],
    base_model: str | None = None,
) -> list[str]:
    """Write the BamLlama folder `out_dir`: `weights` (name, tensor) in safetensors shards, the config and remote
    code, `copied_files` (tokenizer, generation config) and the package's model card with `card_lines` (how the
    folder was converted) as its description. Staged beside `out_dir`: a failure leaves nothing behind. Returns the
    weight files' names."""
    with staged_output_dir(out_dir, force, inputs) as staging:
        writer = SafetensorsShardWriter(staging, max_shard_size)
        for name, tensor in weights:
            writer.add(name, tensor)
        weight_files = writer.finish()
        save_config_and_code(config, staging)
        copy_files(copied_files, staging)
        write_model_card(staging, model_name=out_dir.name, description="\n".join(card_lines), base_model=base_model)
    return weight_files
