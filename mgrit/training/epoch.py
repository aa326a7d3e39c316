"""Per-epoch bookkeeping of the training loop: :class:`EpochAccumulator` sums one replica's
steps (loss, correct, samples; MGRIT iterations, final residuals and unconverged solves) and
turns the epoch's totals into an :class:`~mgrit.training.records.EpochRecord`; its state is
saved in checkpoints so that a resumed epoch ends with the same record."""
from __future__ import annotations

import numpy as np

from ..convergence import UnconvergedWarning  # re-exported: the per-epoch summary uses it too
from .records import EpochRecord, StepRecord

__all__ = ["EpochAccumulator", "UnconvergedWarning"]


class EpochAccumulator:
    """One replica's running totals of an epoch (``state``: from :meth:`state`, or None)."""

    def __init__(self, state: dict | None = None):
        state = state or {}
        self.tot = np.asarray(state.get("tot", [0.0, 0.0, 0.0]), dtype=np.float64)
        self.fres = list(state.get("fres", []))
        self.bres = list(state.get("bres", []))
        self.fits, self.bits = int(state.get("fits", 0)), int(state.get("bits", 0))
        self.unconverged = int(state.get("unconverged", 0))
        self.mgrit = bool(state.get("mgrit", False))

    def add(self, rec: StepRecord, exact: bool) -> None:
        """Add one step (an empty shard adds nothing)."""
        if not rec.samples:
            return
        correct = np.nan if rec.correct is None else rec.correct
        self.tot += [rec.loss * rec.samples, correct, rec.samples]
        rf, rb = rec.forward, rec.backward
        if rf is None:
            return
        self.mgrit = True
        self.fits, self.bits = rf.iterations, (rb.iterations if rb is not None else 0)
        if exact:
            for f, b in rec.solves:
                self.unconverged += (not f.converged) + (b is not None and not b.converged)
        if rf.residuals:
            self.fres.append(float(rf.residuals[-1]))
        if rb is not None and rb.residuals:
            self.bres.append(float(rb.residuals[-1]))

    def totals(self) -> np.ndarray:
        """``[loss sum, correct, samples, unconverged solves]`` (summed over replicas by the
        loop with one allreduce)."""
        return np.append(self.tot, float(self.unconverged))

    def record(self, epoch: int, tot, test_acc, test_loss, t_epoch: float, t_eval: float,
               tol: float | None) -> EpochRecord:
        """The epoch's record from the replica-summed :meth:`totals` ``tot``."""
        f, b = self.fres, self.bres
        rec = EpochRecord(
            epoch=epoch, loss=float(tot[0] / tot[2]),
            train_acc=None if np.isnan(tot[1]) else float(tot[1] / tot[2]),
            test_acc=None if test_acc is None else float(test_acc),
            test_loss=None if test_loss is None else float(test_loss),
            epoch_time=float(t_epoch), eval_time=float(t_eval),
            fwd_iters=self.fits if self.mgrit else None,
            bwd_iters=self.bits if self.mgrit else None,
            fwd_residual=f[-1] if f else None, bwd_residual=b[-1] if b else None,
            fwd_residual_mean=float(np.mean(f)) if f else None,
            bwd_residual_mean=float(np.mean(b)) if b else None,
            unconverged=int(tot[3]))
        if rec.unconverged:
            rec.warnings.append(f"{rec.unconverged} MGRIT solve(s) this epoch stopped at the "
                                f"cycle cap before the tolerance {tol:g}: gradients are not "
                                f"exact")
        return rec

    def state(self) -> dict:
        """Plain state for checkpoints."""
        return {"tot": [float(v) for v in self.tot], "fres": self.fres, "bres": self.bres,
                "fits": self.fits, "bits": self.bits, "unconverged": self.unconverged,
                "mgrit": self.mgrit}

    @staticmethod
    def state_for(saved: list, grid) -> dict | None:
        """This replica's saved state: its own on the same number of replicas; otherwise
        replica 0 takes the sum of all saved totals (the epoch's totals are summed anyway)
        and replica 0's residual history, the others start empty."""
        if len(saved) == grid.data_size:
            return saved[grid.data_rank]
        if grid.data_rank != 0:
            return None
        merged = dict(saved[0])
        merged["tot"] = [float(v) for v in np.sum([s["tot"] for s in saved], axis=0)]
        merged["unconverged"] = sum(int(s["unconverged"]) for s in saved)
        return merged
