"""Files on disk shared by the commands: output folders staged and renamed into place, safetensors written shard
by shard, and the model path and tokenizer of a model folder.

Light on imports (torch, safetensors and Transformers are imported where used), so the commands can parse their
arguments and print --help without loading the model stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    import torch

DEFAULT_MAX_SHARD_SIZE = "5GB"


class OutputError(ValueError):
    """A bad output folder or output setting. The message names it; nothing has been written."""


# --------------------------------------------------------------------------------------------------------
# Output folder: staged beside OUT_DIR, renamed into place when complete
# --------------------------------------------------------------------------------------------------------


def check_output_dir(out_dir: Path, force: bool, inputs: Iterable[Path] = ()) -> None:
    """Refuse an output that would replace an input, or an existing one without `force`. What killed runs left
    beside `out_dir` is dealt with first (see `recover_interrupted_output`)."""
    recover_interrupted_output(out_dir)
    for source in inputs:
        if out_dir == source or out_dir in source.parents:
            raise OutputError(f"the output folder {out_dir} would replace the input {source}")
    if out_dir.exists() or out_dir.is_symlink():
        if not force:
            raise OutputError(f"the output folder {out_dir} already exists; pass --force to replace it")


@contextlib.contextmanager
def staged_output_dir(out_dir: Path, force: bool, inputs: Iterable[Path] = ()) -> Iterator[Path]:
    """Yield an empty folder beside `out_dir`; it becomes `out_dir` if the block succeeds and is deleted otherwise.

    The staging folder is named `.OUT.<pid>.<random>.partial`, so a later run can tell a killed run's leftovers
    from a running one's.
    """
    inputs = tuple(inputs)
    check_output_dir(out_dir, force, inputs)
    try:
        created_parents = make_parents(out_dir.parent)
        staging = Path(tempfile.mkdtemp(prefix=leftover_prefix(out_dir), suffix=".partial", dir=out_dir.parent))
    except PermissionError as error:
        raise OutputError(f"cannot create {out_dir}: no permission to write in {error.filename or out_dir.parent}") from None
    try:
        yield staging
        check_output_dir(out_dir, force, inputs)
        apply_umask_permissions(staging)
        move_into_place(staging, out_dir)
    except BaseException:
        with signals_deferred():
            shutil.rmtree(staging, ignore_errors=True)
            for folder in reversed(created_parents):
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise


def move_into_place(staging: Path, out_dir: Path) -> None:
    """Rename `staging` to `out_dir`. An existing `out_dir` is first renamed aside to `.OUT.<pid>.<random>.old`
    and deleted once the new one is in place; SIGINT / SIGTERM wait until both renames are done. If the process
    dies between the two renames anyway (SIGKILL, power loss), the old output is complete under its `.old` name
    and the next run puts it back (`recover_interrupted_output`)."""
    aside = None
    try:
        with signals_deferred():
            if not (out_dir.exists() or out_dir.is_symlink()):
                os.replace(staging, out_dir)
                return
            aside = Path(tempfile.mkdtemp(prefix=leftover_prefix(out_dir), suffix=".old", dir=out_dir.parent))
            aside.rmdir()  # only the unique name is wanted: os.replace cannot put a file or symlink over a folder
            os.replace(out_dir, aside)
            try:
                os.replace(staging, out_dir)
            except BaseException:
                os.replace(aside, out_dir)
                raise
    finally:  # also when a deferred signal arrives at the end of the block
        if aside is not None and out_dir.exists():
            remove_path(aside)


def leftover_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.{os.getpid()}."


LEFTOVER_KINDS = ("partial", "old", "work")  # staging, a replaced output, a conversion's scratch folder
LEFTOVER_DESCRIPTIONS = {"partial": "incomplete output", "old": "previous output", "work": "scratch folder"}


def recover_interrupted_output(out_dir: Path) -> None:
    """Clean up after runs killed while writing `out_dir`, with a note on stderr for each thing done.

    `.OUT.<pid>.*.partial` of a process that no longer runs is an incomplete output: deleted. `.OUT.<pid>.*.old`
    is a complete previous output moved aside by a `--force` replace: put back when `out_dir` is missing (the
    run died between the two renames), deleted otherwise. `.OUT.<pid>.*.work` is a conversion's scratch folder
    (the dequantized GGUF): deleted. Leftovers of running processes are left alone, and
    ones without a process id (older versions) are only reported.
    """
    pattern = re.compile(rf"\.{re.escape(out_dir.name)}\.(?:(\d+)\.)?[^.]+\.({'|'.join(LEFTOVER_KINDS)})")
    if not out_dir.parent.is_dir():
        return
    leftovers = [(path, match) for path in out_dir.parent.iterdir() if (match := pattern.fullmatch(path.name))]
    leftovers.sort(key=lambda item: item[0].lstat().st_mtime, reverse=True)  # the newest old output first
    for path, match in leftovers:
        pid, kind = match.group(1), match.group(2)
        if pid is None:
            note(f"{path} looks like the leftover of an interrupted run; delete it if no other run writes {out_dir}")
        elif process_is_running(int(pid)):
            continue
        elif kind == "old" and not (out_dir.exists() or out_dir.is_symlink()):
            os.replace(path, out_dir)
            note(f"restored {out_dir} from {path.name}: a run replacing it was interrupted")
        else:
            remove_path(path)
            note(f"removed {path.name}, the {LEFTOVER_DESCRIPTIONS[kind]} of a run that was interrupted while writing {out_dir}")


def process_is_running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block is done, then deliver them, so renames come in pairs and cleanups
    finish. (Python runs signal handlers in the main thread only; elsewhere there is nothing to defer.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum)) for signum in DEFERRED_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in received:
            signal.raise_signal(signum)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit(143), like Ctrl-C's KeyboardInterrupt, so staged outputs are cleaned up."""

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)


