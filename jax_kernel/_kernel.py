"""The stable moments kernel in JAX: the reference implementation.

This file and ``tf_stable_moments/_kernel.py`` are mirror images: the same
steps, the same names, in the same order.  ``docs/algorithm.md`` is the
contract both follow; section numbers below refer to it.

Every operation is either exact or a single IEEE-754 rounding whose result does
not depend on fusion: the only products are exact (halves of at most 12
significant bits for float32, 26 for float64, or powers of two), so XLA's
contraction of ``a*b + c`` into an FMA cannot change a bit (section 6).
"""

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax


class Format(NamedTuple):
    """Bit layout of a working float type (section 2)."""

    float_dtype: np.dtype
    int_dtype: np.dtype
    mantissa_bits: int  # stored significand bits: 23 or 52
    bias: int  # exponent bias: 127 or 1023
    split_mask: int  # keeps the top 12 (26) significant bits
    split_half: int  # half a unit of the dropped bits: round to nearest


FORMATS = {
    np.dtype(np.float32): Format(np.dtype(np.float32), np.dtype(np.int32), 23, 127, ~0xFFF, 0x800),
    np.dtype(np.float64): Format(
        np.dtype(np.float64), np.dtype(np.int64), 52, 1023, ~((1 << 27) - 1), 1 << 26
    ),
}


