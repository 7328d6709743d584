"""lock_bam: one live run per output folder (a lock that dies with its holder), earlier results kept unless the
run continues them or the user asks to replace them."""

import os
import signal
import sys

import pytest
from helpers import checkout_environment
from waiting import WatchedProcess, scaled

from bam_llama.training.output_hold import (
    LOCK_NAME,
    OutputDirError,
    OutputDirInUse,
    hold_output_dir,
    resumes_in,
)

HOLDER = """
import sys, time
from bam_llama.training.output_hold import hold_output_dir

with hold_output_dir(sys.argv[1], "bam-holder"):
    print("held", flush=True)
    deadline = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline:  # until the test kills it
        time.sleep(0.05)
sys.exit("the test never killed the holder")
"""


def start_holder(folder) -> WatchedProcess:
    """A process holding `folder`, once it printed 'held'."""
    holder = WatchedProcess([sys.executable, "-c", HOLDER, str(folder), str(scaled(600))], env=checkout_environment())
    holder.wait_for_line("held", 120)
    return holder


def test_a_live_holder_refuses_a_second_run_and_its_death_releases_the_folder(tmp_path):
    folder = tmp_path / "out"
    holder = start_holder(folder)
    try:
        with pytest.raises(OutputDirInUse) as error:
            with hold_output_dir(folder, "bam-second"):
                pytest.fail("two runs held the same folder")
        message = str(error.value)
        assert "\n" not in message
        assert f"{folder} is in use by another run (bam-holder, pid {holder.process.pid} on " in message
    finally:
        holder.process.send_signal(signal.SIGKILL)  # no clean-up code runs: only the OS can release the lock
        holder.wait(60, "the killed holder's exit")
    assert (folder / LOCK_NAME).exists()  # left behind by the killed holder, and not in the way
    with hold_output_dir(folder, "bam-second"):
        assert str(os.getpid()) in (folder / LOCK_NAME).read_text()
    assert not (folder / LOCK_NAME).exists()


def test_a_second_holder_in_the_same_process_is_refused(tmp_path):
    with hold_output_dir(tmp_path, "first"):
        with pytest.raises(OutputDirInUse, match=rf"\(first, pid {os.getpid()} on "):
            with hold_output_dir(tmp_path, "second"):
                pass
    with hold_output_dir(tmp_path, "third"):
        pass


def earlier_run(folder):
    (folder / "checkpoint-4").mkdir(parents=True)
    (folder / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4}')
    (folder / "adapter").mkdir()
    (folder / "summary.json").write_text("{}")
    (folder / "notes.txt").write_text("the user's own file")


RESULTS = ("checkpoint-*", "adapter", "model", "summary.json")


