"""PyTorch's transforms around a layer-parallel network against serial PyTorch autograd
(issue 36 items 1, 7, 8, 9, 11, 13), float64, on 1, 2 and 3 ranks (one MPI job per rank count;
the checks are in tests/mpi_cases/nn/transform_cases.py): ``torch.compile`` of the whole
network, gradients with respect to the input, ``torch.func.functional_call``; functorch
transforms and forward-mode AD refused alike on every rank; an agreement's deadline."""
import pytest

from tests.mpi_harness import MPIBatch

C = "tests.mpi_cases.nn.transform_cases"
BATCH = MPIBatch()
for k in (1, 2, 3):
    for levels in (1, 2):
        for backend in ("eager", "aot_eager"):
            BATCH.add(k, f"compiled_net-L{levels}-{backend}", f"{C}:check_compiled_net",
                      levels=levels, backend=backend)
        for how in ("grad", "unused", "inputs", "vjp", "both"):
            BATCH.add(k, f"input_gradient-L{levels}-{how}", f"{C}:check_input_gradient",
                      levels=levels, how=how)
        BATCH.add(k, f"functional_call-L{levels}", f"{C}:check_functional_call", levels=levels)
        BATCH.add(k, f"functional_call_between-L{levels}", f"{C}:check_functional_call_between",
                  levels=levels)
        for target in ("net", "segment"):
            BATCH.add(k, f"refusals-L{levels}-{target}", f"{C}:check_refusals", levels=levels,
                      module=target)
for k in (1, 2):
    for levels in (1, 2):
        BATCH.add(k, f"gru_and_tied_refusals-L{levels}", f"{C}:check_gru_and_tied_refusals",
                  levels=levels)
BATCH.add(2, "agreement_deadline", f"{C}:check_agreement_deadline")


@pytest.mark.slow
@pytest.mark.parametrize("k,name", BATCH.ids())
def test_transforms(k, name):
    BATCH.run(k, name)