def make_parents(folder: Path) -> list[Path]:
    """Create `folder` and its missing parents; return the folders created, outermost first."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    created = []
    for folder in reversed(missing):
        folder.mkdir()
        created.append(folder)
    return created


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def apply_umask_permissions(folder: Path) -> None:
    """mkdtemp (and safetensors) create private files; give the output the permissions of ordinary new files."""
    umask = current_umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def parse_size(size: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", str(size).upper())
    if match is None or float(match.group(1)) <= 0:
        raise OutputError(f"cannot read the shard size {size!r}; write it like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * units[match.group(2) or ""])


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


# --------------------------------------------------------------------------------------------------------
# Model folders and tokenizers
# --------------------------------------------------------------------------------------------------------


def check_model_path(path) -> None:
    """A path that can only be local (absolute, ./ or ../, more than one '/') must exist: Transformers would
    otherwise report it as an invalid Hub repo id."""
    text = str(path)
    looks_local = isinstance(path, Path) or text.startswith((os.sep, ".", "~")) or text.count("/") > 1
    if looks_local and not Path(text).expanduser().exists():
        raise FileNotFoundError(f"no model folder at {text}")


def read_utf8_text(path: Path) -> str:
    """The text of a user's data file; a file that is not UTF-8 (a binary file in a data folder) is a ValueError
    naming the file, the line and the byte, like the JSON-lines errors (Python names neither file nor line)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path}:{line} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): a binary "
            "file? Only UTF-8 text files can be read as training or evaluation text"
        ) from None


def check_safetensors_files(model_path) -> None:
    """Every safetensors file of a local model folder must open: a corrupt or truncated one is named (safetensors
    itself only says "Error while deserializing header")."""
    folder = Path(model_path)
    if not folder.is_dir():
        return
    from safetensors import SafetensorError, safe_open

    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt"):
                pass
        except SafetensorError as error:
            raise ValueError(f"{path} is not a readable safetensors file, probably corrupt or truncated ({error})") from None


def load_tokenizer(model_path, config, tokenizer=None):
    """`tokenizer` (an object, or a path to load), else the one saved at `model_path`, else the built-in byte
    tokenizer (with a note on stderr, and a warning when the model's vocabulary is not the byte tokenizer's)."""
    from .data.tokenizers import BYTE_VOCAB_SIZE, build_byte_tokenizer

    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer if tokenizer is not None else model_path)
    except (OSError, ValueError, TypeError):
        if tokenizer is not None:
            raise
    vocab_size = getattr(config, "vocab_size", BYTE_VOCAB_SIZE)
    if vocab_size != BYTE_VOCAB_SIZE:
        raise ValueError(
            f"no tokenizer found in {model_path}, and the built-in byte tokenizer does not fit the model: its "
            f"vocab_size is {vocab_size}, the byte tokenizer's {BYTE_VOCAB_SIZE}; save the model's tokenizer in its "
            "folder (bam-eval can also take one with --tokenizer)"
        )
    print(f"No tokenizer found in {model_path}; using the built-in byte tokenizer.", file=sys.stderr)
    return build_byte_tokenizer()
