"""A number from outside (a server's answer, a peer's file, a checkpoint, a reward function) as the trainer will use it.

JSON's numbers are unbounded: ``-1e300`` is a finite float64 that becomes ``-inf`` in a float32 tensor, and a
401-digit integer raises OverflowError on ``float()``. Every number that crosses into rlvr from outside passes
through ``finite_float32`` first, so "finite" means finite in the dtype the trainer computes in, and a number too
large for any float is refused like any other bad value, never a traceback.
"""

from __future__ import annotations

import math
import numbers

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32: (2 - 2**-23) * 2**127


def finite_float32(value: object) -> float | None:
    """``value`` as a Python float when it is a real number (int, float, a NumPy scalar; never a bool or a string)
    that is finite in float32, else None. Never raises: an integer too large for a float, NaN, ±inf and
    |x| > float32's largest finite value all give None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        x = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return x if math.isfinite(x) and abs(x) <= FLOAT32_MAX else None


def is_finite_float32(value: object) -> bool:
    return finite_float32(value) is not None
