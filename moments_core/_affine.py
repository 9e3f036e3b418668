"""The layers' elementwise output: every rounding fixed, none a compiler can change.

After the statistics (certified: the same bits everywhere) a normalization layer maps
each element through a per-slice scale and shift.  Written naively,

    y = (x - mean) * (gamma / sqrt(var + eps)) + beta,

its bits depend on how it is compiled: XLA contracts a product feeding an addition
into one fused multiply-add (one rounding instead of two), TensorFlow's graph
optimizer rewrites 1 / v into an approximate Reciprocal, and both rewrite
a / sqrt(b) into a * rsqrt(b) (an approximation that differs between TensorFlow's
kernels and XLA's), and XLA turns a division by a broadcast vector into a product
with its reciprocal.  Measured on float32 [64, 8, 8, 32] (issue #27): up to all
131,072 outputs differed between TF eager, tf.function and jit_compile.

The formulas here (docs/algorithm.md section 14) use only

  * exact operations: products of two float32 in float64 (24 + 24 bits <= 53),
    sums and differences that Sterbenz's lemma makes exact, comparisons, integer
    operations on the encodings, conversions to a wider format;
  * one rounding each, of a value that is defined exactly: float32 operations with
    no product feeding them (x - m, and the product r * t, which feeds a
    conversion, not an addition), and conversions float64 -> float32;
  * approximations whose results are then certified and corrected exactly.

A contraction can only remove the rounding of a product; where every product that
feeds an addition is exact there is no rounding to remove, so contracted and
uncontracted code give the same bits.  No formula divides, takes a square root or
a reciprocal whose rounding reaches the result.  The results are therefore the
same in TensorFlow eager, graphs, XLA and JAX, on any device that has IEEE float32
and float64 arithmetic (subnormal results aside: TensorFlow and JAX flush them on
the CPU).

The functions take `ops`, the array namespace of a backend (tf_stable_moments/_ops.py,
jax_kernel/_ops.py; JAX with 64-bit types enabled), and float32 arrays.
"""

from moments_core._exact import bit_length

# Clearing the low 28 of the 52 stored significand bits of a float64 leaves 25
# significant bits; the rest of a 50-bit number then has at most 25 bits too.
_HIGH_25 = -(1 << 28)
_INF_BITS = 0x7F800000  # float32 +inf's encoding: above it (as a magnitude), the NaNs


def round32(ops, a):
    """float64 a rounded to the nearest float32, ties to even, as a float32: the
    conversion (IEEE round to nearest, everywhere), then `canonical_nan`, a select on
    the result's encoding.

    Why the select matters beyond NaNs: XLA may remove a conversion float64 ->
    float32 -> float64 ("excess precision", on by default: measured on the CPU, where
    a float64 sum of squares of values converted to float32 summed them unrounded
    under jax.jit), so a rounded value that a later computation widens again (this
    layer's, or the next layer's statistics kernel) could silently keep its float64
    bits.  Between the two conversions stands the select, whose result is a float32
    that no simplification folds into the float64 it came from (tested:
    tests/test_affine.py, a widened sum of squares under jit against the same sum of
    the rounded values).  Before, the rounding was done on the encoding (integer
    operations, then an exact conversion): the same bits, at some 8x the cost of the
    layers' per-element pass where it runs from cache (a [256, 128] output: 32 us
    against 4 us under jax.jit on this 2-core CPU).  Results below the float32
    normal range (2**-126) are subnormal or flushed to zero where the device flushes
    subnormals (TensorFlow and JAX on the CPU): the one case where the bits follow
    the device.
    """
    return canonical_nan(ops, ops.cast(a, "float32"))


def _float32_neighbours(ops, t):
    """(down, up): the float32 values next to a positive finite float32 t (from its
    encoding: t's successor and predecessor have the adjacent integer encodings)."""
    bits = ops.bitcast(t, "int32")
    return ops.bitcast(bits - 1, "float32"), ops.bitcast(bits + 1, "float32")


