"""Harness self-checks: a passing job and a job where only rank 1 fails."""
from mpi4py import MPI


def check_sum(expected):
    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.Get_rank() + 1)
    assert total == expected, f"sum {total} != {expected}"
    return total


def check_rank1_fails():
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 1:
        raise AssertionError("deliberate failure on rank 1")
    comm.recv(source=1)  # would hang forever without abort-on-error


def check_leave_torch_changed():
    import torch
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)


def check_torch_defaults():
    import torch
    return str(torch.get_default_dtype()), torch.is_grad_enabled()


def check_hangs():
    import time
    time.sleep(600)
