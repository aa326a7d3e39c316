"""Layer-parallel ResNet checks of conversions and state, run on k ranks by
tests/nn/test_nn_mpi.py (float64): ``to_serial``, global state dicts (round trip and loading
under another partition)."""
import torch
from mpi4py import MPI
from torch import nn

from tests.mpi_cases.nn.nn_cases import (BATCH, COMM, DT, _build, _build_net, _global_max,
                                      _net_input, _rand, _rel, _shape)


def check_to_serial(kind, act, n, levels, cfactor, tol=1e-12):
    torch.set_default_dtype(DT)
    x = _rand(BATCH, *_shape(kind), seed=19)
    model = _build(kind, act, n, levels, cfactor, seed=8)
    with torch.no_grad():
        out = model(x if model.is_first else None, batch_size=BATCH)
    ser = model.to_serial()
    assert isinstance(ser, nn.Sequential) and len(ser) == n
    with torch.no_grad():
        ref = ser(x)
    worst = 0.0
    if model.is_last:
        worst = _rel(out, ref)
        assert worst <= tol, f"to_serial prediction rel err {worst}"
    # the serial copy is independent of the layer-parallel weights
    with torch.no_grad():
        for p in ser.parameters():
            p.add_(1.0)
        out2 = model(x if model.is_first else None, batch_size=BATCH)
    if model.is_last:
        assert torch.equal(out, out2), "to_serial shares parameters with the layer-parallel model"

    # LayerParallelNet.to_serial
    xn, _ = _net_input(kind)
    net = _build_net(kind, act, n, levels, cfactor, seed=8)
    with torch.no_grad():
        outn = net(xn)
    sn = net.to_serial()
    assert len(sn) == n + 2
    with torch.no_grad():
        refn = sn(xn)
    if net.is_last:
        e = _rel(outn, refn)
        assert e <= tol, f"LayerParallelNet.to_serial prediction rel err {e}"
        worst = max(worst, e)
    return _global_max(worst)


def _perturb(model, seed):
    with torch.no_grad():
        for j, s in enumerate(model.steps):
            for i, p in enumerate(s.parameters()):
                p.add_(0.3 * _rand(*p.shape, seed=seed * 1000 + 37 * (model.first + j) + i))


def check_state_dict_roundtrip(kind, act, n):
    torch.set_default_dtype(DT)
    x = _rand(BATCH, *_shape(kind), seed=20)
    a = _build(kind, act, n, seed=1)
    b = _build(kind, act, n, seed=2)
    _perturb(b, seed=9)
    sb = b.gather_state_dict()
    if COMM.rank == 0:
        assert sb is not None and len(sb) == n * len(list(b.steps[0].state_dict()))
        assert all(k.split(".")[0].isdigit() for k in sb)
    else:
        assert sb is None
    a.load_global_state_dict(sb)
    for sa_, sb_ in zip(a.steps, b.steps):
        for (na, pa), (nb, pb) in zip(sa_.state_dict().items(), sb_.state_dict().items()):
            assert na == nb and torch.equal(pa, pb), f"{na} not restored"
    sa = a.gather_state_dict()
    if COMM.rank == 0:
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    with torch.no_grad():
        oa = a(x if a.is_first else None, batch_size=BATCH)
        ob = b(x if b.is_first else None, batch_size=BATCH)
    if a.is_last:
        assert torch.equal(oa, ob), "same weights give different outputs"
    # a missing layer is reported by name
    if COMM.rank == 0:
        bad = {k: v for k, v in sb.items() if not k.startswith(f"{n - 1}.")}
    else:
        bad = None
    try:
        a.load_global_state_dict(bad)
    except KeyError as exc:
        raised = str(exc)
    else:
        raised = None
    if a.is_last:
        assert raised is not None and f"{n - 1}." in raised, f"missing layer not reported: {raised}"


def check_state_dict_across_partitions(kind, act, n, tol=1e-12):
    """Build on 2 ranks (world ranks 0,1), gather; load into P=1 (rank 0) and P=world builds."""
    torch.set_default_dtype(DT)
    assert COMM.size >= 3
    x = _rand(BATCH, *_shape(kind), seed=22)
    color = 0 if COMM.rank < 2 else MPI.UNDEFINED
    sub = COMM.Split(color, COMM.rank)
    state, out2 = None, None
    if sub != MPI.COMM_NULL:
        m2 = _build(kind, act, n, seed=1, comm=sub)
        _perturb(m2, seed=10)
        with torch.no_grad():
            o = m2(x if m2.is_first else None, batch_size=BATCH)
        out2 = o if m2.is_last else None
        state = m2.gather_state_dict(root=0)  # world rank 0
        sub.Free()
    out2 = COMM.bcast(out2, root=1)
    # P = 1 on world rank 0
    if COMM.rank == 0:
        m1 = _build(kind, act, n, seed=2, comm=MPI.COMM_SELF)
        with torch.no_grad():
            before = m1(x)
        assert _rel(before, out2) > 1e-3, "the check would not discriminate"
        m1.load_global_state_dict(state)
        with torch.no_grad():
            o1 = m1(x)
        e = _rel(o1, out2)
        assert e <= tol, f"P=1 build with P=2 state: rel err {e}"
    # P = world size
    mp = _build(kind, act, n, seed=2, comm=COMM)
    mp.load_global_state_dict(state, root=0)
    with torch.no_grad():
        op = mp(x if mp.is_first else None, batch_size=BATCH)
    if mp.is_last:
        e = _rel(op, out2)
        assert e <= tol, f"P={COMM.size} build with P=2 state: rel err {e}"


# -- 5. construction errors ---------------------------------------------------------------------
