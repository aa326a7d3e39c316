"""Per-rank instrumentation of a solve: time per phase, step applications, messages, bytes."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["SolverStats", "PHASES"]

#: Phases timed by the solver (seconds, wall clock on this rank; on CUDA the times include only
#: what the host waited for unless the propagator synchronizes).
PHASES = ("relax", "residual", "restrict", "coarse", "comm_wait")


@dataclass
class SolverStats:
    """Counters of one or more solves on one rank (add with ``+=``; reset with :meth:`reset`).

    Attributes:
        time: seconds per phase (keys :data:`PHASES`); ``comm_wait`` is time blocked in
            ``Wait``/``Recv`` and is also contained in the phase that waited.
        steps_single: propagator calls on one state (``Propagator.step``).
        steps_batched_calls: calls of a native ``Propagator.step_batch``.
        steps_batched_items: states advanced by those batched calls.
        messages, bytes_sent: point-to-point state messages sent and their payload size.
        allreduces: collective reductions (residual norms, validation agreement).
        tracer: class attribute, ``None`` (the default: nothing recorded, no cost); the solver
            sets it on the counters of a solve to its ``MGRIT.tracer``, an object with the
            hooks of :class:`mgrit.perf.trace.Tracer` that records every counted operation
            (the core only calls the hooks; it never imports :mod:`mgrit.perf`).
    """

    tracer = None  # not a field: not counted, added, reset or compared

    time: dict = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    steps_single: int = 0
    steps_batched_calls: int = 0
    steps_batched_items: int = 0
    messages: int = 0
    bytes_sent: int = 0
    allreduces: int = 0

    @property
    def step_applications(self) -> int:
        """Total states advanced by one step, batched or not (the work measure of the cost model)."""
        return self.steps_single + self.steps_batched_items

    @contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.time[phase] += time.perf_counter() - t0

    def reset(self) -> None:
        self.__init__()

    def __iadd__(self, other: "SolverStats") -> "SolverStats":
        for p in PHASES:
            self.time[p] += other.time[p]
        for name in ("steps_single", "steps_batched_calls", "steps_batched_items", "messages",
                     "bytes_sent", "allreduces"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def as_dict(self) -> dict:
        return {"time": dict(self.time), "steps_single": self.steps_single,
                "steps_batched_calls": self.steps_batched_calls,
                "steps_batched_items": self.steps_batched_items,
                "step_applications": self.step_applications, "messages": self.messages,
                "bytes_sent": self.bytes_sent, "allreduces": self.allreduces}

    def summary(self) -> str:
        t = " ".join(f"{p}={self.time[p]:.3f}s" for p in PHASES)
        return (f"{t} | steps={self.step_applications} (single {self.steps_single}, batched "
                f"{self.steps_batched_items} in {self.steps_batched_calls} calls) | "
                f"messages={self.messages} bytes={self.bytes_sent}")
