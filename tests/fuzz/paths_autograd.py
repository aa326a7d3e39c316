"""The fuzzer's paths through PyTorch's transforms (issue 36 items 1, 7, 8, 11, 13, 15): a mixin
of :class:`tests.fuzz.executor.Run` and the generator's part for them (same conventions as
:mod:`.model_actions`: each action runs the serial side, then the layer-parallel side, through
``both(side, fn)``).

Features (names of :data:`~tests.fuzz.program.FEATURES`) and their actions:

* ``input_grad`` -- ``input_grad``: a fresh forward with the input requiring grad on every rank,
  then its gradient with respect to the input *only*: ``autograd.grad(loss, x)``, with
  ``allow_unused=True``, ``loss.backward(inputs=[x])`` or ``autograd.functional.vjp``. Serial's
  gradient on the rank holding the input, zeros (or ``None`` with ``allow_unused``) elsewhere;
  no parameter ``.grad`` touched.
* ``functional_call`` -- ``functional_call``: ``torch.func.functional_call`` with fast weights
  ``p * scale + shift`` (differentiable in the parameters) for every parameter of this rank,
  forward and backward on both sides: output and every parameter's ``.grad``.
* ``forward_ad`` -- ``forward_ad`` (a ``forward_ad`` dual input) and ``func_transform``
  (``torch.func.vmap`` / ``jvp`` / ``jacrev``): serial computes it; the layer-parallel side
  must refuse on every rank with a ValueError naming the transform (checked here, so the
  program goes on: the network must work after a refusal).
* ``compile_net`` -- ``compiled_forward``: a forward through ``torch.compile(net,
  backend=...)`` of the whole network (eager / aot_eager backends), kept for later backwards
  like a forward. Campaign only (dynamo costs seconds per program).
"""
from __future__ import annotations

import torch
from mpi4py import MPI
from torch.autograd import forward_ad as fwAD
from torch.func import functional_call

FEATURES = frozenset({"input_grad", "functional_call", "forward_ad", "compile_net"})
CAMPAIGN_ONLY = frozenset({"compile_net"})
_KINDS = {"input_grad": ("input_grad",), "functional_call": ("functional_call",),
          "forward_ad": ("forward_ad", "func_transform"), "compile_net": ("compiled_forward",)}
#: what a refusal must name, per transform
_WORDS = {"forward_ad": "forward-mode AD", "vmap": "torch.func.vmap", "jvp": "torch.func.jvp",
          "jacrev": "torch.func.grad"}


def kinds(enabled) -> list:
    """Action kinds of the enabled features (each twice: looked for)."""
    return [k for f in sorted(FEATURES & enabled) for k in _KINDS[f] for _ in range(2)]


def action_args(c, kind: str, state: dict) -> dict | None:
    """Arguments of an action ``kind`` of this module (``None``: not one of them)."""
    if kind == "input_grad":
        return {"x": c.int(0, 999), "w": c.int(0, 999),
                "how": c.pick(["grad", "unused", "inputs", "vjp"])}
    if kind == "functional_call":
        return {"x": c.int(0, 999), "w": c.int(0, 999), "scale": c.pick([1.0, 0.9, 1.2]),
                "shift": c.pick([0.0, 0.01])}
    if kind == "forward_ad":
        return {"x": c.int(0, 999)}
    if kind == "func_transform":
        return {"x": c.int(0, 999), "which": c.pick(["vmap", "jvp", "jacrev"])}
    if kind == "compiled_forward":
        state["pending"] += 1
        return {"x": c.int(0, 999), "backend": c.pick(["eager", "aot_eager"])}
    return None