def _midpoints(ops, t):
    """(down, up, m_down, m_up): t's neighbours and the float64 midpoints between them
    and t, exact (two adjacent float32 sum exactly in float64; halving is exact)."""
    down, up = _float32_neighbours(ops, t)
    t64 = ops.cast(t, "float64")
    m_down = (ops.cast(down, "float64") + t64) * 0.5
    m_up = (t64 + ops.cast(up, "float64")) * 0.5
    return down, up, m_down, m_up


def _split_25(ops, a):
    """(h, l) with a = h + l exactly, h the leading 25 bits of a float64 a of at most 50
    significant bits and l the rest (at most 25 bits): an integer mask on the encoding,
    then a difference that is exact because l is representable."""
    h = ops.bitcast(ops.band(ops.bitcast(a, "int64"), _HIGH_25), "float64")
    return h, a - h


def _square_times_below_one(ops, m, v):
    """m * m * v < 1, exactly, for float64 m of at most 25 bits and float32 v (as float64)
    with m * m * v within a factor 2 of 1.

    m * m has at most 50 bits: exact.  Split into h + l of 25 bits each, h * v and l * v
    have at most 49 bits: exact.  h * v lies in [1/2, 2], so h * v - 1 is exact
    (Sterbenz).  m * m * v < 1 <=> h * v - 1 < -(l * v): a comparison of two exact
    values.  (Contracting h * v - 1 or m * m - h into a fused multiply-add rounds an
    exact value: the same.)
    """
    h, l = _split_25(ops, m * m)
    return h * v - 1.0 < -(l * v)


def rsqrt32(ops, v):
    """RN32(1 / sqrt(v)) for float32 v: correctly rounded, the same bits everywhere.

    t0 = RN32(1 / sqrt(v)) computed in float64 by whatever the compiler makes of it
    (a division or an rsqrt: relative error far below 2**-30) is within one float32
    ulp of the answer.  The answer is t0's upper neighbour if the midpoint m_up
    between them satisfies m_up**2 * v < 1 (then 1/sqrt(v) > m_up), the lower one if
    m_down**2 * v > 1, else t0: exact tests (`_square_times_below_one`).  1/sqrt(v) is
    never a midpoint (m = M 2**k with M odd of 25 bits, M**2 V 2**j = 1 has no such
    solution), so there are no ties.  v = 0 gives inf, v = inf gives 0, v < 0 or NaN
    gives NaN (the guesses are kept where t0 is not a positive finite number).
    """
    v64 = ops.cast(v, "float64")
    t = round32(ops, 1.0 / ops.sqrt(v64))
    down, up, m_down, m_up = _midpoints(ops, t)
    above = _square_times_below_one(ops, m_up, v64)
    below = ~_square_times_below_one(ops, m_down, v64)
    corrected = ops.where(above, up, ops.where(below, down, t))
    # Tests on the encodings, not float comparisons: TensorFlow's XLA CPU code was seen
    # to return inf for a NaN or negative v in some shapes and not in others (comparisons
    # with NaN not honoured), where integer comparisons hold.
    t_bits, v_bits = ops.bitcast(t, "int32"), ops.bitcast(v, "int32")
    regular = (t_bits > 0) & (t_bits < _INF_BITS)  # t positive and finite
    magnitude = ops.band(v_bits, 0x7FFFFFFF)
    invalid = (magnitude > _INF_BITS) | ((v_bits < 0) & ops.ne(magnitude, 0))  # NaN, v < 0
    return ops.where(invalid, float("nan"), ops.where(regular, corrected, t))


def canonical_nan(ops, y):
    """float32 y with every NaN the quiet NaN 0x7FC00000 (an integer test on the encoding):
    a NaN's sign and payload depend on which operand a machine instruction propagates,
    which compilers reorder, so the formulas' results name one NaN.  Where the
    operations honour IEEE comparisons with NaN (`ops.honours_nan`: TensorFlow's own
    kernels, not XLA's CPU code, see `rsqrt32`) the test is `isnan`: one pass over
    the output instead of two (an exported layer's output formula, `scale_shift32` in
    plain operations: 0.97 ms against 1.21 ms on [32, 8, 8, 256])."""
    if ops.honours_nan:
        return ops.where(ops.isnan(y), float("nan"), y)
    magnitude = ops.band(ops.bitcast(y, "int32"), 0x7FFFFFFF)
    return ops.where(magnitude > _INF_BITS, float("nan"), y)


