"""Issue 36 items 2-6, 10, 12: paths one step off the Trainer's own, against serial PyTorch in
float64 (rank-side checks in ``tests/mpi_cases/nn/offpath_cases.py``):

* item 2: a user network on NetMixin (a wrapper around a LayerParallelNet) checkpoints every
  tensor under its serial key and resumes onto the continuous run and serial PyTorch; a
  partial one with local keys is refused naming the colliding keys; a plain wrapper at
  P > 1 is refused with advice naming the protocol;
* item 3: ``clip_grad_norm_(net, max_norm, comm)`` (the README's call) asks the network for
  its replicated and tied parameters: the norm and the clipped gradients equal torch's on the
  serial model (a tie group spanning ranks, a ParallelGRU, a plain module around a net);
* item 4: ``nn.Dropout`` in the opening and closing and mgrit Dropout/DropPath in the steps,
  seeded per rank (``1000 + rank``) or alike, several steps without reseeding: loss,
  gradients and parameters equal the serial network seeded as the first layer rank, and the
  layer ranks' generators are equal after every forward (2-level and one-level paths);
* item 5: ``Trainer.evaluate`` with data-parallel replicas and a BatchNorm without running
  statistics equals the one-process evaluation in the same chunks;
* item 6: non-reentrant ``torch.utils.checkpoint`` around a net with BatchNorm in the steps:
  gradients, running statistics and ``num_batches_tracked`` equal serial + checkpoint on every
  rank (the recomputation inside an adjoint solve updates them as serial does);
* item 10: training threads under ``MPI4PY_RC_THREAD_LEVEL=single`` are refused on every
  rank and thread (no hang); item 12: a loader thread drawing from the default generator
  is named as a possible cause of the "step drew random numbers" error (whole 2-rank jobs);
* item 15: the fuzzer's path programs (``tests.fuzz.paths_distributed``): its regressions
  (counterexamples found on the code before these fixes) and 12 fresh seeds per rank count.

All harness checks of one rank count run in one job (2 and 3 ranks).
"""
import pytest

from tests.mpi_harness import MPIBatch

C = "tests.mpi_cases.nn.offpath_cases"
BATCH = MPIBatch(timeout=300)
for _k in (2, 3):
    BATCH.add(_k, "user_net_checkpoint", f"{C}:check_user_net_checkpoint", ckpt_dir="")
    BATCH.add(_k, "clip_readme_way", f"{C}:check_clip_readme_way")
    BATCH.add(_k, "dropout_streams-per_rank", f"{C}:check_dropout_streams", per_rank=True)
    BATCH.add(_k, "dp_eval_batch_stats", f"{C}:check_dp_eval_batch_stats")
    BATCH.add(_k, "checkpoint_batchnorm", f"{C}:check_checkpoint_batchnorm")
    BATCH.add(_k, "fuzz_path_regressions", "tests.fuzz.paths_distributed:check_path_regressions")
    BATCH.add(_k, "fuzz_paths", "tests.fuzz.paths_distributed:check_path_seeds",
              seeds=list(range(360100, 360112)))
BATCH.add(3, "checkpoint_batchnorm-L1", f"{C}:check_checkpoint_batchnorm", levels=1)
BATCH.add(3, "dropout_streams-same-L1", f"{C}:check_dropout_streams", per_rank=False, levels=1)


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_offpath_mpi(k, name):
    results = BATCH.run(k, name)
    if name != "fuzz_paths":  # (its summary holds each rank's own seconds)
        assert len(set(map(str, results))) == 1, f"ranks disagree: {results}"


def _threads(mode, **env):
    import subprocess
    import sys
    from tests.job.test_train_job import ROOT, job_env
    from tests.mpi_harness import mpiexec_path
    e = {**job_env(), **env}
    p = subprocess.run([mpiexec_path(), "-n", "2", sys.executable,
                        str(ROOT / "tests" / "mpi_cases" / "nn" / "threads_script.py"), mode],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=240)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.slow
def test_thread_level_single_refused_not_hung():
    """Item 10: two training threads per rank under MPI4PY_RC_THREAD_LEVEL=single get the
    library's RuntimeError naming the level on every rank and thread (the job ends); under
    mpi4py's default (multiple) they train."""
    rc, out = _threads("level", MPI4PY_RC_THREAD_LEVEL="single")
    assert rc == 0, out[-3000:]
    assert out.count("refused: mgrit communicates from thread 'trainer-") == 4, out[-3000:]
    assert "THREAD_SINGLE" in out and "MPI4PY_RC_THREAD_LEVEL=multiple" in out
    rc, out = _threads("level")
    assert rc == 0 and out.count("['trained', 'trained']") == 2, out[-3000:]


@pytest.mark.slow
def test_loader_thread_named_as_possible_cause():
    """Item 12: a thread drawing from torch's default generator during the solves: the error
    (if the generator moved during a solve) names that thread as a possible cause."""
    rc, out = _threads("loader")
    assert rc == 0, out[-3000:]
    for line in out.splitlines():
        if "loader: refused" in line:
            assert "another thread of this process" in line and "'loader'" in line, line
        else:
            assert "step drew" not in line, line
    assert out.count("loader: ") == 2, out[-3000:]


# -- one process -----------------------------------------------------------------------------
def _tied_wrapper():
    import torch
    from mpi4py import MPI
    from torch import nn

    from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet
    from mgrit.options import MGRITOptions
    from tests.mpi_cases.nn.offpath_cases import Wrapped
    torch.set_default_dtype(torch.float64)
    o = MGRITOptions(max_levels=1)
    seg = LayerParallelResNet.build(lambda k: DenseStep(3, "tanh"), 4, (3,), comm=MPI.COMM_SELF,
                                    tie=[0, 0, None, None], forward=o, backward=o)
    return Wrapped(LayerParallelNet(nn.Linear(2, 3), seg, nn.Linear(3, 2)))


def test_netmixin_composes_a_wrapped_network():
    """Item 2 on one process: the wrapper's global keys are ``net.`` + the serial keys, its
    ties and segments those of the wrapped network, and a checkpoint key maps to its tie
    group's first layer behind the wrapper's prefix."""
    from mgrit.nn.net import tied_source
    net = _tied_wrapper()
    keys = sorted(p + n for p, m in net.global_modules() for n in m.state_dict())
    assert keys == sorted("net." + k for k in net.net.to_serial().state_dict())
    assert net.tied_prefixes() == {"net.2.F.": "net.1.F."}
    assert net.solver_segments() == list(net.net.segments)
    assert net.checkpoint_meta()["kind"] == "layer-parallel"
    assert tied_source("net.2.F.linear.weight", net.tied_prefixes()) == "net.1.F.linear.weight"
    assert tied_source("net.12.F.linear.weight", {"2.F.": "1.F."}) is None


def test_thread_level_check_on_one_process():
    """Item 10's check is silent on the main thread and on a one-rank world (nothing can wait
    for another rank there)."""
    import threading

    from mgrit.collective import check_thread_level
    check_thread_level()
    errors = []
    t = threading.Thread(target=lambda: errors.append(check_thread_level()))
    t.start()
    t.join()
    assert errors == [None]
