"""Staged outputs under interruption: SIGTERM, SIGKILL and crashes between the two renames of a replace, sent to
real subprocesses; and the stale leftovers of killed runs, cleaned (or put back) by the next run."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import SAFETENSORS_DISK_FULL_MESSAGES, checkout_environment, fill, small_tmpfs
from waiting import communicate_within, scaled

from bam_llama.files import outputs as io_bam
from bam_llama.files.outputs import OutputError, check_output_dir, staged_files, staged_output_dir

# Writes OUT/content.txt through staged_output_dir. ACTION "wait" stops inside the staging block (prints
# "staged"); "kill-after-rename-N" / "term-after-rename-N" send SIGKILL / SIGTERM to itself right after the N-th
# os.replace of the move into place. WAIT_S: how long "wait" waits for the test's signal.
WRITER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    from bam_llama.files import outputs as io_bam

    out, content, action, wait_s = Path(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
    io_bam.exit_on_sigterm()
    real_replace, renames = os.replace, []

    def replace(source, target):
        real_replace(source, target)
        renames.append(target)
        if action == f"kill-after-rename-{len(renames)}":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == f"term-after-rename-{len(renames)}":
            os.kill(os.getpid(), signal.SIGTERM)

    os.replace = replace
    with io_bam.staged_output_dir(out, force=True) as staging:
        (staging / "content.txt").write_text(content)
        if action == "wait":
            print("staged", flush=True)
            time.sleep(wait_s)
    print("done", flush=True)
    """
)


def start_writer(out: Path, content: str, action: str) -> subprocess.Popen:
    script = out.parent.parent / "writer.py"
    script.write_text(WRITER)
    return subprocess.Popen(
        [sys.executable, str(script), str(out), content, action, str(scaled(600))],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=checkout_environment(),
    )


def run_writer(out: Path, content: str, action: str) -> subprocess.CompletedProcess:
    process = start_writer(out, content, action)
    stdout, stderr = communicate_within(process, 120, f"the writer ({action})")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def wait_until_staged(process: subprocess.Popen) -> None:
    line = process.stdout.readline()
    assert line.strip() == "staged", process.stderr.read()


def hidden_leftovers(parent: Path) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if path.name.startswith("."))


@pytest.fixture
def old_output(tmp_path) -> Path:
    """tmp_path/outputs/out holding content.txt = "old"."""
    out = tmp_path / "outputs" / "out"
    out.mkdir(parents=True)
    (out / "content.txt").write_text("old")
    return out


def test_sigterm_while_staging_removes_the_partial_output_and_keeps_the_old(old_output):
    process = start_writer(old_output, "new", "wait")
    wait_until_staged(process)
    assert len(hidden_leftovers(old_output.parent)) == 1  # the staging folder exists while the run writes
    process.send_signal(signal.SIGTERM)
    communicate_within(process, 60, "the writer's exit after SIGTERM")
    assert process.returncode == 128 + signal.SIGTERM
    assert hidden_leftovers(old_output.parent) == []
    assert (old_output / "content.txt").read_text() == "old"


def test_the_staging_folder_of_a_killed_run_is_removed_by_the_next_run(old_output, capsys):
    process = start_writer(old_output, "new", "wait")
    wait_until_staged(process)
    process.send_signal(signal.SIGKILL)
    communicate_within(process, 60, "the killed writer's exit")
    [leftover] = hidden_leftovers(old_output.parent)
    assert leftover.startswith(f".out.{process.pid}.") and leftover.endswith(".partial")

    with staged_output_dir(old_output, force=True) as staging:
        (staging / "content.txt").write_text("next")
    assert hidden_leftovers(old_output.parent) == []
    assert (old_output / "content.txt").read_text() == "next"
    assert f"removed {leftover}" in capsys.readouterr().err


