"""Serial tests of mgrit.problems against closed forms and PyMGRIT 1.0.6's applications."""
import math

import numpy as np
import pytest
import torch

from mgrit.problems import Dahlquist, Heat1D
from tests.pymgrit_ref import _pymgrit, heat_init, heat_rhs

F64 = torch.float64


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("method, factor", [
    ("BE", lambda z: 1.0 / (1.0 - z)),
    ("FE", lambda z: 1.0 + z),
    ("TR", lambda z: (1.0 + z / 2) / (1.0 - z / 2)),
])
@pytest.mark.parametrize("times", ["pymgrit", "uniform"])
def test_dahlquist_step_closed_form(method, factor, times):
    p = Dahlquist(lam=-2.5, t_start=0.0, t_stop=5.0, n_intervals=100, method=method, times=times)
    u = torch.tensor(0.7, dtype=F64)
    for start, stop in [(0, 1), (10, 12), (0, 16), (96, 100)]:
        z = -2.5 * (stop - start) * 0.05
        want = factor(z) * 0.7
        got = p.step(u, start, stop, 0)
        assert got.shape == () and got.dtype == F64
        assert abs(float(got) - want) <= 1e-14 * abs(want)
    # Whole chain: BE/FE/TR powers of the amplification factor; BE/TR converge to exp(-2.5 t)
    v = p.initial_value()
    for i in range(100):
        v = p.step(v, i, i + 1)
    assert abs(float(v) - factor(-2.5 * 0.05) ** 100) <= 1e-12 * abs(factor(-0.125) ** 100)
    assert float(p.exact(100)) == pytest.approx(math.exp(-12.5), rel=1e-15)


def test_dahlquist_times_pymgrit_vs_uniform():
    # PyMGRIT's dt = linspace differences: t[stop] - t[start]; uniform: (stop - start) * h.
    a = Dahlquist(n_intervals=100, times="pymgrit")
    b = Dahlquist(n_intervals=100, times="uniform")
    t = np.linspace(0.0, 5.0, 101)
    assert a.dt(3, 4) == t[4] - t[3] and b.dt(3, 4) == 0.05
    assert sum(a.dt(i, i + 1) != b.dt(i, i + 1) for i in range(100)) > 50  # not bitwise equal
    assert all(abs(a.dt(i, i + 1) - 0.05) < 1e-15 for i in range(100))


@pytest.mark.parametrize("method", ["BE", "FE", "TR"])
def test_dahlquist_matches_pymgrit_step_bitwise(method):
    _, PyDahlquist, _ = _pymgrit()
    from pymgrit.dahlquist.dahlquist import VectorDahlquist
    p = Dahlquist(lam=-1.0, n_intervals=128, method=method)
    ref = PyDahlquist(constant_lambda=-1, method=method, t_interval=p.t)
    for start, stop in [(0, 1), (5, 6), (0, 16), (112, 128), (64, 128)]:
        want = ref.step(VectorDahlquist(0.3), p.t[start], p.t[stop]).get_values()
        assert float(p.step(torch.tensor(0.3, dtype=F64), start, stop)) == want


def test_dahlquist_vector_state_and_batch():
    lam = torch.tensor([-1.0, -10.0, 0.5], dtype=F64)
    p = Dahlquist(lam=lam, dim=3, n_intervals=50, method="TR")
    u0 = p.initial_value()
    assert u0.shape == (3,) and torch.equal(u0, torch.ones(3, dtype=F64))
    got = p.step(u0, 0, 2)
    z = lam * 0.2
    assert rel(got, (1 + z / 2) / (1 - z / 2)) <= 1e-15
    assert rel(p.exact(50), torch.exp(lam * 5.0)) <= 1e-15
    U = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    starts, stops = [0, 1, 2, 0, 4, 40], [1, 2, 4, 4, 8, 50]
    batch = p.step_batch(U, starts, stops, 1)
    loop = torch.stack([p.step(U[b], starts[b], stops[b], 1) for b in range(6)])
    assert batch.shape == (6, 3) and rel(batch, loop) <= 1e-14


@pytest.mark.parametrize("method", ["BE", "FE", "TR"])
def test_dahlquist_scalar_batch_equals_step(method):
    p = Dahlquist(lam=-3.0, n_intervals=64, method=method)
    U = torch.linspace(-1.0, 2.0, 9, dtype=F64)
    starts = [0, 1, 2, 3, 8, 16, 32, 48, 60]
    stops = [1, 2, 4, 5, 16, 32, 64, 64, 64]
    batch = p.step_batch(U, starts, stops, 0)
    loop = torch.stack([p.step(U[b], starts[b], stops[b], 0) for b in range(9)])
    assert batch.shape == (9,) and rel(batch, loop) <= 1e-14
    assert p.batched


