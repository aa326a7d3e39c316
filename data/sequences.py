"""Synthetic long-sequence tasks for recurrent networks: the adding problem.

Source: Hochreiter & Schmidhuber, "Long short-term memory", Neural Computation 9 (1997),
experiment 4; in the form of Le, Jaitly & Hinton, "A simple way to initialize recurrent networks
of rectified linear units" (2015) and Arjovsky, Shah & Bengio, "Unitary evolution recurrent
neural networks" (ICML 2016), who use it for sequences of 100 to 750 steps.

Why this task for GRU parallel in time (sequences >= 1,024 steps): only the *final* hidden state
is read (one head on the last time rank, exactly the layer-parallel structure); the answer
depends on two inputs far apart in time, so a model that forgets scores no better than the
constant baseline; the difficulty grows with the length; the baseline is known in closed form
(predicting 1 gives mean squared error ``Var(u_1 + u_2) = 1/6``); and the data is generated from
a seed in O(n T) without any file. (The copy task needs an output at every step, i.e. a loss
spread over all time ranks; the adding problem keeps the loss on one rank.)

Exact definition used here: sequence ``t = 0..T-1`` has two channels, ``x[t, 0] ~ U[0, 1)``
and a marker ``x[t, 1] in {0, 1}`` equal to 1 at exactly two steps, one drawn uniformly in the
first half ``[0, T // 2)`` and one in the second half ``[T // 2, T)``; the target is the sum of
the two marked values (summed in float32). Generation:
``rng = np.random.default_rng(np.random.SeedSequence([seed, stream]))`` (stream 0 = train,
1 = test); ``values = rng.random((n, T))``, then ``first = rng.integers(0, T // 2, n)``,
``second = rng.integers(T // 2, T, n)``.
Inputs float32 ``(n, T, 2)``, targets float32 ``(n,)`` in ``[0, 2)``. No torch is imported.
"""
from __future__ import annotations

import numpy as np

__all__ = ["make_adding_problem", "ADDING_BASELINE_MSE"]

#: Mean squared error of the constant prediction 1 (the variance of a sum of two U[0, 1)).
ADDING_BASELINE_MSE = 1.0 / 6.0


def make_adding_problem(n: int, seq_len: int, seed: int = 0, stream: int = 0):
    """The adding problem (see the module doc for the exact definition).

    Args:
        n: number of sequences (int >= 1).
        seq_len: ``T``, time steps per sequence (int >= 2).
        seed: base seed (int >= 0); ``stream``: 0 = train, 1 = test (any int >= 0).

    Returns:
        ``(x, y)``: float32 arrays ``(n, T, 2)`` and ``(n,)``.

    Raises:
        ValueError: ``n < 1``, ``seq_len < 2`` or a negative/non-integer seed or stream.
    """
    for name, v, low in (("n", n, 1), ("seq_len", seq_len, 2), ("seed", seed, 0),
                         ("stream", stream, 0)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
            raise ValueError(f"{name}={v!r} is not allowed: use an int >= {low}")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(stream)]))
    half = seq_len // 2
    values = rng.random((n, seq_len))
    first = rng.integers(0, half, n)
    second = rng.integers(half, seq_len, n)
    marks = np.zeros((n, seq_len))
    rows = np.arange(n)
    marks[rows, first] = 1.0
    marks[rows, second] = 1.0
    x = np.stack([values, marks], axis=-1).astype(np.float32)
    y = x[rows, first, 0] + x[rows, second, 0]  # float32 sum of the float32 inputs
    return x, y
