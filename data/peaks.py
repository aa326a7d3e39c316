"""The Peaks classification problem (2-D points, 5 classes).

Source: used by Günther, Ruthotto, Schroder, Cyr & Gauger, "Layer-parallel
training of deep residual neural networks", SIAM J. Math. Data Sci. 2 (2020),
with 5,000 training and 200 validation points; introduced in Haber & Ruthotto,
"Stable architectures for deep neural networks", Inverse Problems 34 (2018),
reference implementation ``setupPeaks.m`` in the Meganet.m toolbox.

Exact definition used here:

* MATLAB's ``peaks`` function
  ``f(x, y) = 3 (1-x)^2 exp(-x^2 - (y+1)^2)
  - 10 (x/5 - x^3 - y^5) exp(-x^2 - y^2) - 1/3 exp(-(x+1)^2 - y^2)``.
* Level values (as in ``setupPeaks.m``): ``f`` is evaluated on MATLAB's
  ``peaks(256)`` grid, ``meshgrid(linspace(-3, 3, 256))``; with ``m`` and ``M``
  its minimum and maximum, ``levels[k] = m + k (M - m) / 5`` for k = 0..5,
  i.e. approximately ``[-6.5497, -3.6187, -0.6877, 2.2433, 5.1744, 8.1054]``
  (:data:`LEVELS`, computed at import).
* Class of a point: ``c = k`` if ``levels[k] < f <= levels[k+1]``; values
  below ``levels[1]`` are class 0 and values above ``levels[4]`` class 4
  (``np.searchsorted(levels[1:5], f, side="left")``).
* Points are uniform in ``[-3, 3]^2`` conditioned on their class, with equal
  class sizes (``setupPeaks.m`` draws the same number of points per class;
  uniform points alone would be 72 % class 2).  Generation: with
  ``rng = np.random.default_rng(np.random.SeedSequence([seed, stream]))``
  (stream 0 = train, 1 = validation), draw blocks of
  ``max(20 n, 100000)`` points ``rng.uniform(-3, 3, (m, 2)).astype(float32)``
  (labels are computed from these float32 values), keep the first
  ``n_k`` points of each class ``k`` in draw order (``n_k = n // 5`` plus one
  for the first ``n % 5`` classes), until every class is full; then shuffle
  the rows with ``rng.permutation(n)``.

Inputs are float32 ``(n, 2)`` in ``[-3, 3]``, labels int64 ``(n,)`` in 0..4.
"""

from __future__ import annotations

import numpy as np

from .split import Split

__all__ = ["peaks", "LEVELS", "NUM_CLASSES", "peaks_labels", "make_peaks", "load_peaks"]

NUM_CLASSES = 5
GRID_SIZE = 256


def peaks(x, y):
    """MATLAB's ``peaks`` function evaluated elementwise (float64)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    return (3.0 * (1.0 - x) ** 2 * np.exp(-x ** 2 - (y + 1.0) ** 2)
            - 10.0 * (x / 5.0 - x ** 3 - y ** 5) * np.exp(-x ** 2 - y ** 2)
            - 1.0 / 3.0 * np.exp(-(x + 1.0) ** 2 - y ** 2))


def _levels() -> np.ndarray:
    t = np.linspace(-3.0, 3.0, GRID_SIZE)
    xx, yy = np.meshgrid(t, t)
    f = peaks(xx, yy)
    lo, hi = f.min(), f.max()
    return lo + (hi - lo) * np.arange(NUM_CLASSES + 1) / NUM_CLASSES


LEVELS = _levels()


def peaks_labels(points: np.ndarray) -> np.ndarray:
    """Class 0..4 of each point ``(n, 2)`` by the level bands in :data:`LEVELS` (int64)."""
    points = np.asarray(points, dtype=np.float64)
    f = peaks(points[:, 0], points[:, 1])
    return np.searchsorted(LEVELS[1:NUM_CLASSES], f, side="left").astype(np.int64)


def make_peaks(num_samples: int, seed: int = 0, stream: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Generate ``num_samples`` class-balanced Peaks points (see module docstring).

    Args:
        num_samples: number of points, >= 1.
        seed: non-negative int.
        stream: non-negative int selecting an independent stream (0 train, 1 validation).

    Returns:
        ``(x, y)``: float32 ``(n, 2)`` and int64 ``(n,)``.
    """
    if int(num_samples) < 1:
        raise ValueError(f"num_samples={num_samples} must be >= 1")
    if int(seed) < 0 or int(stream) < 0:
        raise ValueError(f"seed={seed} and stream={stream} must be non-negative integers")
    n = int(num_samples)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), int(stream)]))
    want = np.full(NUM_CLASSES, n // NUM_CLASSES)
    want[: n % NUM_CLASSES] += 1
    got = [np.empty((0, 2), dtype=np.float32) for _ in range(NUM_CLASSES)]
    block = max(20 * n, 100_000)
    while any(len(g) < w for g, w in zip(got, want)):
        pts = rng.uniform(-3.0, 3.0, size=(block, 2)).astype(np.float32)
        lab = peaks_labels(pts)
        for k in range(NUM_CLASSES):
            need = want[k] - len(got[k])
            if need > 0:
                got[k] = np.concatenate([got[k], pts[lab == k][:need]])
    x = np.concatenate(got)
    y = np.repeat(np.arange(NUM_CLASSES, dtype=np.int64), want)
    order = rng.permutation(n)
    return x[order], y[order]


def load_peaks(seed: int = 0, num_train: int = 5000, num_val: int = 200):
    """Train (stream 0) and validation (stream 1) Peaks splits as raw :class:`~data.split.Split`."""
    names = [f"level{k}" for k in range(NUM_CLASSES)]
    src = (f"peaks level sets (Guenther et al. 2020; Haber & Ruthotto 2018), seed={seed}, "
           f"levels={[round(float(v), 6) for v in LEVELS]}")
    xtr, ytr = make_peaks(num_train, seed, 0)
    xva, yva = make_peaks(num_val, seed, 1)
    return (Split(x=xtr, y=ytr, num_classes=NUM_CLASSES, class_names=names, name="peaks", source=src, split="train"),
            Split(x=xva, y=yva, num_classes=NUM_CLASSES, class_names=names, name="peaks", source=src, split="test"))
