"""Process grid: layer-parallel groups x data-parallel groups over one communicator, and the
rank -> device map.

World rank ``w`` of a grid with ``P_L`` layer ranks and ``P_D`` replicas sits at
``layer_rank = w % P_L`` in replica ``data_rank = w // P_L``: layer-parallel groups are blocks
of ``P_L`` consecutive ranks (consecutive ranks hold consecutive layers, usually on one node, so
the frequent neighbour messages of the layer solve stay on the node), data-parallel groups
collect the ranks holding the same layers in every replica (one gradient Allreduce per step,
see :mod:`mgrit.parallel.dataparallel`). The same grid serves layer-wise stages x replicas.

Example, 6 ranks, ``ProcessGrid(comm, data_parallel=2)`` (``P_L = 3``)::

    world rank      0  1  2 | 3  4  5
    layer_rank      0  1  2 | 0  1  2
    data_rank       0  0  0 | 1  1  1
    layer_comm      {0,1,2}   {3,4,5}
    data_comm       {0,3} {1,4} {2,5}

Devices: :func:`device_for_rank` maps a rank to ``cuda:(local_rank % device_count)`` when CUDA
is present (``local_rank`` = rank among the ranks sharing the node, from
``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``), otherwise to the CPU.
"""
from __future__ import annotations

import operator

import torch
from mpi4py import MPI

from ..collective import check_thread_level
from ..launch import check_launch

__all__ = ["ProcessGrid", "device_for_rank", "local_rank_and_size", "check_grid_shape"]


def local_rank_and_size(comm: MPI.Comm | None = None) -> tuple[int, int]:
    """``(rank, size)`` of this process among the ranks of ``comm`` on the same node
    (shared-memory domain). Collective over ``comm``."""
    comm = MPI.COMM_WORLD if comm is None else comm
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def _device_from_local_rank(local_rank: int) -> torch.device:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def device_for_rank(comm: MPI.Comm | None = None) -> torch.device:
    """The device this rank should compute on: ``cuda:(local_rank % torch.cuda.device_count())``
    when CUDA is available, else ``cpu``. Collective over ``comm`` (default ``COMM_WORLD``).

    With more ranks per node than GPUs, several ranks share a GPU (round robin); restrict the
    visible devices with ``CUDA_VISIBLE_DEVICES`` to choose which GPUs are used. The device is
    not made current: pass it to ``.to(device)`` (and ``torch.cuda.set_device`` if wanted).
    """
    return _device_from_local_rank(local_rank_and_size(comm)[0])


def check_grid_shape(size: int, data_parallel) -> int:
    """Validate ``data_parallel`` for a communicator of ``size`` ranks; returns ``P_D`` as int.

    Raises:
        ValueError: ``data_parallel`` is not an int (bool and float rejected), is < 1, or does
            not divide ``size`` (the message gives the allowed values).
    """
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    if isinstance(data_parallel, bool):
        dp = None
    else:
        try:
            dp = operator.index(data_parallel)
        except TypeError:
            dp = None
    if dp is None or dp < 1:
        raise ValueError(f"data-parallel size P_D={data_parallel!r} is not allowed: use a positive "
                         f"int dividing the number of ranks {size} (one of {divisors})")
    if size % dp:
        raise ValueError(f"data-parallel size P_D={dp} does not divide the number of ranks {size}: "
                         f"P_L * P_D must equal the world size; use P_D in {divisors}")
    return dp


class ProcessGrid:
    """Split ``comm`` into a ``P_L x P_D`` grid.

    Args:
        comm: the job's communicator (default ``MPI.COMM_WORLD``).
        data_parallel: ``P_D >= 1``, number of data-parallel replicas (default 1), the same on
            every rank. ``P_L = size // P_D`` (e.g. the main job's ``--dp``).

    Attributes:
        comm, layer_comm, data_comm: the whole grid, this rank's layer-parallel group (ranks in
            layer order) and this rank's data-parallel group (ranks in replica order); never
            ``COMM_WORLD`` unless passed in.
        layer_rank, layer_size (``P_L``), data_rank, data_size (``P_D``).
        local_rank, local_size: this rank among the ranks of ``comm`` on its node.
        device: :func:`device_for_rank`'s choice for this rank (no communication to read it).

    Raises:
        ValueError: ``P_D`` not a positive int or not dividing the communicator size, or ranks
            passing different ``P_D``; raised on every rank (one tiny allgather of the
            requested ``P_D`` first, so that no rank is left waiting in a collective).
        ~mgrit.launch.LaunchError: a foreign launcher (torchrun, srun with another MPI)
            started several processes that MPI sees as 1-rank jobs
            (:func:`mgrit.launch.check_launch`; before any communication).
    """

    def __init__(self, comm: MPI.Comm | None = None, data_parallel: int = 1):
        check_launch()
        check_thread_level()
        comm = MPI.COMM_WORLD if comm is None else comm
        size = comm.Get_size()
        requested = comm.allgather(repr(data_parallel))
        if len(set(requested)) > 1:
            raise ValueError(f"ranks disagree on the data-parallel size P_D: "
                             f"{dict(enumerate(requested))} (rank: value)")
        dp = check_grid_shape(size, data_parallel)
        self.comm = comm
        self.data_size = dp
        self.layer_size = size // dp
        rank = comm.Get_rank()
        self.layer_rank = rank % self.layer_size
        self.data_rank = rank // self.layer_size
        self.layer_comm = comm.Split(color=self.data_rank, key=self.layer_rank)
        self.data_comm = comm.Split(color=self.layer_rank, key=self.data_rank)
        self.local_rank, self.local_size = local_rank_and_size(comm)
        self.device = _device_from_local_rank(self.local_rank)

    def world_rank(self, layer_rank: int, data_rank: int) -> int:
        """Rank in ``comm`` of the process at ``(layer_rank, data_rank)``."""
        if not (0 <= layer_rank < self.layer_size and 0 <= data_rank < self.data_size):
            raise ValueError(f"({layer_rank}, {data_rank}) is outside the grid "
                             f"P_L={self.layer_size} x P_D={self.data_size}")
        return data_rank * self.layer_size + layer_rank

    @property
    def is_first_layer_rank(self) -> bool:
        """Holds the open layer (first layers) of its replica."""
        return self.layer_rank == 0

    @property
    def is_last_layer_rank(self) -> bool:
        """Holds the close layer and loss of its replica."""
        return self.layer_rank == self.layer_size - 1

    def free(self) -> None:
        """Free the two sub-communicators (collective; the grid is unusable afterwards)."""
        for c in (self.layer_comm, self.data_comm):
            if c != MPI.COMM_NULL:
                c.Free()

    def __repr__(self) -> str:
        return (f"ProcessGrid(P_L={self.layer_size}, P_D={self.data_size}, "
                f"layer_rank={self.layer_rank}, data_rank={self.data_rank}, device={self.device})")