def div32(ops, a, s):
    """RN32(a / s) for float32 a and s: correctly rounded, the same bits everywhere.

    As `rsqrt32`: t0 from a float64 division (whatever the compiler makes of it: XLA
    divides by a broadcast vector through its reciprocal, TensorFlow's graph optimizer
    turns 1 / s into an approximate Reciprocal), then the exact tests m * |s| < |a|
    (m of 25 bits, s of 24: an exact product in float64).  No ties: a / s = M 2**k with
    M odd of 25 bits would make M 2**k s, a number of at least 25 bits, equal to a.
    Where t0 is 0, inf or NaN (a or s 0, inf or NaN, or the quotient beyond the float32
    range) t0 is the answer.
    """
    a64, s64 = ops.cast(a, "float64"), ops.cast(s, "float64")
    t = round32(ops, a64 / s64)
    t_abs = ops.abs(t)
    down, up, m_down, m_up = _midpoints(ops, t_abs)
    a_abs, s_abs = ops.abs(a64), ops.abs(s64)
    above = m_up * s_abs < a_abs
    below = m_down * s_abs > a_abs
    corrected = ops.where(above, up, ops.where(below, down, t_abs))
    corrected = ops.where(t < 0, -corrected, corrected)
    regular = (t_abs > 0) & (t_abs < float("inf"))
    return ops.where(regular, corrected, t)


def recip32(ops, s):
    """RN32(1 / s): `div32` with a = 1."""
    return div32(ops, ops.ones_like(s), s)


def times32(ops, a, b):
    """RN32(a * b): the exact float64 product rounded once to float32.

    (A float32 product is the same value; the float64 detour keeps a chain a * b * c
    from being reordered by a graph optimizer: TensorFlow's reorders chains of
    products to broadcast less, which changes their roundings.)"""
    return round32(ops, ops.cast(a, "float64") * ops.cast(b, "float64"))


def affine32(ops, r, f, b):
    """RN32(RN64(r * f + b)) for float32 r, f, b.

    r * f is exact in float64, so a contraction of r * f + b into a fused multiply-add
    computes the same float64 sum as the separate operations; the sum is rounded to
    float64, then to float32 (a double rounding: it differs from RN32(r * f + b) by
    one ulp when the float64 sum lands exactly on a float32 midpoint, rarely, and
    always the same way).
    """
    p = ops.cast(r, "float64") * ops.cast(f, "float64")
    return round32(ops, p + ops.cast(b, "float64"))


def blend32(ops, a, wa, b, wb):
    """RN32(RN64(a * wa + b * wb)) for float32 operands: moving averages, and the
    masked variance.  Both products are exact in float64; contracting either into the
    sum rounds the same exact value once."""
    p = ops.cast(a, "float64") * ops.cast(wa, "float64")
    q = ops.cast(b, "float64") * ops.cast(wb, "float64")
    return round32(ops, p + q)


def scale_shift32(ops, r, v, gamma=None, beta=None, shared=False, t=None):
    """A normalization layer's output from r (centred input), v = var + eps (per slice,
    broadcast against r), gamma and beta (None where absent), all float32, with the
    per-slice t = rsqrt32(v) (or t as given: the same values from a native call, v then
    unused):

      shared (gamma per slice, as t: BatchNormalization):  y = RN32(RN64(r f + beta)),
          f = times32(gamma, t);
      else (t per sample or group, gamma per feature: LN, GN):  y = RN32(RN64(p gamma +
          beta)), p = times32(r, t);
      no gamma: y = RN32(RN64(r t + beta));  no beta: the products alone (times32).
    """
    # Per-slice values as buffers of their own (ops.materialize): XLA would otherwise fuse
    # their chains (some 60 operations) into the per-element pass, once per element.
    if t is None:
        t = ops.materialize(rsqrt32(ops, v))
    if gamma is None:
        return times32(ops, r, t) if beta is None else affine32(ops, r, t, beta)
    if shared:
        r, scale = r, ops.materialize(times32(ops, gamma, t))
    else:
        r, scale = times32(ops, r, t), gamma
    return times32(ops, r, scale) if beta is None else affine32(ops, r, scale, beta)