def test_earlier_results_are_refused_kept_continued_or_replaced_on_request(tmp_path):
    earlier_run(tmp_path)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(OutputDirError, match=r"holds the results of an earlier run \(adapter, checkpoint-4, "
                                             r"summary.json\): pass --resume-from-checkpoint latest"):
        with hold_output_dir(tmp_path, "bam-finetune", RESULTS):
            pytest.fail("a new run went over an earlier run's results")
    assert sorted(os.listdir(tmp_path)) == before
    with hold_output_dir(tmp_path, "bam-finetune", RESULTS, continuing=True) as hold:
        assert hold.replaced == []
    with hold_output_dir(tmp_path, "bam-finetune", RESULTS, overwrite=True) as hold:
        assert hold.replaced == ["adapter", "checkpoint-4", "summary.json"]
        assert sorted(os.listdir(tmp_path)) == sorted(before + [LOCK_NAME])  # nothing deleted before it is asked
        hold.clear_earlier_results()
        assert sorted(os.listdir(tmp_path)) == sorted(["notes.txt", LOCK_NAME])
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_the_refusal_offers_to_continue_only_where_a_complete_checkpoint_is(tmp_path):
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{")  # a checkpoint whose save did not finish
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(OutputDirError) as error:
        with hold_output_dir(tmp_path, "bam-pretrain", RESULTS):
            pytest.fail("a new run went over an earlier run's results")
    assert "--resume-from-checkpoint" not in str(error.value)
    assert str(error.value).endswith("pass --overwrite-output-dir to replace them, or choose another --output-dir")


def test_what_a_run_prepares_before_training_is_replaced_by_the_next_run_not_refused(tmp_path):
    """A run stopped before its first checkpoint leaves its tokenizer, its lock file (SIGKILL) and a staged
    checkpoint: the next run holds the folder and replaces the tokenizer once asked to; continuing keeps it."""
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    (tmp_path / LOCK_NAME).write_text("{}")
    (tmp_path / ".checkpoint-2.staging" / "checkpoint-2").mkdir(parents=True)
    with hold_output_dir(tmp_path, "bam-pretrain", RESULTS, continuing=True) as hold:
        assert hold.replaced == []
    with hold_output_dir(tmp_path, "bam-pretrain", RESULTS, prepared=("tokenizer",)) as hold:
        assert hold.replaced == ["tokenizer"] and (tmp_path / "tokenizer").exists()
        hold.clear_earlier_results()
        assert os.listdir(tmp_path) == [LOCK_NAME]
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "model").mkdir()
    with pytest.raises(OutputDirError, match=r"earlier run \(model\)"):  # a result beside it is refused as before
        with hold_output_dir(tmp_path, "bam-pretrain", RESULTS, prepared=("tokenizer",)):
            pass
    with hold_output_dir(tmp_path, "bam-pretrain", RESULTS, overwrite=True, prepared=("tokenizer",)) as hold:
        assert hold.replaced == ["model", "tokenizer"]


def test_a_folder_created_for_a_run_that_wrote_nothing_is_removed(tmp_path):
    with pytest.raises(RuntimeError):
        with hold_output_dir(tmp_path / "new" / "out", "bam-finetune", RESULTS):
            raise RuntimeError("bad input")
    assert not (tmp_path / "new" / "out").exists()


def test_ranks_other_than_0_check_alike_but_lock_and_delete_nothing(tmp_path, monkeypatch):
    """Under torchrun every rank refuses the same folder (so that none waits for a rank that quit) and knows what
    rank 0 replaces (bam-finetune's stale merged/ check), but only rank 0 locks and deletes."""
    earlier_run(tmp_path)
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(OutputDirError, match="holds the results of an earlier run"):
        with hold_output_dir(tmp_path, "bam-finetune", RESULTS):
            pass
    with hold_output_dir(tmp_path, "bam-finetune", RESULTS, overwrite=True) as hold:
        assert hold.replaced == ["adapter", "checkpoint-4", "summary.json"] and not (tmp_path / LOCK_NAME).exists()
        hold.clear_earlier_results()
    assert sorted(os.listdir(tmp_path)) == before


def test_only_a_checkpoint_of_the_folder_continues_its_run(tmp_path):
    assert resumes_in(tmp_path, "latest") and resumes_in(tmp_path, str(tmp_path / "checkpoint-4"))
    assert not resumes_in(tmp_path, None) and not resumes_in(tmp_path, "")
    assert not resumes_in(tmp_path / "out", str(tmp_path / "other-run" / "checkpoint-4"))


def test_a_lock_file_deleted_under_its_holder_stops_it_before_it_writes_and_is_not_taken_from_the_next(tmp_path):
    """Someone deletes the holder's lock file: a second run can then lock a new one. The first run finds out before
    it writes or deletes anything (ensure_held), and its release leaves the second run's lock file in place, so that
    a third run is still refused."""
    with hold_output_dir(tmp_path, "first") as first:
        (tmp_path / LOCK_NAME).unlink()
        with pytest.raises(OutputDirInUse, match="was removed while this run held"):
            first.ensure_held()  # no second run yet: a lock file that is gone protects nothing already
        with hold_output_dir(tmp_path, "second") as second:
            with pytest.raises(OutputDirInUse, match=rf"the lock file {tmp_path / LOCK_NAME} was removed while this run held"):
                first.ensure_held()
            with pytest.raises(OutputDirInUse):
                first.clear_earlier_results()
            second.ensure_held()
        assert not (tmp_path / LOCK_NAME).exists()  # the second released its own file
        (tmp_path / LOCK_NAME).write_text("")  # a third run's file, not locked: the first must leave it alone
    assert (tmp_path / LOCK_NAME).exists()


