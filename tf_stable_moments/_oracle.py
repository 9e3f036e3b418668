"""Exact mean and variance of floating-point data, rounded once: the specification.

This module is the specification of what `tf_stable_moments.moments` and
`jax_kernel.moments` return; the kernels are tested bit for bit against it.
The inputs are binary floats, so their mean and variance are rational numbers.
They are computed here with Python integers and Fractions only (each float is
split exactly into an integer mantissa and an exponent; no rounding arithmetic on
the data) and rounded to the target format once, with
round-half-to-even, overflow to inf, and results below the smallest normal
number flushed to zero (the contract of docs/algorithm.md, section 8).
Subnormal inputs count as zero, as on CPUs that flush them.

Formats (`_INFO`: precision, smallest normal exponent, overflow exponent):

* float32 (24, -126, 128), float64 (53, -1022, 1024);
* float16 (11, -14, 16) and bfloat16 (8, -126, 128; ``ml_dtypes.bfloat16``,
  present when ml_dtypes is installed, as it is with jax).  Their mean and
  variance are rounded once, directly to the 16-bit format (not to float32 first).

For one slice x_1 .. x_n and a non-negative integer ddof:

* an input whose magnitude is below the smallest normal number of its format
  counts as 0;
* mean = (1/n) sum x_i and var = (1/(n - ddof)) sum (x_i - mean)**2, exactly;
* each is rounded once: nearest, ties to even; a rounded magnitude of at least
  2**emax is inf, one below 2**emin (the smallest normal) is 0;
* var is NaN when n - ddof <= 0.

Complex slices (`exact_complex_moments`, complex64 / complex128 with float32 /
float64 parts): each part of the mean is the exact mean of that part rounded once
to the part format, and var = sum |z_i - mean|**2 / (n - ddof) (the real
numerators of both parts added exactly) rounded once; parts below the smallest
normal number of the part format count as 0.
"""

from fractions import Fraction

import numpy as np

_INFO = {
    np.dtype(np.float32): (24, -126, 128),
    np.dtype(np.float64): (53, -1022, 1024),
    np.dtype(np.float16): (11, -14, 16),
}
try:  # bfloat16 comes with ml_dtypes (installed with jax); the module imports without it
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - depends on the environment
    _ml_dtypes = None
else:
    _INFO[np.dtype(_ml_dtypes.bfloat16)] = (8, -126, 128)

_COMPLEX_PARTS = {
    np.dtype(np.complex64): np.dtype(np.float32),
    np.dtype(np.complex128): np.dtype(np.float64),
}


def _tiny(dtype):
    """The smallest normal number of `dtype` (inputs below it count as 0)."""
    return 2.0 ** _INFO[np.dtype(dtype)][1]


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
    tiny = _tiny(dtype)
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
    tiny = _tiny(dtype)
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


def _part_dtype(dtype):
    """The float format of the parts of a complex `dtype` (a float dtype is its own part)."""
    dtype = np.dtype(dtype)
    if dtype in _COMPLEX_PARTS:
        return _COMPLEX_PARTS[dtype]
    if dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        return dtype
    raise TypeError(f"exact_complex_moments takes complex64 or complex128, not {dtype}")


def _complex_sums(values, part):
    """n and the exact sums of both parts: (n, (s1, s2) real, (s1, s2) imag, scale)."""
    tiny = _tiny(part)
    values = np.asarray(values).ravel()
    re = [float(v) for v in np.real(values)]
    im = [float(v) for v in np.imag(values)]
    re = [0.0 if abs(v) < tiny else v for v in re]
    im = [0.0 if abs(v) < tiny else v for v in im]
    n = len(re)
    if n == 0 or not all(np.isfinite(re + im)):
        raise ValueError("exact_complex_moments takes a non-empty slice of finite values")
    ints, e = _exact_ints(re + im)  # one common exponent for both parts
    ri, ii = ints[:n], ints[n:]
    sums = [(sum(p), sum(m * m for m in p)) for p in (ri, ii)]
    return n, sums[0], sums[1], Fraction(2) ** e


def exact_complex_value(values, dtype, ddof=0):
    """(mean_real, mean_imag, var) of a complex slice as unrounded Fractions.

    var is sum |z_i - mean|**2 / (n - ddof), both parts' numerators added exactly.
    """
    part = _part_dtype(dtype)
    n, (r1, r2), (i1, i2), scale = _complex_sums(values, part)
    num = (n * r2 - r1 * r1) + (n * i2 - i1 * i1)
    var = Fraction(num, n * (n - ddof)) * scale * scale if n - ddof > 0 else None
    return Fraction(r1, n) * scale, Fraction(i1, n) * scale, var


def exact_complex_moments(values, dtype, ddof=0):
    """(mean_real, mean_imag, var) of one complex slice, each rounded once to the part format.

    `dtype` is complex64 or complex128 (parts float32 or float64).  Each part of
    the mean is that part's exact mean rounded once; var is the exact
    sum |z_i - mean|**2 / (n - ddof) rounded once (not the sum of two rounded
    variances); var is NaN when n - ddof <= 0.
    """
    part = _part_dtype(dtype)
    mean_re, mean_im, var = exact_complex_value(values, dtype, ddof)
    mean_re, mean_im = round_rational(mean_re, part), round_rational(mean_im, part)
    if var is None:
        return mean_re, mean_im, part.type(np.nan)
    return mean_re, mean_im, round_rational(var, part)
