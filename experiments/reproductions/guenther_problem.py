"""Pieces of ``experiments/reproductions/reproduce_guenther.py`` (Günther et al. 2020, SIMODS): one rank's
share of the Peaks network with the regularized full-batch objective (:class:`Problem`) and the
L-BFGS optimizer with Armijo backtracking (:func:`lbfgs_armijo`) that drives it.

The problem's options (attributes of ``args``; the study's values are the defaults, the authors'
program's values in brackets, selected by ``--authors-config``, see ``guenther_authors``):
``T`` 1.0 [5.0]; ``layers`` 30 [28 residual layers: their ``nlayers = 30`` counts the opening and
the classification layer]; ``opening`` ``"dense"`` (trainable ``Linear(2, w) + SmoothReLU``)
[``"zero"``: ``u0 = (x1, x2, 0, ..., 0)``, no parameters]; ``bias`` ``"channel"`` [``"scalar"``:
one bias per layer added to every channel]; ``init`` ``"torch"`` [``"glibc"``: ``srand(1)``, every
parameter ``rand() / RAND_MAX * init_scale`` in the authors' order, ``init_scale`` 1e-3];
``ddt_form`` ``"h"`` (``gamma_ddt/2 * h * sum |dtheta/h|^2``) [``"plain"``: without the factor h];
``ddt_gradient`` True [False: the authors' gradient omits the ddt term, its factor
``gamma_ddt / dt^2`` is stored in an ``int`` in their layer.cpp]; ``warm_adjoint`` False [True:
warm restarts of the adjoint solves too]; ``xbraid_adjoint`` False [True: the adjoint solve as
their XBraid run does it, ``guenther_xbraid``]; ``partition`` ``"even"`` [``"xbraid"``: XBraid's
blocks of the ``N + 1`` points, the last one the classification layer's: the same terms in each
rank's share of the dot products as theirs]."""
from __future__ import annotations

import math

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, SmoothReLU
from mgrit.grid import Partition
from mgrit.options import MGRITOptions

__all__ = ["Problem", "lbfgs_armijo", "ScalarBiasStep", "ZeroOpening", "glibc_rand"]


def glibc_rand(seed: int, n: int) -> list:
    """The first ``n`` values of glibc's ``rand()`` after ``srand(seed)`` (the default
    ``TYPE_3`` additive feedback generator of ``random_r``: 31 words seeded by the
    Park-Miller recurrence ``16807 * r mod (2^31 - 1)``, 310 values discarded, then
    ``r_i = r_{i-31} + r_{i-3} mod 2^32``, output ``r_i >> 1``); ints in ``[0, 2^31 - 1]``."""
    r = [int(seed) & 0xFFFFFFFF or 1]
    for i in range(1, 31):
        hi, lo = divmod(r[i - 1], 127773)
        word = 16807 * lo - 2836 * hi
        r.append(word + 2147483647 if word < 0 else word)
    r += r[0:3]
    for i in range(34, 344 + n):
        r.append((r[i - 31] + r[i - 3]) & 0xFFFFFFFF)
    return [v >> 1 for v in r[344:344 + n]]


class AuthorsSmoothReLU(nn.Module):
    """SmoothReLU as the authors' layer.cpp evaluates it: ``a x^2 + b x + c`` (``a = 1/(4 eta)``,
    ``b = 1/2``, ``c = eta/4``) for ``|x| < eta``, else ``max(x, 0)``; the same function as
    :class:`mgrit.nn.SmoothReLU`, rounded as theirs."""

    def __init__(self, eta: float = 0.1):
        super().__init__()
        self.eta = eta

    def forward(self, x):
        e = self.eta
        quad = (1.0 / (4.0 * e)) * (x * x) + 0.5 * x + e / 4.0
        return torch.where((x > -e) & (x < e), quad, torch.clamp(x, min=0.0))


