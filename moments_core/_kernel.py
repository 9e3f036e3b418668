"""The certified moments kernel, written once for every backend.

docs/algorithm.md is the contract; section numbers below refer to it.  Every
function takes `ops`, a small namespace of array operations (TensorFlow:
``tf_stable_moments/_ops.py``; JAX: ``jax_kernel/_ops.py``), so that the
TensorFlow and the JAX implementation are the same code.

Per slice (section 4): a fast approximation of the mean and of the variance in
float64 (float64 pairs for float64 input) with a rigorous error bound that holds
for any order of evaluation of its sums; the rounding test of section 5 decides
the correctly rounded result when the whole error interval lies in one rounding
cell.  Slices it does not decide (and slices with NaN or Inf) take the exact
path of section 7 (`_exact.py`), in batches of BATCH slices in a while loop, so
the common case pays one check.
"""

import os
import struct
from fractions import Fraction
from typing import NamedTuple

from moments_core import _exact, _state

U = 2.0**-53  # unit roundoff of float64
MARGIN = 1.0 + 2.0**-20  # covers the roundings of evaluating the bounds themselves
TINY = 2.0**-1000  # per element: what flushing a float64 intermediate can lose (pairs only)
BATCH = 8  # slices per iteration of the exact path (fewer for long slices: `_batch`)
BATCH_ELEMENTS = 2**16  # elements per iteration of the exact path, at most BATCH slices
BLOCK = 256  # terms per block of the fast path's float64 sums (`block_sums`)
SUB = 16  # a block is reduced as SUB x SUB terms (BLOCK = SUB**2): see `_block_stage`
SUMS_BATCH = 64  # slices per iteration when only the sums need exact rounding
ONE_PASS_ROWS = 2**17  # slice length from which the exact path sums by the one pass
SPLIT_MASK = ~((1 << 27) - 1)
SPLIT_HALF = 1 << 26


