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

Two ways to the same canonical state here: `from_rows`, the digits of every element
(`_exact.accumulate`: a segment sum, a chunk at a time), and `from_one_pass` for
inputs of at most 24 bits, exact float64 sums of blocks of 256 pieces whose bits are
counted (docs section 13, "The state in one pass"), placed at their digits per slice.
A third is native (moments_core/native/moments.h `state`, exact integer sums written
as these digits; `state_result` rounds a state as `values` does), which the frameworks
call on the CPU.

`carry` has no data-dependent loop: a fixed number of carry steps brings every
digit to [0, 2**16], and the remaining carries of 0 or 1 are resolved by a
carry-lookahead (Kogge-Stone) prefix over each field; a carry out of a field's
top digit is dropped (arithmetic modulo 2**(16 length) per field).
"""

from typing import NamedTuple

import numpy as np

from moments_core import _exact
from moments_core._exact import MASK

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
    s1s, s2 = accumulate_chunks(ops, clean, fmt, layout)
    ones = ops.ones_like(flushed[0], "bool")
    fields = [counted(ones)]
    for r, s1 in zip(flushed, s1s):
        fields += [
            s1,
            counted(ops.isnan(r)),
            counted(ops.eq(r, np.inf)),
            counted(ops.eq(r, -np.inf)),
        ]
    return _canonical(ops, ops.concat(fields + [s2], 1), layout)


def _canonical(ops, raw, layout):
    """Canonical int64 digits of raw digit sums [slices, L]: every field's digits are
    non-negative except those of S1 (any sign, |digit| < 2**62)."""
    # S1 = P - Q with P, Q >= 0 digit by digit: carried separately, then P + (2**(16 l1) - Q).
    s1 = ops.constant(layout.mask("s1")[None, :], "bool")
    zero = ops.zeros_like(raw)
    positive = ops.where(s1, ops.maximum(raw, zero), raw)
    negative = ops.where(s1, ops.maximum(-raw, zero), zero)
    both = carry(ops, ops.concat([positive, negative], 0), layout.lengths, 63)
    rows = ops.shape(raw, 0)
    positive, negative = both[:rows], both[rows:]
    return carry(ops, positive + _complement_plus_one(ops, negative, layout), layout.lengths, 18)


# ------------------------------------------------------------------ the state in one pass
# Inputs of at most 24 bits (float32, float16, bfloat16, complex64) take this path: one
# pass of exact float64 sums per real part instead of a scatter of digits per element
# (docs section 13, "The state in one pass").
RANGE_BITS = 42  # R: the pass holds the inputs within 2**R of the largest of their slice
BLOCK = 256  # terms per block of the pass: 2**8 pieces below 2**44 sum exactly (below 2**52)
_F32_MAX = float(np.finfo(np.float32).max)


# std (reduce_std, jnp.std) of inputs of at most 24 bits with at least this many elements
# per slice takes the variance rounded to float64 from the exact state (the one pass,
# then `values(target=float64)`), not from the kernel on the data widened to float64,
# whose fast path decides almost no slice at 53 bits: the same bits, 3-11x faster for
# float32 [64, 32, 32, 64] over axes 0-2 (docs section 12).  Below it the state's
# finish (a few ms) costs more than the kernel's exact path.
STD_FROM_STATE = 2**14


def one_pass_applies(fmt):
    """Whether the inputs of `fmt` take `from_one_pass` (a float32 holds them exactly)."""
    return fmt.precision <= 24


# A block of BLOCK terms is reduced in stages of 8, 8 and 4 terms (the first stage the
# innermost): LLVM unrolls the 8 terms of a stage fully and vectorises the kept axis,
# as it did not with the 16 terms of `_kernel._block_stage` once the pass's arithmetic
# was fused in (scalar code).  float32 [65536, 64] over axis 0 under JAX, the CPU twin:
# moments_state 17.9 ms -> 12.0 ms; [4096, 256] 4.6 -> 3.0 ms.
STAGES = (8, 8, 4)


def _block_reduce(ops, arrays, inits, fn, axis, full):
    """fn's reduction of 2-D arrays (full * BLOCK terms along axis) per block of BLOCK
    consecutive terms, in the STAGES (any order within each: the blocks' sums are
    exact): [full, kept] (axis 0) or [kept, full] (axis 1)."""
    kept = ops.shape(arrays[0], 1 - axis)
    shape = [full, *reversed(STAGES), kept] if axis == 0 else [kept, full, *reversed(STAGES)]
    arrays = [ops.reshape(a, shape) for a in arrays]
    for k in range(len(STAGES)):  # the innermost stage first
        arrays = ops.variadic(arrays, inits, fn, len(STAGES) - k + axis)
    return arrays


def _pieces(ops, blocks, axis, extra=()):
    """Sums along axis of the block sums (float64 integers, |v| < 2**53), each as four
    int64 [kept] pieces P_k (value sum_k P_k 2**(16 k)), one list per array; each piece
    sums terms below 2**16 (exact for fewer than 2**47 terms).  extra: int64 arrays like
    them, summed in the same reduction (returned last).

    One variadic reduction for all of them (XLA's CPU backend gives each reduction a
    kernel of its own: twenty of them before)."""
    terms = []
    for v in blocks:
        i = ops.cast(v, "int64")
        terms += [ops.band(ops.shr(i, 16 * k), MASK) for k in range(3)] + [ops.shr(i, 48)]
    terms += list(extra)
    sums = ops.variadic(terms, (0,) * len(terms), _add, axis)
    return [sums[4 * j : 4 * j + 4] for j in range(len(blocks))], sums[4 * len(blocks) :]


def _add(u, v):
    return tuple(a + b for a, b in zip(u, v))


def _field(ops, terms, offset, length, digits, signed=False):
    """Canonical digits [kept, length] of V 2**offset modulo 2**(16 length), where
    V = sum P 2**s over terms (P, s): P int64 [kept] pieces of `_pieces` (|P| < 2**62,
    any sign), s static bit shifts; offset int64 [kept] >= 0; |V| < 2**(16 digits - 1).
    signed: digits of V 2**offset itself instead, the top one signed (0 or negative)
    and none above it (so none may fall beyond `length`: `_signed_lengths`), from P
    below 2**40 (`digit_sums`), which the carry pass takes whole (a third of the
    operations: each P split in four pieces first was 0.1 s of XLA compile time).

    V's relative digits come from one carry pass over `digits` digits of [kept] vectors
    (the floor shift is arithmetic: a negative V comes out in two's complement, its sign
    in the last carry); they are shifted by offset mod 16 bits and placed from digit
    offset // 16 on, the sign extended above them.  A handful of operations on [kept]
    and [kept, length] arrays (a carry over the whole state, `carry`, took 2.3 ms for
    256 float32 slices on this CPU; one pass over all its digits compiled for 1 s)."""
    raw = [None] * digits
    for p, shift in terms:
        a, b = divmod(shift, _exact.RADIX_BITS)
        if signed:  # |P 2**b| < 2**55; with the 2 or 3 terms of a digit and the carries
            # into it, |raw + up| < 2**58
            piece = ops.shl(p, b) if b else p
            raw[a] = piece if raw[a] is None else raw[a] + piece
            continue
        for m in range(4):
            piece = ops.band(ops.shr(p, 16 * m), MASK) if m < 3 else ops.shr(p, 48)
            piece = ops.shl(piece, b) if b else piece  # below 2**31 in magnitude
            raw[a + m] = piece if raw[a + m] is None else raw[a + m] + piece
    rel, up = [], None
    for r in raw:
        t = r if up is None else (up if r is None else r + up)
        rel.append(ops.band(t, MASK))
        up = ops.shr(t, _exact.RADIX_BITS)
    ext = ops.where(up < 0, MASK, 0)  # the digits above V: 0, or 2**16 - 1 when V < 0
    first, b = ops.shr(offset, 4), ops.band(offset, 15)
    index = ops.expand_dims(ops.iota(length, "int64"), 0)
    start = ops.expand_dims(first, 1)
    out = 0 if signed else ops.where(index > start + digits, ops.expand_dims(ext, 1), 0)
    for j, d in enumerate(rel + [up if signed else ext]):
        below = rel[j - 1] if j > 0 else ops.zeros_like(d)
        w = ops.shl(d, b) if signed and j == digits else ops.band(ops.shl(d, b), MASK)
        w = w + ops.shr(below, 16 - b)
        out = out + ops.where(ops.eq(index, start + j), ops.expand_dims(w, 1), 0)
    return out


def _signed_lengths(fmt):
    """Digits of the signed fields of S1 and S2 (`_field`): room for the highest offset,
    that of the largest finite input (e = emax - 1), and a field's relative digits and
    its top one above it (10 + 1 and 12 + 1); at least the state's."""
    layout = Layout(fmt, 1)
    offset = max(fmt.emax - 1 - (RANGE_BITS + 23), fmt.base) - fmt.base
    return max(layout.l1, offset // 16 + 11), max(layout.l2, 2 * offset // 16 + 13)


def _split(ops, v, bits):
    """(hi, lo) with v = hi 2**bits + lo, hi = floor(v 2**-bits), 0 <= lo < 2**bits: exact
    for an integer v of float64 (lo holds some of v's bits; v 2**-bits is exact)."""
    hi = ops.floor(v * 2.0**-bits)
    return hi, v - hi * 2.0**bits


def from_one_pass(ops, parts, valid, fmt, axis, count=None):
    """int64 canonical state digits [slices, L], the same as `from_rows`, for inputs of
    at most 24 bits: parts, one or two real parts laid out 2-D (slices along `axis`, 0
    or 1, the other axis the kept one) in any float dtype holding fmt's values; valid:
    bool like them, or None; count: None, or the number of elements of each slice
    (an int64 scalar) where the slices were padded with zeros (they add nothing else).

    A first pass finds each slice's largest finite |x| = m (2**e <= m < 2**(e + 1))
    and the NaN/+inf/-inf counts (packed in one int32 lane per block).  The inputs with
    |x| >= 2**(e - R) are integers y = x / u in the unit u = 2**max(e - R - 23, base),
    |y| < 2**66; with y = y1 2**33 + y0 and y**2 = q2 2**88 + q1 2**44 + q0 (floor
    splits, every piece in [0, 2**44) but y1), a block of 256 pieces sums exactly in
    float64 in any order.  The blocks' sums go to int64 in 16-bit pieces and to their
    digits.  Slices with inputs below 2**(e - R) (a range of more than 2**42 in one
    slice; flushed inputs aside; counted in y0's lane) add those by more passes, each
    over the inputs below the last one's lower end, in a branch that runs only then.
    Docs section 13 counts the bits.
    """
    layout = Layout(fmt, len(parts))
    data, full = _padded(ops, parts, valid, axis)
    kept = ops.shape(data[0], 1 - axis)
    lengths = (layout.l1, layout.l2)
    passes = [_pass(ops, x, fmt, axis, full, lengths) for x in data]
    if valid is not None:
        count = ops.sum(ops.cast(valid, "int64"), axis)
    else:
        count = ops.zeros([kept], "int64") + (ops.shape(parts[0], axis) if count is None else count)
    fields = [_count_digits(ops, count)]
    for q in passes:
        fields += [q.s1] + [_count_digits(ops, c) for c in q.special]
    digits = ops.concat(fields + [_s2(passes)], 1)
    if len(passes) > 1:  # complex: the parts' S2 fields add (digits below 2**17)
        digits = carry(ops, digits, layout.lengths, 17)

    def below(digits):
        """The inputs below the pass: `_passes_below` from its lower ends, their fields
        (canonical modulo their size, at most six passes) added to the state's and the
        sum carried once (digits below 7 2**17 < 2**20)."""
        caps = [q.lower for q in passes]
        s1s, s2 = _passes_below(ops, data, caps, fmt, axis, full, lengths, False)
        extra = [ops.zeros_like(fields[0])]
        for p, s1 in enumerate(s1s):
            extra += [s1] + [ops.zeros_like(f) for f in fields[2 + 4 * p : 5 + 4 * p]]
        return (carry(ops, digits + ops.concat(extra + [s2], 1), layout.lengths, 20),)

    return ops.cond(_deep(ops, passes), below, (digits,))[0]


def _padded(ops, parts, valid, axis):
    """(the parts as float32, zeros where not valid, padded to whole blocks; blocks)."""
    n = ops.shape(parts[0], axis)
    full = (n + (BLOCK - 1)) // BLOCK  # at least one block: an empty slice's is zeros
    full = max(full, 1) if isinstance(full, int) else ops.maximum(full, 1)
    data = [ops.cast(p, "float32") for p in parts]
    if valid is not None:
        data = [ops.where(valid, p, ops.zeros_like(p)) for p in data]
    return [ops.pad(p, axis, full * BLOCK - n, 0.0) for p in data], full


class Pass(NamedTuple):
    """`_pass`'s results for one real part: the S1 and S2 fields, the NaN / +inf / -inf
    counts (or none), the lower end of the pass per slice, and whether a slice has
    inputs below it."""

    s1: object
    s2: object
    special: list
    lower: object
    deep: object


def _s2(passes):
    """The S2 field of the parts' passes together (complex: the sum of both)."""
    return passes[0].s2 if len(passes) == 1 else passes[0].s2 + passes[1].s2


def _deep(ops, passes):
    """Whether any slice has inputs below its pass (another pass must add them)."""
    deep = passes[0].deep
    for q in passes[1:]:
        deep = deep | q.deep
    return ops.any(deep)


def _passes_below(ops, data, caps, fmt, axis, full, lengths, signed):
    """(S1 per part, S2): the sums of the fields of passes over the inputs below caps
    (float32 [kept] per part), each pass over the inputs below the last one's lower
    end, until no slice has any left: a loop that runs at least once and at most seven
    times (the flushed float32 inputs span less than 2**254, a pass 2**42).  The fields
    of every pass have one layout (`lengths`, `signed`: see `_pass`), so they add."""
    kept = ops.shape(data[0], 1 - axis)
    sums = [ops.zeros([kept, lengths[0]], "int64") for _ in data]
    sums.append(ops.zeros([kept, lengths[1]], "int64"))

    def step(*state):
        caps, sums = state[: len(data)], state[len(data) + 1 :]
        passes = [
            _pass(ops, x, fmt, axis, full, lengths, False, signed, cap)
            for x, cap in zip(data, caps)
        ]
        new = [q.s1 for q in passes] + [_s2(passes)]
        return (*[q.lower for q in passes], _deep(ops, passes), *[a + b for a, b in zip(sums, new)])

    start = (*caps, ops.constant(True, "bool"), *sums)
    sums = ops.while_loop(lambda *state: state[len(data)], step, start)[len(data) + 1 :]
    return list(sums[:-1]), sums[-1]


def _pass(ops, x, fmt, axis, full, lengths, specials=True, signed=False, cap=None):
    """The pass over one real part x (float32, 2-D, full blocks along axis): a `Pass`,
    the digits canonical modulo 2**(16 length)
    (lengths: of S1, of S2), or `_field`'s signed ones.  specials=False: x is finite,
    or cap ([kept] float32) is given: the pass takes only the inputs with |x| < cap."""
    r, tiny = RANGE_BITS, 2.0**fmt.emin

    def lane(v):  # a per-slice vector [kept] against the elements
        return ops.expand_dims(v, axis)

    def blocks(arrays, inits, fn):
        return _block_reduce(ops, arrays, inits, fn, axis, full)

    def largest_and_counts(u, v):  # max, then sums
        return (ops.maximum(u[0], v[0]), *_add(u[1:], v[1:]))

    if cap is not None:  # NaN and inf out (cap is finite, or inf for finite x); no
        # |x| of its own, which XLA would hoist out of a loop as a buffer of its own
        c = lane(cap)
        x = ops.where((x < c) & (x > -c), x, ops.zeros_like(x))
    a = ops.abs(x)
    zero = ops.zeros_like(a)
    if specials:
        # The largest finite |x| and the NaN / +inf / -inf counts as 9-bit fields of one
        # int32 (a block counts at most 256 of each), per block; then over the blocks,
        # the fields apart in int64 (exact in any order).
        finite = a <= _F32_MAX
        code = ops.where(ops.isnan(x), zero + 1.0, ops.where(x > 0, zero + 2.0**9, zero + 2.0**18))
        top, packed = blocks(
            [ops.where(finite, a, zero), ops.cast(ops.where(finite, zero, code), "int32")],
            (0.0, 0),
            largest_and_counts,
        )
        packed = ops.cast(packed, "int64")
        fields = [ops.band(ops.shr(packed, 9 * k), 511) for k in range(3)]
        top, *special = ops.variadic([top, *fields], (0.0, 0, 0, 0), largest_and_counts, axis)
    else:
        (top,) = blocks([a], (0.0,), largest_and_counts)
        (top,) = ops.variadic([top], (0.0,), largest_and_counts, axis)
        special = []
    e = ops.shr(ops.cast(ops.bitcast(top, "int32"), "int64"), 23) - 127
    lower = ops.bitcast(
        ops.cast(ops.shl(ops.maximum(e - r, fmt.emin) + 127, 23), "int32"), "float32"
    )
    unit = ops.maximum(e - (r + 23), fmt.base)  # log2 u
    scale = ops.bitcast(ops.shl(1023 - unit, 52), "float64")
    inside = a >= lane(lower)
    if specials:
        inside = inside & (a <= _F32_MAX)
    wide = ops.cast(x, "float64")
    y = ops.where(inside, wide * lane(scale), ops.zeros_like(wide))
    y1, y0 = _split(ops, y, 33)
    q2, rest = _split(ops, y * y, 88)  # y * y: exact (at most 48 bits)
    q1, q0 = _split(ops, rest, 44)
    # The inputs below the pass (>= 2**emin) counted in y0's lane from bit 41 on: a
    # block's y0 sum is below 2**41, its count below 2**9 (one lane less to reduce).
    under = ops.where((a < lane(lower)) & (a >= tiny), 2.0**41, 0.0)
    sums = blocks([y1, y0 + under, q2, q1, q0], (0.0,) * 5, _add)
    under, sums[1] = _split(ops, sums[1], 41)
    sums, (under,) = _pieces(ops, sums, axis, [ops.cast(under, "int64")])
    offset = unit - fmt.base  # u = 2**offset in units of 2**base
    # V1 = sum y: |V1| < n 2**67 < 2**113; V2 = sum y**2 < n 2**132 < 2**178; the
    # relative digits reach the top piece of the top sum (bit 33 + 48, 88 + 48).
    s1 = _field(ops, _terms(sums[:2], (33, 0)), offset, lengths[0], 10, signed)
    s2 = _field(ops, _terms(sums[2:], (88, 44, 0)), 2 * offset, lengths[1], 12, signed)
    return Pass(s1, s2, special, lower, under > 0)


CHUNK = 2**16  # elements per chunk of `accumulate_chunks`


def accumulate_chunks(ops, rows, fmt, layout):
    """`_exact.accumulate`'s digit sums (S1 per part [kept, l1], S2 [kept, l2]) of rows
    [kept, size] (one array per real part; float64, finite, flushed, zeros where nothing
    counts), a chunk of `step` terms of every row at a time in a while loop, so that the
    buffers of the digits (about 14 int64 words per element) stay near CHUNK elements'
    whatever the size of the input (at once: 35 times the input, 1.1 GB of temporary
    buffers for float64 [65536, 64] under JAX).  Integer digit sums: any cut, one
    result (below 2**16 per element: exact for n < 2**47)."""
    size, kept = ops.shape(rows[0], 1), ops.shape(rows[0], 0)
    step = _chunk(ops, size, kept)
    count = (size + (step - 1)) // step  # at least one chunk: an empty slice's is zeros
    count = max(count, 1) if isinstance(count, int) else ops.maximum(count, 1)
    if isinstance(count, int) and count == 1:  # one chunk: no loop to compile
        return _exact.accumulate(ops, rows, None, fmt, layout.l1, layout.l2)
    chunks = [ops.reshape(ops.pad(r, 1, count * step - size, 0), [kept, -1, step]) for r in rows]

    def add(i, *acc):
        part = [ops.take(c, i, 1) for c in chunks]
        d1, d2 = _exact.accumulate(ops, part, None, fmt, layout.l1, layout.l2)
        return (i + 1, *[u + v for u, v in zip(acc, [*d1, d2])])

    start = [ops.zeros([kept, layout.l1], "int64") for _ in rows]
    start.append(ops.zeros([kept, layout.l2], "int64"))
    _, *sums = ops.while_loop(lambda i, *_: i < count, add, (ops.constant(0, "int64"), *start))
    return sums[:-1], sums[-1]


def _chunk(ops, size, kept):
    """Terms per slice in a chunk of `accumulate_chunks`: the largest power of two with
    at most CHUNK elements in all, up to BLOCK or beyond it while it divides size (a
    known one), and no more than size needs (at least 1); where kept is known only
    while running, up to BLOCK."""
    if not isinstance(kept, int):  # an int64 scalar, which XLA knows when it compiles
        step = ops.constant(1, "int64")
        for j in range(1, BLOCK.bit_length()):
            step = ops.where(kept * 2**j <= CHUNK, 2**j, step)
        return step
    step = 1
    while step * 2 * kept <= CHUNK and (step * 2 <= BLOCK or _divides(step * 2, size)):
        if isinstance(size, int) and step >= size:
            break
        step *= 2
    return step


def _divides(d, total):
    return isinstance(total, int) and total % d == 0


SPLIT_ROWS = 64  # `digit_sums` cuts each row into this many parts (at least 2**11 each)
PART = 2**24  # and into parts of at most this many elements (`_field`'s P below 2**40)


def digit_sums(ops, rows, fmt):
    """`_exact.accumulate`'s digit sums (S1 per part, S2: the same values, digits of
    either sign, [slices, `_signed_lengths`] each: fewer than the exact path's l2) of
    rows [slices, size] (a static size) of at most 24-bit values (float64, finite,
    flushed; zeros where an element does not count) by the one pass: exact float64
    block sums instead of the digits of every element (the kernel's exact path for
    long slices: `_kernel.ONE_PASS_ROWS`).

    Each row is cut into SPLIT_ROWS (or more) consecutive parts of at most PART
    elements (zeros appended), the passes of the parts taken together (`_pass` along
    axis 1, vectorised across the parts: one row alone ran as scalar code, 30 ms for
    2**20 elements) and their digits summed: `_passes_below` from +inf, the loop that
    runs once unless some part spans more than 2**42 (`from_one_pass`'s branch is the
    same loop from the first pass's lower ends).  Compiled code holds one pass and no
    element digits, carry or count (`_field`'s signed fields: `_exact.finish` carries;
    the rows are finite and every element counts): 0.4 s of XLA compile time, JAX,
    float32 rows of 2**17, against 1.2 s for the canonical state of `from_one_pass`
    with the element digits of the inputs below the pass in a branch."""
    slices, size = ops.shape(rows[0], 0), ops.shape(rows[0], 1)
    count = max(SPLIT_ROWS, -(-size // PART))
    part = -(-size // count)
    cut = [
        ops.reshape(ops.pad(r, 1, part * count - size, 0.0), [slices * count, part]) for r in rows
    ]
    data, full = _padded(ops, cut, None, 1)
    caps = [ops.zeros([slices * count], "float32") + np.inf for _ in data]
    s1s, s2 = _passes_below(ops, data, caps, fmt, 1, full, _signed_lengths(fmt), True)
    sums = [*s1s, s2]
    sums = [ops.sum(ops.reshape(v, [slices, count, -1]), 1) for v in sums]
    return sums[:-1], sums[-1]


def _terms(sums, shifts):
    """(piece, shift) pairs of `_field` for sums (each four pieces) at bit shifts."""
    return [(p, shift + 16 * m) for ps, shift in zip(sums, shifts) for m, p in enumerate(ps)]


def merge(ops, a, b, layout):
    """Canonical int64 digits of the merge of two states (int64 digits, each a sum of
    canonical states, at most 2**15 canonical states in all): the digit sums, carried."""
    return carry(ops, a + b, layout.lengths, 31)


def _number(ops, d):
    """An int64 [rows] from 3 canonical digits [rows, 3]."""
    return d[:, 0] + ops.shl(d[:, 1], 16) + ops.shl(d[:, 2], 32)


def finish(ops, d, layout, ddof, target=None):
    """(mean bits per part, var bits, special) from int64 canonical digits [rows, L].

    Bit patterns as signed integers of fmt.bits (moments_core._exact.to_float),
    special: per part (nan, pinf, ninf) bool [rows], and n (int64 [rows]).  target:
    None, or a wider format to round to (the sums are exact: the mean of float32
    data to float64, for the layers' second part of the mean).

    The rounding is the exact path's (`_exact.finish`), on the S1 fields as signed
    digits (a two's complement field whose top digit is 2**15 or more has that digit
    less 2**16: the same value) and the S2 field: compiled code of its carry loops,
    not the three Kogge-Stone carries of 7-10 XLA kernels each that this function
    had (1.2 s of XLA compile time for `state_moments` of float32 states, JAX).
    """
    fmt = layout.fmt
    l1 = layout.l1
    d = ops.reshape(d, [-1, layout.size])  # the fields' static lengths (TF graphs)
    n = _number(ops, d[:, :COUNT_DIGITS])
    parts = range(layout.parts)
    s1s = []
    for p in parts:
        o = layout.offset(("s1", p))
        top = d[:, o + l1 - 1 : o + l1]
        top = ops.where(top >= RADIX // 2, top - RADIX, top)
        s1s.append(ops.concat([d[:, o : o + l1 - 1], top], 1))
    s2 = d[:, layout.offset("s2") :]
    # n = 0 (an empty slice; its results are NaN: `values`): S1 = S2 = 0, any count.
    count = ops.maximum(n, ops.ones_like(n))
    # Digits of n S2 < 2**(16 l2 + 46) and of S1**2 (2 l1 - 1), a multiple of 8 (`lengths`)
    width = -(-max(layout.l2 + 3, 2 * l1 - 1) // 8) * 8
    means, var = _exact.finish(ops, s1s, None, s2, count, ddof, fmt, target, width, True)
    special = []
    for p in range(layout.parts):
        flags = []
        for name in ("nan", "pinf", "ninf"):
            o = layout.offset((name, p))
            flags.append(ops.any(ops.ne(d[:, o : o + COUNT_DIGITS], 0), 1))
        special.append(flags)
    return means, var, special, n


def values(ops, d, layout, ddof, target=None):
    """(means per part, var) as float64 arrays of fmt values (target's, if given: see
    `finish`), with the special values of `moments` (docs section 8) from int64
    canonical digits [rows, L]."""
    mean_bits, var_bits, special, n = finish(ops, d, layout, ddof, target)
    out = layout.fmt if target is None else target
    nan, inf = float("nan"), float("inf")
    means, any_special = [], None
    for bits, (has_nan, pos, neg) in zip(mean_bits, special):
        value = ops.from_bits(bits, out)
        value = ops.where(
            has_nan | (pos & neg), nan, ops.where(pos, inf, ops.where(neg, -inf, value))
        )
        means.append(ops.where(n > 0, value, nan))
        flag = has_nan | pos | neg
        any_special = flag if any_special is None else any_special | flag
    var = ops.from_bits(var_bits, out)
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