def test_a_crash_between_the_two_renames_keeps_the_old_output_and_the_next_run_puts_it_back(old_output, capsys):
    completed = run_writer(old_output, "new", "kill-after-rename-1")
    assert completed.returncode == -signal.SIGKILL
    assert not old_output.exists()  # the window: the old output is only under its hidden .old name
    # the new output is complete too, but still under its hidden staging name
    aside, staging = sorted(hidden_leftovers(old_output.parent), key=lambda name: name.endswith(".partial"))
    assert aside.endswith(".old") and (old_output.parent / aside / "content.txt").read_text() == "old"
    assert staging.endswith(".partial")

    with pytest.raises(OutputError, match="already exists"):  # the next run first restores it, so no --force
        check_output_dir(old_output, force=False)
    assert (old_output / "content.txt").read_text() == "old"
    assert hidden_leftovers(old_output.parent) == []
    assert f"restored {old_output} from {aside}" in capsys.readouterr().err


def test_a_crash_after_the_second_rename_keeps_the_new_output_and_the_next_run_removes_the_old(old_output, capsys):
    completed = run_writer(old_output, "new", "kill-after-rename-2")
    assert completed.returncode == -signal.SIGKILL
    assert (old_output / "content.txt").read_text() == "new"
    [aside] = hidden_leftovers(old_output.parent)

    check_output_dir(old_output, force=True)
    assert hidden_leftovers(old_output.parent) == []
    assert (old_output / "content.txt").read_text() == "new"
    assert f"removed {aside}" in capsys.readouterr().err


def test_sigterm_between_the_two_renames_waits_for_the_second(old_output):
    completed = run_writer(old_output, "new", "term-after-rename-1")
    assert completed.returncode == 128 + signal.SIGTERM, completed.stderr
    assert "done" not in completed.stdout
    assert (old_output / "content.txt").read_text() == "new"
    assert hidden_leftovers(old_output.parent) == []


