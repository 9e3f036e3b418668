"""The exact path: sums of a slice as integers, and their correctly rounded quotients.

Section 7 of docs/algorithm.md.  Every input float of a slice is an integer
times a power of two, x = s * M * 2**E.  Relative to the lowest exponent `base`
an input of the format can have, X = s * M * 2**(E - base) is an integer, and

    S1 = sum X_i,    S2 = sum X_i**2,    N = n * S2 - S1**2  (= n * sum (X_i - mean X)**2)

are integers.  They are held as little-endian arrays of *digits* in radix
2**16, one array per slice, in int64: a digit may temporarily hold any int64
value; `normalise` carries until every digit but the top one lies in [0, 2**16)
(the top one carries the sign).  Integer addition is associative, so these sums
do not depend on the order in which the digits are accumulated: a segment sum
(scatter-add) in any order gives the same integers.  The results are then

    mean = S1 / n * 2**base,    var = N / (n * (n - ddof)) * 2**(2 * base),

each rounded once by `to_float`: long division by n (and n - ddof), a sticky bit
for the remainders, and round-half-even on the leading bits (Boldo-Melquiond:
rounding the p + 2 leading bits of the quotient with a sticky bit gives the
correct rounding).

Inside the exact path's loops a constant is added, never subtracted (x + (-c)): XLA's
algebraic simplifier rewrites x - c as x + negate(c), its loop-invariant code motion
hoists that negate out of the loop before constant folding folds it, and constant
sinking moves it back in a round later; the rounds of that fixpoint each pass over the
whole module (nine `moments` calls in one JAX `jit`: 7 rounds, 4 without; docs section 10).

Limits: n < 2**46 (digit sums, products n * digit and remainders * 2**16 stay
below 2**63).  All operations are integer operations of the backend: XLA
compiles them (jit_compile, jax.jit, vmap, GPU); no host callback.
"""

RADIX_BITS = 16
MASK = (1 << RADIX_BITS) - 1
MAX_N_BITS = 46


