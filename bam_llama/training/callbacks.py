"""What a caller of `BamTrainer` may add to the loop: its steps on the package's progress display (`StepProgress`,
BamTrainer's `progress`, in place of Trainer's own bar and printed logs) and each optimizer step's seconds
(`StepSeconds`)."""

from __future__ import annotations

import time

from transformers import TrainerCallback

from ..runtime.progress import progress_bar


class StepProgress(TrainerCallback):
    """The run's optimizer steps on `runtime.progress.progress_bar` (a bar in a terminal, `position` its line where
    several runs train at once; whole lines in a log), each with the loss last logged; on the main process only. A
    step that logs moves the display once its loss is known, so a line never shows a step without its loss."""

    def __init__(self, description: str, position: int | None = None, disable: bool = False):
        self.description, self.position, self.disable = description, position, disable
        self.display, self.shown = None, 0

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.display = progress_bar(state.max_steps, self.description, "steps", self.position, self.disable)
            self.shown = 0
            self._show(state.global_step)  # a resumed run's steps done

    def on_step_end(self, args, state, control, **kwargs):
        if not control.should_log:  # a logging step moves with its loss (on_log)
            self._show(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.display is not None and logs and "loss" in logs:
            self.display.set_postfix(loss=f"{logs['loss']:.3f}")
            self._show(state.global_step)

    def _show(self, step: int) -> None:
        if self.display is not None and step > self.shown:
            self.display.update(step - self.shown)
            self.shown = step

    def on_train_end(self, args, state, control, **kwargs):
        if self.display is not None:
            self.display.close()
            self.display = None


class StepSeconds(TrainerCallback):
    """The wall seconds of each optimizer step (`seconds`): forward, backward, clipping and the update, without
    loading its batch."""

    def __init__(self):
        self.seconds: list[float] = []
        self._started = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._started)