# ---------------------------------------------------------------- section 6: error-free steps
def two_sum(a, b):
    """s + e == a + b exactly, s = fl(a + b) (Knuth, Ogita-Rump-Oishi Alg. 3.1)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def fast_two_sum(a, b):
    """s + e == a + b exactly when |a| >= |b| or a == 0 (Dekker)."""
    s = a + b
    return s, b - (s - a)


def split(a, fmt):
    """a == hi + lo, hi rounded to 12 (26) significant bits by a bit mask."""
    bits = lax.bitcast_convert_type(a, fmt.int_dtype)
    hi = lax.bitcast_convert_type((bits + fmt.split_half) & fmt.split_mask, fmt.float_dtype)
    return hi, a - hi


def two_prod(a, b, fmt):
    """(p, e) with p + e == a * b to double precision, from exact partial products."""
    ah, al = split(a, fmt)
    bh, bl = split(b, fmt)
    p, e1 = two_sum(ah * bh, ah * bl)
    p, e2 = two_sum(p, al * bh)
    return p, (e1 + e2) + al * bl


def df_add(ah, al, bh, bl):
    s, e = two_sum(ah, bh)
    return fast_two_sum(s, e + (al + bl))


def df_mul(ah, al, bh, bl, fmt):
    p, e = two_prod(ah, bh, fmt)
    cross = two_prod(ah, bl, fmt)[0] + two_prod(al, bh, fmt)[0]
    return fast_two_sum(p, e + cross)


def pow2(k, fmt):
    """2**k for integer k in the normal range, built from its bits."""
    return lax.bitcast_convert_type(
        (k.astype(fmt.int_dtype) + fmt.bias) << fmt.mantissa_bits, fmt.float_dtype
    )


def exponent(a, fmt):
    """floor(log2|a|) for normal a; -bias for zero; bias + 1 for inf and nan."""
    bits = lax.bitcast_convert_type(a, fmt.int_dtype)
    return ((bits >> fmt.mantissa_bits) & (2 * fmt.bias + 1)) - fmt.bias


def reciprocal_pair(n, fmt):
    """1/n as a double-float pair (hi, lo) for an integer n >= 1 (section 7).

    Integer long division in digits of c = 12 (26) bits, then exact float steps;
    no floating-point division anywhere (XLA's CPU division is not IEEE-exact).
    Computed on the host: n is static under jit.
    """
    n = max(int(n), 1)
    f = fmt.float_dtype.type
    c = (fmt.mantissa_bits + 1) // 2
    t = n.bit_length()
    digit, r = divmod(1 << t, n)
    digits = [digit]
    for _ in range(4):
        digit, r = divmod(r << c, n)
        digits.append(digit)
    a = f(digits[0]) + f(digits[1]) * f(2.0**-c)
    b = f(digits[2]) * f(2.0 ** (-2 * c)) + f(digits[3]) * f(2.0 ** (-3 * c))
    h, l = two_sum(a, b)
    l = l + f(digits[4]) * f(2.0 ** (-4 * c))
    return h * f(2.0**-t), l * f(2.0**-t)


def count_pair(n, fmt):
    """The integer n as a double-float pair (hi, lo), exact for n < 2**48."""
    hi = fmt.float_dtype.type(n)
    return hi, fmt.float_dtype.type(n - int(hi))


class Counts(NamedTuple):
    """The slice length n and the pairs the mean and the finish need (section 7)."""

    n: int
    rn: tuple  # 1/n
    rd: tuple  # 1/(n - ddof)
    pair: tuple  # n


def counts(n, ddof, fmt):
    return Counts(n, reciprocal_pair(n, fmt), reciprocal_pair(n - ddof, fmt), count_pair(n, fmt))


# ---------------------------------------------------------------- section 5: the tree
def _pad_to_power_of_two(v, axis):
    n = v.shape[axis]
    size = 1 << max(n - 1, 0).bit_length()
    if size == n:
        return v
    pad = [(0, 0)] * v.ndim
    pad[axis] = (0, size - n)
    return jnp.pad(v, pad)


def _pair(a, b):
    """One compensated tree node: the reducer of a level (section 5)."""
    (h0, l0), (h1, l1) = a, b
    s, e = two_sum(h0, h1)
    return s, (l0 + l1) + e


def _rows(v, lo, hi, axis):
    return lax.slice_in_dim(v, lo, hi, axis=axis)


def tree_sum(h, l, axis):
    """Halving tree over `axis` (zero padded to 2**k): node i pairs with i + half.

    Every node is a TwoSum on the high parts; the low parts and errors are
    added as (l_i + l_j) + e.  Each step evaluates two levels in one XLA
    reduction with both outputs: on a [..., 4, size/4, ...] view, rows 0, 1 pair
    with rows 2, 3 (slices, fused into the reduction), then the reduction over
    the remaining axis of length 2.  Its result does not depend on the
    reduction order: TwoSum is symmetric and combining with the zero initial
    value is exact.
    """
    h = _pad_to_power_of_two(h, axis)
    l = _pad_to_power_of_two(l, axis)
    zero = np.zeros((), h.dtype)
    size = h.shape[axis]
    while size > 1:
        rows = 4 if size >= 4 else 2
        size //= rows
        shape = h.shape[:axis] + (rows, size) + h.shape[axis + 1 :]
        h, l = h.reshape(shape), l.reshape(shape)
        if rows == 4:
            low = (_rows(h, 0, 2, axis), _rows(l, 0, 2, axis))
            high = (_rows(h, 2, 4, axis), _rows(l, 2, 4, axis))
            h, l = _pair(low, high)
        h, l = lax.reduce((h, l), (zero, zero), _pair, (axis,))
    return jnp.squeeze(h, axis), jnp.squeeze(l, axis)


# ---------------------------------------------------------------- sections 3-4: one part
def classify(x, axis):
    """Step 0: per slice, max and min (order-free), and the largest magnitude."""
    hi, lo = jnp.max(x, axis=axis), jnp.min(x, axis=axis)
    amax = jnp.expand_dims(jnp.maximum(jnp.abs(hi), jnp.abs(lo)), axis)
    return amax, (hi, lo)


def scale_exponent(amax, fmt):
    """Step 1: e such that max|x| * 2**e lies in [2, 4)."""
    return jnp.clip(1 - exponent(amax, fmt), 1 - fmt.bias, fmt.bias)


def square(dh, dl, fmt):
    """Step 4: (qh, ql) ~ (dh + dl)**2 from exact products of 12-bit halves."""
    ah, al = split(dh, fmt)
    ch, cl = split(dl, fmt)
    a2 = ah + ah
    qh, q1 = two_sum(ah * ah, a2 * al)
    ql = q1 + ((al * al + a2 * ch) + (a2 * cl + (al + al) * ch))
    return qh, ql


def part_sums(x, e, rn, axis, fmt, valid=None):
    """Steps 1-5 for one real part: the mean pair, the centre and the sums.

    valid: None, or a mask of the data along `axis` (padded slices, section 5):
    the squares of the padding are left out of the tree.
    """
    # Step 1: range.  Drop what the scaled value would flush, and infinities; scale exactly.
    threshold = pow2(jnp.maximum(-e, 0) + 1 - fmt.bias, fmt)
    dropped = (jnp.abs(x) < threshold) | (jnp.abs(x) == np.inf)
    xs = jnp.where(dropped, jnp.zeros_like(x), x) * pow2(e, fmt)
    # Step 2: shift by the first element, kept exactly as pairs, summed by the tree.
    k = lax.slice_in_dim(xs, 0, 1, axis=axis)
    yh, yl = two_sum(xs, -k)
    sy = two_sum(*tree_sum(yh, yl, axis))
    # Step 3: the mean to double precision; the centre c is the rounded mean.
    k = jnp.squeeze(k, axis)
    mean = df_add(k, jnp.zeros_like(k), *df_mul(*sy, *rn, fmt))
    c = jnp.expand_dims(mean[0], axis)
    # Step 4: exact residuals and their squares.
    dh, dl = two_sum(xs, -c)
    qh, ql = square(dh, dl, fmt)
    if valid is not None:
        qh, ql = jnp.where(valid, qh, jnp.zeros_like(qh)), jnp.where(valid, ql, jnp.zeros_like(ql))
    # Step 5: the compensated tree of the squares.
    s2 = two_sum(*tree_sum(qh, ql, axis))
    return mean, k, sy, s2


# ---------------------------------------------------------------- section 7: finish
def finish(parts, e, count, fmt):
    """Two-term correction, division and the single rounding, per slice.

    parts: a list of (mean, k, sy, s2) pairs from part_sums, sharing the scale
    exponent e; count: the Counts of the slices.  Returns the scaled-back
    (mean_hi, mean_lo) of each part and the variance.
    """
    rn, rd = count.rn, count.rd
    means, num = [], None
    for (mh, ml), k, sy, s2 in parts:
        # S1 = sum(xs - c) = sy - n (c - k), with c - k exact.
        shift = df_mul(*count.pair, *two_sum(mh, -k), fmt)
        s1 = df_add(*sy, -shift[0], -shift[1])
        corr = df_mul(*df_mul(*s1, *rn, fmt), *s1, fmt)
        term = df_add(*s2, -corr[0], -corr[1])
        num = term if num is None else df_add(*num, *term)
        means.append((mh, ml))
    vh, _ = df_mul(*num, *rd, fmt)
    var = jnp.where(vh > 0, vh, jnp.zeros_like(vh))
    e1 = e >> 1
    u1, u2 = pow2(-e1, fmt), pow2(e1 - e, fmt)
    var = var * u1 * u1 * u2 * u2
    means = [(mh * u1 * u2, ml * u1 * u2) for mh, ml in means]
    return means, var


def slice_moments(parts_x, axis, ddof, n=None):
    """Mean pairs and variance of the slices of 2-D arrays along `axis` (0 or 1).

    parts_x: one real array, or the real and imaginary parts of a complex one.
    n: None, or the number of data in slices padded beyond it with copies of
      their first element (section 5): the same bits as the unpadded slices.
    Returns ([(mean_hi, mean_lo) per part], var), each of the kept length.
    """
    fmt = FORMATS[np.dtype(parts_x[0].dtype)]
    size = parts_x[0].shape[axis]
    n = size if n is None else n
    kept = parts_x[0].shape[1 - axis]
    nan = jnp.full((kept,), np.nan, fmt.float_dtype)
    if n == 0:
        return [(nan, jnp.zeros_like(nan)) for _ in parts_x], nan
    count = counts(n, ddof, fmt)
    valid = None
    if n < size:
        index = lax.broadcasted_iota(np.int32, (size, 1) if axis == 0 else (1, size), axis)
        valid = index < n
    # Step 0: classify; one scale for all parts.
    classified = [classify(x, axis) for x in parts_x]
    amax = classified[0][0]
    for a, _ in classified[1:]:
        amax = jnp.maximum(amax, a)
    e = scale_exponent(amax, fmt)
    parts = [part_sums(x, e, count.rn, axis, fmt, valid) for x in parts_x]
    means, var = finish(parts, jnp.squeeze(e, axis), count, fmt)
    # Section 8: special values, each slice on its own.
    zero = jnp.zeros_like(nan)
    all_finite = True
    out_means = []
    for (mh, ml), (_, (hi, lo)), (_, _, sy, _) in zip(means, classified, parts):
        # Infinities were dropped in step 1 and nothing overflows: SY is NaN iff x has a NaN.
        pos, neg, has_nan = hi == np.inf, lo == -np.inf, jnp.isnan(sy[0])
        finite = ~(has_nan | pos | neg) & (n > 0)
        all_finite = all_finite & finite
        special = jnp.where(has_nan | (pos & neg) | (n == 0), nan, jnp.where(pos, np.inf, -np.inf))
        mh = jnp.where(finite, jnp.where(mh == 0, zero, mh), special)
        out_means.append((mh, jnp.where(finite, ml, zero)))
    var = jnp.where(all_finite & (n - ddof > 0), var, nan)
    return out_means, var