class ScalarBiasStep(nn.Module):
    """``F(x) = SmoothReLU(x W^T + b)`` with ONE bias ``b`` per layer added to every channel
    (the authors' DenseLayer: ``dim_Bias = 1``); ``weight`` ``(w, w)``, ``bias`` ``(1,)``."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, width).uniform_(-width ** -0.5, width ** -0.5))
        self.bias = nn.Parameter(torch.zeros(1))
        self.act = AuthorsSmoothReLU()

    def forward(self, x):
        return self.act(F.linear(x, self.weight) + self.bias)


class ZeroOpening(nn.Module):
    """``u0 = (x, 0, ..., 0)``: the features padded with zeros to ``width`` channels, no
    parameters (the authors' OpenExpandZero, ``weights_open_init = 0``)."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def forward(self, x):
        return F.pad(x, (0, self.width - x.shape[1]))


class Problem:
    """One rank's share of the network and the regularized full-batch objective."""

    def __init__(self, args, comm, method):
        self.comm, self.args = comm, args
        N = args.layers
        if method == "serial":
            fw = MGRITOptions(max_levels=1, tol=0, max_iter=1)
            bw = MGRITOptions(max_levels=1, tol=0, max_iter=1)
            warm = False
        else:
            kw = dict(max_levels=args.max_levels, cfactor=args.cfactor, min_coarse=args.min_coarse,
                      relax=["F", "FCF"], tol=0, max_iter=args.mgrit_iters)
            fw, bw, warm = MGRITOptions(**kw), MGRITOptions(**kw), True
        self.fw_opts, self.bw_opts = fw, bw
        width = args.width
        opt = lambda name, default: getattr(args, name, default)  # noqa: E731
        self.ddt_form, self.ddt_gradient = opt("ddt_form", "h"), opt("ddt_gradient", True)
        scalar = opt("bias", "channel") == "scalar"
        part = None
        if opt("partition", "even") == "xbraid":  # XBraid's blocks of the N + 1 points
            q, r = divmod(N + 1, comm.Get_size())
            sizes = [q + (p < r) for p in range(comm.Get_size())]
            sizes[-1] -= 1  # the last point is the classification layer's
            part = Partition(N, sizes)
        resnet = LayerParallelResNet.build(
            (lambda k: ScalarBiasStep(width)) if scalar else (lambda k: DenseStep(width, "smoothrelu")),
            N, (width,), comm=comm, seed=args.seed, T=opt("T", 1.0), forward=fw, backward=bw,
            warm_start=warm, warm_start_adjoint=warm and opt("warm_adjoint", False), partition=part)
        xb = opt("xbraid_adjoint", False)
        if warm and xb:
            from experiments.reproductions.guenther_xbraid import use_xbraid_adjoint
            use_xbraid_adjoint(resnet, "both" if xb is True else xb)
        torch.manual_seed(args.seed + 7)
        opening = (ZeroOpening(width) if opt("opening", "dense") == "zero"
                   else nn.Sequential(nn.Linear(2, width), SmoothReLU()))
        closing = nn.Linear(width, opt("classes", 5))
        self.net = LayerParallelNet(opening, resnet, closing)
        self.resnet = resnet
        self.h = resnet.h
        self.open_params = list(self.net.opening.parameters()) if self.net.opening is not None else []
        self.close_params = list(self.net.closing.parameters()) if self.net.closing is not None else []
        self.step_params = [list(s.parameters()) for s in resnet.steps]
        self.params = self.open_params + [p for ps in self.step_params for p in ps] + self.close_params
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.n_eval = 0
        if opt("init", "torch") == "glibc":
            self._init_glibc(opt("init_scale", 1e-3))

    def _init_glibc(self, scale):
        """Every parameter ``rand() / RAND_MAX * scale`` after ``srand(1)``, drawn in the
        authors' order (opening, layers 0..N-1, classification; each: weights row-major, then
        bias), the same global vector on every rank."""
        n_open = sum(p.numel() for p in self.open_params)
        n_layer = sum(p.numel() for p in self.step_params[0])  # every layer has the same shape
        n_close = self.comm.bcast(sum(p.numel() for p in self.close_params), root=self.size - 1)
        n = n_open + self.args.layers * n_layer + n_close
        design = torch.tensor(glibc_rand(1, n), dtype=torch.float64) / 2147483647.0 * scale
        first = self.resnet.first
        parts = [(0, self.open_params)] if self.open_params else []
        parts += [(n_open + (first + i) * n_layer, ps) for i, ps in enumerate(self.step_params)]
        if self.close_params:
            parts.append((n - n_close, self.close_params))
        with torch.no_grad():
            for i, ps in parts:
                for p in ps:
                    p.copy_(design[i:i + p.numel()].view_as(p))
                    i += p.numel()

    # -- flat local vectors
    def get_flat(self):
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def set_flat(self, v):
        i = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(v[i:i + n].view_as(p))
                i += n

    def grad_flat(self):
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in self.params])

    def dot(self, a, b):
        return self.comm.allreduce(float(torch.dot(a, b)), op=MPI.SUM)

    def _ddt(self):
        """Depth-smoothness term on this rank (value counts pairs ending in a local layer; the
        autograd graph also holds the pair (last local, right neighbour's first) so the
        gradient of the local parameters is complete)."""
        g = self.args.gamma_ddt
        if g == 0 or not self.step_params:
            return torch.zeros(()), 0.0
        local = [torch.cat([p.reshape(-1) for p in ps]) for ps in self.step_params]
        mine_first = local[0].detach().numpy().copy()
        mine_last = local[-1].detach().numpy().copy()
        left = self.rank - 1 if self.rank > 0 else MPI.PROC_NULL
        right = self.rank + 1 if self.rank < self.size - 1 else MPI.PROC_NULL
        # send my last to the right, receive the left's last; and the mirror
        from_left = self.comm.sendrecv(mine_last, dest=right, source=left)
        from_right = self.comm.sendrecv(mine_first, dest=left, source=right)
        chain = ([torch.as_tensor(from_left)] if from_left is not None else []) + local
        h = self.h
        if not self.ddt_gradient:
            chain = [c.detach() for c in chain]
            local = [c.detach() for c in local]
        w = h if self.ddt_form == "h" else 1.0
        term = sum(((b - a) / h).pow(2).sum() for a, b in zip(chain[:-1], chain[1:])) * w
        if not isinstance(term, torch.Tensor):
            term = torch.zeros(())
        term = 0.5 * g * term
        value = float(term.detach())
        if from_right is not None:
            extra = 0.5 * g * w * ((torch.as_tensor(from_right) - local[-1]) / h).pow(2).sum()
            term = term + extra  # gradient only; its value is counted on the right rank
        return term, value

    def evaluate(self, x, y, need_grad=True):
        """Objective J (global, on every rank) and the local gradient (flat)."""
        self.n_eval += 1
        a = self.args
        for p in self.params:
            p.grad = None
        out = self.net(x)
        ce = self.net.loss(out, y)
        reg = sum((0.5 * a.gamma_tik * p.pow(2).sum() for p in self.open_params), torch.zeros(()))
        reg = reg + sum((0.5 * a.gamma_tik * p.pow(2).sum() for ps in self.step_params for p in ps),
                        torch.zeros(()))
        reg = reg + sum((0.5 * a.gamma_class * p.pow(2).sum() for p in self.close_params),
                        torch.zeros(()))
        ddt, ddt_value = self._ddt()
        total = ce + reg + ddt
        local_value = (float(ce.detach()) if self.net.is_last else 0.0) + float(reg.detach()) + ddt_value
        if need_grad:
            total.backward()
        J = self.comm.allreduce(local_value, op=MPI.SUM)
        if getattr(a, "metrics", False):  # (loss, accuracy in %) of this evaluation, every rank
            self.last_metrics = self.net.from_last(
                (float(ce.detach()), 100.0 * float((out.argmax(1) == y).double().mean()))
                if self.net.is_last else None)
        return J, (self.grad_flat() if need_grad else None)

    def serial_metrics(self, xs):
        """Exact (serial) loss/accuracy of the current weights on each ``(x, y)`` (every rank)."""
        model = self.net.to_serial()
        res = []
        with torch.no_grad():
            for x, y in xs:
                out = model(x)
                res.append((float(F.cross_entropy(out, y)), float((out.argmax(1) == y).double().mean())))
        return res


