"""Exact mean and variance of floating-point data, rounded once.

The inputs are binary floats, so their mean and variance are rational numbers.
They are computed here with Python integers and rounded to the target format
once, with round-half-to-even, overflow to inf, and results below the smallest
normal number flushed to zero (the contract of docs/algorithm.md, section 8).
Subnormal inputs count as zero, as on CPUs that flush them.
"""

from fractions import Fraction

import numpy as np

_INFO = {
    np.dtype(np.float32): (24, -126, 128),
    np.dtype(np.float64): (53, -1022, 1024),
}


def _exact_ints(values):
    """Integers M_i and a common exponent E with values == M_i * 2**E."""
    values = [float(v) for v in values]
    parts = []
    for v in values:
        if v == 0.0:
            parts.append((0, 0))
            continue
        m, e = np.frexp(v)  # v == m * 2**e, 0.5 <= |m| < 1, exact in float64
        parts.append((int(m * 2.0**53), int(e) - 53))
    e_min = min((e for m, e in parts if m), default=0)
    return [m << (e - e_min) if m else 0 for m, e in parts], e_min


def round_rational(value, dtype):
    """Round a Fraction to `dtype` once: nearest, ties to even, FTZ, overflow to inf."""
    precision, emin, emax = _INFO[np.dtype(dtype)]
    ftype = np.dtype(dtype).type
    if value == 0:
        return ftype(0.0)
    sign = -1 if value < 0 else 1
    num, den = abs(value.numerator), value.denominator
    e = num.bit_length() - den.bit_length()
    if Fraction(num, den) < Fraction(2) ** e:
        e -= 1  # now 2**e <= |value| < 2**(e+1)
    shift = precision - 1 - e
    scaled = Fraction(num * 2**shift, den) if shift >= 0 else Fraction(num, den * 2**-shift)
    q, r = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * r
    if twice > scaled.denominator or (twice == scaled.denominator and q % 2 == 1):
        q += 1
    result = Fraction(q) / Fraction(2) ** shift if shift >= 0 else Fraction(q * 2**-shift)
    if result >= Fraction(2) ** emax:
        return ftype(sign * np.inf)
    if result < Fraction(2) ** emin:
        return ftype(0.0)
    return ftype(sign * float(result))


def exact_moments(values, dtype, ddof=0):
    """(mean, variance) of one slice of finite floats, each rounded once to dtype."""
    tiny = np.finfo(dtype).tiny
    values = [0.0 if abs(float(v)) < tiny else float(v) for v in np.asarray(values).ravel()]
    n = len(values)
    if n == 0 or not all(np.isfinite(values)):
        raise ValueError("exact_moments takes a non-empty slice of finite values")
    ints, e = _exact_ints(values)
    s1 = sum(ints)
    s2 = sum(m * m for m in ints)
    scale = Fraction(2) ** e
    mean = round_rational(Fraction(s1, n) * scale, dtype)
    if n - ddof <= 0:
        return mean, np.dtype(dtype).type(np.nan)
    var = Fraction(n * s2 - s1 * s1, n * (n - ddof)) * scale * scale
    return mean, round_rational(var, dtype)


def exact_value(values, dtype, ddof=0):
    """The unrounded variance and mean of a slice, as Fractions (for ulp errors)."""
    tiny = np.finfo(dtype).tiny
    values = [0.0 if abs(float(v)) < tiny else float(v) for v in np.asarray(values).ravel()]
    n = len(values)
    ints, e = _exact_ints(values)
    s1, s2 = sum(ints), sum(m * m for m in ints)
    scale = Fraction(2) ** e
    return Fraction(s1, n) * scale, Fraction(n * s2 - s1 * s1, n * (n - ddof)) * scale * scale


def ulp_error(computed, exact, dtype):
    """|computed - exact| in units of the last place of `exact` in `dtype`."""
    precision, emin, _ = _INFO[np.dtype(dtype)]
    computed = float(computed)
    if not np.isfinite(computed):
        return float("inf")
    diff = abs(Fraction(computed) - exact)
    mag = abs(exact)
    if mag == 0:
        return 0.0 if diff == 0 else float("inf")
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if mag < Fraction(2) ** e:
        e -= 1
    e = max(e, emin)
    return float(diff / Fraction(2) ** (e - precision + 1))