# ---------------------------------------------------------------- error-free steps (section 6)
def two_sum(a, b):
    """s + e == a + b exactly, s = fl(a + b) (Knuth; Ogita-Rump-Oishi Alg. 3.1)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def fast_two_sum(a, b):
    """s + e == a + b exactly when |a| >= |b| or a == 0 (Dekker)."""
    s = a + b
    return s, b - (s - a)


def split(ops, a):
    """a == hi + lo, hi rounded to 26 significant bits by integer operations on its bits.

    A Python float (a count's reciprocal) is split on the host, by the same integer
    operations on its encoding: the same values, and no operations in the graph."""
    if isinstance(a, float):
        bits = struct.unpack("<q", struct.pack("<d", a))[0]
        hi = struct.unpack("<d", struct.pack("<q", (bits + SPLIT_HALF) & SPLIT_MASK))[0]
        return hi, a - hi
    bits = ops.bitcast(a, "int64")
    hi = ops.bitcast(ops.band(bits + SPLIT_HALF, SPLIT_MASK), "float64")
    return hi, a - hi


def two_prod(ops, a, b):
    """(p, e), p + e == a * b up to the rounding of al * bl (products of split halves)."""
    ah, al = split(ops, a)
    bh, bl = split(ops, b)
    p, e1 = two_sum(ah * bh, ah * bl)
    p, e2 = two_sum(p, al * bh)
    return p, (e1 + e2) + al * bl


def df_add(ah, al, bh, bl):
    """Pair sum; error below 8 u**2 (|a| + |b|) for pairs with |al| <= u |ah|, |bl| <= u |bh|.

    (s, e) = TwoSum(ah, bh) is exact; al + bl is rounded once (<= u**2 (|ah| + |bh|)), its
    sum with e once (<= u (|e| + |al + bl|) <= 2 u**2 (|ah| + |bh|)); FastTwoSum of s and
    that sum w is exact where |s| >= |w|, and where it is not (s cancelled to below
    u (|ah| + |bh|)) its two roundings of values below 4 u (|ah| + |bh|) lose at most
    4 u**2 (|ah| + |bh|): 7 u**2 in all, to first order."""
    s, e = two_sum(ah, bh)
    return fast_two_sum(s, e + (al + bl))


def df_mul(ops, ah, al, bh, bl):
    """Pair product; error below 26 u**2 |a b| for pairs with |al| <= u |ah|, |bl| <= u |bh|.

    (p, e) = `two_prod`(ah, bh) is within 8 u**2 |ah bh| (`pair_times`), with |e| <= 4 u
    |ah bh| (p is ah bh after two roundings and without the product of the low halves,
    below 2u |ah bh|).  Each cross product ah bl, al bh is the high part of a `two_prod`,
    within 4 u of it: 4 u**2 |ah bh| each; their sum is rounded once (<= 2 u**2 |ah bh|)
    and al bl (<= u**2 |ah bh|) is dropped: 11 u**2.  e + cross is rounded once (<= u (4 u
    + 2 u) |ah bh| = 6 u**2), and FastTwoSum of p and it is exact (|e + cross| is far below
    |p|): 25 u**2 |ah bh| in all, to first order, below 26 u**2 |a b|.  With al = 0 (or
    bl = 0) one cross product remains, exact to add: 8 + 4 + 5 = 17 u**2.  (The bound was
    written 16 u**2 before 2026-12-06 without this count; sampled errors stayed below
    8 u**2.)"""
    p, e = two_prod(ops, ah, bh)
    cross = two_prod(ops, ah, bl)[0] + two_prod(ops, al, bh)[0]
    return fast_two_sum(p, e + cross)


def square(ops, dh, dl):
    """(qh, ql) ~ (dh + dl)**2 from products of split halves; error below 32 u**2 q."""
    ah, al = split(ops, dh)
    ch, cl = split(ops, dl)
    a2 = ah + ah
    qh, q1 = two_sum(ah * ah, a2 * al)
    return qh, q1 + ((al * al + a2 * ch) + (a2 * cl + (al + al) * ch))


def pow2(ops, k):
    """2.0**k (float64) for integer k in [-1022, 1023], built from its bits."""
    return ops.bitcast(ops.shl(ops.cast(k, "int64") + 1023, 52), "float64")


def exponent(ops, a):
    """floor(log2 |a|) of a normal float64; -1023 for zero."""
    return ops.band(ops.shr(ops.bitcast(a, "int64"), 52), 0x7FF) - 1023


def gamma(k):
    """An upper bound of gamma_k = k u / (1 - k u) for k u <= 1/2, without a division."""
    return k * U * (1.0 + 2.0 * k * U)


# ---------------------------------------------------------------- counts (section 4)
class Counts(NamedTuple):
    n: object  # the count: a Python int or an int64 scalar
    nf: object  # n as a float64 (exact: n < 2**46)
    rn: tuple  # 1/n as a float64 pair, error below u**2 / n
    rd: tuple  # 1/max(n - ddof, 1) likewise


def reciprocal_pair(ops, n):
    """1/n as a float64 pair for an integer n >= 1: exact rounding on the host, else
    integer long division in 16-bit digits (no floating-point division: XLA's is not IEEE)."""
    if isinstance(n, int):
        h = float(Fraction(1, n))
        return h, float(Fraction(1, n) - Fraction(h))
    t = _exact.bit_length(ops, n)
    r = ops.shl(ops.ones_like(n), t)  # 2**(t-1) <= n < 2**t
    digits = []
    for _ in range(8):
        # r >= 0 and n >= 1: the truncated quotient is the floor, without the sign
        # corrections of a floor division, which XLA repeats in each fusion of the
        # digits' chain (JAX, the fast path of float32 [3840, 64] with n an input, as
        # TensorFlow's padded batches have it: 2,810 -> 2,046 HLO lines, compiled in
        # 0.61 -> 0.42 s).
        d = ops.truncdiv(r, n)
        digits.append(ops.cast(d, "float64"))
        r = ops.shl(r - d * n, 16)  # r < n < 2**46
    a = ((digits[0] + digits[1] * 2.0**-16) + digits[2] * 2.0**-32) + digits[3] * 2.0**-48
    b = (digits[4] * 2.0**-64 + digits[5] * 2.0**-80) + digits[6] * 2.0**-96
    h, l = two_sum(a, b)
    l = l + digits[7] * 2.0**-112
    scale = pow2(ops, -t)
    return h * scale, l * scale


def counts(ops, n, ddof, reciprocals=True):
    """Counts of n (an int, or an int64 array) for ddof; reciprocals=False leaves rn and
    rd None (the exact path divides by integers).  With ddof 0, rd is rn: for an n not
    known while tracing, each reciprocal is some 90 operations to trace."""
    if isinstance(n, int):
        if not reciprocals:
            return Counts(n, float(n), None, None)
        rn = reciprocal_pair(ops, max(n, 1))
        return Counts(n, float(n), rn, reciprocal_pair(ops, max(n - ddof, 1)) if ddof else rn)
    n = ops.cast(n, "int64")
    if not reciprocals:
        return Counts(n, ops.cast(n, "float64"), None, None)
    one = ops.ones_like(n)
    rn = reciprocal_pair(ops, ops.maximum(n, one))
    rd = reciprocal_pair(ops, ops.maximum(n - ddof, one)) if ddof else rn
    return Counts(n, ops.cast(n, "float64"), rn, rd)


# ---------------------------------------------------------------- fast path (section 4)
def block_sums(ops, a, b, c, axis, terms):
    """(sum a, sum b, min c, g) along `axis` of 2-D arrays, summed to a known depth.

    The terms of each slice are cut into blocks of BLOCK consecutive terms (the last
    one shorter); each block is summed by one reduction of unknown order (`ops.sums_min`),
    the block sums by a compensated sum of pairs in any tree (`ops.pair_sums_min`), and
    the pair rounded once to float64.  XLA may reduce a block in any order and fuse or
    split reductions, but it cannot merge the two stages: their reductions apply
    different computations.  Section 4, "Depth": with L the longest block and m the
    number of blocks, every sum s of terms t_i (each t_i the rounded value of an exact
    term T_i through at most j roundings) satisfies

        |s - sum T_i| <= (gamma_(L + j) + 2 e_m) sum |T_i|,   e_m = gamma_(2m) u m

    (a block: gamma_(L-1); the compensated sum: e_m of the sum of the |block sums|,
    section 6; the final rounding: u).  g(j) returns that factor.  A slice of at most
    BLOCK terms is one reduction: g(j) is the any-order gamma_(n + j - 1).  A length
    unknown while tracing (TF) pads every slice to whole blocks with exact zeros (a, b)
    and inf (c), and adds one more block of them (m counts it), which change no sum
    and no minimum.  terms: n, the number of terms that
    may be nonzero (float64; the others are exact zeros, which no addition rounds), so
    that L is at most n too.
    """
    n = ops.shape(a, axis)
    if isinstance(n, int) and n <= BLOCK:
        return (*ops.sums_min(a, b, c, axis), lambda j: gamma(terms + j))
    arrays = (a, b, c)
    if isinstance(n, int):
        m = n - n % BLOCK
        full = m // BLOCK
        cut = [t[:m] if axis == 0 else t[:, :m] for t in arrays]
        blocks = _block_stage(ops, cut, axis, full)
        if m < n:
            tail = ops.sums_min(*(t[m:] if axis == 0 else t[:, m:] for t in arrays), axis)
            blocks = [ops.concat([s, ops.expand_dims(r, axis)], axis) for s, r in zip(blocks, tail)]
        count = float(full + (m < n))
    else:
        full = (n + (BLOCK - 1)) // BLOCK
        padded = [
            ops.pad(t, axis, full * BLOCK - n, v) for t, v in zip(arrays, (0.0, 0.0, float("inf")))
        ]
        blocks = _block_stage(ops, padded, axis, full)
        # One more block of exact zeros (inf for the minimum): a slice of one block
        # would make the second stage a reduction over one element, which XLA turns
        # into a reshape once the length is known, and its reshape mover sinks that
        # reshape through the per-slice chain one operation per round of its
        # simplification fixpoint (TF `jit_compile` ResNet50: 9 rounds after the changes
        # of `_batched` and `_exact`, 4 with the block; docs section 10).  The bound
        # counts the block.
        blocks = [ops.pad(t, axis, 1, v) for t, v in zip(blocks, (0.0, 0.0, float("inf")))]
        count = ops.cast(full + 1, "float64")
    h1, l1, h2, l2, smallest = ops.pair_sums_min(*blocks, axis)
    e = 2.0 * gamma(2.0 * count) * U * count
    longest = min(terms, BLOCK) if isinstance(terms, float) else ops.minimum(terms, float(BLOCK))
    return h1 + l1, h2 + l2, smallest, lambda j: gamma(longest + j + 1.0) + e


def depth_bound(ops, n):
    """g(j) that bounds `block_sums`' g(j) for every slice of at most n terms (n: a
    float, or a float64 array): the longest block is at most min(n, BLOCK) terms and the
    number of blocks at most ceil(n / BLOCK) + 1 (a length unknown while tracing adds a
    block of zeros), and gamma_k and e_m grow with k and m (a slice of at most BLOCK
    terms has the any-order gamma_(n + j - 1), below it too)."""
    if isinstance(n, float):
        blocks = float(-(-int(n) // BLOCK) + 1)
        longest = min(n, float(BLOCK))
    else:
        blocks = ops.floor((n + (2 * BLOCK - 1)) * (1.0 / BLOCK))  # exact: n < 2**53, BLOCK 2**8
        longest = ops.minimum(n, float(BLOCK))
    e = 2.0 * gamma(2.0 * blocks) * U * blocks
    return lambda j: gamma(longest + j + 1.0) + e


def _block_stage(ops, arrays, axis, full):
    """Per block of BLOCK consecutive terms of 2-D arrays of `full` blocks along axis:
    (sum, sum, min) as [full, kept] (axis 0) or [kept, full] (axis 1).

    A block is reduced as SUB x SUB terms (axis 1: the terms SUB apart first), which
    XLA's CPU emitter keeps vectorised (float64 [65536, 64] along axis 0 under JAX: 2.1 ms against
    8.0 ms for one reduction of each block, 18 ms unblocked; along axis 1, 2.2 ms against
    7.0 ms).  It is still a sum of the block's terms in some order, all the bound counts.
    """
    kept = ops.shape(arrays[0], 1 - axis)
    shape = [full, SUB, SUB, kept] if axis == 0 else [kept, full, SUB, SUB]
    inner = ops.sums_min(*(ops.reshape(t, shape) for t in arrays), 2)
    return ops.sums_min(*inner, axis + 1)


class Approx(NamedTuple):
    """Per slice: approximations as float64 pairs (h, l) and rigorous bounds of their error."""

    mean: tuple
    mean_err: object
    num: tuple  # n_eff * variance: sum (x - mean)**2
    num_err: object
    sums: tuple = None  # (K, sum y, sum y**2) (float64 sums only)
    exact: object = None  # where those sums are exact
    grid: object = None  # q: every input of the slice is a multiple of q (float64 sums only)
    exact_mean: object = None  # where sum y alone is exact (float64 sums only)


def approximate(ops, x, magnitude, first, axis, c, fmt, w=None):
    """The fast approximation of one real part: x float64 [.., ..] and its magnitude
    (both from `flush`), first = x's first element per slice (keepdims), c the Counts,
    fmt the target format.  Returns
    (Approx, bad): bad marks slices whose sums are not finite (a NaN or Inf in the
    slice, or an overflow).

    w: None, or integer frequency weights (float64, like x; c.n their sums per
    slice, elements of weight 0 replaced by `first`): then A = sum w (x - K) and
    B = sum w (x - K)**2 from t = fl(w y), fl(t y), m = the slice length terms:
    |s2 - B| <= gamma_(m+4) B, |s1 - A| <= gamma_(m+1) sum w |x - K| and
    sum w |x - K| <= sqrt(W B) (Cauchy-Schwarz), W = sum w.
    """
    y = x - first
    n = c.nf
    if w is None:
        s1, s2, smallest, depth = block_sums(ops, y, y * y, magnitude, axis, n)
        g2, g1 = depth(2), depth(1)
    else:
        t = w * y
        m = ops.shape(x, axis)
        m = float(m) if isinstance(m, int) else ops.cast(m, "float64")
        s1, s2, smallest, depth = block_sums(ops, t, t * y, magnitude, axis, m)
        g2, g1 = depth(4), depth(1)
    k = ops.squeeze(first, axis)
    bad = ~ops.isfinite(s2) | ~ops.isfinite(s1)
    # S2 = sum y**2 of the exact differences y = x - K: each y and y**2 rounds once,
    # the sum of n terms in any order has error gamma_(n-1) sum|t| (all t >= 0).
    b_up = s2 * (1.0 + 2.0 * g2) * MARGIN
    a_abs = ops.sqrt(n * b_up) * MARGIN  # sum |y| <= sqrt(n sum y**2)
    unit, exact, exact_mean = _lattice(ops, smallest, b_up, a_abs, n, bad, fmt, 52)
    d2 = ops.where(exact, 0.0, g2 * b_up)
    d1 = ops.where(exact_mean, 0.0, g1 * a_abs * MARGIN)
    approx = _from_sums(ops, k, s1, s2, d1, d2, c)
    approx = approx._replace(sums=(k, s1, s2), exact=exact, grid=unit, exact_mean=exact_mean)
    return approx, bad


def _lattice(ops, smallest, b_up, a_abs, n, bad, fmt, bits, qmin=0.0):
    """(q, exact, exact_mean): where the sums are exact, for sums that are exact on
    multiples of q below 2**bits q (float64: 52; float32 pairs: 45, section 4b).

    Every x is a multiple of q, the unit in the last place of the smallest nonzero |x|
    in its format; if sum y**2 <= 2**bits q**2 and sum |y| <= sqrt(n sum y**2) <=
    2**bits q, every y, y**2 and every partial sum, in any order, is an integer
    multiple of q (q**2) below 2**bits of them: no rounding happened, s1 and s2 are
    exact (used by the exact path and the tie test of `certify`).  s1 alone is exact
    when sum |y| <= 2**bits q, whatever the squares do.  qmin: the smallest q (and
    q**2) for which no multiple is flushed.
    """
    unit = pow2(ops, ops.minimum(exponent(ops, smallest), 1000) - (fmt.precision - 1))
    lattice = ops.isfinite(smallest) & ~bad & (unit >= qmin)
    exact = lattice & (b_up <= 2.0**bits * unit * unit) & (unit * unit >= qmin)
    exact = exact & (n * b_up <= 2.0 ** (2 * bits) * unit * unit)
    exact_mean = lattice & (a_abs <= 2.0**bits * unit)
    return unit, exact, exact_mean


def _from_sums(ops, k, s1, s2, d1, d2, c):
    """Approx from the float64 sums s1 ~ A = sum (x - K), s2 ~ B = sum (x - K)**2 and
    bounds |s1 - A| <= d1, |s2 - B| <= d2: mean = K + A / n, num = B - A**2 / n."""
    t = s1 * c.rn[0]
    mean = k + t
    mean_err = ((d1 + 3.0 * U * ops.abs(s1)) * c.rn[0] * MARGIN + U * ops.abs(t)) * MARGIN
    mean_err = (mean_err + U * ops.abs(mean)) * MARGIN
    corr = (s1 * s1) * c.rn[0]
    d_corr = d1 * (2.0 * ops.abs(s1) + d1) * c.rn[0] * MARGIN + 4.0 * U * ops.abs(corr)
    num = s2 - corr
    num_err = (d2 + d_corr + U * ops.abs(num)) * MARGIN
    zero = ops.zeros_like(num)
    return Approx((mean, zero), mean_err, (num, zero), num_err)


# ---------------------------------------------------------------- float32 pairs (section 4b)
def f32_pairs(platform=None):
    """Whether the fast path sums float32/float16/bfloat16 input in float32 pairs on
    `platform` ("cpu", "cuda", "rocm", "tpu"; None: not known while tracing).

    TF_STABLE_MOMENTS_F32_PAIRS=1 (0) forces the pairs on (off) everywhere; otherwise
    they serve TPUs, which have no float64 hardware.  CPUs and GPUs with float64 sum it
    faster (measured on this CPU: float64 0.08-0.39x the time of the pairs).  Either
    way the certificate is the same, and so are the results.
    """
    forced = os.environ.get("TF_STABLE_MOMENTS_F32_PAIRS", "")
    if forced in ("0", "1"):
        return forced == "1"
    return platform == "tpu"


U32 = 2.0**-24  # unit roundoff of float32
ETA = 2.0**-126  # the most a float32 operation can lose to flushing a tiny result to 0
STAGE = 4  # terms per reduction stage of the float32-pair sums
DYNAMIC_STAGES = 6  # stages of STAGE terms for a length unknown while tracing
LEAF = 10.2  # |qh + ql - y**2| <= LEAF u32**2 y**2 (`square32`; 0.1 for flushing, 4b)
NODE = 3.01  # a pair addition errs by at most NODE u32**2 (|h0| + |h1|) (`pair_add32`)
FLUSH = 64.0  # per term: what flushing can lose, in units of ETA (section 4b)
SAMPLE = 64  # leading elements of a slice among which `shift32` picks the shift


def split32(ops, a):
    """a == hi + lo for float32 a, hi rounded to 12 significant bits by integer
    operations on its bits: the products of halves are exact (at most 24 bits)."""
    bits = ops.bitcast(a, "int32")
    hi = ops.bitcast(ops.cast(ops.band(bits + (1 << 11), -(1 << 12)), "int32"), "float32")
    return hi, a - hi


def square32(ops, yh, yl):
    """(qh, ql) ~ (yh + yl)**2 for a float32 pair with |yl| <= u32 |yh|.

    yh**2 = ah**2 + 2 ah al + al**2 exactly (split32); (qh, q1) = TwoSum of the first
    two (exact products); ql adds q1, al**2 (exact) and 2 yh yl (one rounding) and drops
    yl**2 <= u32**2 y**2.  Every product is of halves (exact) or the small 2 yh yl, so a
    compiler's contraction of a product into an addition (an FMA) only removes a
    rounding.  Error: 2 yh yl rounds by <= 2 u32**2 yh**2, the two additions by
    <= 3 and 4 u32**2 yh**2, the dropped term <= u32**2 y**2: LEAF u32**2 y**2.
    """
    ah, al = split32(ops, yh)
    qh, q1 = two_sum(ah * ah, (ah + ah) * al)
    return fast_two_sum(qh, q1 + (al * al + (yh + yh) * yl))


def pair_add32(h0, l0, h1, l1, flip=False):
    """A renormalised pair sum: (s, e) = TwoSum(h0, h1), then TwoSum(s, e + (l0 + l1)).

    Only t = fl(e + fl(l0 + l1)) rounds: with |l_i| <= u32 |h_i| and |e| <= u32 |s|,
    the error is at most u32 (|l0| + |l1|) + u32 |t| <= NODE u32**2 (|h0| + |h1|), and
    the output is normalised again (|l| <= u32 |h|).  flip swaps the operands of the
    first TwoSum (the same values, another computation: see `pair_sums32`).
    """
    s, e = two_sum(h1, h0) if flip else two_sum(h0, h1)
    return two_sum(s, e + (l0 + l1))


def _pairs_min32(ops, flip):
    def combine(a, b):
        (h0, l0, r0, g0, m0, c0), (h1, l1, r1, g1, m1, c1) = a, b
        first = pair_add32(h0, l0, h1, l1, flip)
        # The running bound of the first sum: the magnitudes this addition errs on.
        run = (r0 + r1) + (ops.abs(h0) + ops.abs(h1))
        second = pair_add32(g0, m0, g1, m1, flip)
        return (*first, run, *second, ops.minimum(c0, c1))

    return combine


def pair_sums32(ops, arrays, axis):
    """(h1, l1, r1, h2, l2, smallest, depth): two sums of float32 pairs and a minimum along
    `axis` of 2-D arrays (h1, l1, h2, l2, c), reduced in stages of at most STAGE terms,
    and r1, the first sum's running bound: the float32 sum, over the additions of the
    tree that computed it, of |h0| + |h1| (section 4b, "Running bound").

    Each stage is one variadic reduction of unknown order over groups of STAGE
    consecutive terms (the last stage over what is left), with `pair_add32`: a term
    passes through at most m - 1 additions of a reduction of m terms.  Section 4b,
    "Depth": with D the sum over the stages of (terms per group - 1), the error of a
    sum of pairs T_i is at most NODE D u32**2 sum |T_i| (each addition errs by NODE
    u32**2 times the magnitudes it adds; the magnitudes under one addition sum to at
    most sum |T_i|; a term is under at most D of them).  Consecutive stages apply
    different computations (`pair_add32`'s flip), so that XLA cannot merge two
    reductions into one of more terms.  Padding (a length not a multiple of STAGE, or
    unknown while tracing: DYNAMIC_STAGES stages) appends exact zero pairs and inf,
    which change nothing.  (Explicit halving trees of elementwise additions would
    count log2 STAGE per stage, but XLA's CPU fusion recomputes their shared operands:
    93 ms on float32 [65536, 64], against 20 ms for reductions of groups of 16 and
    4.6 ms for groups of 4, measured before the scaling step.)
    """
    n = ops.shape(arrays[0], axis)
    static = isinstance(n, int)
    arrays = [*arrays[:2], ops.zeros_like(arrays[0]), *arrays[2:]]
    inits = (0.0, 0.0, 0.0, 0.0, 0.0, float("inf"))
    depth, flip, stage = 0.0, False, 0
    while (static and n > STAGE) or (not static and stage < DYNAMIC_STAGES):
        full = -(-n // STAGE) if static else (n + (STAGE - 1)) // STAGE
        kept = ops.shape(arrays[0], 1 - axis)
        shape = [full, STAGE, kept] if axis == 0 else [kept, full, STAGE]
        padded = [ops.pad(t, axis, full * STAGE - n, v) for t, v in zip(arrays, inits)]
        arrays = ops.variadic(
            [ops.reshape(t, shape) for t in padded], inits, _pairs_min32(ops, flip), axis + 1
        )
        depth, flip, stage, n = depth + (STAGE - 1), not flip, stage + 1, full
    arrays = ops.variadic(arrays, inits, _pairs_min32(ops, flip), axis)
    last = float(n - 1) if static else ops.cast(ops.maximum(n, 1) - 1, "float64")
    return (*arrays, depth + last)


def flush32(ops, x, fmt):
    """x as float32 (exact for the formats of precision <= 24), inputs below the
    format's normal range replaced by 0."""
    x = ops.cast(x, "float32")
    return ops.where(ops.abs(x) < 2.0**fmt.emin, ops.zeros_like(x), x)


def shift32(ops, x, axis):
    """K per slice (keepdims) for the float32-pair sums: of the slice's first SAMPLE
    elements (all of a shorter slice), one nearest to their float32 mean (the smallest
    such one).  An element, so the lattice of section 5 holds as for the first element;
    near the mean, so the partial sums of x - K, and with them the running bound of
    their sum (section 4b), stay small.  Any K gives a valid bound: this choice only
    tightens it.  A NaN or Inf among them gives non-finite sums (the exact path, as
    such a slice takes anyway)."""
    sample = ops.head(x, axis, SAMPLE)
    m = ops.shape(sample, axis)
    mean = ops.sum(sample, axis, keepdims=True) / ops.cast(m, "float32")
    d = ops.abs(sample - mean)
    nearest = ops.eq(d, -ops.expand_dims(ops.max(-d, axis), axis))
    candidates = ops.where(nearest, -sample, float("-inf"))
    k = -ops.expand_dims(ops.max(candidates, axis), axis)
    # A sample whose float32 sum is NaN (+inf and -inf, or two opposite overflows) has
    # no nearest element: the first one instead.
    first = first_element(ops, sample, axis, dynamic=not isinstance(ops.shape(x, axis), int))
    return ops.where(ops.isfinite(k), k, first)


def scale32(ops, size, axis):
    """(sigma, k): sigma = 2**k = 2**(40 - e) per slice, e = floor(log2 max |x|) (from
    size = |x|), within float32's normal range: the scaled inputs and differences lie
    below 2**42 in magnitude (their squares and sums far from overflow) and far above
    the flushing threshold unless tiny beside the largest |x| (section 4b)."""
    top = ops.bitcast(ops.max(size, axis), "int32")
    e = ops.band(ops.shr(top, 23), 0xFF) - 127
    k = ops.minimum(ops.maximum(40 - e, -126), 127)
    return ops.bitcast(ops.cast(ops.shl(k + 127, 23), "int32"), "float32"), k


def approximate32(ops, x, first, axis, c, fmt, valid=None):
    """As `approximate` (without weights), summing in float32 pairs: x float32 [.., ..]
    from `flush32`, first an element per slice (keepdims: `shift32`'s).  Section 4b.
    valid: None, or where an element counts (bool, broadcast like x): the others, copies
    of the slice's first counted element, add exact zeros whatever the shift.

    In units scaled by sigma (`scale32`, a power of two per slice), the shift is
    K' = fl(K sigma) (the mean uses K = K' / sigma, the shift actually subtracted) and
    y' = (yh, yl) = TwoSum(x sigma, -K') is exact but for flushing;
    q = square32(y') within LEAF u32**2 y'**2;
    the sums of `pair_sums32` err by NODE D u32**2 sum|T| (the first also by NODE u32**2
    times its running bound, read up, whichever is smaller: with K from `shift32` near
    the mean, several times smaller); their float64 values h + l by U |h + l| more.
    Flushing (a float32 result below 2**-126 read as 0: CPUs under
    TF and JAX, and accelerators) loses less than ETA per operation it touches: at
    most FLUSH n ETA per sum in all (each term passes through fewer than 16
    operations of its own and shares fewer than 16 per addition, of which there are
    fewer than n).  Sums on a lattice are exact as in `approximate` (`_lattice`, 45
    bits: a float32 pair holds every multiple of q below 2**48 q, and its additions
    are exact below 2**46 q); a slice of zeros (smallest = inf) has exact zero sums.
    """
    size = ops.abs(x)
    sigma, shift = scale32(ops, size, axis)
    wide = ops.expand_dims(sigma, axis)
    first = first * wide  # K' = fl(K sigma): exact but for flushing; K = K' / sigma below
    yh, yl = two_sum(x * wide, -first)  # y' = x sigma - K', exact but for flushing
    if valid is not None:
        yh, yl = (ops.where(valid, t, ops.zeros_like(t)) for t in (yh, yl))
    qh, ql = square32(ops, yh, yl)
    mags = ops.where(ops.eq(size, 0.0), float("inf"), size)
    h1, l1, r1, h2, l2, smallest, depth = pair_sums32(ops, [yh, yl, qh, ql, mags], axis)
    s1 = ops.cast(h1, "float64") + ops.cast(l1, "float64")
    s2 = ops.cast(h2, "float64") + ops.cast(l2, "float64")
    sigma = ops.cast(sigma, "float64")
    smallest = ops.cast(smallest, "float64") * sigma  # in scaled units, as the sums
    inverse = pow2(ops, -shift)  # 1 / sigma, exact (float64; no division)
    k = ops.cast(ops.squeeze(first, axis), "float64") * inverse
    n = c.nf
    bad = ~ops.isfinite(s2) | ~ops.isfinite(s1)  # h + l: a NaN or Inf in either shows
    u2 = U32 * U32
    g1 = (NODE * depth * u2 + U) * MARGIN
    g2 = ((LEAF + NODE * depth * (1.0 + LEAF * u2)) * u2 + U) * MARGIN
    flushed = FLUSH * n * ETA
    b_up = (s2 + flushed) * (1.0 + 2.0 * g2) * MARGIN
    a_abs = ops.sqrt(n * b_up) * MARGIN  # sum |y| <= sqrt(n sum y**2)
    unit, exact, exact_mean = _lattice(ops, smallest, b_up, a_abs, n, bad, fmt, 45, ETA)
    zeros = ops.eq(smallest, float("inf"))  # every x is 0: the sums are exact zeros
    exact, exact_mean = exact | (zeros & ~bad), exact_mean | (zeros & ~bad)
    d2 = ops.where(exact, 0.0, (g2 * b_up + flushed) * MARGIN)
    # The running bound: a term of r1 is rounded (down by at most a factor 1 - u32) by two
    # float32 additions at each addition above it, fewer than 4 depth + 8 in all (an
    # addition of a reduction's initial zero counted too); flushing takes less than eta
    # from each of r1's fewer than 8 n operations.
    r1 = (ops.cast(r1, "float64") + 8.0 * n * ETA) / (1.0 - (4.0 * depth + 8.0) * U32)
    d1_run = (NODE * u2 * r1 + U * ops.abs(s1)) * MARGIN
    d1 = ops.minimum(g1 * a_abs, d1_run)
    d1 = ops.where(exact_mean, 0.0, (d1 + flushed) * MARGIN)
    # Back to the data's units: exact products with 1 / sigma.
    s1, d1, unit = s1 * inverse, d1 * inverse, unit * inverse
    s2, d2 = s2 * inverse * inverse, d2 * inverse * inverse
    approx = _from_sums(ops, k, s1, s2, d1, d2, c)
    approx = approx._replace(sums=(k, s1, s2), exact=exact, grid=unit, exact_mean=exact_mean)
    return approx, bad


def approximate_pairs(ops, x, first, axis, c, fmt):
    """As `approximate`, for float64 input: differences, squares and sums as float64 pairs."""
    yh, yl = two_sum(x, -first)
    s1 = two_sum(*ops.pair_sum(yh, yl, axis))
    qh, ql = square(ops, yh, yl)
    s2 = two_sum(*ops.pair_sum(qh, ql, axis))
    k = ops.squeeze(first, axis)
    bad = ~ops.isfinite(s2[0]) | ~ops.isfinite(s1[0]) | ~ops.isfinite(s2[1] + s1[1])
    n = c.nf
    u2 = U * U
    # A compensated sum of n pairs in any tree: the high parts are exact (TwoSum), the
    # low channel sums 2n - 1 terms: error <= gamma_2n (sum|l| + u (n - 1) sum|h|).
    b_up = (s2[0] + ops.abs(s2[1])) * (1.0 + 4.0 * n * U) * MARGIN + n * TINY
    e2 = (gamma(2.0 * n + 2.0) * (n + 3.0) * U + 32.0 * u2) * b_up * MARGIN + n * TINY
    a_abs = ops.sqrt(n * b_up) * MARGIN
    e1 = gamma(2.0 * n + 2.0) * (n + 1.0) * U * a_abs * MARGIN + n * TINY
    t = df_mul(ops, *s1, *c.rn)
    mean = df_add(k, ops.zeros_like(k), *t)
    abs_s1 = ops.abs(s1[0]) + ops.abs(s1[1])
    # t = s1 rn within 26 u**2 |t| (`df_mul`), rn within u**2 / n of 1/n (4 u**2 |s1| / n
    # covers it); the sum with K by `df_add`.
    mean_err = (e1 * c.rn[0] + 26.0 * u2 * ops.abs(t[0]) + 4.0 * u2 * abs_s1 * c.rn[0]) * MARGIN
    mean_err = (mean_err + 8.0 * u2 * (ops.abs(k) + ops.abs(t[0])) + TINY) * MARGIN
    corr = df_mul(ops, *t, *s1)
    # corr = t s1 within 26 u**2 |corr| (`df_mul`); t within 27 u**2 |t| of s1 / n (above):
    # 27 u**2 |corr| more; s1 within e1 of the exact sum: (2 |s1| + e1) e1 / n.
    e_corr = ((2.0 * abs_s1 + e1) * e1 * c.rn[0] + 56.0 * u2 * ops.abs(corr[0])) * MARGIN
    num = df_add(*s2, -corr[0], -corr[1])
    num_err = e2 + e_corr + 8.0 * u2 * (ops.abs(s2[0]) + ops.abs(corr[0])) + TINY
    # All differences exactly zero: the mean is K and the variance 0, whatever the bounds.
    constant = ops.eq(s1[0], 0.0) & ops.eq(s1[1], 0.0) & ops.eq(s2[0], 0.0) & ops.eq(s2[1], 0.0)
    constant = constant & (ops.abs(k) >= 2.0**-450)
    mean_err = ops.where(constant, 0.0, mean_err)
    num_err = ops.where(constant, 0.0, num_err * MARGIN)
    return Approx(mean, mean_err, num, num_err), bad


def combine_nums(ops, a, b, pairs):
    """The numerators of the two parts of a complex slice, added: one rounding at the end.

    The pair sum errs by at most 8 u**2 (|a| + |b|).  For formats of precision <= 24,
    `variance_of` keeps only the high part, which drops up to u |num| more; float64
    keeps the pair (a u |num| term there would leave every slice undecided).
    """
    num = df_add(*a.num, *b.num)
    size = ops.abs(a.num[0]) + ops.abs(b.num[0])
    err = (a.num_err + b.num_err) * MARGIN + 8.0 * U * U * size
    if not pairs:
        err = err + U * ops.abs(num[0])
    return num, err * MARGIN


def variance_of(ops, num, num_err, c, pairs):
    """(var pair, error bound) = num / (n - ddof)."""
    if pairs:
        v = df_mul(ops, *num, *c.rd)  # 26 u**2 |v|; rd within u**2 / d of 1 / d: u**2 |v|
        err = (num_err * c.rd[0] * MARGIN + 27.0 * U * U * ops.abs(v[0])) * MARGIN
        return v, ops.where(num_err == 0, 0.0, err + TINY)  # 0 only for constant slices
    v = num[0] * c.rd[0]
    err = (num_err * c.rd[0] * MARGIN + 3.0 * U * ops.abs(v)) * MARGIN
    return (v, ops.zeros_like(v)), err


def pair_times(ops, h, l, y):
    """(h + l) y as a pair, for a pair (|l| <= u |h|) and a float64 y (an array or a
    Python float): p + e = h y by `two_prod` (within 8 u**2 |h y|: its error terms
    rounded twice, al bl once), then e + l y in float64 (l y and the sum rounded once
    each, or contracted into one rounding: within u (|e| + |l y|) + u**2 |h y| <=
    6 u**2 |h y|).  In all below 15 u**2 |(h + l) y|; one `two_prod` where `df_mul`
    of the pair (l, 0) takes two."""
    p, e = two_prod(ops, h, y)
    return fast_two_sum(p, e + l * y)


def variance_from_exact_sums(ops, a, c):
    """(var, error bound) from the sums of `approximate` where they are exact (a.exact).

    With s1 = A and s2 = B exact, N = B - A**2 / n in pair arithmetic: t = A rn
    (`pair_times` of the pair rn and A: error <= 15 u**2 |t|, rn within u**2 / n of
    1/n: <= 17 u**2 |t| in all), C = t A (`pair_times` again: <= 33 u**2 |C|), N~ = B - C
    (<= 8 u**2 (B + |C|) more), var = N~ rd_h by `pair_times` plus the float64 term
    N~_h rd_l (<= 20 u**2 |var| more, rd within u**2 / d of 1/d: u**2 |N~| rd) and the
    pair's float64 sum (<= u |var|): about u |var| in all, where the float64
    evaluation of `approximate` errs by up to 8 u |var|; ties of exact sums (section 5)
    need the smaller bound once n (n - ddof) exceeds about 2**22.
    """
    _, s1, s2 = a.sums
    t = pair_times(ops, *c.rn, s1)
    corr = pair_times(ops, *t, s1)
    num = df_add(s2, ops.zeros_like(s2), -corr[0], -corr[1])
    v = pair_times(ops, *num, c.rd[0])
    var = v[0] + (v[1] + num[0] * c.rd[1])
    u2 = U * U
    num_err = (8.0 * u2 * (ops.abs(s2) + ops.abs(corr[0])) + 33.0 * u2 * ops.abs(corr[0])) * MARGIN
    err = (num_err * c.rd[0] + u2 * ops.abs(num[0]) * c.rd[0] + 20.0 * u2 * ops.abs(var)) * MARGIN
    return var, (err + U * ops.abs(var)) * MARGIN


# ---------------------------------------------------------------- rounding test (section 5)
def nearest(ops, a, fmt):
    """For a > 0 (float64, normal): the float of `fmt` nearest to a (ties to even, unbounded
    exponent) and the two midpoints around it, all as float64 (exact: p + 1 <= 53 bits)."""
    return _nearest(ops, a, fmt)[:3]


def _nearest(ops, a, fmt):
    """`nearest`'s (c, lo, hi), then c = k unit: its integer significand k (float64) and
    unit = 2**(e - (p - 1)), e = floor(log2 a)."""
    p = fmt.precision
    e = exponent(ops, a)
    unit = pow2(ops, e - (p - 1))
    k = ops.round(a * pow2(ops, (p - 1) - e))  # in [2**(p-1), 2**p], half to even
    c = k * unit
    top = ops.eq(k, 2.0**p)  # c = 2**(e+1): its ulp is 2 unit
    power = top | ops.eq(k, 2.0 ** (p - 1))
    ulp = ops.where(top, unit + unit, unit)
    hi = c + 0.5 * ulp
    lo = c - ops.where(power, 0.25 * ulp, 0.5 * ulp)
    return c, lo, hi, k, unit


def certify(ops, v, err, fmt, tie=None):
    """(value, decided): the correctly rounded value of every number within err of v.

    v: float64 pair (h, l); for formats of precision <= 24 the pair's low part is 0.
    decided is False where the interval [v - err, v + err] contains a rounding
    boundary (a midpoint), or where the test does not apply (tiny or non-finite v);
    those slices take the exact path.  Ties are not decided here unless `tie` says
    that the exact value lies on a lattice: a slice whose interval touches a midpoint
    goes to the exact path, which rounds ties to even.

    tie: None, or (where, grid, scale) for formats of precision <= 24: where it holds,
    the exact value times D lies in grid * Z for an integer D with 1/D >= scale
    (1 + 2**-19) (grid a power of two).  Every midpoint M is a multiple of h, a
    quarter of the unit of the candidate, so the exact value V != M is at least
    sep = min(grid, h) / D away from M.  Where 2 err < sep, the interval holds at
    most one midpoint (2 err < h), and it holds one only if V equals it: if the
    nearest midpoint M is within err of v, V = M and rounds half to even; else no
    midpoint is in the interval and V rounds to the candidate.
    """
    h, l = v
    tiny = 2.0**fmt.emin
    negative = h < 0
    a = ops.abs(h)
    low = ops.where(negative, -l, l)
    if fmt.precision == 53:  # 2**-1024 would be read as 0 (subnormal): only exact zeros
        zero = ops.eq(a, 0.0) & ops.eq(low, 0.0) & ops.eq(err, 0.0)
    else:
        zero = (a < 0.25 * tiny) & (ops.abs(low) < 0.25 * tiny) & (err < 0.25 * tiny)
    if fmt.precision == 53:  # the candidate is h itself (h = fl(h + l)); gap to the midpoint
        e = exponent(ops, a)
        ok = (e >= -969) & (e <= 1023)
        unit = pow2(ops, ops.where(ok, e - 52, 0))
        power = ops.eq(ops.band(ops.bitcast(a, "int64"), (1 << 52) - 1), 0)
        below = ops.where(power, 0.25 * unit, 0.5 * unit)
        gap = ops.where(low >= 0, 0.5 * unit - low, below + low)
        value = a
    else:
        ok = (a >= 0.25 * tiny) & (a < 2.0**1000)
        safe = ops.where(ok, a, ops.ones_like(a))
        value, lo, hi, k, unit = _nearest(ops, safe, fmt)
        gap = ops.minimum(hi - safe, safe - lo)  # exact: safe / 2 < lo < safe < hi < 2 safe
        if tie is not None:
            where, grid, scale = tie
            sep = ops.minimum(grid, 0.25 * unit) * scale * (1.0 - 2.0**-18)
            up = hi - safe <= safe - lo  # the nearer midpoint is hi
            on_lattice = ok & where & (err + err < sep)
            # The tie M rounds half to even: to c where k is even (powers of two and
            # 2**(e+1) included), else to c's neighbour beyond M, c + unit or c - unit (an
            # odd k is no power of two: both neighbours are a unit away).
            odd = ops.ne(ops.floor(k * 0.5) * 2.0, k)
            even = ops.where(odd, ops.where(up, value + unit, value - unit), value)
            value = ops.where(on_lattice & (gap <= err), even, value)
        value = ops.where(value >= 2.0**fmt.emax, float("inf"), value)
        value = ops.where(value < tiny, 0.0, value)
    decided = (ok & (err + err < gap)) | zero
    if tie is not None:
        decided = decided | on_lattice
    value = ops.where(zero, 0.0, value)
    value = ops.where(negative & ops.ne(value, 0.0), -value, value)
    return value, decided


def round_to(ops, v, fmt):
    """Plain round-half-even of float64 v to `fmt` (not certified; used for mean_lo)."""
    if fmt.precision == 53:
        return v
    a = ops.abs(v)
    tiny = 2.0**fmt.emin
    ok = (a >= tiny) & ops.isfinite(a)
    value, _, _ = nearest(ops, ops.where(ok, a, ops.ones_like(a)), fmt)
    value = ops.where(ok & (value < 2.0**fmt.emax), value, ops.where(ok, float("inf"), 0.0))
    return ops.where(v < 0, -value, value)


def _certified_variance(ops, num, num_err, c, fmt, pairs, lattice=None):
    """(var, decided): num / (n - ddof) certified (`variance_of`, `certify`); lattice: None,
    or the Approx of one real part with float64 sums, whose exact sums (a.exact) give the
    variance by `variance_from_exact_sums` and decide its ties (section 5)."""
    v, v_err = variance_of(ops, num, num_err, c, pairs)
    tie = None
    if lattice is not None:
        a = lattice
        tie = (a.exact, a.grid * a.grid, c.rn[0] * c.rd[0])
        v_exact, err_exact = variance_from_exact_sums(ops, a, c)
        v = (ops.where(a.exact, v_exact, v[0]), v[1])
        v_err = ops.where(a.exact, err_exact, v_err)
    return certify(ops, v, v_err, fmt, tie)


def _with_variance(ops, decided, ok, c, ddof):
    """decided and the variance's test, which counts only where n - ddof > 0 (section 8)."""
    defined = c.n - ddof > 0  # a Python bool for a static count
    if isinstance(defined, bool):
        return (decided & ok) if defined else decided
    return decided & (ok | ~defined)


# ---------------------------------------------------------------- the whole slice (section 8)
def flush(ops, x, fmt, magnitude=False):
    """x as float64, inputs below the format's normal range replaced by 0; with
    magnitude=True also |x| with those inputs (zeros included) replaced by inf, the
    terms of the smallest nonzero magnitude of `approximate`.

    Both come from one comparison of the unflushed |x|: XLA's CPU emitter keeps the
    fused pass vectorised then (with |flushed x| compared again, measured 3.5x slower
    on [4096, 4096] along axis 0)."""
    x = ops.cast(x, "float64")
    size = ops.abs(x)
    tiny = size < 2.0**fmt.emin
    flushed = ops.where(tiny, ops.zeros_like(x), x)
    if not magnitude:
        return flushed
    return flushed, ops.where(tiny, float("inf"), size)


def first_element(ops, x, axis, dynamic=False):
    """K: each slice's first element (keepdims); 0 for an empty slice of unknown length."""
    k = x[0:1] if axis == 0 else x[:, 0:1]
    return ops.sum(k, axis, keepdims=True) if dynamic else k


def counted(ops, size, n, axis):
    """Where an element of slices of `size` laid out along axis counts, for slices padded
    beyond their count n: the first n places (keepdims, broadcast against the 2-D
    layout)."""
    return ops.expand_dims(ops.iota(size, "int64") < ops.cast(n, "int64"), 1 - axis)


def slice_moments(ops, parts, axis, ddof, fmt, n=None, exact_only=False, mask=None, f32=False):
    """Correctly rounded means (one per part) and variance of the slices of 2-D arrays.

    parts: one real array, or the real and imaginary parts of a complex one, in
      the format `fmt`, laid out [n, kept] (axis 0) or [kept, n] (axis 1).
    n: None, or the count when the slices are padded beyond it (with copies of
      their first element: their differences from it are exact zeros).
    exact_only: send every slice through the exact path (a test switch).
    mask: None, or per element, laid out like the parts: bool (the selected
      elements; n then holds the count per slice, int64 [kept]) or int64
      integer frequency weights (n then holds their sum per slice, below
      2**40).  The caller replaces every unselected (weight 0) element by the
      slice's first selected one (0 where none is), so that the first element
      K is selected and the others contribute exact zeros to the fast sums.
    f32: the fast path sums in float32 pairs (section 4b) where it applies (formats of
      precision <= 24, no weights); the same certificate, the same results.
    Returns (means, var, undecided): float64 arrays of the kept length holding
    values of `fmt` exactly, and the number of slices the fast path left open.
    """
    means, var, todo, sums = fast_moments(ops, parts, axis, ddof, fmt, n, exact_only, mask, f32)
    undecided = ops.sum(ops.cast(todo, "int64"), 0)
    means, var = exact_fix(ops, parts, axis, ddof, fmt, n, todo, means, var, sums, mask)
    return means, var, undecided


def kernel_outputs(ops, parts, axis, ddof, fmt, n=None, lo=False, exact_only=False, f32=False):
    """(mean per part, var, [mean_lo per part], undecided): `slice_moments`, and with lo
    `mean_lo`, in the parts' dtype; the whole kernel as the TensorFlow wrapper, its
    XlaCallModule export (tf_stable_moments/_xla_module.py) and JAX's XLA kernel
    (jax_kernel/_moments.py) return it."""
    dtype = parts[0].dtype.name
    means, var, undecided = slice_moments(ops, parts, axis, ddof, fmt, n, exact_only, None, f32)
    out = [ops.cast(m, dtype) for m in means] + [ops.cast(var, dtype)]
    if lo:  # mean_lo_round materializes them
        out += [
            ops.cast(mean_lo(ops, p, axis, m, var, ddof, fmt, n), dtype)
            for p, m in zip(parts, means)
        ]
    return (*out, undecided)


def _one_buffer(ops, means, var, todo):
    """(means, var, todo) computed by one kernel into buffers of their own
    (`ops.materialize_all`), the same values.  They share the per-slice chain of the
    bounds and the rounding test (some 400 operations), which XLA would otherwise fuse
    into a computation of its own for each result that a later step reads, compiling and
    running the chain up to four times (measured in the JAX synchronized BN step: fusions
    of 438, 440, 397 and 213 operations on [128], one of 508 with the buffer).  One
    multi-output reduction, not a reduction of their stack: XLA's CPU backend emitted the
    chain once per stacked row there (its compilation, float32 [4096, 64] under JAX:
    0.22 s -> 0.10 s)."""
    flags = ops.cast(todo, "float64")
    *means, var, flags = ops.materialize_all([*means, var, flags])
    return means, var, flags > 0.0


def _weights(mask):
    """The mask's integer weights, or None for no mask or a boolean selection."""
    if mask is None or mask.dtype.name == "bool":
        return None
    return mask


def fast_moments(ops, parts, axis, ddof, fmt, n=None, exact_only=False, mask=None, f32=False):
    """The fast path and its rounding test: (means, var, todo, sums), todo marking the
    slices it did not decide (their values are meaningless until `exact_fix`), sums
    what `exact_fix` can round exactly without the elements (float64 sums only).
    mask: see `slice_moments`; float64 parts with weights take the exact path."""
    weights = _weights(mask)
    if weights is not None and not fmt.wide:
        exact_only = True  # no pair version of the weighted bounds: all slices exact
    size = ops.shape(parts[0], axis)
    c = counts(ops, size if n is None else n, ddof)
    if isinstance(size, int) and size == 0:  # no data: NaN (section 8)
        nan = ops.zeros([ops.shape(parts[0], 1 - axis)], "float64") + float("nan")
        return [nan for _ in parts], nan, ops.eq(nan, 0.0), []
    pairs = not fmt.wide
    f32 = f32 and not pairs and weights is None
    if pairs:
        xs = [flush(ops, p, fmt) for p in parts]
    elif f32:
        xs = [flush32(ops, p, fmt) for p in parts]
    else:
        xs, mags = zip(*(flush(ops, p, fmt, magnitude=True) for p in parts))
    valid = None
    if f32:  # the pairs' running bound wants K near the mean (`shift32`); padded or
        # unselected elements, copies of the first counted one, are made exact zeros
        firsts = [shift32(ops, x, axis) for x in xs]
        if mask is not None:
            valid = mask
        elif n is not None:
            valid = counted(ops, size, n, axis)
    else:
        firsts = [first_element(ops, x, axis, dynamic=not isinstance(size, int)) for x in xs]
    if pairs:
        approx = [approximate_pairs(ops, x, k, axis, c, fmt) for x, k in zip(xs, firsts)]
    elif f32:
        approx = [approximate32(ops, x, k, axis, c, fmt, valid) for x, k in zip(xs, firsts)]
    else:
        w = None if weights is None else ops.cast(weights, "float64")
        approx = [approximate(ops, *a, axis, c, fmt, w) for a in zip(xs, mags, firsts)]
    bad = approx[0][1]
    for _, b in approx[1:]:
        bad = bad | b
    # One real part with float64 sums: ties of exact sums are decided here (`certify`).
    lattice = len(approx) == 1 and not pairs
    means, decided = [], ~bad
    for a, _ in approx:
        tie = (a.exact_mean, a.grid, c.rn[0]) if lattice else None
        m, ok = certify(ops, a.mean, a.mean_err, fmt, tie)
        means.append(m)
        decided = decided & ok
    if len(approx) == 1:
        num, num_err = approx[0][0].num, approx[0][0].num_err
    else:
        num, num_err = combine_nums(ops, approx[0][0], approx[1][0], pairs)
    var, ok = _certified_variance(
        ops, num, num_err, c, fmt, pairs, approx[0][0] if lattice else None
    )
    decided = _with_variance(ops, decided, ok, c, ddof)
    if exact_only:
        decided = ops.zeros_like(decided)
    means, var = _special_counts(ops, means, var, c, ddof)
    means, var, todo = _one_buffer(ops, means, var, ~decided)
    if pairs:
        return means, var, todo, []
    exact = approx[0][0].exact
    for a, _ in approx[1:]:
        exact = exact & a.exact
    sums = [list(a.sums) for a, _ in approx]
    return means, var, todo, [ops.cast(exact, "bool"), *[v for part in sums for v in part]]


def exact_fix(ops, parts, axis, ddof, fmt, n, todo, means, var, sums=(), mask=None):
    """The exact path for the slices marked in `todo` (section 7); the others are kept.

    sums: fast_moments' fourth output; slices of complex data whose fast sums were
    exact are rounded from the sums, the others from their elements.  mask: see
    `slice_moments`.
    """
    size = ops.shape(parts[0], axis)
    c = counts(ops, size if n is None else n, ddof, reciprocals=False)
    kept = ops.shape(parts[0], 1 - axis)
    if isinstance(kept, int) and kept == 0:  # no slices: nothing to recompute
        return _special_counts(ops, means, var, c, ddof)
    per_part, from_sums = None, None
    # One real part decides its ties of exact sums in the fast path (`certify` with the
    # lattice): the few exact-sum slices it leaves open take the element path, and the
    # compiled exact path holds no second kind of slice (the rounding from sums was 25%
    # of its XLA compile time: 1.53 s -> 1.15 s, JAX, float32 [4096, 64]).
    if len(sums) and len(parts) > 1:
        exact, flat = sums[0], list(sums[1:])
        per_part = [flat[3 * i : 3 * i + 3] for i in range(len(parts))]
        from_sums = todo & exact
        todo = todo & ~from_sums
    means, var = _exact_loop(
        ops, parts, axis, c, ddof, fmt, n, todo, means, var, mask, per_part, from_sums
    )
    return _special_counts(ops, means, var, c, ddof)


def _special_counts(ops, means, var, c, ddof):
    """var NaN where n - ddof <= 0, everything NaN where n == 0 (section 8)."""
    nan = float("nan")
    defined = c.n - ddof > 0
    if not isinstance(defined, bool):
        var = ops.where(defined, var, nan)
    elif not defined:
        var = ops.zeros_like(var) + nan
    if not isinstance(c.n, int) or c.n == 0:
        means = [ops.where(c.n > 0, m, nan) for m in means]
        var = ops.where(c.n > 0, var, nan)
    return means, var


def _pick(ops, todo, batch):
    """(gather, write): the first `batch` slices marked in todo ([batch] int64, top_k of
    their position).  todo ends with a dummy slot that is never marked; `gather` repeats
    the first pick in unused places (a valid slice to compute on), `write` sends those
    places to the dummy slot, so that no slice is written twice in one scatter."""
    size = ops.shape(todo, 0)
    key = ops.where(todo, ops.cast(size - ops.iota(size, "int64"), "float64"), 0.0)
    key = ops.concat([key, ops.zeros([batch], "float64")], 0)
    vals, idx = ops.top_k(key, batch)
    idx = ops.cast(idx, "int64")
    used = vals > 0
    gather = ops.minimum(ops.where(used, idx, idx[0]), size - 2)  # a real slice, always
    return gather, ops.where(used, idx, size - 1)


def _batched(ops, todos, batches, compute, values):
    """values updated on the slices marked in todos, batches[g] of todos[g] at a time.

    One while loop: each iteration picks up to batches[g] marked slices of every group
    g and calls compute(picks) once (picks: one [batches[g]] index array per group), which
    returns the new values of all picked slices, group after group ([sum(batches)] each).
    Unused places (and every place of a group with none left) compute on some slice and
    are written to a dummy slot (appended here, removed at the end).

    The loop's state is one float64 table, a row per slice: its values, then a flag
    (1.0 or 0.0) per group; an iteration writes the picked rows (new values, flags 0) in
    one scatter.  The groups mark disjoint slices, so clearing every flag of a picked row
    clears only its own.  (A scatter per value and per flag array compiled to a kernel
    each: 4 -> 2 scatters per call, with the segment sum of the digits.)

    The values leave the table through one reduction (`ops.materialize_all`, the same
    bits).  A column of the table is a [kept, 1] slice reshaped to [kept], and XLA's
    reshape mover sinks such a reshape through the elementwise chains that read the
    values (`mean_lo`'s exponents, the layers' formulas), one operation per round of
    its simplification fixpoint, every round a pass over the whole module: a Keras-JAX
    training step with one StableBatchNormalization took 10 rounds; a JAX `stats` step
    took 10, 7 with the reduction alone and 4 with it and `_exact`'s added constants
    (docs section 10)."""
    groups, k = len(batches), len(values)

    def flags(table):
        return [table[:, k + g] > 0.0 for g in range(groups)]

    def body(table):
        picks = [_pick(ops, t, b) for t, b in zip(flags(table), batches)]
        new = compute([gather for gather, _ in picks])
        write = ops.concat([w for _, w in picks], 0)
        done = [ops.zeros_like(new[0])] * groups
        return (ops.scatter(table, write, ops.stack([*new, *done], 1)),)

    def pending(table):
        return ops.any(table[:, k:] > 0.0)

    start = ops.stack([*values, *(ops.cast(t, "float64") for t in todos)], 1)
    start = ops.concat([start, ops.zeros([1, k + groups], "float64")], 0)
    table = ops.while_loop(pending, body, (start,))[0]
    kept = ops.shape(values[0], 0)
    return ops.materialize_all([table[:kept, j] for j in range(k)])


def _rows(ops, x, idx, axis):
    """The slices idx of a 2-D array in the layout, as rows [len(idx), size]."""
    r = ops.take(x, idx, 1 - axis)
    return r if axis == 1 else ops.transpose(r)


def _batch(size):
    """Slices per iteration of the exact path: BATCH, fewer when their elements exceed
    BATCH_ELEMENTS.  A compiled loop's buffers are allocated at every call, iterations
    or not: 8 slices of 131072 elements need 150 MB, measured doubling the time of
    [131072, 64] along axis 0 under jit_compile (every slice decided)."""
    if not isinstance(size, int):
        return BATCH
    return max(1, min(BATCH, BATCH_ELEMENTS // max(size, 1)))


def _one_pass_rows(size, fmt):
    """Whether the exact path sums slices of `size` elements of `fmt` by the state's one
    pass (`_state.digit_sums`) instead of the digits of every element: long slices of at
    most 24-bit values."""
    return isinstance(size, int) and size >= ONE_PASS_ROWS and fmt.precision <= 24


def _exact_loop(
    ops, xs, axis, c, ddof, fmt, n, todo, means, var, mask=None, sums=None, from_sums=None
):
    """The exact path (section 7): the slices in `todo` from their elements, `_batch` at
    a time, and those in `from_sums` (their fast float64 sums were exact: `sums`, per part
    [K, A, B]) from those sums alone, SUMS_BATCH at a time, in one loop whose iterations
    round both kinds together (`_exact.finish`: compiled code holds the rounding once).

    xs: the parts as given (flushed here, on the gathered slices only)."""
    size = ops.shape(xs[0], axis)
    valid = None
    if n is not None and mask is None:
        valid = counted(ops, size, n, 1)  # the gathered rows: [slices, size]
    count = ops.cast(c.n, "int64")
    weights = _weights(mask)
    one_pass = weights is None and _one_pass_rows(size, fmt)
    batch = _batch(size)

    def compute(idxs):
        idx = idxs[0]
        rows = [flush(ops, _rows(ops, x, idx, axis), fmt) for x in xs]
        if one_pass:  # gathered once (a column of an axis-0 layout: a cache line per
            # element), not in each of the passes that XLA would fuse the gather into
            rows = [ops.materialize(r) for r in rows]
        w = ok = None
        if weights is not None:
            w = _rows(ops, weights, idx, axis)
            ok = w > 0
        elif mask is not None:
            ok = _rows(ops, mask, idx, axis)
        k = count if mask is None else ops.take(count, idx, 0)
        n_rows = ops.zeros([batch], "int64") + k
        clean, special = _clean_rows(ops, rows, valid if ok is None else ok)
        l1, l2 = _exact.lengths(fmt, aligned=True)
        if one_pass:  # long slices: exact float64 block sums, not every element's digits
            s1s, s2 = _state.digit_sums(ops, clean, fmt)
        else:
            s1s, s2 = _exact.accumulate(ops, clean, None, fmt, l1, l2, w)
        # Blocks of rows to stack: per part the S1 of the means and the S1' that goes
        # with S2 (for the elements S1' = S1: `finish` gets None and carries S1 once),
        # S2 and the counts.
        means_d, shifted_d, s2s, ns = [[s] for s in s1s], [[s] for s in s1s], [s2], [n_rows]
        if sums is not None:
            picked = [[ops.take(v, idxs[1], 0) for v in part] for part in sums]
            k = count if mask is None else ops.take(count, idxs[1], 0)
            n_sums = ops.zeros([SUMS_BATCH], "int64") + k
            m, sh, q = _exact.sums_digits(ops, picked, n_sums, fmt)
            for j in range(len(xs)):
                means_d[j].append(m[j])
                shifted_d[j].append(sh[j])
            s2s.append(q)
            ns.append(n_sums)
            # Slices rounded from their sums are finite (their sums were exact).
            none = ops.zeros([SUMS_BATCH], "float64")
            special = [ops.concat([odd, none], 0) for odd in special]

        def stack(blocks):
            return ops.concat([_exact.resize(ops, b, l2) for b in blocks], 0)

        mean_bits, var_bits = _exact.finish(
            ops,
            [stack(b) for b in means_d],
            None if sums is None else [stack(b) for b in shifted_d],
            stack(s2s),
            ops.concat(ns, 0),
            ddof,
            fmt,
        )
        means_new = [ops.from_bits(b, fmt) for b in mean_bits]
        return _special_rows(ops, special, means_new, ops.from_bits(var_bits, fmt))

    todos, batches = [todo], [batch]
    if sums is not None:
        todos, batches = [todo, from_sums], [batch, SUMS_BATCH]
    out = _batched(ops, todos, batches, compute, [var, *means])
    return out[1:], out[0]


def _clean_rows(ops, rows, valid):
    """(rows with non-finite and unselected elements 0, per part the sum of its
    non-finite selected elements).

    That sum is what section 8 needs, in one reduction per part: 0 where the row is
    finite, NaN where it holds a NaN or both infinities, else the infinity it holds,
    in any order of addition (NaN absorbs, inf + -inf is NaN, and the finite elements
    enter as exact zeros).  Three boolean `any` reductions compiled into 15 kernels
    (XLA's CPU backend cuts each long one into a chain of reduce-windows)."""
    finite = [ops.isfinite(r) for r in rows]
    if valid is not None:
        finite = [f & valid for f in finite]
    clean = [ops.where(f, r, ops.zeros_like(r)) for f, r in zip(finite, rows)]
    odd = [ops.where(f, ops.zeros_like(r), r) for f, r in zip(finite, rows)]
    if valid is not None:  # an unselected element is no special value
        odd = [ops.where(valid, o, ops.zeros_like(o)) for o in odd]
    return clean, [ops.sum(o, 1) for o in odd]


def _special_rows(ops, special, means, var):
    """[var, *means] of exact rows with the special values of section 8 put in: per part
    the sum of its non-finite elements (`_clean_rows`), 0 for a finite row."""
    nan = float("nan")
    out, any_special = [], None
    for odd, value in zip(special, means):
        flag = ~ops.isfinite(odd)
        out.append(ops.where(flag, ops.where(ops.isnan(odd), nan, odd), value))
        any_special = flag if any_special is None else (any_special | flag)
    return [ops.where(any_special, nan, var), *out]


# ---------------------------------------------------------------- merged fast path (section 13b)
def merge_fast(ops, x, axis, fmt, shift, reduce, replicas, n=None, mask=None, ddof=0):
    """The fast path across replicas (section 13b): (mean, var, todo, n) of the union of
    the slices that every replica holds a part of, the same on every replica.

    x: this replica's part, 2-D in the layout (a format of precision <= 24: float64 sums);
    shift(k, has): K per slice from this replica's first selected elements k (has: whether
    it has one), the same on every replica (a collective); reduce(a): the SUM of a float64
    array over the replicas (an all-reduce that gives every replica the same values);
    replicas: how many there are (static).  n: None (every replica holds the static
    length), this replica's count as a scalar (the same for every slice), or per slice
    (mask: its selection).  The steps between the collectives are `merge_first`,
    `merge_rows` and `merge_decide` (TensorFlow compiles each as an XLA computation).
    todo: the slices it leaves open (exact states decide them), computed from reduced
    values alone, so the same on every replica; n: the global count (a Python int, or an
    int64 scalar or [kept] array).
    """
    first, has = merge_first(ops, x, axis, fmt, n, mask)
    k = shift(first, has)
    reduced = reduce(merge_rows(ops, x, axis, fmt, k, n, mask))
    count = ops.shape(x, axis) * replicas if n is None else None
    return merge_decide(ops, reduced, k, fmt, replicas, _count_kind(n), count, ddof)


def _count_kind(n):
    """How merge_rows sends the count: None (static), "scalar" (one value) or "slice"."""
    if n is None:
        return None
    return "scalar" if len(getattr(n, "shape", ())) == 0 else "slice"


def merge_first(ops, x, axis, fmt, n=None, mask=None):
    """(first, has): per slice this replica's first selected element (flushed, float64;
    0 where it has none) and whether it has one (None without a selection).  The element
    is picked first (a sum of at most one nonzero term: exact), then flushed: the same
    value as picking from the flushed part, without a pass over all of it."""
    if mask is None:  # with n, a length that may be 0 (dynamic: 0 for an empty part)
        first = ops.squeeze(first_element(ops, x, axis, dynamic=n is not None), axis)
        return flush(ops, first, fmt), None
    first = ops.sum(ops.where(_first_selected(ops, mask, axis), x, ops.zeros_like(x)), axis)
    return flush(ops, first, fmt), ops.any(mask, axis)


def merge_rows(ops, x, axis, fmt, k, n=None, mask=None):
    """This replica's share of the SUM, flat float64: per slice s1 ~ sum (x - K), s2 ~
    sum (x - K)**2 (summed as `block_sums` does) and the term of its smallest |x|
    (`_min_exponent_term`), then its count (per slice, or one value: `_count_kind`).
    The sums' error bounds need no rows: `merge_decide` bounds them from the global sums
    and count (`depth_bound`)."""
    size = ops.shape(x, axis)
    terms = float(size) if n is None else ops.cast(n, "float64")
    x, magnitude = flush(ops, x, fmt, magnitude=True)
    y = x - ops.expand_dims(k, axis)
    if mask is not None:
        magnitude = ops.where(mask, magnitude, float("inf"))
        y = ops.where(mask, y, ops.zeros_like(y))
    s1, s2, smallest, _ = block_sums(ops, y, y * y, magnitude, axis, terms)
    rows = [s1, s2, _min_exponent_term(ops, smallest)]
    kind = _count_kind(n)
    if kind == "slice":
        rows.append(terms)
    flat = ops.reshape(ops.stack(rows, 0), [-1])
    if kind == "scalar":
        flat = ops.concat([flat, ops.reshape(terms, [1])], 0)
    return flat


def merge_decide(ops, reduced, k, fmt, replicas, kind, count=None, ddof=0):
    """(mean, var, todo, n) from the SUM of every replica's `merge_rows` (the same values
    on every replica) and the shared shift k: the rounding test of one device on the
    global sums.  kind: `_count_kind` of the rows' count; count: the global count when
    static (kind None)."""
    kept = ops.shape(k, 0)
    width = 4 if kind == "slice" else 3
    total = ops.reshape(reduced[: width * kept], [width, kept])
    s1, s2 = total[0], total[1]
    smallest = _min_exponent(ops, total[2])
    if kind is not None:
        count = ops.cast(reduced[-1] if kind == "scalar" else total[3], "int64")
    c = counts(ops, count, ddof)
    # Section 13b, step 3: every replica's sums are within g_r(1) sqrt(n_r B_r) and
    # g_r(2) B_r of their exact A_r, B_r, with g_r <= G = depth_bound(n) (n_r <= n), and
    # B_r <= s2_r (1 + 2 G(2)); the all-reduce adds g = gamma_(R-1) times the sum of the
    # magnitudes; sum_r s2_r <= S2 (1 + 2 g) (non-negative terms), sum_r sqrt(n_r B_r)
    # <= sqrt(n B) (Cauchy-Schwarz) and sum_r |s1_r| <= sqrt(n B) (1 + G(1)).
    big = depth_bound(ops, c.nf)
    g = gamma(float(replicas - 1)) if replicas > 1 else 0.0
    spread = s2 * ((1.0 + 2.0 * g) * MARGIN)  # >= sum_r s2_r
    b_all = spread * ((1.0 + 2.0 * big(2)) * MARGIN)  # >= B
    root = ops.sqrt(c.nf * b_all) * MARGIN  # >= sqrt(n B)
    d1 = (big(1) * root + g * (root * (1.0 + big(1)) * MARGIN)) * MARGIN
    d2 = (big(2) * b_all + g * spread) * MARGIN
    b_up = (s2 + d2) * MARGIN
    a_abs = ops.sqrt(c.nf * b_up) * MARGIN
    bad = ~ops.isfinite(s1) | ~ops.isfinite(s2) | ~ops.isfinite(d1) | ~ops.isfinite(d2)
    # The lattice (section 5) of the union: every x, every y = x - K (K is an x) and every
    # partial sum on any replica and in the all-reduce is a multiple of q below the
    # global bounds, so the global sums are exact where `_lattice` says so.
    unit, exact, exact_mean = _lattice(ops, smallest, b_up, a_abs, c.nf, bad, fmt, 52)
    d2 = ops.where(exact, 0.0, d2)
    d1 = ops.where(exact_mean, 0.0, d1)
    a = _from_sums(ops, k, s1, s2, d1, d2, c)._replace(sums=(k, s1, s2), exact=exact, grid=unit)
    mean, ok = certify(ops, a.mean, a.mean_err, fmt, (exact_mean, unit, c.rn[0]))
    var, ok_var = _certified_variance(ops, a.num, a.num_err, c, fmt, False, a)
    ok = _with_variance(ops, ok, ok_var, c, ddof)
    (mean,), var = _special_counts(ops, [mean], var, c, ddof)
    (mean,), var, todo = _one_buffer(ops, [mean], var, ~(ok & ~bad))
    return mean, var, todo, c.n


# The smallest |x| of the union through the SUM (section 13b): a replica whose smallest
# nonzero |x| has exponent e (|e| <= 127 in every format of precision <= 24) sends
# 2**(8 (-e)), none 0.  The largest term, 2**(8 v) with v = -min e, is at most the sum,
# and R terms sum to less than 2**8 of it for R < 256 (with the rounding of any order):
# floor(log2 sum / 8) = v exactly.  More replicas can only give a larger v: a smaller q,
# a lattice on which every x still lies (section 5), checked less often.
_MIN_SPACING = 8


def _min_exponent_term(ops, smallest):
    e = exponent(ops, smallest)  # smallest: a normal magnitude of the format, or inf
    term = pow2(ops, ops.minimum(ops.maximum(-_MIN_SPACING * e, -1016), 1016))
    return ops.where(ops.isfinite(smallest), term, 0.0)


def _min_exponent(ops, total):
    """2**(min e) from the SUM of `_min_exponent_term`s (inf where no replica has one)."""
    v = ops.shr(exponent(ops, total), _MIN_SPACING.bit_length() - 1)  # floor division
    return ops.where(total > 0.0, pow2(ops, -v), float("inf"))


def _first_selected(ops, mask, axis):
    """Per slice, True at its first selected element only (none where none is)."""
    running = ops.cumsum(ops.cast(mask, "int64"), axis)
    return mask & ops.eq(running, 1)


# ---------------------------------------------------------------- mean_lo (section 9)
def mean_lo(ops, x, axis, mean, var, ddof, fmt, n=None, mask=None, reduce=None, rn=None):
    """mean - mean_hi, to the format, from a deterministic fixed-point sum (for the layers).

    d = x - mean (float64) is scaled by a power of two q chosen from the certified
    mean and variance alone, so that every rint(d / q) is an integer and their sum
    stays below 2**53: the float64 sum is exact in any order.  Hence mean_lo has
    the same bits in every mode and framework, although it is not correctly rounded.
    mask: None or a boolean selection laid out like x (n its count per slice).
    reduce: None, or a function applied to the per-slice fixed-point sums (an all-reduce
    SUM over replicas that hold parts of the slices; mean, var and n are then those of
    the union): the sums are integers below 2**53, so the result has the same bits.
    The steps around that collective are `mean_lo_sums` and `mean_lo_round`.
    rn: None, or the float64 nearest 1/n (`counts`' rn[0]) where the caller has it.
    """
    total, unscale, ok = mean_lo_sums(ops, x, axis, mean, var, ddof, fmt, n, mask)
    if reduce is not None:
        total = reduce(total)
    count = ops.shape(x, axis) if n is None else n
    return mean_lo_round(ops, total, unscale, ok, count, fmt, rn)


def mean_lo_sums(ops, x, axis, mean, var, ddof, fmt, n=None, mask=None):
    """(total, unscale, ok): the fixed-point sums of `mean_lo` (exact, below 2**53), their
    scale 2**shift and where they are defined (1.0, else 0.0), all float64."""
    size = ops.shape(x, axis)
    count = size if n is None else n
    c = counts(ops, count, ddof, reciprocals=False)  # n and its bit length, no 1/n
    # The same values as `flush`, but not the same expression: XLA would merge the two
    # (the fast path's flush) into one float64 copy of the input that both passes read
    # (measured in the JAX synchronized BN step, [256, 128] per device).
    x = ops.cast(flush32(ops, x, fmt), "float64") if fmt.wide else flush(ops, x, fmt)
    m = ops.expand_dims(mean, axis)
    d = x - m
    if mask is not None:
        d = ops.where(mask, d, ops.zeros_like(d))
    elif n is not None and not (isinstance(n, int) and isinstance(size, int) and n >= size):
        # Slices padded beyond n (a static n of at least their length, the count of the
        # union in `jax_kernel._union.union_stats`, pads nothing: no mask to build and apply).
        d = ops.where(counted(ops, size, n, axis), d, ops.zeros_like(d))
    ulp = pow2(ops, ops.maximum(exponent(ops, ops.abs(mean)) - (fmt.precision - 1), -1000))
    eff = c.nf - ddof
    r2 = (eff * var * 2.0 + c.nf * ulp * ulp) * 2.0  # >= sum d**2
    ok = ops.isfinite(r2) & ops.isfinite(mean) & (r2 > 0) & (eff > 0)
    r2 = ops.where(ok, r2, ops.ones_like(r2))
    half = ops.shr(exponent(ops, r2) + 2, 1)  # 2**half >= sqrt(r2)
    nb = _nbits(ops, c)
    shift = ops.minimum(ops.maximum(half + nb - 52, -1000), 1000)
    # The per-slice chain into one buffer (`_one_buffer`), what the rounding needs as
    # floats: XLA cut it into a kernel per value that its consumers read (seven in the JAX
    # synchronized BN step, where the rounding runs in a branch of a conditional).
    scale, unscale, ok = ops.materialize_all(
        [pow2(ops, -shift), pow2(ops, shift), ops.cast(ok, "float64")]
    )
    scaled = ops.round(d * ops.expand_dims(scale, axis))
    return ops.exact_sum(scaled, axis), unscale, ok  # exact: |total| < 2**53, in any order


def mean_lo_round(ops, total, unscale, ok, n, fmt, rn=None):
    """mean_lo from the (all-reduced) fixed-point sums and `mean_lo_sums`' unscale = 2**shift
    and ok: total 2**shift / n, to the format (rn: None, or the float64 nearest 1/n,
    `counts`' rn[0], which is computed here else).

    A buffer of its own (`ops.materialize`): the layers subtract mean_lo from every
    element, and XLA would otherwise fuse this per-slice rounding (some 60 operations)
    into that per-element pass (measured in the JAX synchronized BN step: per-element
    fusions of 109-144 operations)."""
    rn = counts(ops, n, 0).rn[0] if rn is None else rn
    lo = total * unscale * rn
    return ops.materialize(ops.where(ok > 0.0, round_to(ops, lo, fmt), 0.0))


def _nbits(ops, c):
    if isinstance(c.n, int):
        return max(c.n, 1).bit_length()
    return _exact.bit_length(ops, ops.maximum(c.n, ops.ones_like(c.n)))