class AutogradPaths:
    """Actions of the module docstring (a mixin of :class:`tests.fuzz.executor.Run`)."""

    def a_input_grad(self, both, x, w, how):
        xl, xs = self._x(x)
        ys = both("ser", lambda: self.twin.ser_forward(xs))
        if how != "vjp":  # (vjp runs its own forward)
            yl = both("lp", lambda: self.twin.lp_forward(self._shard(xl)))
            if ys is None or yl is None:
                return
        elif ys is None:
            return
        v = self._w(ys, w)
        gs = both("ser", lambda: torch.autograd.grad(self.ser_loss(ys, v), xs)[0])
        if how == "vjp":
            def lp():
                t = self._shard(xl).detach()
                _, g = torch.autograd.functional.vjp(
                    lambda u: self.lp_loss(self.twin.lp_forward(u), v), t,
                    torch.ones((), dtype=torch.float64))
                full = torch.zeros_like(xl)  # the replica's rows of the whole batch
                n = t.shape[0]
                full[self.r * n:(self.r + 1) * n] = g
                return [full]
        elif how == "inputs":
            def lp():
                self.lp_loss(yl, v).backward(inputs=[xl])
                return [xl.grad]
        else:
            def lp():
                return list(torch.autograd.grad(self.lp_loss(yl, v), xl,
                                                allow_unused=how == "unused"))
        got = both("lp", lp)  # [gradient]; None: an exception (the executor's verdict)
        if gs is None or got is None:
            return
        gl = got[0]
        if gl is None and not self.twin.gru and (how != "unused" or self.twin.holds_input):
            self.problems.append(f"input gradient ({how}) is None on the layer-parallel side")
            return
        if self.twin.gru:  # each rank fills its time rows: the sum over the ranks
            gl = torch.zeros_like(xl) if gl is None else gl.detach().clone()
            self.comm.Allreduce(MPI.IN_PLACE, gl.numpy(), op=MPI.SUM)
            self.check(self._reduce(gl), gs, f"input gradient ({how})")
        elif self.twin.holds_input:
            self.check(self._reduce(gl), gs, f"input gradient ({how})")
        elif gl is not None and float(gl.abs().max()) != 0.0:
            self.problems.append(f"input gradient ({how}) off the input's rank is not zero")

    def a_functional_call(self, both, x, w, scale, shift):
        xl, xs = self._x(x)
        fast_s = {n: p * scale + shift for n, p in self.twin.ser_params().items()}
        local = {n: p * scale + shift for n, p in self.twin.lp.named_parameters()}
        ys = both("ser", lambda: functional_call(self.twin.ser, fast_s, (xs,)))
        yl = both("lp", lambda: functional_call(self.twin.lp, local, (self._shard(xl),)))
        if ys is None or yl is None:
            return
        self._out(yl, ys, "functional_call output")
        v = self._w(ys, w)
        both("ser", lambda: self.ser_loss(ys, v).backward())
        both("lp", lambda: self.lp_loss(yl, v).backward())
        both("lp", self._average)
        self._xgrad(xl, xs, "functional_call input.grad")

    def _expect_refusal(self, both, what, fn, ser_ok):
        """The layer-parallel side refuses ``fn`` naming ``what``; where serial raised too
        (``ser_ok`` false), the refusal is left to the executor (both raised: stopped)."""
        self.counts["ser"].update(self._ser_counts)  # the refused call ran no layer: serial's
        if not ser_ok:                               # hook calls of it are not compared
            both("lp", fn)
            return

        def lp():
            try:
                fn()
            except ValueError as exc:
                if _WORDS[what] not in str(exc):
                    self.problems.append(f"the refusal of {what} does not name "
                                         f"{_WORDS[what]!r}: {str(exc)[:160]}")
                return
            self.problems.append(f"{what} ran on the layer-parallel side (a refusal expected)")
        both("lp", lp)

    def a_forward_ad(self, both, x):
        xl, xs = self._x(x)
        xs, xl = xs.detach(), xl.detach()

        def dual(f, t):
            with fwAD.dual_level():
                return fwAD.unpack_dual(f(fwAD.make_dual(t, torch.ones_like(t)))).tangent
        self._ser_counts = dict(self.counts["ser"])
        ok = both("ser", lambda: dual(self.twin.ser_forward, xs) is not None)
        self._expect_refusal(both, "forward_ad",
                             lambda: dual(self.twin.lp_forward, self._shard(xl)), ok)

    def a_func_transform(self, both, x, which):
        xl, xs = self._x(x)
        xs, xl = xs.detach(), self._shard(xl.detach())

        def run(f, t):
            if which == "vmap":
                return torch.func.vmap(f)(t.unsqueeze(1))
            if which == "jvp":
                return torch.func.jvp(f, (t,), (torch.ones_like(t),))[1]
            return torch.func.jacrev(lambda u: f(u).sum())(t)
        self._ser_counts = dict(self.counts["ser"])
        ok = both("ser", lambda: run(self.twin.ser_forward, xs) is not None)
        self._expect_refusal(both, which, lambda: run(self.twin.lp_forward, xl), ok)

    def a_compiled_forward(self, both, x, backend):
        xl, xs = self._x(x)
        cache = self.__dict__.setdefault("_compiled", {})
        key = (id(self.twin.lp), backend)
        if key not in cache:  # one compiled wrapper per network and backend, as a user keeps
            cache[key] = torch.compile(self.twin.lp, backend=backend)
        ys = both("ser", lambda: self.twin.ser_forward(xs))
        yl = both("lp", lambda: cache[key](self._shard(xl)))
        if yl is not None and ys is not None:
            self._out(yl, ys, f"compiled ({backend}) output")
            self.pending.append((yl, ys, xl, xs))

