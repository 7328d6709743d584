"""tests/waiting.py, how the suite waits for its subprocesses: until they end, a hang guard stretched by the machine's
load (or BAM_TEST_TIMEOUT_SCALE) the only bound, and a guard that trips fails the test saying it was a time limit,
what it waited for and the command's last line on stderr, with the command and its children killed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import still_running
from waiting import SCALE_VARIABLE, HangGuard, WatchedProcess, run_within, timeout_scale, wait_until, wait_within

SLEEP = "import time; time.sleep(3600)"


def test_the_scale_is_the_variable_where_set_and_refuses_a_bad_one(monkeypatch):
    monkeypatch.setenv(SCALE_VARIABLE, "7.5")
    assert timeout_scale() == 7.5
    guard = HangGuard(10, "nothing")
    assert 70 < guard.left() <= 75
    for bad in ("0", "-2", "fast"):
        monkeypatch.setenv(SCALE_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"{SCALE_VARIABLE} must be a positive number, got '{bad}'"):
            timeout_scale()


def test_without_the_variable_the_scale_is_the_runnable_processes_per_core_at_least_one(monkeypatch):
    monkeypatch.delenv(SCALE_VARIABLE, raising=False)
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0 * cores, 0.0, 0.0))
    assert timeout_scale() >= 9.0  # a busy machine: nine runnable processes a core, or more running now
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert timeout_scale() >= 1.0


def test_a_guard_stretches_when_the_machine_gets_busier_while_it_waits(monkeypatch):
    monkeypatch.setenv(SCALE_VARIABLE, "1")
    guard = HangGuard(10, "nothing")
    monkeypatch.setenv(SCALE_VARIABLE, "30")
    assert guard.left() > 290
    monkeypatch.setenv(SCALE_VARIABLE, "2")  # and keeps the most it saw
    assert guard.left() > 290


def test_run_within_returns_what_subprocess_run_would(tmp_path):
    script = "import sys; print(sys.stdin.read().upper()); print('warn', file=sys.stderr); sys.exit(3)"
    completed = run_within([sys.executable, "-c", script], 60, input="abc", cwd=tmp_path)
    assert (completed.returncode, completed.stdout, completed.stderr) == (3, "ABC\n", "warn\n")
    merged = run_within([sys.executable, "-c", script], 60, input="x", stderr=subprocess.STDOUT)
    assert merged.stdout == "X\nwarn\n" and merged.stderr is None


def test_a_command_past_its_guard_fails_saying_so_and_its_children_are_killed(monkeypatch, tmp_path):
    monkeypatch.setenv(SCALE_VARIABLE, "1")
    pid_file = tmp_path / "child.pid"
    script = (f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); "
              f"open({str(pid_file)!r}, 'w').write(str(child.pid)); "
              "print('[2/2] compiling forward for sm_90', file=sys.stderr, flush=True); time.sleep(3600)")
    with pytest.raises(pytest.fail.Exception) as failed:
        run_within([sys.executable, "-c", script], 3)
    message = str(failed.value)
    assert f"for {sys.executable} -c import subprocess" in message
    assert "a hang guard of 3 s on an idle machine, x1.0 for this machine's load (not a wrong result" in message
    assert message.endswith("its last line on stderr: [2/2] compiling forward for sm_90")
    child = int(pid_file.read_text())
    wait_until(lambda: not still_running([child]), 30, "the killed command's child to end")


def test_wait_within_and_wait_until_name_what_they_waited_for(monkeypatch):
    monkeypatch.setenv(SCALE_VARIABLE, "1")
    sleeper = subprocess.Popen([sys.executable, "-c", SLEEP])
    with pytest.raises(pytest.fail.Exception, match=r"waited \d+ s for the sleeper's exit: a hang guard of 0.5 s"):
        wait_within(sleeper, 0.5, "the sleeper's exit")
    assert sleeper.wait() != 0  # killed
    with pytest.raises(pytest.fail.Exception, match="for a file that never comes: a hang guard of 0.5 s"):
        wait_until(Path("/nonexistent/never").exists, 0.5, "a file that never comes")


def test_a_watched_process_gives_its_line_or_says_it_ended_without_it():
    script = "import sys; print('ready', flush=True); print('oops', file=sys.stderr); sys.exit(4)"
    watched = WatchedProcess([sys.executable, "-c", script])
    watched.wait_for_line("ready", 60)
    assert watched.wait(60) == 4
    ended = WatchedProcess([sys.executable, "-c", script])
    with pytest.raises(pytest.fail.Exception, match=r"ended \(exit 4\) before writing 'never'"):
        ended.wait_for_line("never", 60)
    assert "oops" in ended.error_output()
