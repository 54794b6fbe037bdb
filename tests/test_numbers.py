"""``finite_float32``: a number from outside as the trainer will compute with it, values derived by hand."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from rlvr.platform.numbers import FLOAT32_MAX, finite_float32, is_finite_float32


@pytest.mark.parametrize("value, want", [
    (-1e300, None),  # a finite float64, -inf in float32
    (10 ** 400, None),  # float() raises OverflowError
    (-(10 ** 400), None),
    (3.5e38, None),  # above float32's largest, (2 - 2**-23) * 2**127 = 3.4028234663852886e38
    (True, None),  # a bool is no number here
    ("1", None),  # nor a string
    (None, None),
    (math.nan, None),
    (math.inf, None),
    (-math.inf, None),
    (3.4e38, 3.4e38),  # below the largest: finite in float32
    (FLOAT32_MAX, FLOAT32_MAX),
    (-FLOAT32_MAX, -FLOAT32_MAX),
    (-0.0, -0.0),
    (7, 7.0),
    (-1000.5, -1000.5),
    (np.float32(0.25), 0.25),  # NumPy scalars are real numbers too
    (np.int64(-3), -3.0),
    (Fraction(10 ** 400, 3), None),
])
def test_finite_float32_by_hand(value, want):
    got = finite_float32(value)
    if want is None:
        assert got is None and not is_finite_float32(value)
        return
    assert got == want and type(got) is float and is_finite_float32(value)
    assert math.copysign(1, got) == math.copysign(1, want)  # -0.0 stays -0.0
    assert math.isfinite(float(torch.tensor(got, dtype=torch.float32)))  # what the trainer computes in


def test_what_it_refuses_is_not_finite_in_float32():
    for value in (-1e300, 3.5e38, 1e39):
        assert math.isfinite(value) and not math.isfinite(float(torch.tensor(value, dtype=torch.float32)))
    with pytest.raises(OverflowError):
        float(10 ** 400)
