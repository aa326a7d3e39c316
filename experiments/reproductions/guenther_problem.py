"""Pieces of ``experiments/reproductions/reproduce_guenther.py`` (Günther et al. 2020, SIMODS): one rank's
share of the Peaks network with the regularized full-batch objective (:class:`Problem`) and the
L-BFGS optimizer with Armijo backtracking (:func:`lbfgs_armijo`) that drives it."""
from __future__ import annotations

import math

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from mgrit.nn import DenseStep, LayerParallelNet, LayerParallelResNet, SmoothReLU
from mgrit.options import MGRITOptions

__all__ = ["Problem", "lbfgs_armijo"]


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
        resnet = LayerParallelResNet.build(lambda k: DenseStep(width, "smoothrelu"), N, (width,),
                                           comm=comm, seed=args.seed, T=1.0, forward=fw,
                                           backward=bw, warm_start=warm)
        torch.manual_seed(args.seed + 7)
        opening = nn.Sequential(nn.Linear(2, width), SmoothReLU())
        closing = nn.Linear(width, 5)
        self.net = LayerParallelNet(opening, resnet, closing)
        self.resnet = resnet
        self.h = resnet.h
        self.open_params = list(self.net.opening.parameters()) if self.net.opening is not None else []
        self.close_params = list(self.net.closing.parameters()) if self.net.closing is not None else []
        self.step_params = [list(s.parameters()) for s in resnet.steps]
        self.params = self.open_params + [p for ps in self.step_params for p in ps] + self.close_params
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.n_eval = 0

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
        term = sum(((b - a) / h).pow(2).sum() for a, b in zip(chain[:-1], chain[1:])) * h
        if not isinstance(term, torch.Tensor):
            term = torch.zeros(())
        term = 0.5 * g * term
        value = float(term.detach())
        if from_right is not None:
            extra = 0.5 * g * h * ((torch.as_tensor(from_right) - local[-1]) / h).pow(2).sum()
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