def test_dahlquist_float32_keeps_dtype():
    p = Dahlquist(n_intervals=10)
    out = p.step(torch.tensor(1.0, dtype=torch.float32), 0, 1)
    assert out.dtype == torch.float32 and abs(float(out) - 1 / 1.5) < 1e-7


def _pymgrit_heat(p):
    _, _, PyHeat = _pymgrit()
    return PyHeat(x_start=0.0, x_end=1.0, nx=p.nx, a=p.a, init_cond=heat_init, rhs=heat_rhs,
                  t_interval=p.t)


@pytest.mark.parametrize("solver, tol", [("superlu", 0.0), ("cholesky", 1e-12)])
def test_heat_step_matches_pymgrit(solver, tol):
    # superlu: PyMGRIT's own factorization, bitwise. cholesky: a different backward-stable
    # solve; cond(I + dt L) ~ 1e5..1e6 here, so ~1e-13 relative (2-norm) differences.
    p = Heat1D(nx=1001, n_intervals=64, linear_solver=solver)
    ref = _pymgrit_heat(p)
    u0 = p.initial_value()
    assert u0.shape == (999,) and u0.dtype == F64
    assert np.array_equal(u0.numpy(), ref.vector_t_start.get_values())
    u = u0 + 0.1 * torch.cos(torch.arange(999, dtype=F64))
    for start, stop in [(0, 1), (7, 8), (0, 2), (16, 32), (48, 64)]:
        v = ref.vector_template.clone()
        v.set_values(u.numpy().copy())
        want = torch.from_numpy(ref.step(v, p.t[start], p.t[stop]).get_values())
        got = p.step(u, start, stop, 0)
        assert got.shape == (999,) and got.dtype == F64
        err = float(torch.linalg.norm(got - want) / torch.linalg.norm(want))
        assert err <= tol, (start, stop, err)


@pytest.mark.parametrize("solver", ["superlu", "cholesky"])
def test_heat_batch_equals_step(solver):
    p = Heat1D(nx=201, n_intervals=64, linear_solver=solver)
    U = torch.randn(8, 199, dtype=F64, generator=torch.Generator().manual_seed(1))
    starts, stops = [0, 1, 2, 5, 0, 8, 32, 16], [1, 2, 4, 6, 16, 16, 64, 32]
    batch = p.step_batch(U, starts, stops, 0)
    loop = torch.stack([p.step(U[b], starts[b], stops[b], 0) for b in range(8)])
    assert batch.shape == (8, 199) and rel(batch, loop) <= 1e-14


def test_heat_matches_manufactured_solution():
    # u = sin(pi x) cos t solves u_t - u_xx = f for the default f: BE + FD converge O(dt + dx^2).
    p = Heat1D(nx=101, n_intervals=400, t_stop=1.0)
    u = p.initial_value()
    for i in range(400):
        u = p.step(u, i, i + 1)
    exact = torch.from_numpy(np.sin(np.pi * p.x) * np.cos(1.0))
    assert float((u - exact).abs().max()) < 5e-3


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_intervals=0), "n_intervals"),
    (dict(n_intervals=2.5), "n_intervals"),
    (dict(t_start=1.0, t_stop=1.0), "t_start < t_stop"),
    (dict(t_stop=float("nan")), "t_start < t_stop"),
    (dict(method="MR"), "method"),
    (dict(dim=0), "dim"),
    (dict(lam=[-1.0, -2.0], dim=3), "lam"),
    (dict(lam=float("inf")), "finite"),
    (dict(times="linspace"), "times"),
])
def test_dahlquist_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Dahlquist(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(nx=2), "nx"),
    (dict(a=0.0), "a="),
    (dict(n_intervals=-1), "n_intervals"),
    (dict(t_start=2.0, t_stop=0.0), "t_start < t_stop"),
    (dict(rhs=None), "callable"),
    (dict(linear_solver="lu"), "linear_solver"),
])
def test_heat_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Heat1D(**kwargs)


def test_step_outside_the_grid_is_an_error():
    with pytest.raises(ValueError, match="interval"):
        Dahlquist(n_intervals=10).step(torch.tensor(1.0, dtype=F64), 5, 11)
    with pytest.raises(ValueError, match="interval"):
        Heat1D(nx=11, n_intervals=4).step(torch.zeros(9, dtype=F64), 2, 2)


def test_batch_rejects_intervals_outside_the_grid():
    with pytest.raises(ValueError, match="intervals"):
        Dahlquist(n_intervals=10).step_batch(torch.ones(2, dtype=F64), [0, 9], [1, 11], 0)
