"""The one least-squares routine of the cost-model fits: non-negative coefficients that minimise
the squared *relative* error of measured times (``scipy.optimize.nnls``).

Every fit in :mod:`verl_ext.perf` (grid, trace, step log) models a measured time as a
non-negative combination of counted columns (steps, tokens, KV tokens, ...). Relative errors
weigh a 20 ms window like a 2 s one, and scaling the columns to unit norm keeps the solver well
conditioned when columns differ by orders of magnitude (steps vs. KV tokens).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from scipy.optimize import nnls


def relative_nnls(columns: Sequence[np.ndarray], y: np.ndarray, target: Optional[np.ndarray] = None) -> np.ndarray:
    """``x >= 0`` minimising ``sum_i ((sum_j x_j columns[j][i] - target[i]) / y[i]) ** 2``.

    ``y``: the measured times (all > 0), the scale of each residual; ``target``: what the
    columns must explain (default ``y``; a fit that pins part of the time passes the rest)."""
    y = np.asarray(y, dtype=np.float64)
    if not (y > 0).all():
        raise ValueError("relative least squares needs positive measured times")
    A = np.stack([np.asarray(c, dtype=np.float64) for c in columns], axis=1) / y[:, None]
    b = (y if target is None else np.asarray(target, dtype=np.float64)) / y
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    x, _ = nnls(A / scale, b)
    return x / scale