# ---------------------------------------------------------------- float64 (section 14b)
# float64 has no wider format here, so a rounded float64 product feeding an addition is
# what a contraction changes.  The float64 formulas therefore multiply only halves: every
# operand is split on its encoding (integer operations) into a part of 26 significant bits
# and the rest, so that each product of parts is exact, and the sums of exact products
# come in a fixed order.  Every result leaves through `canonical_nan64`, a select on the
# encoding, so that no caller's addition can be contracted with a product of ours.
_MANT_BITS = (1 << 52) - 1
_LOW_27 = (1 << 27) - 1
_INF_BITS_64 = 0x7FF0000000000000
_LIMB = 18  # the exact tests' integers, in limbs of 18 bits (products of 3 limbs < 2**63)
_LIMB_MASK = (1 << _LIMB) - 1


def canonical_nan64(ops, y):
    """float64 y with every NaN the quiet NaN (an integer test on the encoding), and a
    select that no compiler contracts with the product that may have made y."""
    magnitude = ops.band(ops.bitcast(y, "int64"), 0x7FFFFFFFFFFFFFFF)
    return ops.where(magnitude > _INF_BITS_64, float("nan"), y)


def _fields(ops, a):
    """(bits, field, M) of float64 a: its encoding, exponent field and integer significand
    (the implicit bit included for normal numbers): |a| = M 2**(field - 1075)."""
    bits = ops.bitcast(a, "int64")
    field = ops.band(ops.shr(bits, 52), 0x7FF)
    mant = ops.band(bits, _MANT_BITS) + ops.where(ops.ne(field, 0), 1 << 52, 0)
    return bits, field, mant


def _pow2_64(ops, e):
    """2**e as a float64 for int64 e in [-1022, 1023] (built on the encoding)."""
    return ops.bitcast(ops.shl(e + 1023, 52), "float64")


def _scaled(ops, k, e, negative):
    """+-k 2**e for int64 |k| < 2**28 and e >= -1074: exact where the result is a normal
    number (two products by powers of two in the normal range, each exact)."""
    half = ops.shr(e, 1)
    v = ops.cast(k, "float64") * _pow2_64(ops, half) * _pow2_64(ops, e - half)
    return ops.where(negative, -v, v)


def split64(ops, a, rounded=False):
    """(h, l) with a = h + l exactly, h the leading 26 significant bits of float64 a
    (truncated, or rounded to nearest: then |l| has at most 26 bits, else 27), both from
    the encoding: integer operations and exact scalings, no float64 operation on a, so
    that a may be a product the compiler could otherwise contract.  Zero, subnormal,
    infinite and NaN a (and h rounded up to infinity): (a, 0)."""
    bits, field, mant = _fields(ops, a)
    if rounded:
        lowest_kept = ops.band(ops.shr(bits, 27), 1)
        hbits = ops.band(bits + (lowest_kept + ((1 << 26) - 1)), ~_LOW_27)
    else:
        hbits = ops.band(bits, ~_LOW_27)
    h = ops.bitcast(hbits, "float64")
    _, hfield, hmant = _fields(ops, h)
    diff = mant - ops.shl(hmant, hfield - field)  # h may have carried into the next binade
    low = _scaled(ops, ops.abs(diff), field - 1075, (bits < 0) ^ (diff < 0))
    regular = (field > 0) & (field < 0x7FF) & (hfield < 0x7FF)
    return ops.where(regular, h, a), ops.where(regular, low, ops.zeros_like(a))


def times64(ops, a, b):
    """RN64(a * b) for float64 a and b: the product, left through `canonical_nan64`."""
    return canonical_nan64(ops, a * b)


def _product_terms(ops, a, b, a_rounded=True):
    """(high, low) of a * b: high = ah bh exact, low = RN(RN(ah bl + al bh) + al bl) of
    exact products (b split rounded, or given as that split (bh, bl); a rounded or
    truncated: 26 + 27 bits <= 53)."""
    ah, al = split64(ops, a, a_rounded)
    bh, bl = b if isinstance(b, tuple) else split64(ops, b, True)
    return ah * bh, (ah * bl + al * bh) + al * bl


