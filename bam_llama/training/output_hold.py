"""Who owns a training output folder: one live run at a time, and never a new run over an earlier run's results.

`hold_output_dir(folder, command, results=...)` is held for the whole run:

* a lock (`fcntl.flock` on `folder/.bam-run.lock`, holding the holder's pid, host, command and start time). The
  operating system releases it when the holder dies, however it dies, so a killed run never blocks the next one;
  a second live run into the same folder is refused with one line naming the holder;
* the folder's results from an earlier run (`results`: glob patterns such as "checkpoint-*", "summary.json") are
  kept: a new run is refused unless it continues that run (`continuing`, e.g. `--resume-from-checkpoint latest`)
  or the user asked to replace them (`overwrite`, `--overwrite-output-dir`, as in Transformers' example
  scripts). The refusal offers only what works: `--resume-from-checkpoint latest` where a complete checkpoint is
  there to continue. Replaced results are deleted by `OutputDirHold.clear_earlier_results()`, which the command
  calls once its inputs have loaded and before it writes anything: a run that fails on bad input deletes nothing,
  and the two runs' files never mix;
* what a run writes before it trains (`prepared`, e.g. a trained tokenizer) is no result: a run stopped before its
  first checkpoint leaves only that (with a staged checkpoint and a lock file, both dead), and the same command
  run again starts afresh, replacing it. Continuing keeps it.

Under torchrun / accelerate launch only the main process (RANK 0) holds the folder: the other ranks write into
the same run. Light on imports (standard library only).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .checkpoints import latest_checkpoint

LOCK_NAME = ".bam-run.lock"


class OutputDirError(ValueError):
    """The output folder cannot be used by this run; the message says why and what to do."""


class OutputDirInUse(OutputDirError):
    """Another live run holds the output folder."""


class OutputDirHold:
    """What `hold_output_dir` yields: the folder, and the earlier results this run replaces (empty unless
    overwriting). Every rank knows them; only the main process (the owner) deletes them."""

    def __init__(self, folder: Path, replaced: list[str], owner: bool, lock_descriptor: int | None = None):
        self.folder, self.replaced, self.owner = folder, replaced, owner
        self.lock_descriptor = lock_descriptor

    def clear_earlier_results(self) -> None:
        """Delete the replaced results (call it after the inputs loaded, before writing anything)."""
        self.ensure_held()
        if self.owner:
            for name in self.replaced:
                _remove(self.folder / name)
        self.replaced = []

    def ensure_held(self) -> None:
        """Raise OutputDirInUse if the lock file is no longer this run's (someone deleted it, so another run may
        have taken the folder since): called before the run writes or deletes anything there."""
        if self.lock_descriptor is not None and not _same_file(self.lock_descriptor, self.folder / LOCK_NAME):
            raise OutputDirInUse(
                f"the lock file {self.folder / LOCK_NAME} was removed while this run held {self.folder}, so another "
                "run may be writing there: stopped before writing; choose another --output-dir"
            )


@contextlib.contextmanager
def hold_output_dir(
    folder: str | os.PathLike,
    command: str,
    results: Iterable[str] = (),
    continuing: bool = False,
    overwrite: bool = False,
    prepared: Iterable[str] = (),
) -> Iterator[OutputDirHold]:
    """Hold `folder` (created if missing) for the block; see the module docstring.

    Raises OutputDirInUse while another live process holds it, OutputDirError when it holds earlier results
    (names matching `results`) and the run neither continues them nor overwrites them. A folder this call created
    and that is still empty afterwards (the run stopped before writing anything) is removed again."""
    folder = Path(folder)
    results, prepared = tuple(results), tuple(prepared)
    if not is_main_process():  # the other ranks check the same (so that all refuse together), lock nothing
        yield OutputDirHold(folder, _replaced_results(folder, results, prepared, continuing, overwrite), owner=False)
        return
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputDirError(f"cannot create the output folder {folder}: {error.strerror}") from None
    try:
        with _folder_lock(folder, command) as descriptor:
            remove_staged_checkpoints(folder)
            replaced = _replaced_results(folder, results, prepared, continuing, overwrite)
            yield OutputDirHold(folder, replaced, True, descriptor)
    finally:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty


def _replaced_results(folder: Path, results: tuple[str, ...], prepared: tuple[str, ...], continuing: bool,
                      overwrite: bool) -> list[str]:
    """What a run replaces of an earlier one (its results and what it prepared; nothing when it continues it); an
    OutputDirError if there are results and it neither continues them nor overwrites them."""
    if continuing:
        return []
    earlier = earlier_results(folder, results)
    if earlier and not overwrite:
        shown = ", ".join(earlier[:4]) + (", ..." if len(earlier) > 4 else "")
        options = ["--overwrite-output-dir to replace them", "choose another --output-dir"]
        if latest_checkpoint(folder) is not None:
            options.insert(0, "--resume-from-checkpoint latest to continue that run")
        raise OutputDirError(
            f"{folder} holds the results of an earlier run ({shown}): pass {', '.join(options[:-1])}, or {options[-1]}"
        )
    return earlier_results(folder, (*results, *prepared))


STAGED_CHECKPOINT = ".{}.staging"  # where a checkpoint is written before it is renamed to its name (trainer.py)


def remove_staged_checkpoints(folder: Path) -> None:
    """Checkpoints a killed run was still writing: only the holder of the folder writes there, so they are dead."""
    for leftover in sorted(folder.glob(STAGED_CHECKPOINT.format("checkpoint-*"))):
        _remove(leftover)
        print(f"note: removed {leftover.name}, a checkpoint an interrupted run did not finish writing", file=sys.stderr)


def earlier_results(folder: Path, patterns: Iterable[str]) -> list[str]:
    """Sorted names in `folder` matching any of the glob `patterns`."""
    return sorted({path.name for pattern in patterns for path in folder.glob(pattern)})


def resumes_in(folder: str | os.PathLike, resume_from_checkpoint: str | None) -> bool:
    """Whether --resume-from-checkpoint continues the run in `folder`: 'latest', or one of its checkpoints."""
    if resume_from_checkpoint in (None, ""):
        return False
    return resume_from_checkpoint == "latest" or Path(resume_from_checkpoint).resolve().parent == Path(folder).resolve()


def is_main_process() -> bool:
    """True unless a launcher (torchrun, accelerate, deepspeed) says this process is a rank other than 0."""
    return int(os.environ.get("RANK", "0") or 0) == 0


@contextlib.contextmanager
def _folder_lock(folder: Path, command: str) -> Iterator[int]:
    """An exclusive flock on folder/LOCK_NAME, never waiting; yields its descriptor. The file is removed on release
    while still locked (if it is still ours); a process that opened it before the removal finds its inode gone
    from the path after locking, and retries."""
    path = folder / LOCK_NAME
    while True:
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(descriptor)
            os.close(descriptor)
            raise OutputDirInUse(
                f"{folder} is in use by another run ({holder}): wait for it to finish, or choose another --output-dir"
            ) from None
        if _same_file(descriptor, path):
            break
        os.close(descriptor)  # unlinked by its releasing holder between our open and our lock: take the new file
    try:
        _write_holder(descriptor, command)
        yield descriptor
    finally:
        if _same_file(descriptor, path):  # not a later run's lock file, if ours was deleted under us
            with contextlib.suppress(OSError):
                os.unlink(path)
        os.close(descriptor)


def _same_file(descriptor: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except FileNotFoundError:
        return False


def _write_holder(descriptor: int, command: str) -> None:
    holder = {
        "command": command, "pid": os.getpid(), "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, (json.dumps(holder) + "\n").encode(), 0)


def _holder(descriptor: int) -> str:
    """'bam-finetune, pid 123 on host, started ...' from the lock file; the holder may not have written it yet."""
    try:
        holder = json.loads(os.pread(descriptor, 4096, 0).decode())
        return f"{holder['command']}, pid {holder['pid']} on {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its details are not written yet"


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
