"""Output folders shared by the commands: staged beside their destination and renamed into place when complete,
with signals held during the renames and what killed runs left behind cleaned up.

Light on purpose (standard library only): the commands import it before they parse their arguments.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path


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
    except OSError as error:
        raise OutputError(f"cannot create {out_dir}: {os_error_message(error)}") from None
    try:
        with disk_full_named(out_dir):
            yield staging
        check_output_dir(out_dir, force, inputs)
        apply_umask_permissions(staging)
        move_into_place(staging, out_dir)
    except BaseException:
        discard_staging(staging, created_parents)
        raise


@contextlib.contextmanager
def staged_files(folder: Path, name: str) -> Iterator[Path]:
    """Yield an empty staging folder inside `folder` (created if missing); the files written into it replace their
    namesakes in `folder` (paths relative to the staging folder kept) once the block succeeds, all renames with
    SIGINT / SIGTERM held. Otherwise nothing of it stays and the earlier files are untouched.

    For outputs that share a folder with other files (`bam-eval --out`'s table, results and plot; `bam-card`'s
    README.md and plots). The staging folder is `.NAME.<pid>.<random>.partial`: a killed run's is removed by the
    next one (`recover_interrupted_output(folder / name)`)."""
    folder = Path(folder)
    recover_interrupted_output(folder / name)
    try:
        created_parents = make_parents(folder)
        staging = Path(tempfile.mkdtemp(prefix=leftover_prefix(folder / name), suffix=".partial", dir=folder))
    except OSError as error:
        raise OutputError(f"cannot write in {folder}: {os_error_message(error)}") from None
    try:
        with disk_full_named(folder):
            yield staging
        apply_umask_permissions(staging)
        with signals_deferred():
            for path in sorted(path for path in staging.rglob("*") if not path.is_dir()):
                target = folder / path.relative_to(staging)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
            shutil.rmtree(staging)
    except BaseException:
        discard_staging(staging, created_parents)
        raise


def discard_staging(staging: Path, created_parents: list[Path]) -> None:
    """Remove a staging folder and the (still empty) parents made for it, innermost first, signals held."""
    with signals_deferred():
        shutil.rmtree(staging, ignore_errors=True)
        for created in reversed(created_parents):
            with contextlib.suppress(OSError):
                created.rmdir()


def os_error_message(error: OSError) -> str:
    """'No space left on device (/out/passkey.json)': an OSError in one line, with the path it names."""
    reason = error.strerror or str(error)
    filename = error.filename if error.filename2 is None else f"{error.filename} -> {error.filename2}"
    return f"{reason} ({filename})" if filename else reason


# --------------------------------------------------------------------------------------------------------
# A full disk, whatever library writes: OSError(ENOSPC), which every command reports in one line (status 1)
# --------------------------------------------------------------------------------------------------------

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
TORCH_ZIP_WRITER = "inline_container.cc"  # PyTorch's torch.save writer fails with "unexpected pos" and no errno
NEARLY_FULL_BYTES = 1 << 20


@contextlib.contextmanager
def disk_full_named(path: Path) -> Iterator[None]:
    """An error of the block that says the disk is full becomes an OSError(ENOSPC or EDQUOT) naming `path`
    (`disk_full_error`); any other error goes through unchanged."""
    try:
        yield
    except Exception as error:
        full = disk_full_error(error, path)
        if full is None or full is error:
            raise
        raise full from error


def disk_full_error(error: BaseException, path: Path | None = None) -> OSError | None:
    """The OSError a full disk (or quota) is, for `error` raised by any library; None for any other error.

    An OSError with errno ENOSPC or EDQUOT, in `error` or its causes, is kept (given `path` if it names no file).
    An exception whose message says so (safetensors' SafetensorError "... No space left on device (os error 28)",
    PyTorch's "write(): fd 3 failed with No space left on device") becomes one. PyTorch's zip writer says only
    "unexpected pos" or "file write failed": it counts as a full disk when `path`'s file system has under 1 MiB free.
    """
    chain = causes(error)
    for cause in chain:
        if isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS:
            if cause.filename is not None or path is None:
                return cause
            return OSError(cause.errno, cause.strerror, str(path))
        for number in DISK_FULL_ERRNOS:
            if os.strerror(number) in str(cause):
                return OSError(number, os.strerror(number), *([str(path)] if path is not None else []))
    if path is not None and any(TORCH_ZIP_WRITER in str(cause) for cause in chain):
        if free_bytes(path) < NEARLY_FULL_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return None


def causes(error: BaseException) -> list[BaseException]:
    """`error`, then what it was raised from or while handling, outermost first."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain


def free_bytes(path: Path) -> int:
    """Free bytes (for unprivileged users) on the file system of `path` or of its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return NEARLY_FULL_BYTES  # unknown: not taken for a full disk


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
            report_leftover(f"{path} looks like the leftover of an interrupted run; delete it if no other run writes {out_dir}")
        elif process_is_running(int(pid)):
            continue
        elif kind == "old" and not (out_dir.exists() or out_dir.is_symlink()):
            os.replace(path, out_dir)
            report_leftover(f"restored {out_dir} from {path.name}: a run replacing it was interrupted")
        else:
            remove_path(path)
            report_leftover(f"removed {path.name}, the {LEFTOVER_DESCRIPTIONS[kind]} of a run that was interrupted while writing {out_dir}")


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


def report_leftover(message: str) -> None:
    """One line on stderr saying what was done with (or found of) a killed run's leftover."""
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


class FolderInUse(OSError):
    """Another live process holds the folder (`FolderLock`)."""


class FolderLock:
    """One live holder of `folder` at a time: an OS lock (flock) on `folder/.lock`, which the kernel drops when its
    holder ends however it ends, so a killed holder never blocks the next. `FolderInUse` where another holds it."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.file = open(folder / ".lock", "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise FolderInUse(f"another live process is writing {folder}") from None

    def release(self) -> None:
        self.file.close()