def lengths(fmt, aligned=False):
    """Digit counts of S1 and of S2 (and N) for inputs of `fmt`, with room for n < 2**46.

    aligned: S2's count rounded up to a multiple of 8 (more zero digits), for the exact
    path's working arrays: XLA's CPU backend compiled small fusions over rows of 57
    digits (float32) 2-3x slower than over rows of 64 (0.1 s for a select of two
    [16, 57] int64 arrays, 0.03 s for [16, 64]), vectorising each row with a remainder.
    The states of section 13 keep the exact counts."""
    l1 = (fmt.top + 53 + MAX_N_BITS) // RADIX_BITS + 2
    l2 = 2 * ((fmt.top + 53) // RADIX_BITS) + (2 * MAX_N_BITS) // RADIX_BITS + 14
    l2 = max(l2, 2 * l1)
    return l1, -(-l2 // 8) * 8 if aligned else l2


def decompose(ops, x, fmt, base=None):
    """x (float64, finite, flushed) -> (negative, M, P): |x| = M * 2**(P + base), P >= 0."""
    base = fmt.base if base is None else base
    bits = ops.bitcast(x, "int64")
    field = ops.band(ops.shr(bits, 52), 0x7FF)
    mant = ops.band(bits, (1 << 52) - 1) + ops.where(ops.ne(field, 0), 1 << 52, 0)
    p = ops.where(ops.ne(field, 0), field + (-1075 - base), 0)
    return bits < 0, mant, p


def _five_digits(ops, mant, p, pieces=4):
    """|X| = M 2**P (M < 2**(16 pieces)) as pieces + 1 digits (each below 2**17) from
    digit P // 16 on: five for a 53-bit M."""
    off = ops.band(p, 15)
    v = [ops.shl(ops.band(ops.shr(mant, 16 * k), MASK), off) for k in range(pieces)]
    lo = [ops.band(vk, MASK) for vk in v] + [0]
    hi = [0] + [ops.shr(vk, 16) for vk in v]
    return [lo[j] + hi[j] for j in range(pieces + 1)], ops.shr(p, 4)


def _narrow(ops, mant, p, fmt):
    """(M, P) with M shifted down to fmt's p bits (its low 53 - p bits are zero for a
    value of the format) and the pieces M needs: fewer digits, less code to compile."""
    drop = 53 - fmt.precision
    return ops.shr(mant, drop), p + drop, -(-fmt.precision // RADIX_BITS)


def digits_of(ops, v, base, length, fmt):
    """Digits [rows, length] of float64 values v [rows], each a multiple of 2**base."""
    negative, mant, p = decompose(ops, v, fmt, base)
    e, first = _five_digits(ops, mant, p)
    index = ops.expand_dims(ops.iota(length, "int64"), 0)
    sign = ops.where(negative, -1, 1)
    out = None
    for j in range(5):
        term = ops.where(
            ops.eq(index, ops.expand_dims(first + j, 1)), ops.expand_dims(e[j] * sign, 1), 0
        )
        out = term if out is None else out + term
    return out


def sums_digits(ops, parts, n, fmt):
    """(S1 digits per part for the means, for the variance, S2 digits) from exact shifted
    sums, for `finish`.

    parts: per real part [K, A, B] (float64 [rows]) with A = sum (x - K) and
    B = sum (x - K)**2 exact; then n mean = n K + A and n sum (x - mean)**2 =
    n B - A**2 (the variance does not see the shift): integers in units of
    2**base and 2**(2 base).  Digits not normalised.
    """
    l1, l2 = lengths(fmt, aligned=True)
    means, shifted, s2 = [], [], None
    for k, a, b in parts:
        da = digits_of(ops, a, fmt.base, l1, fmt)
        means.append(digits_of(ops, k, fmt.base, l1, fmt) * ops.expand_dims(n, 1) + da)
        shifted.append(da)
        db = digits_of(ops, b, 2 * fmt.base, l2, fmt)
        s2 = db if s2 is None else s2 + db
    return means, shifted, s2


def accumulate(ops, parts, valid, fmt, l1, l2, weights=None, axis=1):
    """Digits of S1 (one array per part) and of S2 (all parts together), [rows, digits].

    parts: float64 arrays [rows, n] (finite, flushed; [n, rows] for axis 0: the
    elements of a row along `axis`); valid: bool like them or None;
    weights: None or int64 [rows, n] integer frequencies (each digit is multiplied
    by its weight: S1 = sum w X, S2 = sum w X**2; exact for sum w < 2**40).
    Each |X| = M * 2**P, M the p-bit integer of the format, is first written as
    d = ceil(p / 16) + 1 digits e_0..e_{d-1} (not normalised, each below 2**17;
    five for float64, three for float32, two for float16 and bfloat16) at digit
    D = P // 16; X**2 is their convolution, 2 d - 1 sums below d 2**34 <= 2**37,
    each split in two below 2**21: 2 d digits at 2 D.
    """
    rows = ops.shape(parts[0], 1 - axis)
    row = ops.expand_dims(ops.iota(rows, "int64"), axis)
    groups, s2_data, s2_ids = [], [], []
    for x in parts:
        negative, mant, p = decompose(ops, x, fmt)
        if valid is not None:
            mant = ops.where(valid, mant, 0)
        # Piece k = (M >> 16 k) mod 2**16 sits at bit P + 16 k: split (piece << P mod 16).
        mant, p, pieces = _narrow(ops, mant, p, fmt)
        e, first = _five_digits(ops, mant, p, pieces)
        sign = ops.where(negative, -1, 1)
        if weights is not None:
            sign = sign * weights
        groups.append(([ej * sign for ej in e], [row * l1 + first], l1))
        d = len(e)
        conv = [
            sum(e[a] * e[j - a] for a in range(max(0, j - d + 1), min(d - 1, j) + 1))
            for j in range(2 * d - 1)
        ]
        low = [ops.band(cj, MASK) for cj in conv] + [0]
        high = [0] + [ops.shr(cj, 16) for cj in conv]
        s2 = [low[j] + high[j] for j in range(2 * d)]
        s2_data += s2 if weights is None else [d * weights for d in s2]
        s2_ids.append(row * l2 + 2 * first)
    *s1s, s2 = _segment_digits(ops, [*groups, (s2_data, s2_ids, l2)], rows)
    return s1s, s2


def _segment_digits(ops, groups, rows):
    """Per group (data, starts, length): the sums of data[j] into digit starts + j (j =
    0, 1, ...) of each row, [rows, length]; starts holds one array of digit indices
    (row * length + D) per run of equal size in data.  Integer sums: any order, one
    result.  All groups in one segment sum (each a scatter XLA compiles on its own,
    with the kernels that lay out its data and indices)."""
    values, indices, offset = [], [], 0
    for data, starts, length in groups:
        per = len(data) // len(starts)
        ids = [starts[g] + (offset + j) for g in range(len(starts)) for j in range(per)]
        values.append(ops.reshape(ops.stack(data, -1), [-1]))
        indices.append(ops.reshape(ops.stack(ids, -1), [-1]))
        offset = offset + rows * length
    out = ops.segment_sum(ops.concat(values, 0), ops.concat(indices, 0), offset)
    sums, at = [], 0
    for _, _, length in groups:
        sums.append(ops.reshape(out[at : at + rows * length], [rows, length]))
        at = at + rows * length
    return sums


def normalise(ops, d):
    """Carry until every digit but the top one lies in [0, 2**16); the value is unchanged.

    Every digit passes its carry floor(d / 2**16) up at once, until no digit below the
    top one has a carry left (a few steps, more only where carries ripple through
    digits of 2**16 - 1); the top digit keeps its carry, so it holds the sign.
    """
    length = ops.shape(d, 1)
    top = ops.eq(ops.expand_dims(ops.iota(length, "int64"), 0), length - 1)

    def pending(d):
        return ops.any(ops.ne(ops.where(top, 0, ops.shr(d, RADIX_BITS)), 0))

    def step(d):
        carry = ops.where(top, 0, ops.shr(d, RADIX_BITS))  # floor division by 2**16
        up = ops.concat([ops.zeros_like(carry[:, :1]), carry[:, :-1]], 1)
        return (d - ops.shl(carry, RADIX_BITS) + up,)

    return ops.while_loop(lambda d: pending(d), step, (d,))[0]


def magnitudes(ops, d):
    """(|value| digits, negative) of digits [rows, L] (|digit| < 2**62), normalised: the
    value and its negation carried together (one loop), each row's non-negative one kept."""
    rows = ops.shape(d, 0)
    # [d; -d] as d times the signs (1, -1) broadcast: XLA's CPU backend compiled the
    # concatenate of d and its negation (s64 [48, 57]) in 0.1-0.27 s, the product in 0.04 s.
    sign = ops.reshape(1 - 2 * ops.iota(2, "int64"), [2, 1, 1])
    both = ops.reshape(ops.expand_dims(d, 0) * sign, [-1, ops.shape(d, 1)])  # [2 rows, L]
    both = normalise(ops, both)
    plus, minus = both[:rows], both[rows:]
    negative = plus[:, -1] < 0
    return ops.where(ops.expand_dims(negative, 1), minus, plus), negative


def multiply(ops, a, b):
    """Digits of a * b (a, b normalised, [rows, L]) as [rows, 2 L - 1], not normalised."""
    length = ops.shape(a, 1)
    outer = ops.expand_dims(a, 2) * ops.expand_dims(b, 1)  # [rows, L, L], each < 2**32
    # Skew: row i moved right by i, so that column k collects the products with i + j = k.
    # (-1 for the rows: a TensorFlow graph keeps the static L through the reshapes.)
    padded = ops.concat([outer, ops.zeros_like(outer)], 2)  # [rows, L, 2 L]
    flat = ops.reshape(padded, [-1, 2 * length * length])[:, : length * (2 * length - 1)]
    return ops.sum(ops.reshape(flat, [-1, length, 2 * length - 1]), 1)


def resize(ops, d, length):
    """Digits padded with zeros (or cut: only zeros may be cut) to `length`."""
    have = d.shape[1]
    if have >= length:
        return d[:, :length]
    return ops.concat([d, ops.zeros([ops.shape(d, 0), length - have], "int64")], 1)


def bit_length(ops, v):
    """Bit length of non-negative int64 values below 2**53 (exact through float64)."""
    bits = ops.bitcast(ops.cast(v, "float64"), "int64")
    return ops.where(v > 0, ops.shr(bits, 52) + (-1022), 0)


def to_float(ops, num, divisors, offset, fmt, negative=None):
    """Bit patterns (int64) of num / prod(divisors) * 2**offset rounded once to `fmt`.

    num: normalised non-negative digits [rows, L]; divisors: int64 [rows] arrays,
    each in [1, 2**46); offset: an int or an int64 [rows] array.  Round-half-even,
    results below 2**emin flush to 0, results >= 2**emax are inf; `negative`
    (bool [rows]) sets the sign.

    One loop, one step per digit from the top (k = L - 1 down to -z): long division by
    every divisor in turn (the quotient digits by the first divisor are the digits the
    next one divides, as they come: floor(floor(v / a) / b) = floor(v / (a b)), with a
    zero remainder only if both are; each remainder r < a, so r 2**16 + digit < 2**62),
    and the quotient digits q_k (each below 2**16, weight 2**(16 k)) shifted into a
    62-bit register from the first nonzero one on: `big` holds its leading `nb` bits,
    its lowest of weight 2**low; the bits that do not fit go to the sticky bit.  The
    z digits below the number (zeros) give the quotient at least p + 2 bits whenever
    num > 0 (num >= 1, the divisors' product < 2**(46 d)); rounding those with a sticky
    bit for the rest and the remainders rounds the quotient correctly (Boldo-Melquiond).
    """
    p = fmt.precision
    z = -(-(p + 2 + len(divisors) * MAX_N_BITS) // RADIX_BITS)
    length = ops.shape(num, 1)
    zero = ops.zeros_like(divisors[0])

    def step(k, state):
        big, nb, low, sticky, *rs = [state[i] for i in range(4 + len(divisors))]
        # Digit k of num (0 below the number): one column read, not a masked row sum
        # (which XLA compiled to a reduction of its own per step).
        q = ops.where(k >= 0, ops.take(num, ops.maximum(k, 0), 1), 0)
        remainders = []
        for a, r in zip(divisors, rs):
            cur = ops.shl(r, RADIX_BITS) + q
            # cur >= 0 and a >= 1: truncating division is floor division here, and
            # needs no sign fix-ups (XLA: one division per step instead of a division,
            # a remainder and selects; to_float's loop ran 2.5x faster).
            q = ops.truncdiv(cur, a)
            remainders.append(cur - q * a)
        fresh = ops.eq(nb, 0)  # no nonzero quotient digit yet: q starts the register
        s = ops.minimum(62 - nb, RADIX_BITS)  # bits of q that still fit
        dropped = ops.band(q, ops.shl(1, RADIX_BITS - s) + (-1))
        big = ops.where(fresh, q, ops.shl(big, s) + ops.shr(q, RADIX_BITS - s))
        sticky = ops.where(fresh | ops.eq(dropped, 0), sticky, 1)
        low = ops.where(fresh, RADIX_BITS * k, low - s)
        nb = ops.where(fresh, bit_length(ops, q), nb + s)
        return (k + (-1), ops.stack([big, nb, low, sticky, *remainders], 0))

    # The registers as the rows of one array (sticky as 0 or 1): the loop's state is one
    # buffer, which the body updates in one fused pass.
    start = ops.stack([zero] * (4 + len(divisors)), 0)
    _, state = ops.while_loop(
        lambda k, _: k >= -z, step, (ops.constant(length - 1, "int64"), start)
    )
    big, nb, low, sticky, *rs = [state[i] for i in range(4 + len(divisors))]
    sticky = ops.ne(sticky, 0)
    for r in rs:
        sticky = sticky | ops.ne(r, 0)
    # Round the nb >= p + 2 leading bits to p: half to even, the sticky bit breaking ties.
    r = ops.maximum(nb + (-p), 1)
    mant = ops.shr(big, r)
    rem = ops.band(big, ops.shl(1, r) + (-1))
    half = ops.shl(1, r + (-1))
    up = (rem > half) | (ops.eq(rem, half) & (sticky | ops.eq(ops.band(mant, 1), 1)))
    mant = mant + ops.where(up, 1, 0)
    over = ops.eq(mant, 1 << p)
    mant = ops.where(over, ops.shr(mant, 1), mant)
    e = low + r + (p - 1) + ops.where(over, 1, 0) + offset  # floor(log2(result))
    bits = ops.shl(e + fmt.bias, p - 1) + (mant + (-(1 << (p - 1))))
    inf = (fmt.emax + fmt.bias) << (p - 1)
    bits = ops.where(e >= fmt.emax, inf, ops.where((e < fmt.emin) | ops.eq(nb, 0), 0, bits))
    if negative is not None:  # the sign bit, as the pattern of a signed integer of fmt.bits
        signed = bits + (-(1 << (fmt.bits - 1)))
        bits = ops.where(negative & ops.ne(bits, 0), signed, bits)
    return bits


def finish(ops, means, shifted, s2, n, ddof, fmt, target=None, width=None, canonical=False):
    """Bit patterns of the means S1 / n (per part) and of the variance
    (n S2 - sum S1'**2) / (n (n - ddof)), from digits (not normalised, [rows, <= l2])
    of sums in units of 2**fmt.base, rounded to fmt (or to `target`, a wider format:
    the state's mean and variance of float32 data in float64, `_state.finish`).
    width: digits of the working rows (l2 of `lengths`, aligned, by default);
    canonical: S2's digits are normalised already (a state's), so only the S1 rows go
    through `magnitudes` (its loop carries each row and its negation).

    means: the S1 of each part (the sum of its X); shifted: the S1' of each part that
    goes with S2 (shifted sums, see `sums_digits`), or None for sums of the elements
    (S1' = S1: carried once).  Everything is carried, made non-negative and rounded as
    the blocks of one stacked array, so that compiled code holds each carry loop and the
    rounding once, whatever the number of parts and whichever sums the rows come from.
    """
    l1, l2 = lengths(fmt, aligned=True)
    l2 = l2 if width is None else width
    k = len(means)
    rows = ops.shape(s2, 0)
    blocks = [*means, *(shifted or [])] + ([] if canonical else [s2])
    sums, negative = magnitudes(ops, ops.concat([resize(ops, b, l2) for b in blocks], 0))
    s2 = resize(ops, s2, l2) if canonical else sums[(len(blocks) - 1) * rows :]
    num = s2 * ops.expand_dims(n, 1)
    for i in range(k, 2 * k) if shifted else range(k):
        magnitude = sums[i * rows : (i + 1) * rows][:, :l1]  # |S1'| < 2**(16 l1); rows, then
        # digits: TensorFlow keeps the static l1 (a begin vector holding rows loses it)
        num = num - resize(ops, multiply(ops, magnitude, magnitude), l2)
    num = normalise(ops, num)
    d = ops.maximum(n + (-ddof), 1)
    ones = ops.ones_like(n)
    # Means S1 / (n * 1) * 2**base, the variance N / (n d) * 2**(2 base).
    divisors = [ops.concat([n] * (k + 1), 0), ops.concat([ones] * k + [d], 0)]
    block = ops.iota(k + 1, "int64")
    offset = ops.expand_dims(ops.where(ops.eq(block, k), 2 * fmt.base, fmt.base), 1) + 0 * n
    signs = ops.concat([negative[: k * rows], ops.zeros_like(negative[:rows])], 0)
    bits = to_float(
        ops,
        ops.concat([sums[: k * rows], num], 0),
        divisors,
        ops.reshape(offset, [-1]),
        fmt if target is None else target,
        signs,
    )
    return [bits[i * rows : (i + 1) * rows] for i in range(k)], bits[k * rows :]
