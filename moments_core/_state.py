"""The mergeable moments state: exact per-slice sums as int32 digits (docs section 13).

Written once for both frameworks against the `ops` namespaces of the kernel
(tf_stable_moments/_ops.py, jax_kernel/_ops.py).  A state of one slice is a
fixed-length vector of *fields*, each a little-endian number in radix 2**16,
every digit in [0, 2**16):

    n                      3 digits   the count (n < 2**46)
    per real part p:
      S1_p = sum X_i       l1 digits  signed: two's complement modulo 2**(16 l1)
      NaN count            3 digits
      +inf count           3 digits
      -inf count           3 digits
    S2 = sum_p sum X_i**2  ls2 digits (all parts together; >= 0)

with X = x / 2**base the exact integer of section 7 (inputs below the normal
range count as 0, non-finite inputs count in n and in their own count only).
The state is *canonical*: one vector per value.  Integer addition is associative
and every digit is below 2**16, so an int32 sum of up to 2**15 states (an
all-reduce SUM, in any order) holds the exact digit sums; `carry` then restores
the canonical form.  Hence merging is associative and commutative in bits, and
`finish` gives the correctly rounded mean and variance of the union, the bits
of `moments` on the concatenated data.

`carry` has no data-dependent loop: a fixed number of carry steps brings every
digit to [0, 2**16], and the remaining carries of 0 or 1 are resolved by a
carry-lookahead (Kogge-Stone) prefix over each field; a carry out of a field's
top digit is dropped (arithmetic modulo 2**(16 length) per field).
"""

from typing import NamedTuple

import numpy as np

from moments_core import _exact

RADIX = 1 << _exact.RADIX_BITS
COUNT_DIGITS = 3  # n < 2**46 < 2**48
MAX_SUMMED = 1 << 15  # canonical states an int32 sum may hold (digits < 2**16)


