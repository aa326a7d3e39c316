"""An interruption for resume tests: :class:`StopAt` is a Trainer callback that raises
:class:`Stop` at the end of the optimizer step ``step`` (1-based), as a killed job would stop."""
from __future__ import annotations


class Stop(Exception):
    pass


class StopAt:
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, record):
        if record.step + 1 == self.step:
            raise Stop()