def test_the_leftovers_of_a_running_process_are_left_alone(tmp_path, capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # killed below
    try:
        busy = tmp_path / f".out.{sleeper.pid}.abc123.partial"
        busy.mkdir()
        unknown = tmp_path / ".out.abc123.partial"  # no process id: an older version's staging folder
        unknown.mkdir()
        check_output_dir(tmp_path / "out", force=False)
        assert busy.is_dir() and unknown.is_dir()
        assert f"{unknown} looks like the leftover of an interrupted run" in capsys.readouterr().err
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_unwritable_output_parent_is_one_clear_error(tmp_path, monkeypatch):
    def refuse(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", str(Path(dir) / ".out.123.partial"))

    monkeypatch.setattr(io_bam.tempfile, "mkdtemp", refuse)
    with pytest.raises(OutputError, match=f"cannot create {tmp_path / 'out'}: no permission to write in"):
        with staged_output_dir(tmp_path / "out", force=False):
            pass


def test_a_killed_conversions_scratch_folder_is_removed_by_the_next_run(tmp_path, capsys):
    """bam-convert's GGUF path dequantizes into `.OUT.<pid>.<random>.work` beside OUT; SIGKILL leaves it behind."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    scratch = tmp_path / f".out.{int(dead.stdout)}.k3x9q.work"
    (scratch / "llama").mkdir(parents=True)
    (scratch / "llama" / "model.safetensors").write_bytes(b"0" * 64)

    check_output_dir(tmp_path / "out", force=False)
    assert not scratch.exists()
    assert f"removed {scratch.name}, the scratch folder" in capsys.readouterr().err


def dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout)


def test_of_several_leftovers_only_the_newest_previous_output_is_put_back(tmp_path, capsys):
    """Killed replaces left two previous outputs (.old) and a newer incomplete one (.partial): the most recently
    written previous output comes back, never the incomplete one, and the rest is removed."""
    pid = dead_pid()
    for name, content, age in [("aaa.old", "oldest", 300), ("bbb.old", "newer", 200), ("ccc.partial", "incomplete", 100)]:
        leftover = tmp_path / f".out.{pid}.{name}"
        leftover.mkdir()
        (leftover / "content.txt").write_text(content)
        os.utime(leftover, (time.time() - age, time.time() - age))
    check_output_dir(tmp_path / "out", force=True)
    assert (tmp_path / "out" / "content.txt").read_text() == "newer"
    assert hidden_leftovers(tmp_path) == []
    assert f"restored {tmp_path / 'out'} from .out.{pid}.bbb.old" in capsys.readouterr().err


def test_an_output_that_appeared_while_staging_is_not_replaced_without_force(tmp_path):
    """The folder is checked again after the staged output is complete: another run may have written it since."""
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="already exists; pass --force"):
        with staged_output_dir(out, force=False) as staging:
            (staging / "content.txt").write_text("mine")
            out.mkdir()
            (out / "content.txt").write_text("the other run's")
    assert (out / "content.txt").read_text() == "the other run's"
    assert hidden_leftovers(tmp_path) == []


def test_staged_files_replace_their_namesakes_together_or_not_at_all(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "keep.txt").write_text("the user's")
    with io_bam.staged_files(folder, "result") as staging:
        (staging / "result.json").write_text("1")
        (staging / "plots").mkdir()
        (staging / "plots" / "result.png").write_text("one")
    assert sorted(str(path.relative_to(folder)) for path in folder.rglob("*")) == [
        "keep.txt", "plots", "plots/result.png", "result.json"]

    with pytest.raises(OSError):
        with io_bam.staged_files(folder, "result") as staging:
            (staging / "result.json").write_text("2")
            raise OSError(28, "No space left on device")
    assert (folder / "result.json").read_text() == "1" and (folder / "plots" / "result.png").read_text() == "one"
    assert hidden_leftovers(folder) == []

    with io_bam.staged_files(folder, "result") as staging:
        (staging / "result.json").write_text("3")
    assert (folder / "result.json").read_text() == "3" and (folder / "plots" / "result.png").read_text() == "one"


def test_the_staged_files_of_a_killed_run_are_removed_by_the_next_run(tmp_path, capsys):
    leftover = tmp_path / f".result.{dead_pid()}.x1y2.partial"
    leftover.mkdir()
    (leftover / "result.json").write_text("half")
    with io_bam.staged_files(tmp_path, "result") as staging:
        (staging / "result.json").write_text("whole")
    assert (tmp_path / "result.json").read_text() == "whole" and hidden_leftovers(tmp_path) == []
    assert f"removed {leftover.name}" in capsys.readouterr().err


# ----------------------------------------------------------------------- a full disk, however a library says so

NO_SPACE, QUOTA = "No space left on device", "Disk quota exceeded"  # Linux's strerror(ENOSPC), strerror(EDQUOT)
TORCH_ZIP_WRITER_FAILURE = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # on a full tmpfs


def raised_from(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def safetensors_error(message: str) -> BaseException:
    from safetensors import SafetensorError

    return SafetensorError(message)


def stage_then_raise(kind: str, out: Path, error: BaseException, write=None) -> None:
    """Write into a staged output (`kind`: a whole folder, or files in a shared folder) and fail with `error`."""
    stager = staged_output_dir(out, force=True) if kind == "folder" else staged_files(out, "results")
    with stager as staging:
        (staging / "half.bin").write_bytes(b"half")
        if write is not None:
            write(staging)
        raise error


@pytest.mark.parametrize("kind", ["folder", "files"])
@pytest.mark.parametrize(
    "error, errno_, reported",
    [
        *[pytest.param(lambda message=message: safetensors_error(message), errno.ENOSPC, f"{NO_SPACE} (OUT)",
                       id=f"safetensors-{index}") for index, message in enumerate(SAFETENSORS_DISK_FULL_MESSAGES)],
        pytest.param(lambda: RuntimeError(f"write(): fd 3 failed with {NO_SPACE}"), errno.ENOSPC, f"{NO_SPACE} (OUT)",
                     id="torch-legacy-format"),
        pytest.param(lambda: OSError(errno.ENOSPC, NO_SPACE), errno.ENOSPC, f"{NO_SPACE} (OUT)", id="no-file-named"),
        pytest.param(lambda: OSError(errno.ENOSPC, NO_SPACE, "/elsewhere/x.bin"), errno.ENOSPC,
                     f"{NO_SPACE} (/elsewhere/x.bin)", id="file-named"),
        pytest.param(lambda: OSError(errno.EDQUOT, QUOTA), errno.EDQUOT, f"{QUOTA} (OUT)", id="quota"),
        pytest.param(lambda: safetensors_error(f"Error while serializing: I/O error: {QUOTA} (os error 122)"),
                     errno.EDQUOT, f"{QUOTA} (OUT)", id="safetensors-quota"),
        pytest.param(lambda: raised_from(RuntimeError("saving the model failed"), OSError(errno.ENOSPC, NO_SPACE)),
                     errno.ENOSPC, f"{NO_SPACE} (OUT)", id="raised-from"),
    ],
)
def test_a_full_disk_is_one_os_error_naming_the_output_whatever_library_said_it(tmp_path, kind, error, errno_, reported):
    """Every command reports an OSError in one line (status 1): a full disk becomes one, with the output's name when
    the library named no file, and the earlier output stays."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier.txt").write_text("earlier")
    with pytest.raises(OSError) as raised:
        stage_then_raise(kind, out, error())
    assert raised.value.errno == errno_
    assert io_bam.os_error_message(raised.value) == reported.replace("OUT", str(out))
    assert sorted(os.listdir(tmp_path)) == ["out"] and sorted(os.listdir(out)) == ["earlier.txt"]


@pytest.mark.parametrize(
    "error",
    [ValueError("a bad value"), RuntimeError("CUDA out of memory"), OSError(errno.EIO, "Input/output error"),
     RuntimeError(TORCH_ZIP_WRITER_FAILURE), KeyboardInterrupt()],
    ids=["value", "memory", "eio", "torch-zip-writer-with-room", "ctrl-c"],
)
def test_other_errors_pass_through_staged_outputs_unchanged(tmp_path, error):
    """PyTorch's zip writer names no reason: with room on the disk it is not taken for a full one."""
    for kind in ("folder", "files"):
        with pytest.raises(type(error)) as raised:
            stage_then_raise(kind, tmp_path / kind, error)
        assert raised.value is error


def test_pytorch_s_zip_writer_failing_on_a_nearly_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    """torch.save's writer fails with "unexpected pos" and no errno: with under 1 MiB free it is a full disk."""
    nearly_full = SimpleNamespace(total=2**30, used=2**30 - 4096, free=4096)
    monkeypatch.setattr(io_bam.shutil, "disk_usage", lambda path: nearly_full)
    with pytest.raises(OSError) as raised:
        stage_then_raise("folder", tmp_path / "out", RuntimeError(TORCH_ZIP_WRITER_FAILURE))
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "out")


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_torch_save_on_a_real_full_disk_is_a_full_disk(tmp_path, legacy):
    """Where the suite may mount a tmpfs: torch.save into a staged output on a full one, in both of its formats."""
    import torch

    with small_tmpfs(tmp_path, "1m") as disk:
        (disk / "out").mkdir()
        fill(disk, leave=64 * 1024)
        with pytest.raises(OSError) as raised:
            stage_then_raise("folder", disk / "out", RuntimeError("not reached"),
                             write=lambda staging: torch.save(torch.zeros(2**17), staging / "model.pt",
                                                              _use_new_zipfile_serialization=not legacy))
        assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(disk / "out")
        assert sorted(os.listdir(disk)) == ["filler", "out"] and os.listdir(disk / "out") == []
