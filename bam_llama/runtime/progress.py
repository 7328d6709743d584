"""Progress of a long loop, shown the way its output can hold it (`progress_bar`): tqdm's bar in a terminal, plain
lines ("train bam: 300/1500 steps, loss 0.012, 2.1 min") where stderr is a file or a pipe (a log, CI), which a bar
would fill with carriage returns and cursor codes. The one place a command's bars are chosen; worker processes
inherit the parent's stderr, so they choose alike."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm
from transformers.utils import logging as transformers_logging

PLAIN_EVERY_FRACTION = 0.2  # a plain line at every fifth of the loop...
PLAIN_EVERY_SECONDS = 60.0  # ...and at least once a minute between


def in_a_terminal() -> bool:
    """Whether stderr, where progress goes, is a terminal."""
    return sys.stderr.isatty()


def keep_library_bars_off_a_log() -> None:
    """Transformers' own bars ("Writing model shards") off where stderr is not a terminal; call in each process."""
    if not in_a_terminal():
        transformers_logging.disable_progress_bar()


def progress_bar(total: int, desc: str, unit: str = "it", position: int | None = None, disable: bool = False):
    """A progress display of `total` units with tqdm's `update`, `set_postfix` and `close`: a bar in a terminal
    (`position`: its line where several loops run at once), plain lines otherwise."""
    if in_a_terminal():
        return tqdm(total=total, desc=desc, unit=unit, position=position, disable=disable,
                    mininterval=1.0 if position is not None else 0.1)
    return PlainProgress(total, desc, unit, disable)


class PlainProgress:
    """Progress as whole lines on stderr: one at the first unit, then at every `PLAIN_EVERY_FRACTION` of the loop
    or `PLAIN_EVERY_SECONDS`, whichever comes first, and one at the end where the last state is not shown yet."""

    def __init__(self, total: int, desc: str, unit: str = "it", disable: bool = False):
        self.total, self.desc, self.unit, self.disable = total, desc, unit, disable
        self.done, self.postfix, self.written = 0, {}, None
        self.start = self.last_line = time.perf_counter()
        self.next_fraction = PLAIN_EVERY_FRACTION

    def update(self, count: int = 1) -> None:
        self.done += count
        now = time.perf_counter()
        fraction = self.done / self.total if self.total else 1.0
        if self.done == count or fraction >= self.next_fraction or now - self.last_line >= PLAIN_EVERY_SECONDS:
            self.write_line(now)
            while self.next_fraction <= fraction:
                self.next_fraction += PLAIN_EVERY_FRACTION

    def set_postfix(self, **values) -> None:
        self.postfix = values

    def close(self) -> None:
        if self.written != (self.done, self.postfix):  # the last state, where no line showed it yet
            self.write_line(time.perf_counter())

    def write_line(self, now: float) -> None:
        if self.disable:
            return
        details = "".join(f", {name} {value}" for name, value in self.postfix.items())
        minutes = (now - self.start) / 60
        line = f"{self.desc}: {self.done}/{self.total} {self.unit}{details}, {minutes:.1f} min\n"
        sys.stderr.write(line)  # one write (print writes the newline apart): whole lines where processes share stderr
        sys.stderr.flush()
        self.last_line, self.written = now, (self.done, self.postfix)
