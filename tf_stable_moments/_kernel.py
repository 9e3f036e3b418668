"""The stable moments kernel in TensorFlow: a mirror of ``jax_kernel/_kernel.py``.

The same steps, the same names, in the same order; ``docs/algorithm.md`` is
the contract both follow; section numbers below refer to it.

Every operation is either exact or a single IEEE-754 rounding whose result does
not depend on fusion: the only products are exact (halves of at most 12
significant bits for float32, 26 for float64, or powers of two), so XLA's
contraction of ``a*b + c`` into an FMA cannot change a bit (section 6).

Unlike the JAX kernel, the slice length n may be unknown while tracing (a
tf.function with None dimensions).  Then the tree runs a fixed number of levels
over zero-padded arrays and 1/n is computed by integer long division in the
graph; both give the same bits as the static path (sections 5 and 7).  The
slices may also come padded to a bucketed length, with their Counts (`count`,
sections 5 and 10).  Without XLA (no variadic reduction), tree levels are folds
of slices: the same bits.
"""

import functools
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as _xla

# Tree levels evaluated per fold of slices (plain ops).  Any value gives the same bits.
FOLD_LEVELS = 5
# Levels run when n is unknown while tracing: enough for 2**36 elements.
DYNAMIC_LEVELS = 36


class Format(NamedTuple):
    """Bit layout of a working float type (section 2)."""

    float_dtype: tf.DType
    int_dtype: tf.DType
    mantissa_bits: int  # stored significand bits: 23 or 52
    bias: int  # exponent bias: 127 or 1023
    split_mask: int  # keeps the top 12 (26) significant bits
    split_half: int  # half a unit of the dropped bits: round to nearest


FORMATS = {
    tf.float32: Format(tf.float32, tf.int32, 23, 127, ~0xFFF, 0x800),
    tf.float64: Format(tf.float64, tf.int64, 52, 1023, ~((1 << 27) - 1), 1 << 26),
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
    bits = tf.bitcast(a, fmt.int_dtype)
    hi = tf.bitcast(
        tf.bitwise.bitwise_and(bits + fmt.split_half, tf.constant(fmt.split_mask, fmt.int_dtype)),
        fmt.float_dtype,
    )
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
    k = tf.cast(k, fmt.int_dtype)
    return tf.bitcast(tf.bitwise.left_shift(k + fmt.bias, fmt.mantissa_bits), fmt.float_dtype)


def exponent(a, fmt):
    """floor(log2|a|) for normal a; -bias for zero; bias + 1 for inf and nan."""
    bits = tf.bitcast(a, fmt.int_dtype)
    return (
        tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, fmt.mantissa_bits), 2 * fmt.bias + 1)
        - fmt.bias
    )


def _bit_length(n):
    """Bit length of a non-negative int64 tensor below 2**53."""
    bits = tf.bitcast(tf.cast(n, tf.float64), tf.int64)
    return tf.maximum(tf.bitwise.right_shift(bits, 52) - 1022, 0)


