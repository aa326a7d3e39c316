"""Process grid: layer-parallel groups x data-parallel groups over one communicator.

World rank ``w`` of a grid with ``P_L`` layer ranks and ``P_D`` replicas sits at
``layer_rank = w % P_L`` in replica ``data_rank = w // P_L``: layer-parallel groups are blocks
of ``P_L`` consecutive ranks (consecutive ranks hold consecutive layers, usually on one node),
data-parallel groups collect the ranks holding the same layers in every replica. The same grid
serves layer-wise stages x replicas.
"""
from __future__ import annotations

from mpi4py import MPI

__all__ = ["ProcessGrid"]


class ProcessGrid:
    """Split ``comm`` into a ``P_L x P_D`` grid.

    Args:
        comm: the job's communicator (default ``MPI.COMM_WORLD``).
        data_parallel: ``P_D >= 1``, number of data-parallel replicas (default 1).
            ``P_L = size // P_D``.

    Attributes:
        comm, layer_comm, data_comm: the whole grid, this rank's layer-parallel group, and this
            rank's data-parallel group (never ``COMM_WORLD`` unless passed in).
        layer_rank, layer_size, data_rank, data_size.

    Raises:
        ValueError: ``P_D`` not a positive int or not dividing the communicator size (raised on
            every rank, before any communication).
    """

    def __init__(self, comm: MPI.Comm | None = None, data_parallel: int = 1):
        comm = MPI.COMM_WORLD if comm is None else comm
        size = comm.Get_size()
        if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
            raise ValueError(f"data-parallel size {data_parallel!r} is not allowed: use an int >= 1")
        if size % data_parallel:
            raise ValueError(f"data-parallel size {data_parallel} does not divide the number of "
                             f"ranks {size}: P_L * P_D must equal the world size")
        self.comm = comm
        self.data_size = data_parallel
        self.layer_size = size // data_parallel
        rank = comm.Get_rank()
        self.layer_rank = rank % self.layer_size
        self.data_rank = rank // self.layer_size
        self.layer_comm = comm.Split(color=self.data_rank, key=self.layer_rank)
        self.data_comm = comm.Split(color=self.layer_rank, key=self.data_rank)

    def __repr__(self) -> str:
        return (f"ProcessGrid(P_L={self.layer_size}, P_D={self.data_size}, "
                f"layer_rank={self.layer_rank}, data_rank={self.data_rank})")