def test_the_first_run_releasing_after_the_second_took_over_keeps_the_second_runs_lock(tmp_path):
    first_context = hold_output_dir(tmp_path, "first")
    first_context.__enter__()
    (tmp_path / LOCK_NAME).unlink()
    with hold_output_dir(tmp_path, "second"):
        first_context.__exit__(None, None, None)  # the first run ends while the second holds the folder
        assert '"second"' in (tmp_path / LOCK_NAME).read_text()
        with pytest.raises(OutputDirInUse, match=r"\(second, pid "):
            with hold_output_dir(tmp_path, "third"):
                pytest.fail("a third run held the folder while the second did")


def test_a_lock_file_replaced_between_open_and_lock_is_retried(tmp_path, monkeypatch):
    """A releasing holder unlinks its file between this run's open and its lock, and another run locks a new file at
    the path: the lock this run gets is on the orphaned file, so it must notice and be refused by the new holder."""
    from bam_llama.training import output_hold as lock

    real_flock, taken = lock.fcntl.flock, []

    def flock(descriptor, operation):
        if not taken:  # the first attempt: another run replaces the file just before
            (tmp_path / LOCK_NAME).unlink()
            other = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
            real_flock(other, operation)
            os.write(other, b'{"command": "other", "pid": 1, "host": "h", "started": "now"}')
            taken.append(other)
        return real_flock(descriptor, operation)

    monkeypatch.setattr(lock.fcntl, "flock", flock)
    try:
        with pytest.raises(OutputDirInUse, match=r"\(other, pid 1 on h"):
            with hold_output_dir(tmp_path, "late"):
                pytest.fail("two runs held the folder")
    finally:
        os.close(taken[0])


def open_descriptors():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors in /proc/self/fd")
def test_a_lock_file_deleted_between_open_and_lock_is_retried_on_a_file_at_the_path(tmp_path, monkeypatch):
    """A releasing holder unlinks its file between this run's open and its lock, and no other run takes the folder:
    the lock this run gets is on a file no path names, which a second run would never see. The run must notice,
    close that descriptor and lock a new file at the path, so that a second run is refused."""
    from bam_llama.training import output_hold as lock

    real_flock, deleted = lock.fcntl.flock, []

    def flock(descriptor, operation):
        if not deleted:  # the first attempt only: the file is unlinked just before it is locked
            (tmp_path / LOCK_NAME).unlink()
            deleted.append(descriptor)
        return real_flock(descriptor, operation)

    monkeypatch.setattr(lock.fcntl, "flock", flock)
    descriptors = open_descriptors()
    with hold_output_dir(tmp_path, "late") as hold:
        assert len(deleted) == 1
        assert '"command": "late"' in (tmp_path / LOCK_NAME).read_text()  # the holder wrote into the file at the path
        assert open_descriptors() == descriptors + 1  # the orphan's descriptor was closed, the new one is held
        hold.ensure_held()
        with pytest.raises(OutputDirInUse, match=rf"\(late, pid {os.getpid()} on "):
            with hold_output_dir(tmp_path, "second"):
                pytest.fail("a second run held the folder: the first run's lock was on a deleted file")
    assert open_descriptors() == descriptors
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_checkpoint_a_killed_run_was_writing_is_removed_by_the_next_holder(tmp_path, capsys):
    staging = tmp_path / ".checkpoint-8.staging" / "checkpoint-8"
    staging.mkdir(parents=True)
    (staging / "model.safetensors").write_bytes(b"half")
    (tmp_path / "checkpoint-4").mkdir()
    with hold_output_dir(tmp_path, "bam-pretrain", continuing=True):
        assert sorted(os.listdir(tmp_path)) == [LOCK_NAME, "checkpoint-4"]
    assert "removed .checkpoint-8.staging" in capsys.readouterr().err