def reciprocal_pair(n, fmt):
    """1/n as a double-float pair (hi, lo) for an integer n >= 1 (section 7).

    Integer long division in digits of c = 12 (26) bits, then exact float steps;
    no floating-point division anywhere (XLA's CPU division is not IEEE-exact).
    On the host when n is static, in int64 graph ops when it is not.
    """
    c = (fmt.mantissa_bits + 1) // 2
    f = fmt.float_dtype.as_numpy_dtype
    if isinstance(n, (int, np.integer)):
        n = max(int(n), 1)
        t = n.bit_length()
        digit, r = divmod(1 << t, n)
        digits = [digit]
        for _ in range(4):
            digit, r = divmod(r << c, n)
            digits.append(digit)
        digits = [tf.constant(d, fmt.float_dtype) for d in digits]
        scale = tf.constant(2.0**-t, fmt.float_dtype)
    else:
        n = tf.maximum(tf.cast(n, tf.int64), 1)
        t = _bit_length(n)
        r = tf.bitwise.left_shift(tf.constant(1, tf.int64), t)
        digits = [r // n]
        r = r % n
        for _ in range(4):
            r = tf.bitwise.left_shift(r, c)
            digits.append(r // n)
            r = r % n
        digits = [tf.cast(d, fmt.float_dtype) for d in digits]
        scale = pow2(-t, fmt)
    a = digits[0] + digits[1] * f(2.0**-c)
    b = digits[2] * f(2.0 ** (-2 * c)) + digits[3] * f(2.0 ** (-3 * c))
    h, l = two_sum(a, b)
    l = l + digits[4] * f(2.0 ** (-4 * c))
    return h * scale, l * scale


def count_pair(n, fmt):
    """The integer n as a double-float pair (hi, lo), exact for n < 2**48."""
    if isinstance(n, (int, np.integer)):
        hi = fmt.float_dtype.as_numpy_dtype(n)
        return tf.constant(hi, fmt.float_dtype), tf.constant(n - int(hi), fmt.float_dtype)
    hi = tf.cast(n, fmt.float_dtype)
    return hi, tf.cast(n - tf.cast(hi, n.dtype), fmt.float_dtype)


class Counts(NamedTuple):
    """The slice length n and the pairs the mean and the finish need (section 7)."""

    n: object  # an int, or an int64 scalar tensor
    rn: tuple  # 1/n
    rd: tuple  # 1/(n - ddof)
    pair: tuple  # n


def counts(n, ddof, fmt):
    return Counts(n, reciprocal_pair(n, fmt), reciprocal_pair(n - ddof, fmt), count_pair(n, fmt))


# ---------------------------------------------------------------- section 5: the tree
def _pair(a, b):
    """One compensated tree node: the reducer of a level (section 5)."""
    (h0, l0), (h1, l1) = a, b
    s, e = two_sum(h0, h1)
    return s, (l0 + l1) + e


@functools.cache
def _pair_reducer(dtype):
    spec = tf.TensorSpec([], dtype)
    pair = tf.function(lambda h0, l0, h1, l1: _pair((h0, l0), (h1, l1)), autograph=False)
    return pair.get_concrete_function(spec, spec, spec, spec)


def _slice(v, lo, hi, axis):
    return v[lo:hi] if axis == 0 else v[:, lo:hi]


def _dims(v):
    return tf.unstack(tf.shape(v)) if None in v.shape else list(v.shape)


def _split_axis(v, rows, size, axis):
    """View `v` as [..., rows, size // rows, ...] at `axis`."""
    dims = _dims(v)
    folded = dims[:axis] + [rows, size // rows] + dims[axis + 1 :]
    return tf.reshape(v, tf.stack(folded) if None in v.shape else folded)


def _pad_at_least(v, rows, axis):
    """Zero padding of a power-of-two length below `rows` up to `rows` (dynamic n)."""
    size = tf.shape(v)[axis]
    pad = [[0, 0], [0, 0]]
    pad[axis] = [0, tf.maximum(rows - size, 0)]
    return tf.pad(v, pad), tf.maximum(size, rows)


def _step_reduce(h, l, axis):
    """Two levels (one if the length is 2) as one XLA reduction; returns the count.

    On a [..., 4, size/4, ...] view, rows 0, 1 pair with rows 2, 3 (slices,
    fused into the reduction), then the reduction over the remaining axis of
    length 2.  Its result does not depend on the reduction order: TwoSum is
    symmetric and combining with the zero initial value is exact.
    """
    size = h.shape[axis]
    rows = 2 if size == 2 else 4
    if size is None:
        h, size = _pad_at_least(h, rows, axis)
        l, _ = _pad_at_least(l, rows, axis)
    h, l = _split_axis(h, rows, size, axis), _split_axis(l, rows, size, axis)
    if rows == 4:
        low = (_slice(h, 0, 2, axis), _slice(l, 0, 2, axis))
        high = (_slice(h, 2, 4, axis), _slice(l, 2, 4, axis))
        h, l = _pair(low, high)
    zero = tf.zeros([], h.dtype)
    h, l = _xla.variadic_reduce([h, l], [zero, zero], [axis], _pair_reducer(h.dtype))
    return h, l, rows.bit_length() - 1


def _fold(h, l, levels, axis):
    """`levels` levels as slices of one [..., 2**levels, size / 2**levels, ...] view."""
    rows = 1 << levels
    size = h.shape[axis]
    if size is None:
        h, size = _pad_at_least(h, rows, axis)
        l, _ = _pad_at_least(l, rows, axis)
    h, l = _split_axis(h, rows, size, axis), _split_axis(l, rows, size, axis)
    while rows > 1:
        rows //= 2
        h, l = _pair(
            (_slice(h, 0, rows, axis), _slice(l, 0, rows, axis)),
            (_slice(h, rows, 2 * rows, axis), _slice(l, rows, 2 * rows, axis)),
        )
    return tf.squeeze(h, axis), tf.squeeze(l, axis)


def _pad_to_power_of_two(v, axis):
    n = v.shape[axis]
    if n is not None:
        size = 1 << max(n - 1, 0).bit_length()
        if size == n:
            return v
        pad_amount = size - n
    else:
        n = tf.cast(tf.shape(v)[axis], tf.int64)
        size = tf.bitwise.left_shift(tf.constant(1, tf.int64), _bit_length(tf.maximum(n - 1, 0)))
        pad_amount = tf.cast(size - n, tf.int32)
    pad = [[0, 0], [0, 0]]
    pad[axis] = [0, pad_amount]
    return tf.pad(v, pad)


def tree_sum(h, l, axis, xla):
    """Halving tree over `axis` (zero padded to 2**k): node i pairs with i + half.

    Every node is a TwoSum on the high parts; the low parts and errors are
    added as (l_i + l_j) + e.  Under XLA, two levels per step: one variadic
    reduction over an axis of length 2 fed by one level of slices (one pass,
    both outputs), as in the JAX kernel; with plain TensorFlow ops, folds of
    FOLD_LEVELS levels of slices.  Same bits.
    When n is unknown while tracing, a fixed number of levels runs over zero
    padding (exact: section 5).
    """
    h, l = _pad_to_power_of_two(h, axis), _pad_to_power_of_two(l, axis)
    size = h.shape[axis]
    levels = DYNAMIC_LEVELS if size is None else size.bit_length() - 1
    while levels > 0:
        if xla:
            h, l, step = _step_reduce(h, l, axis)
        else:
            step = min(FOLD_LEVELS, levels)
            h, l = _fold(h, l, step, axis)
        levels -= step
    if size is None:
        return _first(h, axis), _first(l, axis)
    return tf.squeeze(h, axis), tf.squeeze(l, axis)


def _first(v, axis):
    return v[0] if axis == 0 else v[:, 0]


# ---------------------------------------------------------------- sections 3-4: one part
def classify(x, axis):
    """Step 0: per slice, max and min (order-free), and the largest magnitude."""
    hi, lo = tf.reduce_max(x, axis=axis), tf.reduce_min(x, axis=axis)
    amax = tf.expand_dims(tf.maximum(tf.abs(hi), tf.abs(lo)), axis)
    return amax, (hi, lo)


def scale_exponent(amax, fmt):
    """Step 1: e such that max|x| * 2**e lies in [2, 4)."""
    return tf.clip_by_value(1 - exponent(amax, fmt), 1 - fmt.bias, fmt.bias)


def square(dh, dl, fmt):
    """Step 4: (qh, ql) ~ (dh + dl)**2 from exact products of 12-bit halves."""
    ah, al = split(dh, fmt)
    ch, cl = split(dl, fmt)
    a2 = ah + ah
    qh, q1 = two_sum(ah * ah, a2 * al)
    ql = q1 + ((al * al + a2 * ch) + (a2 * cl + (al + al) * ch))
    return qh, ql


def part_sums(x, e, rn, axis, fmt, xla, valid=None):
    """Steps 1-5 for one real part: the mean pair, the centre and the sums.

    valid: None, or a mask of the data along `axis` (bucketed shapes, section 10):
    the squares of the padding are left out of the tree.
    """
    # Step 1: range.  Drop what the scaled value would flush, and infinities; scale exactly.
    threshold = pow2(tf.maximum(-e, 0) + 1 - fmt.bias, fmt)
    dropped = (tf.abs(x) < threshold) | (tf.abs(x) == np.inf)
    xs = tf.where(dropped, tf.zeros_like(x), x) * pow2(e, fmt)
    # Step 2: shift by the first element, kept exactly as pairs, summed by the tree.
    k = _slice(xs, 0, 1, axis)
    yh, yl = two_sum(xs, -k)
    sy = two_sum(*tree_sum(yh, yl, axis, xla))
    # Step 3: the mean to double precision; the centre c is the rounded mean.
    k = tf.squeeze(k, axis)
    mean = df_add(k, tf.zeros_like(k), *df_mul(*sy, *rn, fmt))
    c = tf.expand_dims(mean[0], axis)
    # Step 4: exact residuals and their squares.
    dh, dl = two_sum(xs, -c)
    qh, ql = square(dh, dl, fmt)
    if valid is not None:
        qh, ql = tf.where(valid, qh, tf.zeros_like(qh)), tf.where(valid, ql, tf.zeros_like(ql))
    # Step 5: the compensated tree of the squares.
    s2 = two_sum(*tree_sum(qh, ql, axis, xla))
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
    var = tf.where(vh > 0, vh, tf.zeros_like(vh))
    e1 = tf.bitwise.right_shift(e, 1)
    u1, u2 = pow2(-e1, fmt), pow2(e1 - e, fmt)
    var = var * u1 * u1 * u2 * u2
    means = [(mh * u1 * u2, ml * u1 * u2) for mh, ml in means]
    return means, var


def slice_moments(parts_x, axis, ddof, xla=False, count=None):
    """Mean pairs and variance of the slices of 2-D tensors along `axis` (0 or 1).

    parts_x: one real tensor, or the real and imaginary parts of a complex one.
    xla: True when the caller compiles with XLA (tree levels as XLA reductions).
    count: None, or the Counts of slices padded to a bucketed length (section
      10): only the first count.n elements of each slice are data, and the
      padding must hold copies of the slice's first element.  Copies leave max,
      min and the shift tree unchanged, and their squares are left out: the
      same bits as the unpadded slices.  (Computed by the caller, outside this
      XLA computation: XLA fuses scalar integer divisions into the loops over
      the elements, where they cannot be hoisted.)
    Returns ([(mean_hi, mean_lo) per part], var), each of the kept length.
    """
    fmt = FORMATS[parts_x[0].dtype]
    n = parts_x[0].shape[axis]
    valid = None
    if count is not None:
        index = tf.range(tf.shape(parts_x[0], out_type=tf.int64)[axis])
        valid = index[:, None] < count.n if axis == 0 else index[None, :] < count.n
    else:
        if n == 0:
            nan = tf.fill([tf.shape(parts_x[0])[1 - axis]], tf.constant(np.nan, fmt.float_dtype))
            return [(nan, tf.zeros_like(nan)) for _ in parts_x], nan
        if n is None:  # unknown while tracing: keep at least one element per slice
            n = tf.shape(parts_x[0], out_type=tf.int64)[axis]
            pad = [[0, 0], [0, 0]]
            pad[axis] = [0, tf.cast(tf.maximum(1 - n, 0), tf.int32)]
            parts_x = [tf.pad(x, pad) for x in parts_x]
            parts_x = [tf.ensure_shape(x, [None, None]) for x in parts_x]
        count = counts(n, ddof, fmt)
    n = count.n
    # Step 0: classify; one scale for all parts.
    classified = [classify(x, axis) for x in parts_x]
    amax = classified[0][0]
    for a, _ in classified[1:]:
        amax = tf.maximum(amax, a)
    e = scale_exponent(amax, fmt)
    parts = [part_sums(x, e, count.rn, axis, fmt, xla, valid) for x in parts_x]
    means, var = finish(parts, tf.squeeze(e, axis), count, fmt)
    # Section 8: special values, each slice on its own.
    nan = tf.fill(tf.shape(var), tf.constant(np.nan, fmt.float_dtype))
    zero = tf.zeros_like(nan)
    all_finite = True
    out_means = []
    for (mh, ml), (_, (hi, lo)), (_, _, sy, _) in zip(means, classified, parts):
        # Infinities were dropped in step 1 and nothing overflows: SY is NaN iff x has a NaN.
        pos, neg, has_nan = hi == np.inf, lo == -np.inf, tf.math.is_nan(sy[0])
        finite = ~(has_nan | pos | neg) & (n > 0)  # n is 0 only when dynamic
        all_finite = all_finite & finite
        inf = tf.where(pos, tf.constant(np.inf, fmt.float_dtype), -np.inf)
        special = tf.where(has_nan | (pos & neg) | (n == 0), nan, inf)
        mh = tf.where(finite, tf.where(mh == 0, zero, mh), special)
        out_means.append((mh, tf.where(finite, ml, zero)))
    var = tf.where(all_finite & (n - ddof > 0), var, nan)
    return out_means, var
