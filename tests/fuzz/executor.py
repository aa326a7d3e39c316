"""Run one program on the layer-parallel model and its serial twin; compare after every action.

:func:`run_program` (every rank of ``comm`` calls it with the same program) returns the same
verdict on every rank: ``{"status", "step", "kind", "message"}`` with status

* ``ok``: every action ran on both sides and every comparison held;
* ``fail``: a comparison failed (values, ``.grad`` presence or values, ``requires_grad``,
  hook call counts, checkpoint keys), ranks disagreed (an exception on some ranks only), or
  the layer-parallel side accepted what serial PyTorch refused, or a refusal did not name its
  reason (autocast);
* ``refused``: serial ran, the layer-parallel side raised on every rank (a clear refusal is
  allowed by the project's standards; the program ends there);
* ``stopped``: both sides raised (the program was invalid from there on, e.g. a shrunk one).

Comparisons (float64, exact-mode solves to 1e-13): ``|a - b|_max <= tol * max(1, |b|_max)``
with ``tol = 1e-9`` by default; NaN must sit where serial has NaN. After every action: this
rank's parameters by global key (values, ``requires_grad``, ``.grad``) and hook counts; after
forwards the output on the rank holding it; after backwards the input gradient where it lives.
Autocast (``bfloat16``) leaves float64 tensors alone, so in this exact mode serial autocast is
a no-op: the layer-parallel side must equal it, or refuse naming autocast. The float32/bf16
numerics of issue 22 item 7 are out of reach of a 1e-9 comparison (not checked here).
"""
from __future__ import annotations

import contextlib

import torch
from mpi4py import MPI

from mgrit.parallel import GradientBuckets, ProcessGrid

from .model_actions import ModelActions
from .paths_autograd import AutogradPaths
from .nets import Twin, input_shape

B = 4  # batch
TOL = 1e-9
NEEDS_WORD = {"forward:autocast": "autocast"}  # a refusal of these must name the reason


def clip_layer_parallel(twin: Twin, max_norm: float) -> None:
    """Gradient clipping on the layer-parallel side: the library's global-norm helper
    ``mgrit.parallel.clip_grad_norm_`` (issue 22 item 10, branch h2) where it exists; on main,
    which has none, PyTorch's habit (each rank clips by its own norm: the item-10 bug)."""
    try:
        from mgrit.parallel import clip_grad_norm_
    except ImportError:
        torch.nn.utils.clip_grad_norm_(twin.lp.parameters(), max_norm)
        return
    params = list(twin.lp.parameters())
    clip_grad_norm_(params, max_norm, twin.comm, replicated=params if twin.gru else ())


