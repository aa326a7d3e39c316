"""The training runtime: one training loop for layer-parallel and serial networks, with
data-parallel replicas, checkpoints, the convergence guard, fault reports and run output.

Public names: :class:`Trainer` (``step``, ``evaluate``, ``fit``, ``save``, ``load``), the
extension point :class:`TrainingMethod` (a training scheme other than one network and one
optimizer: the layer-wise methods), the records :class:`FitResult` and :class:`StepRecord`
(also ``records.EpochRecord``, ``records.FitPlan``), the shipped callbacks
:class:`ConvergenceGuard` (residual growth, NaN names the layer), :class:`BiasMonitor` (inexact
gradients' bias against their noise; raises the solve accuracy or switches to serial),
:class:`ProgressBar`, :class:`ConsoleLog`, :class:`MetricsWriter`, :class:`LRSchedule` (a
learning-rate schedule stepped per optimizer step, saved in checkpoints), and :func:`fail_fast`.
Modules: ``trainer`` (the step), ``fit`` (the epoch loop), ``method`` (``TrainingMethod``,
``MethodOptimizer``), ``epoch``, ``schedule`` (batches, shards), ``heldout`` (the
:class:`~mgrit.training.heldout.Validation` callback: a validation split after every epoch), ``lrschedule`` (learning-rate
schedules), ``callbacks``, ``guard``, ``metrics`` (its results writers, shared
with the experiments, are :mod:`mgrit.reporting`), ``records`` (``FitResult``, ``StepRecord``, ...), ``datapkg``.
Sub-rooms (they import only ``support`` and lower floors): ``support`` (``faults``: phases,
one-line failure reports; ``nets``: ``as_net``/``SerialNet``, the runtime's side of the network
protocol :mod:`mgrit.nn.protocol`; ``solvers``: phase tags on a segment's MGRIT solves,
rebuilding a solver with new options), ``checkpoint`` (save/load; ``io`` the file format,
``match`` key matching) and ``bias`` (the bias monitor; ``estimate``).

Floor L3: depends on the solver core, :mod:`mgrit.nn`, :mod:`mgrit.parallel` and :mod:`data`;
never imports a higher floor: not the model zoo (:mod:`mgrit.models`), the multilevel
algorithms (:mod:`mgrit.multilevel`), ``layerwise``, the main job (:mod:`layerpar`: its
configuration, flags, run folder and wiring) or ``experiments``. Communicators: only
those of the :class:`~mgrit.parallel.ProcessGrid` it is given (``grid.comm`` for agreement,
checkpoints and timing, ``grid.layer_comm`` inside the network, ``grid.data_comm`` for gradient
averaging and metrics); ``fail_fast`` aborts on the communicator passed to it.

A researcher's script (every rank)::

    grid = ProcessGrid(MPI.COMM_WORLD, data_parallel=2)
    train, test = load_dataset("digits")
    net = LayerParallelNet(opening, LayerParallelResNet.build(..., comm=grid.layer_comm), closing)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    trainer = Trainer(net, opt, grid, loss=F.cross_entropy, callbacks=[ConsoleLog()],
                      checkpoint="run/checkpoint.pt")
    result = trainer.fit(train, epochs=2, batch_size=50, seed=0, test=test)

One step, through the modules::

    fit: schedule.epoch_batches -> this replica's shard (x, y)         [data.sharding]
     step: zero_grad (GradientBuckets or optimizer)
           net(x): opening (first layer rank) -> MGRIT forward solve -> closing (last rank)
           net.loss(out, y, loss) -> backward(): adjoint MGRIT solve -> parameter .grad
           callbacks.on_after_backward (ConvergenceGuard: residuals, NaN -> layer named)
           GradientBuckets.average(weight = shard / global batch)      [grid.data_comm]
           optimizer.step()  -> net.from_last(loss, correct) -> StepRecord -> on_step_end
     epoch end: allreduce totals, evaluate(test), EpochRecord -> on_epoch_end (metrics.h5),
                checkpoint.save_checkpoint (atomic, weights-only contents)  [grid.comm]
"""
from .datapkg import require_data_package

require_data_package()  # before any module here imports data: a user's data.py is one clear line

from .bias import BiasMonitor  # noqa: E402
from .callbacks import ConsoleLog, ProgressBar  # noqa: E402
from .support.faults import fail_fast  # noqa: E402
from .guard import ConvergenceGuard  # noqa: E402
from .lrschedule import LRSchedule  # noqa: E402
from .method import TrainingMethod  # noqa: E402
from .metrics import MetricsWriter  # noqa: E402
from .records import FitResult, StepRecord  # noqa: E402
from .trainer import Trainer  # noqa: E402

__all__ = ["Trainer", "TrainingMethod", "FitResult", "StepRecord", "ConvergenceGuard",
           "BiasMonitor", "ProgressBar", "ConsoleLog", "MetricsWriter", "LRSchedule",
           "fail_fast"]
