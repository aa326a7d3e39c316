"""Differential fuzzer (issue 22): random programs of PyTorch user actions, run on the
layer-parallel model and on a serial PyTorch twin with the same weights, compared after every
action in float64 exact mode (solves to 1e-13; comparison ``<= 1e-9`` relative to
``max(1, |serial|)``), on 1, 2 and 3 ranks.

What a program is (:mod:`.program`, :mod:`.nets`): a small network -- dense, conv,
transformer, multi-segment :class:`~mgrit.nn.LayerParallelNet`, or :class:`~mgrit.nn.ParallelGRU`
-- with shipped steps, user step classes, user classes with per-layer buffers or subclasses of
shipped steps; 1 or 2 MGRIT levels; ``l2`` or ``inf`` residual norm. Then 1-12 actions:
forwards (grad, ``no_grad``, ``inference_mode``, autocast) kept for later backwards in any
order, backwards of one or all pending outputs (``retain_graph`` or not), ``autograd.grad``,
micro-batch accumulation, ``zero_grad``, ``train()``/``eval()``, freeze/unfreeze of any
parameter, new optimizers (SGD with momentum and weight decay, Adam) and their steps,
gradient clipping, forward hooks and pre-hooks added/removed (counted, or changing values),
parameters replaced or loaded with ``assign=True``, a checkpoint round trip (gather,
``torch.save``, ``torch.load(weights_only=True)``, load into a new model with other weights),
the gathered weights loaded into the same network on one rank (a checkpoint across rank
counts), a NaN vector-Jacobian product in a middle layer (the same verdict on every rank, no
solve claiming convergence), 2 data-parallel replicas with gradient buckets (at P = 2),
``torch.compile``'d steps.
The verdicts are described in :mod:`.executor`.

Known bugs of main (issue 22 items 1-10) are gated in one place, :mod:`.program`:
``FEATURES`` lists the switchable features, ``KNOWN_BROKEN_ON_MAIN`` (the switch) those main
gets wrong, which CI and the campaign leave out until their fixes are merged and their names
deleted there (``--enable NAME`` or ``all`` adds them to a campaign); ``compile`` is
campaign-only (slow). Regression programs (shrunk findings) are in :mod:`.regressions`.

Hypothesis or home-made: on one rank the programs come from Hypothesis (:mod:`.hypo`:
``st.data()`` feeds the same generator), which gives its shrinking, ``derandomize`` for CI and
readable falsifying examples. On 2-3 ranks every rank must run the *same* program and take the
same shrinking path in lockstep inside one ``mpiexec`` job; Hypothesis's engine draws from its
own RNG and database per process and cannot be driven collectively (and one job per example
would cost 2-3 s of start-up each), so there a seeded ``random.Random`` drives the same
generator on every rank and :func:`.program.shrink` (greedy delta debugging, every candidate
run collectively, verdicts agreed) shrinks failures (:mod:`.driver`).

Commands (from the repository root, venv active)::

    python -m pytest -q tests/test_fuzz.py                      # the CI budget
    python -m tests.fuzz campaign --programs 2000 --ranks 1,2,3  # the long campaign
    python -m tests.fuzz campaign --programs 300 --enable all    # also the known-broken ones
    python -m tests.fuzz replay --ranks 2 '<program json>'       # replay a printed program

The campaign writes ``fuzz-campaign/findings.jsonl`` (seed, ranks, verdict, shrunk program)
and ``summary.json`` (programs and programs per hour per rank count); leave it running in the
background with ``nohup ... &``; ``--hours`` bounds it.
"""
from .program import KNOWN_BROKEN_ON_MAIN  # noqa: F401
