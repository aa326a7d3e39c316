"""Pipelined DGL on 2-4 ranks equals the single-process loop (float64, <= 1e-12); data
parallelism, also with BatchNorm (statistics of the global batch, running statistics equal to
the single-process run and bitwise equal on the replicas) and with batch sizes that leave a
replica an empty shard (every sample used); modules whose buffers change in forward refused
identically on every rank before any step; identical bad-configuration errors on every rank;
no hang on error; the regression path (``loss="mse"``) pipelined, with replicas and unequal
shards, equal to one process, and its bad losses/targets refused identically on every rank.
Through the library's training loop (mgrit.training.Trainer): sequential
and decoupled training equal plain loops written in the test bit for bit, and resume from a
checkpoint taken inside an epoch (and a stage) bit for bit; BatchNorm with replicas in the
Trainer (serial and layer-parallel networks, unequal and empty shards) equals one replica
(float64, 1e-12).

Checks sharing a rank count run in one launch (interpreter start-up dominates), shared with the
other files' checks of that rank count (tests/mpi_harness.py)."""

import pytest

from tests.mpi_harness import MPIBatch, run_mpi

pytestmark = pytest.mark.slow  # MPI launches / whole jobs: `-m "not slow"` skips them

CASES = "tests.mpi_cases.training.layerwise_cases"
EQ = "check_pipeline_equals_serial"
BATCH = MPIBatch(timeout=300)

BATCH.add(2, "two_ranks", f"{CASES}:check_many", checks=[
        [EQ, dict(net="mlp", num_stages=2)],
        [EQ, dict(net="mlp", num_stages=4, stages_per_rank=2, head="mlp")],
        ["check_bad_config_identical", dict(kind="ranks")],
        ["check_bad_config_identical", dict(kind="stages")],
        ["check_bad_config_identical", dict(kind="head")],
        ["check_bad_config_identical", dict(kind="spr")],
        ["check_train_layerwise_digits", dict(asynchronous=True)],
        # 41 = 5 x 8 + 1: the last batch has fewer samples than replicas (replica 1: empty)
        ["check_sequential_data_parallel", dict(replicas=2, n=41)],
        # BatchNorm1d (momentum 0.1 / None, no affine), 2 replicas, unequal shards (48 = 6 x 7 + 6)
        [EQ, dict(net="mlp_bn", num_stages=2, stages_per_rank=2, replicas=2, batch_size=7)],
        ["check_sequential_data_parallel", dict(replicas=2, net="mlp_bn", batch_size=7)],
        # BatchNorm2d + an empty shard in the last batch (25 = 4 x 6 + 1)
        [EQ, dict(net="resnet_bn", num_stages=2, stages_per_rank=2, replicas=2, head="pool",
                  batch_size=6, n=25)],
        ["check_buffer_guard", dict(net="mlp_counter", method="decoupled")],
        ["check_buffer_guard", dict(net="mlp_instancenorm", method="sequential")],
        # the one training loop (Trainer): bit for bit against plain loops, and resume
        ["check_layerwise_loop_equals_plain_loop", dict(method="sequential")],
        ["check_layerwise_loop_equals_plain_loop", dict(method="decoupled")],
        ["check_layerwise_resume", dict(method="sequential")],
        ["check_layerwise_resume", dict(method="decoupled")],
        # synchronized BatchNorm in the Trainer, 2 replicas, unequal shards (38 = 5 x 7 + 3)
        ["check_trainer_batchnorm_replicas", dict(kind="serial")],
        ["check_trainer_batchnorm_replicas", dict(kind="mgrit")],
        # regression (loss="mse"), 2 replicas, unequal shards: DGL (48 = 6 x 7 + 6) and
        # sequential (41 = 5 x 7 + 6) equal the single-process trainers
        [EQ, dict(net="mlp", num_stages=2, stages_per_rank=2, replicas=2, batch_size=7,
                  loss="mse")],
        ["check_sequential_data_parallel", dict(replicas=2, n=41, batch_size=7, loss="mse")],
        # ... and the Trainer equals plain loops with the MSE share written out (2 replicas /
        # 2 pipeline stages)
        ["check_layerwise_loop_equals_plain_loop", dict(method="sequential", loss="mse")],
        ["check_layerwise_loop_equals_plain_loop", dict(method="decoupled", loss="mse")],
        ["check_bad_config_identical", dict(kind="loss")],
        ["check_bad_config_identical", dict(kind="targets")],
        ["check_bad_config_identical", dict(kind="targets_pipeline")],
    ])
