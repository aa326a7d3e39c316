"""Model problems for MGRIT: Dahlquist's test equation and the 1-D heat equation.

Both reproduce PyMGRIT 1.0.6's applications (``pymgrit/dahlquist/dahlquist.py``,
``pymgrit/heat/heat_1d.py``) step for step, as :class:`mgrit.propagator.Propagator`\\ s on
integer fine indices. Every coarse level rediscretizes with the longer step, as PyMGRIT's
``simple_setup_problem`` does.

Time grid (``times``): PyMGRIT's points are ``t = np.linspace(t_start, t_stop, N + 1)`` and its
step sizes ``t[stop] - t[start]``, which are not bitwise equal to ``(stop - start) * h`` (for
``[0, 5]``, ``N = 100`` 98 of 100 fine steps differ in the last bit). Such a last-bit change
moves the last residual of the Dahlquist reference run by 1.7e-7 relative, so the default
``times="pymgrit"`` uses PyMGRIT's grid; ``times="uniform"`` uses ``dt = (stop - start) * h``
and ``t = t_start + stop * h`` with ``h = (t_stop - t_start) / N``.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
import scipy.linalg
import scipy.sparse
import scipy.sparse.linalg
import torch

from .propagator import Propagator

__all__ = ["Dahlquist", "Heat1D"]

_TIMES = ("pymgrit", "uniform")


def _check_time(t_start, t_stop, n_intervals, times):
    if isinstance(n_intervals, bool) or not isinstance(n_intervals, int) or n_intervals < 1:
        raise ValueError(f"n_intervals={n_intervals!r} is not allowed: use an int >= 1")
    if not (math.isfinite(t_start) and math.isfinite(t_stop)) or not t_stop > t_start:
        raise ValueError(f"time interval [{t_start}, {t_stop}] is not allowed: need finite "
                         f"t_start < t_stop")
    if times not in _TIMES:
        raise ValueError(f"times={times!r} is not allowed: use one of {_TIMES}")


class _TimeGrid:
    """Fine time points and step sizes shared by the problems (see module docstring)."""

    def _setup_time(self, t_start, t_stop, n_intervals, times):
        _check_time(t_start, t_stop, n_intervals, times)
        self.t_start, self.t_stop, self.n_intervals = float(t_start), float(t_stop), n_intervals
        self.times = times
        self.h = (self.t_stop - self.t_start) / n_intervals
        self.t = np.linspace(self.t_start, self.t_stop, n_intervals + 1)  # float64, (N+1,)

    def _check_interval(self, start, stop):
        if not 0 <= start < stop <= self.n_intervals:
            raise ValueError(f"interval [{start}, {stop}] is not inside 0..{self.n_intervals} "
                             f"with start < stop")

    def time(self, i: int) -> float:
        """Time of fine point ``i`` (``0 <= i <= N``)."""
        return float(self.t[i]) if self.times == "pymgrit" else self.t_start + i * self.h

    def dts(self, starts: Sequence[int], stops: Sequence[int]) -> np.ndarray:
        """Step sizes of many intervals at once, float64 ``(B,)``, equal to :meth:`dt`."""
        a, b = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        ok = a.shape == b.shape and a.ndim == 1
        if not ok or not np.all((0 <= a) & (a < b) & (b <= self.n_intervals)):
            raise ValueError(f"intervals must satisfy 0 <= start < stop <= {self.n_intervals}")
        if self.times == "pymgrit":
            return self.t[b] - self.t[a]
        return (b - a) * self.h

    def dt(self, start: int, stop: int) -> float:
        """Step size of the interval between fine points ``start`` and ``stop``."""
        self._check_interval(start, stop)
        if self.times == "pymgrit":
            return float(self.t[stop] - self.t[start])
        return (stop - start) * self.h


class Dahlquist(_TimeGrid, Propagator):
    """Dahlquist's test equation ``u' = lam * u`` (PyMGRIT 1.0.6 ``dahlquist.py``).

    One step over ``[start, stop]`` with ``z = dt * lam``: ``"BE"`` ``u / (1 - z)``
    (PyMGRIT: ``1 / (1 - z) * u``), ``"FE"`` ``(1 + z) u``, ``"TR"``
    ``(1 + z/2) / (1 - z/2) u``.

    Args:
        lam: eigenvalue (float, default -1.0); with ``dim`` also a 1-D sequence/tensor of ``dim``
            eigenvalues (diagonal system).
        t_start, t_stop: time interval (default [0, 5]).
        n_intervals: number of fine intervals ``N >= 1`` (PyMGRIT's ``nt = N + 1``; default 100).
        method: ``"BE"`` (default), ``"FE"`` or ``"TR"``.
        dim: ``None`` (default): scalar state, shape ``()``; an int ``>= 1``: state ``(dim,)``.
        times: ``"pymgrit"`` (default) or ``"uniform"`` (see module docstring).

    States are float64 (or float32) tensors on any device; steps keep dtype and device.

    Raises:
        ValueError: ``n_intervals < 1``, ``t_stop <= t_start``, an unknown method or ``times``,
            ``dim < 1``, non-finite ``lam``, or a vector ``lam`` whose length is not ``dim``.
    """

    METHODS = ("BE", "FE", "TR")

    def __init__(self, lam=-1.0, t_start: float = 0.0, t_stop: float = 5.0,
                 n_intervals: int = 100, method: str = "BE", dim: int | None = None,
                 times: str = "pymgrit"):
        self._setup_time(t_start, t_stop, n_intervals, times)
        if method not in self.METHODS:
            raise ValueError(f"method={method!r} is not allowed: use one of {self.METHODS}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim={dim!r} is not allowed: use None (scalar) or an int >= 1")
        lam_t = torch.as_tensor(lam, dtype=torch.float64).cpu()
        if not torch.isfinite(lam_t).all():
            raise ValueError(f"lam={lam!r} must be finite")
        if lam_t.ndim > 1 or (lam_t.ndim == 1 and (dim is None or lam_t.numel() != dim)):
            raise ValueError(f"lam with shape {tuple(lam_t.shape)} is not allowed: use a float, "
                             f"or a 1-D tensor of length dim={dim}")
        self.method, self.dim = method, dim
        self.lam = float(lam_t) if lam_t.ndim == 0 else lam_t  # float or (dim,) float64
        self._factors: dict = {}  # (start, stop) -> amplification factor

    @property
    def state_shape(self) -> tuple:
        return () if self.dim is None else (self.dim,)

    def _factor(self, z):
        # Same operation order as PyMGRIT (z = dt * lam; then the amplification factor).
        if self.method == "BE":
            return 1 / (1 - z)
        if self.method == "FE":
            return 1 + z
        return (1 + z / 2) / (1 - z / 2)

    def initial_value(self, dtype=torch.float64, device="cpu") -> torch.Tensor:
        """``u(t_start) = 1`` (shape ``()``) or ``ones(dim)``."""
        return torch.ones(self.state_shape, dtype=dtype, device=device)

    def exact(self, i: int, dtype=torch.float64, device="cpu") -> torch.Tensor:
        """Solution of the ODE at fine point ``i``: ``exp(lam * (t_i - t_start)) * u(t_start)``."""
        s = self.time(i) - self.t_start
        if isinstance(self.lam, float):
            return torch.full(self.state_shape, math.exp(self.lam * s), dtype=dtype, device=device)
        return torch.exp(self.lam * s).to(dtype=dtype, device=device)

    def step(self, u: torch.Tensor, start: int, stop: int, level: int = 0) -> torch.Tensor:
        f = self._factors.get((start, stop))
        if f is None:  # amplification factor of the interval, computed once (checked there)
            f = self._factor(self.dt(start, stop) * self.lam)
            self._factors[(start, stop)] = f
        if isinstance(f, float):
            return f * u
        return f.to(dtype=u.dtype, device=u.device) * u

    def step_batch(self, u: torch.Tensor, starts: Sequence[int], stops: Sequence[int],
                   level: int = 0) -> torch.Tensor:
        dts = torch.from_numpy(self.dts(starts, stops))
        if isinstance(self.lam, float):
            z = dts * self.lam  # (B,)
        else:
            z = dts[:, None] * self.lam[None, :]  # (B, dim)
        f = self._factor(z).to(dtype=u.dtype, device=u.device)
        return f.reshape(f.shape + (1,) * (u.ndim - f.ndim)) * u


def _default_rhs(x, t):
    return -np.sin(np.pi * x) * (np.sin(t) - np.pi ** 2 * np.cos(t))


def _default_init(x):
    return np.sin(np.pi * x)


class Heat1D(_TimeGrid, Propagator):
    """1-D heat equation ``u_t - a u_xx = f(x, t)`` on ``[0, 1]``, zero Dirichlet boundaries
    (PyMGRIT 1.0.6 ``heat_1d.py`` with ``x_start = 0``, ``x_end = 1``).

    Space: ``x = linspace(0, 1, nx)[1:-1]`` (``nx - 2`` interior points), ``dx = x[1] - x[0]``,
    ``L = (a / dx^2) tridiag(-1, 2, -1)``. Time: backward Euler,
    ``u_new = (I + dt L)^{-1} (u + f(x, t_new) * dt)``. Each distinct ``dt`` gets one cached
    factorization of ``I + dt L``; :meth:`step_batch` solves all right-hand sides of one ``dt``
    with one call.

    ``linear_solver="superlu"`` (default) factorizes with SuperLU exactly as PyMGRIT's
    ``spsolve`` on its CSR matrix does (``splu`` of the transpose, solved with ``trans="T"``):
    steps are bitwise equal to PyMGRIT's. ``"cholesky"`` uses a banded Cholesky factorization
    (``scipy.linalg.cholesky_banded``); it differs from PyMGRIT by ~1e-13 relative per step
    (``cond(I + dt L)`` ~ 1e6), which moves the last residuals of the heat reference run by
    ~1e-7 relative.

    Args:
        nx: number of grid points including the two boundary points, ``>= 3`` (default 1001).
        a: conductivity ``> 0`` (default 1.0).
        t_start, t_stop: time interval (default [0, 2]).
        n_intervals: fine intervals ``N >= 1`` (PyMGRIT's ``nt = N + 1``; default 64).
        rhs: ``f(x, t) -> ndarray`` like ``x`` (default ``-sin(pi x)(sin t - pi^2 cos t)``).
        init: ``u0(x) -> ndarray`` like ``x`` (default ``sin(pi x)``).
        times: ``"pymgrit"`` (default) or ``"uniform"`` (see module docstring).
        linear_solver: ``"superlu"`` (default) or ``"cholesky"``.

    States: float64 CPU tensors of shape ``(nx - 2,)``.

    Raises:
        ValueError: ``nx < 3``, ``a <= 0``, ``n_intervals < 1``, ``t_stop <= t_start``, an
            unknown ``times`` or ``linear_solver``, or ``rhs``/``init`` not callable.
    """

    def __init__(self, nx: int = 1001, a: float = 1.0, t_start: float = 0.0, t_stop: float = 2.0,
                 n_intervals: int = 64, rhs: Callable = _default_rhs, init: Callable = _default_init,
                 times: str = "pymgrit", linear_solver: str = "superlu"):
        self._setup_time(t_start, t_stop, n_intervals, times)
        if linear_solver not in ("superlu", "cholesky"):
            raise ValueError(f"linear_solver={linear_solver!r} is not allowed: use 'superlu' or "
                             f"'cholesky'")
        if isinstance(nx, bool) or not isinstance(nx, int) or nx < 3:
            raise ValueError(f"nx={nx!r} is not allowed: use an int >= 3 (one interior point)")
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 0:
            raise ValueError(f"a={a!r} is not allowed: use a finite number > 0")
        if not callable(rhs) or not callable(init):
            raise ValueError("rhs and init must be callables f(x, t) and u0(x)")
        self.nx, self.a, self.rhs, self.init = nx, float(a), rhs, init
        self.x = np.linspace(0.0, 1.0, nx)[1:-1]  # (nx-2,) float64
        self.dx = self.x[1] - self.x[0] if nx > 3 else 0.5
        self.fac = self.a / self.dx ** 2
        self.linear_solver = linear_solver
        self._fact: dict = {}
        self._f: dict[int, np.ndarray] = {}  # rhs(x, t_i) per fine index (bounded cache)

    @property
    def state_shape(self) -> tuple:
        return (self.nx - 2,)

    def initial_value(self, dtype=torch.float64, device="cpu") -> torch.Tensor:
        """``init(x)`` as a ``(nx - 2,)`` tensor."""
        return torch.as_tensor(np.asarray(self.init(self.x), dtype=np.float64)).to(dtype=dtype,
                                                                                   device=device)

    def _factor(self, dt: float):
        """Cached factorization of ``I + dt L`` (entries computed as PyMGRIT's sparse matrix)."""
        c = self._fact.get(dt)
        if c is None:
            n = self.nx - 2
            off, diag = dt * -self.fac, dt * (2 * self.fac) + 1.0
            if self.linear_solver == "cholesky":
                ab = np.empty((2, n))
                ab[0, 0], ab[0, 1:], ab[1, :] = 0.0, off, diag
                c = scipy.linalg.cholesky_banded(ab, lower=False)
            else:  # PyMGRIT: spsolve(CSR) factorizes the CSC transpose with SuperLU
                a = scipy.sparse.diags([np.full(n, diag), np.full(n - 1, off), np.full(n - 1, off)],
                                       offsets=[0, -1, 1], shape=(n, n), format="csr")
                c = scipy.sparse.linalg.splu(a.T.tocsc())
            self._fact[dt] = c
        return c

    def _solve(self, dt: float, b: np.ndarray) -> np.ndarray:
        if self.linear_solver == "cholesky":
            return scipy.linalg.cho_solve_banded((self._factor(dt), False), b, check_finite=False)
        return self._factor(dt).solve(b, trans="T")

    def _rhs(self, i: int) -> np.ndarray:
        f = self._f.get(i)
        if f is None:
            if len(self._f) >= 4096:
                self._f.clear()
            f = self._f[i] = np.asarray(self.rhs(self.x, self.time(i)), dtype=np.float64)
        return f

    def step(self, u: torch.Tensor, start: int, stop: int, level: int = 0) -> torch.Tensor:
        dt = self.dt(start, stop)
        b = u.detach().cpu().numpy() + self._rhs(stop) * dt
        return torch.from_numpy(self._solve(dt, b)).to(dtype=u.dtype, device=u.device)

    def step_batch(self, u: torch.Tensor, starts: Sequence[int], stops: Sequence[int],
                   level: int = 0) -> torch.Tensor:
        U = u.detach().cpu().numpy()
        out = np.empty_like(U, dtype=np.float64)
        dts = self.dts(starts, stops)
        for dt in np.unique(dts):
            idx = np.flatnonzero(dts == dt)
            B = np.empty((U.shape[1], len(idx)))  # columns = right-hand sides
            for k, b in enumerate(idx):
                B[:, k] = U[b] + self._rhs(int(stops[b])) * float(dt)
            out[idx] = self._solve(float(dt), B).T
        return torch.from_numpy(out).to(dtype=u.dtype, device=u.device)
