"""The main job's composition root (``experiments/train.py``): configuration, flags, the run
folder and the wiring of data, model, training method and callbacks into one run.

Modules: ``jobconfig`` (:class:`JobConfig`, one field per flag; reading a run's
``config.json``) + ``validation`` (the allowed values, every flag checked), ``flags`` (the
argparse groups, :func:`~layerpar.flags.job_parser`), ``cli`` (:class:`~layerpar.cli.JobParser`:
help and errors once on many ranks), ``job`` (:func:`run_job`: grid, run folder, data,
network, optimizer, callbacks, ``Trainer``), ``runfolder`` (what a run folder holds, ``--overwrite``, console copy),
``export`` (a run folder as a plain PyTorch model: ``load_run``; ``python -m layerpar.export RUN
model.pt``).

Floor L6, the top of the library: imports :mod:`data`, the solver core, :mod:`mgrit.nn`,
:mod:`mgrit.parallel`, the runtime :mod:`mgrit.training`, the model zoo :mod:`mgrit.models`,
:mod:`mgrit.multilevel` and the layer-wise family :mod:`layerwise`; it is the only library
package that imports ``layerwise``. Imported by ``experiments/``, ``examples/`` and tests only.
"""
from mgrit.training.datapkg import require_data_package

require_data_package()  # before any module here imports data: a user's data.py is one clear line

from .jobconfig import JobConfig  # noqa: E402
from .job import run_job  # noqa: E402

__all__ = ["JobConfig", "run_job"]
