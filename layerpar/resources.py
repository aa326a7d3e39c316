"""The machine a job runs on, checked before the expensive parts start: cores per rank
(:func:`oversubscription`) and memory for the network (:func:`memory_verdict`), both for the
ranks that share this node (:func:`~mgrit.parallel.procgrid.local_rank_and_size`, collective).

The memory estimate is a lower bound, so it never refuses a run that fits: the parameters
counted from the network built with one and two layers (serially, a few milliseconds), times
the copies training keeps (weights, gradients, the optimizer's state: SGD with momentum 1,
Adam/AdamW 2), plus :data:`BYTES_PER_LAYER` of Python objects per layer; activations and MGRIT
states come on top. It is compared with what this node offers: ``MemAvailable`` of
``/proc/meminfo`` (else ``os.sysconf``), a cgroup's ``memory.max`` headroom, and per process
``RLIMIT_AS`` (``ulimit -v``)."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import sys

import torch
from mpi4py import MPI

from mgrit.parallel.procgrid import local_rank_and_size

__all__ = ["cores", "oversubscription", "available_memory", "model_bytes",
           "memory_verdict", "preflight", "BYTES_PER_LAYER"]

#: Python objects of one layer of a layer-parallel network besides its tensors (modules,
#: parameter wrappers, solver bookkeeping): about 6.6 KB measured for ``--model resnet``
#: (20,000 layers, width 4); 4 KiB keeps the estimate a lower bound.
BYTES_PER_LAYER = 4096
_GiB = float(1 << 30)


def cores() -> int:
    """Cores this process may run on (its CPU affinity, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def oversubscription(threads: int, ranks: int, ncores: int | None = None) -> str | None:
    """The warning when ``threads`` torch threads per rank times ``ranks`` ranks on this node
    exceed its cores (each thread then waits for a core: many times slower), else None."""
    ncores = cores() if ncores is None else ncores
    if threads * ranks <= ncores:
        return None
    fit = max(1, ncores // max(ranks, 1))
    return (f"warning: {threads} torch threads x {ranks} rank(s) on this node = "
            f"{threads * ranks} threads for {ncores} cores: the threads wait for each other "
            f"(many times slower); use --threads {fit}")


def _meminfo() -> dict:
    try:
        with open("/proc/meminfo") as fh:
            return {k.strip(): int(v.split()[0]) * 1024 for k, v in
                    (line.split(":", 1) for line in fh if ":" in line)}
    except (OSError, ValueError):
        return {}


def _cgroup_headroom() -> int | None:
    for limit, used in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                         "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as fh:
                text = fh.read().strip()
            if text == "max" or int(text) >= 1 << 60:
                return None
            with open(used) as fh:
                return max(0, int(text) - int(fh.read().strip()))
        except (OSError, ValueError):
            continue
    return None


def available_memory() -> tuple[int | None, str, int | None]:
    """``(node bytes, where from, per-process bytes)``: the memory this node can still give
    (``MemAvailable``, or a cgroup limit's headroom when smaller; None if unknown) and the
    headroom of this process's ``RLIMIT_AS`` (None without a limit)."""
    info = _meminfo()
    node, where = info.get("MemAvailable"), "MemAvailable in /proc/meminfo"
    if node is None:
        try:
            node = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            where = "os.sysconf available pages"
        except (ValueError, OSError, AttributeError):
            node = None
    cg = _cgroup_headroom()
    if cg is not None and (node is None or cg < node):
        node, where = cg, "the cgroup's memory.max less memory.current"
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    proc = None
    if soft not in (resource.RLIM_INFINITY, -1):
        try:
            with open("/proc/self/statm") as fh:
                vm = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            vm = 0
        proc = max(0, soft - vm)
    return node, where, proc


def model_bytes(c, in_shape, num_classes: int) -> tuple[int, int] | None:
    """``(bytes per layer, bytes of the rest)`` of the network of config ``c`` in training
    (weights, gradients, optimizer state, :data:`BYTES_PER_LAYER`), from its parameters built
    serially with one and two layers; None where the depth is not ``--layers`` (``--model
    gru``: time steps) or the small builds fail."""
    from mgrit.models import build_model

    if c.model == "gru":
        return None
    def count(device):
        counts = []
        with torch.random.fork_rng(devices=[]), device:  # the builders seed the generator
            for n in (1, 2):
                net = build_model(c.model, dataclasses.replace(c, layers=n, multilevel_init=0),
                                  in_shape, num_classes)
                counts.append(sum(p.numel() for p in net.parameters()))
        return counts

    # on the meta device first: shapes only, no memory (a huge --width builds too)
    for device in (torch.device("meta"), contextlib.nullcontext()):
        try:
            counts = count(device)
            break
        except Exception:  # noqa: BLE001 - no estimate; the real build reports its own error
            counts = None
    if counts is None:
        return None
    slots = {"sgd": 1 if c.momentum else 0, "adam": 2, "adamw": 2}.get(c.optimizer, 2)
    size = torch.finfo(torch.float64 if c.dtype == "float64" else torch.float32).bits // 8
    per_param = size * (2 + slots)
    step = max(0, counts[1] - counts[0])
    return step * per_param + BYTES_PER_LAYER, max(0, counts[0] - step) * per_param


def memory_verdict(c, in_shape, num_classes: int, layer_ranks: int, ranks_here: int,
                   available=None) -> str | None:
    """The error message when the network of ``c`` cannot fit: each of the ``ranks_here``
    ranks on this node holds ``ceil(layers / layer_ranks)`` layers (``layer_ranks`` = P_L;
    serial and replicas: all of them) and the rest of the network; compared with
    :func:`available_memory` (or ``available``, the same triple). None when it fits or
    nothing is known."""
    est = model_bytes(c, in_shape, num_classes)
    if est is None:
        return None
    node, where, proc = available_memory() if available is None else available
    per_layer, rest = est
    layers = math.ceil(c.layers / max(1, layer_ranks))
    rank = per_layer * layers + rest
    need = rank * ranks_here
    what = (f"--layers {c.layers} --model {c.model}: training needs at least "
            f"{need / _GiB:.1f} GiB on this node ({ranks_here} rank(s) x {rank / _GiB:.1f} GiB: "
            f"{layers} layers of {per_layer / 1024:.1f} KiB each -- weights, gradients, "
            f"--optimizer {c.optimizer} state, Python objects -- before activations)")
    advice = "use fewer --layers or a smaller network, or more layer ranks / nodes"
    if node is not None and need > node:
        return f"{what}, but {node / _GiB:.1f} GiB are available ({where}): {advice}"
    if proc is not None and rank > proc:
        return (f"{what}, but the address-space limit (ulimit -v) leaves each process "
                f"{proc / _GiB:.1f} GiB: {advice}")
    return None


def preflight(c, comm: MPI.Comm, layer_ranks: int, in_shape, num_classes: int,
              n_train: int) -> None:
    """Before the main job builds its network (collective over ``comm``): rank 0 prints a
    warning when the torch threads of the ranks on this node exceed its cores and a note
    when ``--batch-size`` exceeds the ``n_train`` training samples (every epoch is then one
    batch of all of them); every rank raises when the network cannot fit this node's memory.

    Raises:
        MemoryError: the :func:`memory_verdict` message (estimate and available memory).
    """
    here = local_rank_and_size(comm)[1]
    if comm.Get_rank() == 0:
        warn = oversubscription(torch.get_num_threads(), here)
        if warn:
            print(f"[train] {warn}", file=sys.stderr, flush=True)
        if c.batch_size > n_train:
            print(f"[train] note: --batch-size {c.batch_size} exceeds the {n_train} training "
                  f"samples: every epoch is one full batch of {n_train}", flush=True)
    split = layer_ranks if c.method in ("mgrit", "decoupled") else 1
    msg = memory_verdict(c, in_shape, num_classes, split, here)
    if msg:
        raise MemoryError(msg)