def affine64(ops, r, f, b):
    """RN(RN(rh fh + b) + RN(RN(rh fl + rl fh) + rl fl)): r f + b for float64 operands
    within a few ulps, with every product exact (r split truncated, f rounded: 26 + 27
    bits), so that no contraction changes a bit.  r may be a product; f and b must not
    be products computed in the same expression (weights, buffers, our results).  f may
    come as its rounded split (fh, fl), `split64(f, rounded=True)`."""
    high, low = _product_terms(ops, r, f, a_rounded=False)
    return canonical_nan64(ops, (high + b) + low)


def blend64(ops, a, wa, b, wb):
    """a wa + b wb for float64 operands (moving averages, the masked variance):
    RN(RN(Pa + Pb) + RN(pa + pb)) with Pa, pa the exact high part and the rounded low
    part of a wa (`_product_terms`), likewise for b wb."""
    ha, la = _product_terms(ops, a, wa)
    hb, lb = _product_terms(ops, b, wb)
    return canonical_nan64(ops, (ha + hb) + (la + lb))


def _limbs(ops, m):
    """Non-negative int64 m < 2**54 as 3 limbs of 18 bits, lowest first."""
    return [ops.band(m, _LIMB_MASK), ops.band(ops.shr(m, _LIMB), _LIMB_MASK), ops.shr(m, 36)]


def _multiply(ops, x, y, length):
    """The product of two normalised limb lists, normalised to `length` limbs (each
    convolution sum has at most 3 terms below 2**36: no overflow)."""
    conv = [None] * (len(x) + len(y) - 1)
    for i, a in enumerate(x):
        for j, b in enumerate(y):
            conv[i + j] = a * b if conv[i + j] is None else conv[i + j] + a * b
    out, carry = [], 0
    for k in range(length):
        d = (conv[k] if k < len(conv) else 0) + carry
        out.append(ops.band(d, _LIMB_MASK))
        carry = ops.shr(d, _LIMB)
    return out


def _below(ops, limbs, a, d):
    """L < a 2**d, exactly, for L >= 1 in normalised limbs, int64 1 <= a < 2**53 and int64
    d.  Different bit lengths decide; equal ones (then d = len(L) - len(a) >= 0, as in
    every use here, L having over 100 bits) compare floor(L / 2**d) with a: L = Q 2**d + R,
    0 <= R < 2**d, so L < a 2**d <=> Q < a."""
    length = 0
    for k, limb in enumerate(limbs):
        length = ops.where(ops.ne(limb, 0), _LIMB * k + bit_length(ops, limb), length)
    target = bit_length(ops, a) + d
    shift = ops.maximum(d, 0)
    q = 0
    for k, limb in enumerate(limbs):
        up = _LIMB * k - shift
        moved = ops.where(
            up >= 0,
            ops.shl(limb, ops.minimum(ops.maximum(up, 0), 62)),
            ops.shr(limb, ops.minimum(ops.maximum(-up, 0), 62)),
        )
        q = q + moved
    return ops.where(ops.ne(length, target), length < target, q < a)


def _nearest(ops, t, ok, exceeds):
    """The float64 nearest to a positive value x from a guess t within two ulps of it, where
    ok and t is a positive normal number (else t): twice, t moves to its upper neighbour
    if x exceeds the midpoint above t, to its lower one if x does not exceed the midpoint
    below.  exceeds(M, e): whether x exceeds the midpoint (2 M + 1) 2**(e - 1) above the
    float64 M 2**e, exactly (x is never a midpoint)."""
    for _ in range(2):
        regular = ok & _normal64(ops, t, positive=True)
        safe = ops.where(regular, t, ops.ones_like(t))
        bits = ops.bitcast(safe, "int64")
        down, up = ops.bitcast(bits - 1, "float64"), ops.bitcast(bits + 1, "float64")
        _, fd, md = _fields(ops, down)
        _, ft, mt = _fields(ops, safe)
        above, below = exceeds(mt, ft - 1075), ~exceeds(md, fd - 1075)
        fixed = ops.where(above, up, ops.where(below, down, safe))
        t = ops.where(regular, fixed, t)
    return t