# ---------------------------------------------------------------------------- L-BFGS + Armijo
def lbfgs_armijo(prob: Problem, x, y, iters, history, on_iter, c1=1e-4, max_tries=15):
    """Compact two-loop L-BFGS over the distributed parameters (all dot products allreduced over
    the layer communicator) with Armijo backtracking (halving, at most ``max_tries`` trials)."""
    theta = prob.get_flat()
    J, g = prob.evaluate(x, y)
    S, Y, RHO = [], [], []
    on_iter(0, J, 0, 1.0)
    for it in range(1, iters + 1):
        q = g.clone()
        alphas = []
        for s, yv, rho in zip(reversed(S), reversed(Y), reversed(RHO)):
            al = rho * prob.dot(s, q)
            alphas.append(al)
            q -= al * yv
        if S:
            gamma = prob.dot(S[-1], Y[-1]) / prob.dot(Y[-1], Y[-1])
        else:
            gamma = 1.0 / max(math.sqrt(prob.dot(g, g)), 1e-12)  # first step of unit length
        r = gamma * q
        for (s, yv, rho), al in zip(zip(S, Y, RHO), reversed(alphas)):
            be = rho * prob.dot(yv, r)
            r += (al - be) * s
        d = -r
        gd = prob.dot(g, d)
        if not gd < 0:  # not a descent direction (inexact gradients): restart with -g
            S, Y, RHO = [], [], []
            d = -g / max(math.sqrt(prob.dot(g, g)), 1e-12)
            gd = prob.dot(g, d)
        step, tries = 1.0, 0
        while True:
            tries += 1
            prob.set_flat(theta + step * d)
            J_new, g_new = prob.evaluate(x, y)
            if J_new <= J + c1 * step * gd or tries >= max_tries:
                break
            step *= 0.5
        s_vec = step * d
        y_vec = g_new - g
        sy = prob.dot(s_vec, y_vec)
        if sy > 1e-10 * math.sqrt(prob.dot(s_vec, s_vec) * prob.dot(y_vec, y_vec)):
            S.append(s_vec)
            Y.append(y_vec)
            RHO.append(1.0 / sy)
            if len(S) > history:
                S.pop(0), Y.pop(0), RHO.pop(0)
        theta, J, g = theta + s_vec, J_new, g_new
        on_iter(it, J, tries, step)
    return theta


# ---------------------------------------------------------------------------- cost model