def rand(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def differ(a, b, tol=TOL, what="") -> str | None:
    """Why ``a`` (layer-parallel) is not ``b`` (serial), or None."""
    if a is None or b is None:
        return None if a is None and b is None else f"{what}: {_none(a)} vs serial {_none(b)}"
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return f"{what}: shape {tuple(a.shape)} vs serial {tuple(b.shape)}"
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return f"{what}: NaN at {int(na.sum())} entries vs serial {int(nb.sum())}"
    a, b = a[~nb], b[~nb]
    if a.numel() == 0:
        return None
    err, scale = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
    return None if err <= tol * scale else f"{what}: max err {err:.3e} (scale {scale:.3g})"


def _none(t):
    return "None" if t is None else "a tensor"


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"


class Run(ModelActions, AutogradPaths):
    """The state of one program: twin, pending outputs, hooks, optimizers. With ``spec["dp"]
    == 2`` on an even number of ranks: 2 data-parallel replicas (a :class:`ProcessGrid`), each
    running its half of every batch, gradients averaged by :class:`GradientBuckets` after each
    backward (built with each new optimizer, as a ``Trainer`` builds them); the serial loss is
    then divided by the replica count (the averaged gradient is that of the mean)."""

    def __init__(self, spec: dict, comm: MPI.Comm):
        self.spec, self.grid, self.R, self.r = spec, None, 1, 0
        if spec.get("dp", 1) == 2 and comm.size % 2 == 0:
            self.grid = ProcessGrid(comm, data_parallel=2)
            comm, self.R, self.r = self.grid.layer_comm, 2, self.grid.data_rank
        self.comm = comm
        self.twin = Twin(spec, comm)
        self.pending = []  # (lp out, serial out, lp x, serial x)
        self.hooks = []  # (lp handles, serial handles)
        self.counts = {"lp": {}, "ser": {}}
        self.opt_cfg = {"kind": "sgd", "lr": 0.1, "momentum": 0.0, "wd": 0.0}
        self._new_opts()
        self.problems: list = []

    # -- helpers ---------------------------------------------------------------------------
    def _opt(self, params):
        c = self.opt_cfg
        if c["kind"] == "adam":
            return torch.optim.Adam(params, lr=c["lr"], weight_decay=c["wd"])
        return torch.optim.SGD(params, lr=c["lr"], momentum=c["momentum"], weight_decay=c["wd"])

    def _new_opts(self, buckets=True):
        self.opt_lp = self._opt(list(self.twin.lp.parameters()))
        self.opt_ser = self._opt(list(self.twin.ser.parameters()))
        if self.grid is not None and buckets:
            try:  # the module itself, so the buckets can follow it (h2's item-4 fix) ...
                self.buckets = GradientBuckets(self.twin.lp, self.grid.data_comm)
            except TypeError:  # ... main takes parameters only (and refuses a module)
                self.buckets = GradientBuckets(self.twin.lp.parameters(), self.grid.data_comm)

    def _average(self):
        if self.grid is not None:
            self.buckets.average()

    def _shard(self, t):
        """This replica's rows of a global batch."""
        n = t.shape[0] // self.R
        return t[self.r * n:(self.r + 1) * n]

    def _reduce(self, g, mean=True):
        """A tensor summed (``mean``: averaged) over the replicas."""
        if self.grid is None or g is None:
            return g
        g = g.detach().clone()
        self.grid.data_comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
        return g / self.R if mean else g

    def free(self):
        if self.grid is not None:
            self.grid.free()

    def check(self, a, b, what):
        why = differ(a, b, what=what)
        if why:
            self.problems.append(why)

    def compare_state(self):
        lp, ser = self.twin.lp_params(), self.twin.ser_params()
        for k, p in lp.items():
            q = ser.get(k)
            if q is None:
                self.problems.append(f"parameter key {k!r} is not a key of the serial model")
                continue
            self.check(p, q, f"parameter {k}")
            if p.requires_grad != q.requires_grad:
                self.problems.append(f"{k}: requires_grad {p.requires_grad} vs {q.requires_grad}")
            self.check(p.grad, q.grad, f"{k}.grad")
        for name, n in sorted(self.counts["lp"].items()):
            m = self.counts["ser"].get(name, 0)
            if n != m:
                self.problems.append(f"hook on {name} ran {n} times, serial {m}")

    def _x(self, seed, rows=B):
        x = rand(rows, *input_shape(self.spec["kind"], self.spec), seed=seed)
        return x.clone().requires_grad_(True), x.clone().requires_grad_(True)

    def _w(self, out, seed, j=0):
        return rand(*out.shape, seed=seed + j)

    @staticmethod
    def _mode(mode):
        return {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
                "inference": torch.inference_mode,
                "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[mode]()

    def _out(self, a, b, what="output"):
        if self.twin.holds_output:
            self.check(a, self._shard(b), what)

    def _xgrad(self, xl, xs, what="input.grad"):
        g = self.twin.lp_x_grad(xl)
        if not isinstance(g, str):  # replicas fill their rows; serial's loss is the mean
            self.check(self._reduce(g), xs.grad, what)

    def lp_loss(self, out, w):
        return self.twin.lp_loss(out, self._shard(w))

    def ser_loss(self, out, w):
        return self.twin.ser_loss(out, w) / self.R

    # -- actions: each runs ``ser`` (serial) then ``lp`` via ``both`` --------------------------
    def a_forward(self, both, x, mode):
        xl, xs = self._x(x)
        with self._mode(mode):
            ys = both("ser", lambda: self.twin.ser_forward(xs))
        with self._mode(mode):
            yl = both("lp", lambda: self.twin.lp_forward(self._shard(xl)))
        if yl is not None and ys is not None:
            self._out(yl, ys)
            if mode in ("grad", "autocast"):
                self.pending.append((yl, ys, xl, xs))

    def a_backward(self, both, i, w, retain, all):
        if not self.pending:
            return
        entries = self.pending if all else [self.pending[i % len(self.pending)]]
        ws = [self._w(e[1], w, j) for j, e in enumerate(entries)]
        both("ser", lambda: sum(self.ser_loss(e[1], v) for e, v in zip(entries, ws))
             .backward(retain_graph=retain))
        both("lp", lambda: sum(self.lp_loss(e[0], v) for e, v in zip(entries, ws))
             .backward(retain_graph=retain))
        both("lp", self._average)
        for e in entries:
            self._xgrad(e[2], e[3])
        if not retain:
            self.pending = [e for e in self.pending if not any(e is f for f in entries)]

    def a_autograd_grad(self, both, i, w, retain):
        if not self.pending:
            return
        yl, ys, xl, xs = self.pending[i % len(self.pending)]
        v = self._w(ys, w)
        keys = [k for k, p in sorted(self.twin.lp_params().items()) if p.requires_grad]
        sp = self.twin.ser_params()
        gs = both("ser", lambda: torch.autograd.grad(self.ser_loss(ys, v),
                                                     [xs] + [sp[k] for k in keys if k in sp],
                                                     retain_graph=retain, allow_unused=True))
        lp = self.twin.lp_params()
        gl = both("lp", lambda: torch.autograd.grad(self.lp_loss(yl, v),
                                                    [xl] + [lp[k] for k in keys],
                                                    retain_graph=retain, allow_unused=True))
        if gs is not None and gl is not None:
            if self.twin.holds_input and not self.twin.gru:
                self.check(self._reduce(gl[0]), gs[0], "autograd.grad input")
            for k, a, b in zip(keys, gl[1:], gs[1:]):
                z = torch.zeros_like(sp[k])  # allow_unused: None and zeros are the same
                self.check(self._reduce(z if a is None else a), z if b is None else b,
                           f"autograd.grad {k}")
        if not retain:
            self.pending = [e for e in self.pending if e[0] is not yl]

    def a_accumulate(self, both, x, w, chunks):
        """Micro-batches: forward and backward each chunk of a batch of 12 (F1 B1 F2 B2 ...)."""
        xl, xs = self._x(x, rows=12)
        for j, (cl, cs) in enumerate(zip(xl.chunk(chunks), xs.chunk(chunks))):
            ys = both("ser", lambda: self.twin.ser_forward(cs))
            yl = both("lp", lambda: self.twin.lp_forward(self._shard(cl)))
            if ys is None or yl is None:
                return
            self._out(yl, ys, f"micro-batch {j} output")
            v = self._w(ys, w, j)
            both("ser", lambda: self.ser_loss(ys, v).backward())
            both("lp", lambda: self.lp_loss(yl, v).backward())
            both("lp", self._average)
        self._xgrad(xl, xs)

    def a_zero_grad(self, both, none):
        both("ser", lambda: self.opt_ser.zero_grad(set_to_none=none))
        both("lp", lambda: self.opt_lp.zero_grad(set_to_none=none))

    def a_train(self, both, on):
        both("ser", lambda: self.twin.ser.train(on))
        both("lp", lambda: self.twin.lp.train(on))

    def a_freeze(self, both, p, on):
        keys = sorted(self.twin.ser_params())
        k = keys[p % len(keys)]
        both("ser", lambda: self.twin.ser_params()[k].requires_grad_(on))
        lp = self.twin.lp_params()
        if k in lp:
            both("lp", lambda: lp[k].requires_grad_(on))

    def a_opt_new(self, both, **cfg):
        self.opt_cfg = cfg
        self._new_opts()

    def a_opt_step(self, both):
        both("ser", self.opt_ser.step)
        both("lp", self.opt_lp.step)
        self.pending = []

    def a_clip(self, both, max_norm):
        both("ser", lambda: torch.nn.utils.clip_grad_norm_(self.twin.ser.parameters(), max_norm))
        both("lp", lambda: clip_layer_parallel(self.twin, max_norm))

def run_program(program: dict, comm: MPI.Comm, tol: float = TOL) -> dict:
    """Run ``program`` on ``comm`` (collective); the same verdict on every rank."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _run(program, comm)
    finally:
        torch.set_default_dtype(old)


def _run(program, comm):
    run = None
    try:
        run = Run(program["net"], comm)
        err = None
    except Exception as exc:  # noqa: BLE001 -- a build failure is a verdict, not a crash
        err = _short(exc)
    errs = comm.allgather(err)
    if any(errs):
        status = "fail" if not all(errs) else "refused"
        return {"status": status, "step": -1, "kind": "build", "message": str(errs)}
    try:
        return _actions(run, program, comm)
    finally:
        run.free()


def _actions(run, program, comm):
    for step, (kind, args) in enumerate(program["actions"]):
        exc = {"ser": None, "lp": None}

        def both(side, fn):
            if exc[side] is not None:
                return None
            try:
                return fn()
            except Exception as e:  # noqa: BLE001
                exc[side] = _short(e)
                return None

        run.problems = []
        getattr(run, f"a_{kind}")(both, **args)
        if exc["lp"] is None and exc["ser"] is None:
            run.compare_state()
        mine = (exc["ser"], exc["lp"], run.problems[:3])
        every = comm.allgather(mine)
        verdict = _decide(kind, args, every)
        if verdict is not None:
            return dict(verdict, step=step, kind=kind)
    return {"status": "ok", "step": len(program["actions"]), "kind": "", "message": ""}


def _decide(kind, args, every):
    lp_exc = [e[1] for e in every]
    ser_exc = every[0][0]
    problems = [f"rank {r}: {p}" for r, e in enumerate(every) for p in e[2]]
    if problems and not ser_exc and not any(lp_exc):  # (after an exception: its verdict)
        return {"status": "fail", "message": "; ".join(problems[:4])}
    if any(lp_exc) and not all(lp_exc):
        return {"status": "fail", "message": f"ranks disagree: exceptions {lp_exc}"}
    if ser_exc and not lp_exc[0]:
        return {"status": "fail", "message": f"serial raised {ser_exc}; layer-parallel did not"}
    if ser_exc:
        return {"status": "stopped", "message": f"both raised: {ser_exc} | {lp_exc[0]}"}
    if lp_exc[0]:
        if kind == "nan_backward":
            return {"status": "stopped", "message": f"NaN refused: {lp_exc[0]}"}
        word = NEEDS_WORD.get(f"{kind}:{args.get('mode')}")
        # the library's NaN refusal (a non-finite input state after a NaN step) is its own
        # reason in every mode: it need not name autocast (seeds 400157, 700222)
        nan_refusal = "nan or inf" in lp_exc[0].lower()
        if word and word not in lp_exc[0].lower() and not nan_refusal:
            return {"status": "fail", "message": f"refusal does not name {word}: {lp_exc[0]}"}
        return {"status": "refused", "message": lp_exc[0]}
    return None