class Layout(NamedTuple):
    """Field lengths of the state of one slice for a target format and 1 or 2 real parts."""

    fmt: object
    parts: int

    @property
    def l1(self):
        return _exact.lengths(self.fmt)[0]

    @property
    def l2(self):
        """Digits of S2: X**2 < 2**(2 top + 106), n < 2**46 terms, two parts: one bit more."""
        bits = 2 * (self.fmt.top + 53) + _exact.MAX_N_BITS + 1
        return -(-bits // _exact.RADIX_BITS)

    @property
    def lengths(self):
        per_part = [self.l1] + [COUNT_DIGITS] * 3
        return [COUNT_DIGITS] + per_part * self.parts + [self.l2]

    @property
    def size(self):
        return sum(self.lengths)

    def offset(self, field):
        """Start of a field: 'n', 's2', or (name, part) with name 's1', 'nan', 'pinf', 'ninf'."""
        if field == "n":
            return 0
        if field == "s2":
            return self.size - self.l2
        name, p = field
        start = COUNT_DIGITS + p * (self.l1 + 3 * COUNT_DIGITS)
        if name == "s1":
            return start
        return start + self.l1 + ("nan", "pinf", "ninf").index(name) * COUNT_DIGITS

    def mask(self, name):
        """bool [size]: the digits of the S1 fields ('s1') or their lowest digits ('s1_start')."""
        out = np.zeros(self.size, bool)
        for p in range(self.parts):
            start = self.offset(("s1", p))
            if name == "s1":
                out[start : start + self.l1] = True
            else:
                out[start] = True
        return out


def _steps(bits):
    """Carry steps after which digits below 2**bits lie in [0, 2**16]."""
    bound, steps = 1 << bits, 0
    while bound - 1 > RADIX:
        bound = RADIX + ((bound - 1) >> _exact.RADIX_BITS)
        steps += 1
    return steps


def _indicator(ops, mask, like):
    """1 where mask (broadcast to `like`), else 0, in the dtype of `like`."""
    return ops.where(mask, ops.ones_like(like), ops.zeros_like(like))


def _shifter(ops, lengths):
    """shift(x, s, fill): x moved s digits up within each field, `fill` shifted in."""
    field = np.repeat(np.arange(len(lengths)), lengths)
    size = len(field)

    def shift(x, s, fill):
        same = np.zeros(size, bool)
        same[s:] = field[s:] == field[:-s]
        moved = ops.concat([ops.zeros_like(x[:, :s]), x[:, : size - s]], 1)
        return ops.where(ops.constant(same[None, :], "bool"), moved, fill)

    return shift


def carry(ops, d, lengths, bits):
    """Canonical digits of d [rows, sum(lengths)], 0 <= d < 2**bits, field by field.

    Each field is reduced modulo 2**(16 length): the carry out of its top digit
    is dropped, so a signed field in two's complement stays one.
    """
    shift = _shifter(ops, lengths)
    for _ in range(_steps(bits)):
        d = ops.band(d, RADIX - 1) + shift(ops.shr(d, _exact.RADIX_BITS), 1, 0)
    # Digits in [0, 2**16]: a carry of 1 is generated (2) by 2**16, propagated (1) by
    # 2**16 - 1, killed (0) otherwise.  Prefix over each field: a propagating range takes
    # the state of the range below it (Kogge-Stone, log2(length) steps).
    v = ops.where(ops.eq(d, RADIX), 2, ops.where(ops.eq(d, RADIX - 1), 1, 0))
    v = ops.cast(v, "int64")
    s = 1
    while s < max(lengths):
        v = ops.where(ops.eq(v, 1), shift(v, s, 0), v)
        s *= 2
    d = d + ops.cast(ops.eq(shift(v, 1, 0), 2), "int64")
    return ops.where(d >= RADIX, d - RADIX, d)


def _complement_plus_one(ops, d, layout):
    """(2**(16 l1) - d) in the S1 fields of canonical d (0 elsewhere), not carried."""
    s1 = ops.constant(layout.mask("s1")[None, :], "bool")
    start = ops.constant(layout.mask("s1_start")[None, :], "bool")
    return ops.where(s1, (RADIX - 1) - d, 0) + _indicator(ops, start, d)


def _count_digits(ops, c):
    """int64 counts [rows] -> [rows, 3] digits."""
    mask = RADIX - 1
    return ops.stack([ops.band(c, mask), ops.band(ops.shr(c, 16), mask), ops.shr(c, 32)], 1)


def from_rows(ops, rows, valid, fmt):
    """int64 canonical state digits [slices, L] of the slices of rows.

    rows: one or two real parts [slices, size], float64 holding values of fmt
    (any NaN/Inf); valid: bool [slices, size] or None (every element counts).
    """
    layout = Layout(fmt, len(rows))
    flushed = [ops.where(ops.abs(r) < 2.0**fmt.emin, ops.zeros_like(r), r) for r in rows]

    def counted(mask):
        mask = mask if valid is None else mask & valid
        return _count_digits(ops, ops.sum(ops.cast(mask, "int64"), 1))

    finite = [ops.isfinite(r) for r in flushed]
    if valid is not None:
        finite = [f & valid for f in finite]
    clean = [ops.where(f, r, ops.zeros_like(r)) for f, r in zip(finite, flushed)]
    s1s, s2 = _exact.accumulate(ops, clean, None, fmt, layout.l1, layout.l2)
    ones = ops.ones_like(flushed[0], "bool")
    fields = [counted(ones)]
    for r, s1 in zip(flushed, s1s):
        fields += [
            s1,
            counted(ops.isnan(r)),
            counted(ops.eq(r, np.inf)),
            counted(ops.eq(r, -np.inf)),
        ]
    raw = ops.concat(fields + [s2], 1)
    # S1 = P - Q with P, Q >= 0 digit by digit: carried separately, then P + (2**(16 l1) - Q).
    s1 = ops.constant(layout.mask("s1")[None, :], "bool")
    zero = ops.zeros_like(raw)
    positive = ops.where(s1, ops.maximum(raw, zero), raw)
    negative = ops.where(s1, ops.maximum(-raw, zero), zero)
    both = carry(ops, ops.concat([positive, negative], 0), layout.lengths, 63)
    rows = ops.shape(raw, 0)
    positive, negative = both[:rows], both[rows:]
    return carry(ops, positive + _complement_plus_one(ops, negative, layout), layout.lengths, 18)


def merge(ops, a, b, layout):
    """Canonical int64 digits of the merge of two states (int64 digits, each a sum of
    canonical states, at most 2**15 canonical states in all): the digit sums, carried."""
    return carry(ops, a + b, layout.lengths, 31)


def _number(ops, d):
    """An int64 [rows] from 3 canonical digits [rows, 3]."""
    return d[:, 0] + ops.shl(d[:, 1], 16) + ops.shl(d[:, 2], 32)


def finish(ops, d, layout, ddof):
    """(mean bits per part, var bits, special) from int64 canonical digits [rows, L].

    Bit patterns as signed integers of fmt.bits (moments_core._exact.to_float),
    special: per part (nan, pinf, ninf) bool [rows], and n (int64 [rows]).
    """
    fmt = layout.fmt
    l1, l2 = _exact.lengths(fmt)
    n = _number(ops, d[:, :COUNT_DIGITS])
    parts = range(layout.parts)
    low, low2 = np.zeros(l1, bool), np.zeros(l2, bool)
    low[0] = low2[0] = True  # the lowest digit of each S1 field, of N
    low = ops.constant(np.tile(low, layout.parts)[None, :], "bool")
    low2 = ops.constant(low2[None, :], "bool")
    every = ops.constant(np.ones([1, l1], bool), "bool")
    s1 = ops.concat([d[:, o : o + l1] for o in [layout.offset(("s1", p)) for p in parts]], 1)
    negative = [s1[:, (p + 1) * l1 - 1] >= RADIX // 2 for p in parts]
    # |S1| = 2**(16 l1) - S1 for a negative S1: complement plus one, carried.
    wide = ops.concat([ops.expand_dims(ng, 1) & every for ng in negative], 1)
    mag = ops.where(wide, (RADIX - 1) - s1, s1) + _indicator(ops, wide & low, s1)
    mag = carry(ops, mag, [l1] * layout.parts, 17)
    magnitude = [mag[:, p * l1 : (p + 1) * l1] for p in parts]
    squares = _exact.multiply(ops, magnitude[0], magnitude[0])  # digits < l1 2**32
    for m in magnitude[1:]:
        squares = squares + _exact.multiply(ops, m, m)
    # N = n S2 - sum S1**2 >= 0: n S2 + (2**(16 l2) - sum S1**2) modulo 2**(16 l2).
    s2 = d[:, layout.offset("s2") :] * ops.expand_dims(n, 1)  # digits < 2**62
    both = ops.concat([_exact.resize(ops, s2, l2), _exact.resize(ops, squares, l2)], 1)
    both = carry(ops, both, [l2, l2], 63)
    num = both[:, :l2] + ((RADIX - 1) - both[:, l2:]) + _indicator(ops, low2, s2[:, :1])
    num = carry(ops, num, [l2], 18)
    # One rounding for all: the means (S1 / n, divided by 1 once more) and the variance.
    divisor = ops.maximum(n - ddof, ops.ones_like(n))
    rows = [_exact.resize(ops, m, l2) for m in magnitude] + [num]
    offsets = [fmt.base] * layout.parts + [2 * fmt.base]
    count = ops.maximum(n, ops.ones_like(n))
    bits = _exact.to_float(
        ops,
        ops.concat(rows, 0),
        [
            ops.concat([count] * len(rows), 0),
            ops.concat([ops.ones_like(n)] * layout.parts + [divisor], 0),
        ],
        ops.concat([ops.zeros_like(n) + o for o in offsets], 0),
        fmt,
        ops.concat(negative + [ops.zeros_like(negative[0])], 0),
    )
    size = ops.shape(n, 0)
    means = [bits[p * size : (p + 1) * size] for p in parts]
    var = bits[layout.parts * size :]
    special = []
    for p in range(layout.parts):
        flags = []
        for name in ("nan", "pinf", "ninf"):
            o = layout.offset((name, p))
            flags.append(ops.any(ops.ne(d[:, o : o + COUNT_DIGITS], 0), 1))
        special.append(flags)
    return means, var, special, n


def values(ops, d, layout, ddof):
    """(means per part, var) as float64 arrays of fmt values, with the special values of
    `moments` (docs section 8) from int64 canonical digits [rows, L]."""
    mean_bits, var_bits, special, n = finish(ops, d, layout, ddof)
    nan, inf = float("nan"), float("inf")
    means, any_special = [], None
    for bits, (has_nan, pos, neg) in zip(mean_bits, special):
        value = ops.from_bits(bits, layout.fmt)
        value = ops.where(
            has_nan | (pos & neg), nan, ops.where(pos, inf, ops.where(neg, -inf, value))
        )
        means.append(ops.where(n > 0, value, nan))
        flag = has_nan | pos | neg
        any_special = flag if any_special is None else any_special | flag
    var = ops.from_bits(var_bits, layout.fmt)
    var = ops.where(any_special | (n - ddof <= 0) | ops.eq(n, 0), nan, var)
    return means, var


def merge_stream(batches, axes, convert, describe, moments_state, merge_states):
    """accumulate_state for both frameworks: each batch's state, merged in order.

    convert(batch) -> the framework's array; describe(x) -> (dtype name, rank,
    kept dimensions).  Every batch must have the dtype, rank and kept dimensions
    of the first; an empty stream has no dtype, so it is an error.
    """
    fn = "accumulate_state"
    state, first = None, None
    for i, batch in enumerate(batches):
        x = convert(batch)
        dtype, rank, kept = describe(x)
        if first is None:
            first, first_shape = (dtype, rank, kept), x.shape
        elif (dtype, rank) != first[:2]:
            raise ValueError(
                f"{fn}: every batch must have the dtype and rank of the first; batch {i} "
                f"is {dtype} of shape {x.shape}, batch 0 {first[0]} of shape {first_shape}"
            )
        elif kept != first[2]:
            raise ValueError(
                f"{fn}: every batch must have the kept dimensions of the first; batch {i} "
                f"has shape {x.shape}, batch 0 shape {first_shape} (axes={axes})"
            )
        current = moments_state(x, axes)
        state = current if state is None else merge_states(state, current)
    if state is None:
        raise ValueError(f"{fn}: batches is empty (no batch, so no dtype); got {batches!r}")
    return state