def _normal64(ops, a, positive=False):
    """a is a nonzero finite normal float64 (and positive): integer tests on the encoding."""
    bits = ops.bitcast(a, "int64")
    field = ops.band(ops.shr(bits, 52), 0x7FF)
    normal = (field > 0) & (field < 0x7FF)
    return normal & (bits > 0) if positive else normal


def rsqrt64(ops, v):
    """RN64(1 / sqrt(v)) for float64 v: correctly rounded, the same bits everywhere.

    A guess t from 1 / sqrt(v) (whatever the compiler makes of it: within two ulps), then
    twice: the midpoint m = (2 M + 1) 2**(e - 1) between t = M 2**e and a neighbour is
    tested exactly, m**2 v < 1 <=> (2 M + 1)**2 V < 2**-(2 e - 2 + e_v) for v = V 2**e_v,
    in integers (`_below`, 18-bit limbs); t moves to the neighbour the tests point to.  No
    ties: (2 M + 1)**2 V is never a power of two.  Special values as `rsqrt32`.
    """
    _, fv, mv = _fields(ops, v)
    v_limbs, ev = _limbs(ops, mv), fv - 1075

    def under_one(m, e):  # ((2 m + 1) 2**(e - 1))**2 v < 1
        odd = _limbs(ops, 2 * m + 1)
        w = _multiply(ops, _multiply(ops, odd, odd, 6), v_limbs, 9)
        return _below(ops, w, ops.ones_like(e), -(2 * e - 2 + ev))

    t = _nearest(ops, 1.0 / ops.sqrt(v), _normal64(ops, v), under_one)
    bits = ops.bitcast(v, "int64")
    magnitude = ops.band(bits, 0x7FFFFFFFFFFFFFFF)
    invalid = (magnitude > _INF_BITS_64) | ((bits < 0) & ops.ne(magnitude, 0))
    return canonical_nan64(ops, ops.where(invalid, float("nan"), t))


def div64(ops, a, s):
    """RN64(a / s) for float64 a and s: correctly rounded, the same bits everywhere.

    A guess t from a / s (any division: within two ulps), then twice the exact tests
    m |s| < |a| at the midpoints m = (2 M + 1) 2**(e - 1) next to |t| = M 2**e:
    (2 M + 1) S < A 2**(e_a - e_s - e + 1) in integers (`_below`).  No ties.  Where a or s
    is zero, subnormal, infinite or NaN, or |t| is not a normal number, t."""
    t = a / s
    _, fa, ma = _fields(ops, a)
    _, fs, ms = _fields(ops, s)
    s_limbs, ea, es = _limbs(ops, ms), fa - 1075, fs - 1075

    def below_a(m, e):  # (2 m + 1) 2**(e - 1) |s| < |a|
        w = _multiply(ops, _limbs(ops, 2 * m + 1), s_limbs, 7)
        return _below(ops, w, ma, ea - es - e + 1)

    ok = _normal64(ops, a) & _normal64(ops, s)
    negative = t < 0
    t_abs = _nearest(ops, ops.abs(t), ok, below_a)
    return canonical_nan64(ops, ops.where(negative, -t_abs, t_abs))


def scale_shift64(ops, r, v, gamma=None, beta=None, shared=False):
    """`scale_shift32` for float64 operands: t = rsqrt64(v) per slice; shared (BN):
    y = affine64(r, times64(gamma, t), beta); else (LN, GN) y = affine64(times64(r, t),
    gamma, beta); no gamma: affine64(r, t, beta); no beta: the products (times64).
    The per-slice (or per-feature) scale is split once, into buffers of their own: XLA
    would otherwise split it again for every element."""

    def parts(scale):
        return tuple(ops.materialize(p) for p in split64(ops, scale, True))

    t = ops.materialize(rsqrt64(ops, v))
    if gamma is None:
        return times64(ops, r, t) if beta is None else affine64(ops, r, parts(t), beta)
    if shared:
        r, scale = r, ops.materialize(times64(ops, gamma, t))
    else:
        r, scale = times64(ops, r, t), gamma
    return times64(ops, r, scale) if beta is None else affine64(ops, r, parts(scale), beta)
