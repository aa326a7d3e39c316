"""Actions of the fuzzer that change the model itself: hooks, replaced or reloaded parameters,
checkpoints (also across rank counts), NaN in the adjoint. A mixin of
:class:`tests.fuzz.executor.Run` (same conventions: each action runs the serial side, then the
layer-parallel side, through ``both(side, fn)``, which records an exception per side)."""
from __future__ import annotations

import io
import itertools

import torch
from mpi4py import MPI
from torch import nn

from .nets import build_net


class ModelActions:
    def a_hook_add(self, both, kind):
        lp_h, ser_h = [], []
        for side, names, get, out in (
                ("ser", self.twin.all_step_names(), self.twin.ser_module, ser_h),
                ("lp", self.twin.step_names(), lambda n: self.twin.lp_modules()[n], lp_h)):
            counts = self.counts[side]
            for name in names:
                mod = get(name)
                if kind == "count":
                    counts.setdefault(name, 0)
                    fn = _counter(counts, name)
                    out.append(both(side, lambda: mod.register_forward_hook(fn)))
                elif kind == "scale":
                    out.append(both(side, lambda: mod.register_forward_hook(
                        lambda m, a, o: o * 1.25)))
                else:
                    out.append(both(side, lambda: mod.register_forward_pre_hook(
                        lambda m, a: (a[0] * 0.9,))))
        self.hooks.append((lp_h, ser_h))

    def a_hook_remove(self, both):
        if self.hooks:
            for h in itertools.chain(*self.hooks.pop()):
                if h is not None:
                    h.remove()

    def _param_site(self, module, key, k):
        """``(owner module, attribute name)`` of parameter ``key`` below global module ``k``."""
        path = key[len(k) + 1:] if k else key
        owner, _, name = path.rpartition(".")
        return (module.get_submodule(owner) if owner else module), name

    def a_replace_param(self, both, p):
        keys = sorted(self.twin.ser_params())
        key = keys[p % len(keys)]
        if self.twin.spec.get("stacked") and ".F." in key:  # refused (a layer's view of a
            return  # stacked leaf; tests/nn/test_stacked_leaves.py): not a serial action
        owner, name = self._param_site(self.twin.ser, key, "")
        both("ser", lambda: setattr(owner, name, _replaced(getattr(owner, name))))
        for k, mod in self.twin.lp_modules().items():
            if key.startswith(k + "."):
                o, n = self._param_site(mod, key, k)
                both("lp", lambda: setattr(o, n, _replaced(getattr(o, n))))
        self._new_opts(buckets=False)  # a new optimizer; the buckets must follow (item 4)
        self.pending = []

    def a_load_assign(self, both, scale):
        sd = {k: v * scale for k, v in self.twin.ser.state_dict().items()}
        both("ser", lambda: self.twin.ser.load_state_dict(sd, assign=True))
        stacked = self.twin.spec.get("stacked") and not self.twin.gru
        for k, mod in self.twin.lp_modules().items():
            if stacked and k.endswith(".F"):
                continue  # the segment's state dict below (its layers hold views)
            local = {n: v * scale for n, v in mod.state_dict().items()}
            both("lp", lambda: mod.load_state_dict(local, assign=True))
        for seg in (list(self.twin.lp.segments) if stacked else ()):
            local = {n: v * scale for n, v in seg.state_dict().items()}
            both("lp", lambda: seg.load_state_dict(local, assign=True))
        self._new_opts(buckets=False)
        self.pending = []

    def _gather(self):
        if self.twin.gru:
            return {f"cell.{k}": v.detach().clone() for k, v in self.twin.lp.state_dict().items()}
        return self.twin.lp.gather_state_dict(0)

    def _load(self, net, state, comm):
        if self.twin.gru:
            net.load_state_dict({k[5:]: v for k, v in state.items()})
        else:
            net.load_global_state_dict(state if comm.rank == 0 else None)

    def a_checkpoint(self, both, x):
        """Save (gather, torch.save, torch.load with weights_only) and load into a new model
        built with other weights on the same ranks; the program continues on the new one."""
        def lp():
            state = self._gather()
            if self.comm.rank == 0 or self.twin.gru:
                want = set(self.twin.ser.state_dict())
                if set(state) != want:
                    self.problems.append(f"checkpoint keys {sorted(set(state) - want)[:3]} are "
                                         f"not serial keys {sorted(want - set(state))[:3]}")
                buf = io.BytesIO()
                torch.save(state, buf)
                state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
            fresh = build_net(self.spec, self.comm, seed=self.spec["seed"] + 7919)
            self._load(fresh, state, self.comm)
            old = self.twin.lp_params()
            for k, p in (fresh.named_parameters() if self.twin.gru
                         else fresh.named_global_parameters()):
                p.requires_grad_(old[f"cell.{k}" if self.twin.gru else k].requires_grad)
            fresh.train(self.twin.lp.training)
            self.twin.lp = fresh
        both("lp", lp)
        for p in self.twin.ser.parameters():  # a new model: gradients are not in a checkpoint
            p.grad = None
        while self.hooks:  # the new model has none: drop the serial ones too
            self.a_hook_remove(both)
        self.counts = {"lp": {}, "ser": {}}
        self._new_opts()
        self.pending = []

    def a_reload_self(self, both, x):
        """The gathered weights loaded into the same network on ONE rank (a checkpoint across
        rank counts); its no-grad output must equal serial's, on every rank."""
        def lp():
            state = self.comm.bcast(self._gather(), root=0)
            one = build_net(self.spec, MPI.COMM_SELF, seed=self.spec["seed"] + 7919)
            self._load(one, state, MPI.COMM_SELF)
            one.train(self.twin.lp.training)
            with torch.no_grad():
                return one(self._shard(self._x(x)[0]))
        yl = both("lp", lp)
        if yl is not None and not self.hooks:
            with torch.no_grad():
                self.check(yl, self._shard(self.twin.ser_forward(self._x(x)[1])),
                           "output after a 1-rank load")

    def a_nan_backward(self, both, x):
        """NaN in the solves: a middle layer gets a NaN vector-Jacobian product (steps with a
        ``poison`` buffer, see :class:`~tests.fuzz.nets.UserDense`; forward finite) or else a
        NaN in its first parameter (GRU: ``weight_hh``), both sides; then a forward and a
        backward. Serial gets NaN gradients; the layer-parallel side must raise on every rank,
        or agree with serial (NaN where serial has NaN) and report no solve as converged
        (issue 22 item 5)."""
        names = self.twin.all_step_names()
        mid = names[len(names) // 2] if names else "cell"
        with torch.no_grad():
            vjp_only = hasattr(self.twin.ser_module(mid), "poison")
            if vjp_only:
                self.twin.ser_module(mid).poison.fill_(1.0)
                if mid in self.twin.lp_modules():
                    self.twin.lp_modules()[mid].poison.fill_(1.0)
            else:
                key = next(k for k in sorted(self.twin.ser_params()) if k.startswith(mid + "."))
                for params in (self.twin.ser_params(), self.twin.lp_params()):
                    if key in params:
                        params[key].view(-1)[0] = float("nan")
        xl, xs = self._x(x)
        ys = both("ser", lambda: self.twin.ser_forward(xs))
        yl = both("lp", lambda: self.twin.lp_forward(self._shard(xl)))
        if ys is None or yl is None:
            return
        self._out(yl, ys)
        v = self._w(ys, x)
        both("ser", lambda: self.ser_loss(ys, v).backward())
        both("lp", lambda: self.lp_loss(yl, v).backward())
        both("lp", self._average)
        # module hooks make the forward run the serial pipeline (mgrit.nn.chains.contract): serial
        # semantics, NaN gradients without a verdict as in serial PyTorch; no MGRIT solve
        if self.spec["levels"] > 1 and not (self.hooks and not self.twin.gru):
            solves = [self.twin.lp] if self.twin.gru else list(self.twin.lp.segments)
            for s in solves:
                for what in ("last_backward",) if vjp_only else ("last_forward", "last_backward"):
                    if getattr(getattr(s, what), "converged", False):
                        self.problems.append(f"{what} with NaN reported converged=True")


def _counter(counts: dict, name: str):
    def hook(module, args, out):
        counts[name] += 1
    return hook


def _replaced(p: nn.Parameter) -> nn.Parameter:
    with torch.no_grad():
        return nn.Parameter(p.detach() * 0.9 + 0.01, requires_grad=p.requires_grad)