BATCH.add(3, "three_ranks", f"{CASES}:check_many", checks=[
    [EQ, dict(net="resnet", num_stages=3, head="pool", optimizer="adam")],
    # 3 replicas, global batch 4 < ... and last batch 41 % 4 = 1: empty shards every batch
    [EQ, dict(net="mlp", num_stages=1, replicas=3, batch_size=4, n=41)],
    # BatchNorm2d, last batch 26 % 8 = 2 < 3 replicas: replica 2's shard is empty (with
    # BatchNorm1d a 2-sample batch is too ill-conditioned for 1e-12 after 8 epochs)
    ["check_sequential_data_parallel", dict(replicas=3, net="resnet_bn", n=26)],
    # Trainer + BatchNorm, 3 replicas, last batch 37 % 7 = 2: replica 2's shard is empty
    ["check_trainer_batchnorm_replicas", dict(kind="serial", n=37)],
    ["check_trainer_batchnorm_replicas", dict(kind="mgrit", n=37)]])
BATCH.add(4, "four_ranks", f"{CASES}:check_many", checks=[
    # 49 = 6 x 8 + 1: replica 1's stage-0 rank sends empty activations down its pipeline
    [EQ, dict(net="mlp", num_stages=2, replicas=2, n=49)],
    [EQ, dict(net="resnet", num_stages=2, replicas=2, head="conv", batch_size=12)],
    [EQ, dict(net="mlp_bn", num_stages=2, replicas=2, batch_size=7)],
    # regression (loss="mse") pipelined with replicas, unequal shards (49 = 7 x 7)
    [EQ, dict(net="mlp", num_stages=2, replicas=2, batch_size=7, n=49, loss="mse")],
    # Trainer + BatchNorm in the opening and closing of a LayerParallelNet, P_L 2 x P_D 2
    ["check_trainer_batchnorm_replicas", dict(kind="mgrit", layer_parallel=2)]])


def test_two_ranks_pipeline_configs_async_and_sequential_replicas():
    res = eval(BATCH.run(2, "two_ranks")[0])
    assert res[0] <= 1e-12 and res[1] <= 1e-12
    assert "ranks do not match" in res[2] and "world size = 3 x 1" in res[2]
    assert "more stages than layers" in res[3]
    assert "does not fit the stage output shape" in res[4]
    assert "ranks do not match" in res[5]
    assert res[6] > 0.6  # asynchronous pipeline: best epoch (timing-dependent path; chance 0.1)
    assert max(res[7:11]) <= 1e-12
    assert res[11].startswith("rank 0: module bodies.1.0.2 (StepCounter) changed its buffer(s) "
                              "'steps' in a training forward: with 2 data-parallel replicas")
    assert "module layers.4.2 (InstanceNorm1d) changed its buffer(s) 'running_mean', " \
           "'running_var'" in res[12] and "data_parallel=1" in res[12]
    assert res[13:17] == [7, 3, 7, 3]  # epochs compared (sequential: 3 layers x 2 + head)
    assert max(res[17:21]) <= 1e-12
    assert res[21:23] == [7, 3]
    assert "loss='mae' is not allowed: use one of cross_entropy, mse" in res[23]
    assert "train_y of dtype torch.int64 and shape (48,) is not allowed with loss='mse'" in res[24]
    assert res[25].startswith("rank 0: y of dtype torch.float64 and shape (48, 4) is not allowed "
                              "with loss='mse': use float targets of shape (n, 5)")


def test_three_ranks_resnet_pipeline_and_three_replicas_equal_single_process():
    res = BATCH.run(3, "three_ranks")
    assert all(max(eval(r)) <= 1e-12 for r in res)


def test_two_stages_times_two_replicas_equals_single_process():
    res = BATCH.run(4, "four_ranks")
    assert all(max(eval(r)) <= 1e-12 for r in res)


def test_error_on_one_rank_aborts_instead_of_hanging():
    """The job ends with rank 0's message; a hang would end in the harness's timeout instead
    (no wall-clock assertion: the test cannot fail on a slow machine for being slow)."""
    with pytest.raises(pytest.fail.Exception) as info:
        run_mpi(f"{CASES}:check_error_aborts", 2, timeout=120)
    assert "deliberate failure on rank 0" in str(info.value)
    assert "TIMED OUT" not in str(info.value)
