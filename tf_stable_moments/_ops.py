"""The array operations the shared kernel (moments_core/_kernel.py) uses, in TensorFlow.

Two namespaces: XLA (inside an XLA computation: compensated sums as one
variadic reduction) and PLAIN (plain eager operations: compensated sums as a
halving tree of slices).  Any summation order is allowed by the kernel's
bounds; both give the same certified results.
"""

import builtins
from types import SimpleNamespace

import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as _xla

_DTYPES = {
    "float64": tf.float64,
    "float32": tf.float32,
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
    "int64": tf.int64,
    "int32": tf.int32,
    "int16": tf.int16,
    "bool": tf.bool,
}
_INT = {16: tf.int16, 32: tf.int32, 64: tf.int64}


def _like(v, other):
    """v as a tensor; Python scalars take the dtype of `other` (int64/float64 if none)."""
    if tf.is_tensor(v):
        return v
    if tf.is_tensor(other):
        return tf.constant(v, other.dtype)
    if isinstance(v, bool):
        return tf.constant(v)
    return tf.constant(v, tf.int64 if isinstance(v, int) else tf.float64)


def _int(v):
    return tf.cast(v, tf.int64) if tf.is_tensor(v) else tf.constant(v, tf.int64)


def cast(x, dtype):
    return tf.cast(x, _DTYPES[dtype])


def bitcast(x, dtype):
    if not tf.is_tensor(x):  # a Python scalar: 64 bits, as everywhere in the kernel
        x = tf.constant(x, tf.float64 if dtype == "int64" else tf.int64)
    return tf.bitcast(x, _DTYPES[dtype])


def from_bits(bits, fmt):
    """int64 bit patterns (as signed integers of fmt.bits) -> float64 values of fmt."""
    return tf.cast(tf.bitcast(tf.cast(bits, _INT[fmt.bits]), _DTYPES[fmt.name]), tf.float64)


def band(a, b):
    return tf.bitwise.bitwise_and(_int(a), _int(b))


def shl(a, k):
    return tf.bitwise.left_shift(_int(a), _int(k))


def shr(a, k):
    return tf.bitwise.right_shift(_int(a), _int(k))  # arithmetic for signed integers


def where(c, a, b):
    a, b = _like(a, b), _like(b, a)
    return tf.where(c, a, b)


def eq(a, b):
    """a == b elementwise (Tensor.__eq__ compares identity inside TF1 graphs)."""
    return tf.equal(_like(a, b), _like(b, a))


def ne(a, b):
    return tf.not_equal(_like(a, b), _like(b, a))


def ones_like(x, dtype=None):
    return tf.ones_like(x, None if dtype is None else _DTYPES[dtype])


def sum(x, axis, keepdims=False):  # noqa: A001
    return tf.reduce_sum(x, axis=axis, keepdims=keepdims)


def any(x, axis=None):  # noqa: A001
    return tf.reduce_any(x, axis=axis)


def max(x, axis):  # noqa: A001
    return tf.reduce_max(x, axis=axis)


def shape(x, i):
    d = x.shape[i]
    return d if d is not None else tf.shape(x, out_type=tf.int64)[i]


def iota(n, dtype):
    return tf.range(tf.cast(n, _DTYPES[dtype]) if tf.is_tensor(n) else n, dtype=_DTYPES[dtype])


def zeros(shape, dtype):
    return tf.zeros(shape, _DTYPES[dtype])


def concat(xs, axis):
    return tf.concat(xs, axis)


def stack(xs, axis):
    return tf.stack(xs, axis)


def reshape(x, shape):
    if builtins.any(tf.is_tensor(d) for d in shape):
        shape = tf.stack([tf.cast(d, tf.int64) for d in shape])
    return tf.reshape(x, shape)


def pad(x, axis, extra, value):
    """x with `extra` (an int or an int64 scalar) copies of `value` appended along axis."""
    paddings = [[0, 0]] * len(x.shape)
    paddings[axis] = [0, extra]
    if tf.is_tensor(extra):
        paddings = tf.stack([tf.cast(tf.stack(p), tf.int64) for p in paddings])
    return tf.pad(x, paddings, constant_values=value)


def take(x, idx, axis):
    return tf.gather(x, idx, axis=axis)


def head(x, axis, count):
    """The first `count` elements along axis of a 2-D x (all of a shorter axis)."""
    return x[:count] if axis == 0 else x[:, :count]


def constant(v, dtype):
    return tf.constant(v, _DTYPES[dtype])


def segment_sum(data, ids, num):
    return tf.math.unsorted_segment_sum(data, ids, num)


def cumsum(x, axis):
    return tf.math.cumsum(x, axis)


def top_k(x, k):
    return tf.math.top_k(x, k, sorted=True)


def cond(pred, fn, state):
    """fn(*state) where pred holds, else state (a tuple of tensors fn maps to their kind)."""
    state = tuple(state)
    return tuple(tf.cond(pred, lambda: tuple(fn(*state)), lambda: state))


def while_loop(cond, body, state):
    return tuple(tf.while_loop(cond, lambda *s: tuple(body(*s)), tuple(state)))


def _pair(h0, l0, h1, l1):
    s = h0 + h1
    bb = s - h0
    return s, (l0 + l1) + ((h0 - (s - bb)) + (h1 - bb))


# XLA's CPU emitter reduces the columns of a [n, kept] array (axis 0) several times
# faster when they are first cut into blocks of 16 rows ([n / 16, 16, kept], reduced
# over the middle axis), level after level while 32 rows or more are left: measured
# 0.17-0.24x the time of tf.nn.moments on [4096, 4096] and [4000, 4000] float64 sums,
# against 1.4-1.8x unblocked, 0.4x with one level, 0.8x with blocks of 8 or 32.  The
# kernel's bounds hold for any order of the sums, so the blocking changes no result.
# Long rows (axis 1, 512 or more, a multiple of 16) likewise as [rows, 16, width / 16]:
# 0.22-0.25x instead of 0.31-0.34x tf.nn.moments on [4096, 4096] and [4000, 4000],
# 1.07x instead of 1.25-1.40x on [256, 1024] (the whole kernel under jit_compile).
COLUMN_BLOCK = 16
DYNAMIC_LEVELS = 2  # levels for a row count unknown while tracing


def _variadic(arrays, inits, axis, fn):
    """fn's reduction of `arrays` along `axis` as XLA variadic reductions (any order).

    Along axis 0 in blocks of COLUMN_BLOCK rows; the rows left over at each level are
    reduced apart and combined with fn.  Long rows of a static width that COLUMN_BLOCK
    divides in COLUMN_BLOCK strided parts.  The reducer is traced anew for each graph: a
    concrete function belongs to the graph that traced it (no TensorFlow object is
    kept across graphs).
    """
    reducer = _reducer(arrays, fn)

    def reduce(xs, axes):
        return list(_xla.variadic_reduce(xs, inits, axes, reducer))

    if arrays[0].shape.rank > 2:  # the blocks of `_kernel.block_sums`
        return reduce(arrays, [axis])
    if axis == 1:
        rows, width = arrays[0].shape
        if rows is None or width is None or width < 32 * COLUMN_BLOCK or width % COLUMN_BLOCK:
            return reduce(arrays, [1])
        shape = [rows, COLUMN_BLOCK, width // COLUMN_BLOCK]
        return reduce(reduce([tf.reshape(a, shape) for a in arrays], [1]), [1])
    rest, level = [], 0
    while True:
        rows = arrays[0].shape[0]
        if rows is None:
            if level == DYNAMIC_LEVELS:
                break
            rows = tf.shape(arrays[0], out_type=tf.int64)[0]
        elif rows < 2 * COLUMN_BLOCK:
            break
        kept = arrays[0].shape[1]
        kept = tf.shape(arrays[0], out_type=tf.int64)[1] if kept is None else kept
        m = rows - rows % COLUMN_BLOCK
        shape = [m // COLUMN_BLOCK, COLUMN_BLOCK, kept]
        if builtins.any(tf.is_tensor(d) for d in shape):
            shape = tf.stack([tf.cast(d, tf.int64) for d in shape])
        if not isinstance(m, int) or m < rows:
            rest.append(reduce([a[m:] for a in arrays], [0]))
        arrays = reduce([tf.reshape(a[:m], shape) for a in arrays], [1])
        level += 1
    out = reduce(arrays, [0])
    for r in rest:
        out = list(fn(*out, *r))
    return out


def _reducer(arrays, fn):
    """fn (scalars of `arrays`' dtypes, twice, flat) as the concrete function of a
    variadic reduction, traced in the current graph."""
    spec = [tf.TensorSpec([], a.dtype) for a in arrays]
    return tf.function(fn, autograph=False).get_concrete_function(*spec, *spec)


def _variadic_xla(arrays, inits, fn, axis):
    """fn's reduction of `arrays` along axis as one XLA variadic reduction (any order):
    fn takes two tuples like `arrays` and returns one.  The reducer is traced anew for
    each graph (see `_variadic`)."""
    k = len(arrays)
    inits = [tf.constant(v, a.dtype) for v, a in zip(inits, arrays)]
    reducer = _reducer(arrays, lambda *v: tuple(fn(v[:k], v[k:])))
    return list(_xla.variadic_reduce(list(arrays), inits, [axis], reducer))


def _variadic_tree(arrays, inits, fn, axis):
    """fn's reduction of `arrays` along axis by halving (eager: static shapes)."""
    size = arrays[0].shape[axis]
    width = 1 << builtins.max(size - 1, 0).bit_length()
    rank = len(arrays[0].shape)
    pad = [[0, 0]] * rank
    pad[axis] = [0, width - size]
    arrays = [tf.pad(a, pad, constant_values=v) for a, v in zip(arrays, inits)]
    while width > 1:
        width //= 2
        halves = [tf.split(a, 2, axis=axis) for a in arrays]
        arrays = list(fn(tuple(h[0] for h in halves), tuple(h[1] for h in halves)))
    return [tf.squeeze(a, axis) for a in arrays]


def _pair_sum_xla(h, l, axis):
    """Compensated sum of pairs along axis (any order): see `_variadic`."""
    zero = tf.zeros([], h.dtype)
    return tuple(_variadic([h, l], [zero, zero], axis, _pair))


def _sums_min_xla(a, b, c, axis):
    """(sum a, sum b, min c) in one pass: one variadic reduction (XLA would otherwise
    materialise a producer that several reductions share); see `_variadic`."""
    zero, inf = tf.zeros([], a.dtype), tf.constant(float("inf"), c.dtype)
    return tuple(_variadic([a, b, c], [zero, zero, inf], axis, _sum_sum_min))


def _pair_sums_min_xla(a, b, c, axis):
    """(sum a as a pair, sum b as a pair, min c): compensated sums in any tree, one
    variadic reduction (a different computation from `_sums_min_xla`'s: XLA cannot
    merge the two stages of `_kernel.block_sums`); see `_variadic`."""
    zero, inf = tf.zeros([], a.dtype), tf.constant(float("inf"), c.dtype)
    z = tf.zeros_like(a)
    return tuple(_variadic([a, z, b, z, c], [zero, zero, zero, zero, inf], axis, _pairs_min))


def _pairs_min(h0, l0, g0, m0, c0, h1, l1, g1, m1, c1):
    return (*_pair(h0, l0, h1, l1), *_pair(g0, m0, g1, m1), tf.minimum(c0, c1))


def _sum_sum_min(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, tf.minimum(c0, c1)


def _exact_sum_xla(x, axis):
    """sum x along axis for float64 terms whose partial sums are exact (mean_lo's
    integers): any order gives the same bits.  As a variadic reduction of x twice, in
    `_variadic`'s blocks: XLA's CPU emitter turns a reduction of one array into its
    plain reduce, which summed the float64 columns of [131072, 64] in 43 ms; the same
    sum as a reduction of two arrays took 4.8 ms."""
    zero = tf.zeros([], x.dtype)
    return _variadic([x, x], [zero, zero], axis, _add_twice)[0]


def _add_twice(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


_INT_OF_SIZE = {2: tf.int16, 4: tf.int32, 8: tf.int64}  # a float's encoding as an integer


def _materialize_xla(v):
    """v as a buffer of its own inside an XLA computation: the same bits (signed zeros
    and NaN included), through a reduction over a stacked pair.  XLA fuses a cheap chain of
    per-slice operations into every consumer, so a per-slice vector used by per-element
    passes is recomputed per element: mean_lo's rounding (some 80 operations) cost a
    BN training step on [8, 8, 8, 128] under jit_compile 0.4 ms of 1.7; a reduction is
    not fused into its consumers.  The reduction is on the encodings (a max of integers):
    TensorFlow's XLA CPU min and max may drop a NaN (min(NaN, inf) gave inf), an integer
    max keeps every bit."""
    bits = _INT_OF_SIZE.get(v.dtype.size)
    if bits is None or not v.dtype.is_floating:
        return tf.reduce_min(tf.stack([v, tf.fill(tf.shape(v), v.dtype.max)]), 0)
    floor = tf.fill(tf.shape(v), tf.constant(bits.min, bits))
    return tf.bitcast(tf.reduce_max(tf.stack([tf.bitcast(v, bits), floor]), 0), v.dtype)


def _materialize_all_xla(values):
    """`_materialize_xla` of several float arrays of one shape in one multi-output
    reduction (`_variadic_xla`), so that a chain they share is computed once per element
    (a reduction of their stack computes each row's own)."""
    kinds = [_INT_OF_SIZE[v.dtype.size] for v in values]
    pairs = [
        tf.stack([tf.bitcast(v, b), tf.fill(tf.shape(v), tf.constant(b.min, b))])
        for v, b in zip(values, kinds)
    ]
    inits = [b.min for b in kinds]
    out = _variadic_xla(pairs, inits, lambda a, b: [tf.maximum(x, y) for x, y in zip(a, b)], 0)
    return [tf.bitcast(o, v.dtype) for o, v in zip(out, values)]


def _sums_min_plain(a, b, c, axis):
    return tf.reduce_sum(a, axis), tf.reduce_sum(b, axis), tf.reduce_min(c, axis)


def _pair_sums_min_plain(a, b, c, axis):
    z = tf.zeros_like(a)
    return (*_pair_sum_tree(a, z, axis), *_pair_sum_tree(b, z, axis), tf.reduce_min(c, axis))


def scatter(v, idx, new):
    return tf.tensor_scatter_nd_update(v, tf.expand_dims(idx, 1), new)


def _pair_sum_tree(h, l, axis):
    """Compensated sum of pairs along axis by halving (eager: static shapes)."""
    zero = tf.zeros([], h.dtype)
    return tuple(_variadic_tree([h, l], [zero, zero], lambda a, b: _pair(*a, *b), axis))


_COMMON = dict(
    abs=tf.abs,
    sqrt=tf.sqrt,
    isnan=tf.math.is_nan,
    isfinite=tf.math.is_finite,
    maximum=lambda a, b: tf.maximum(_like(a, b), _like(b, a)),
    minimum=lambda a, b: tf.minimum(_like(a, b), _like(b, a)),
    round=tf.math.round,  # half to even
    floor=tf.math.floor,
    truncdiv=tf.truncatediv,
    zeros_like=tf.zeros_like,
    transpose=tf.transpose,
    expand_dims=tf.expand_dims,
    squeeze=tf.squeeze,
    **{
        f.__name__: f
        for f in (
            cast,
            bitcast,
            from_bits,
            band,
            shl,
            shr,
            where,
            eq,
            ne,
            ones_like,
            sum,
            any,
            max,
            shape,
            iota,
            zeros,
            concat,
            stack,
            reshape,
            pad,
            take,
            head,
            constant,
            segment_sum,
            top_k,
            cond,
            while_loop,
            scatter,
        )
    },
)

XLA = SimpleNamespace(
    variadic=_variadic_xla,
    pair_sum=_pair_sum_xla,
    sums_min=_sums_min_xla,
    pair_sums_min=_pair_sums_min_xla,
    exact_sum=_exact_sum_xla,
    materialize=_materialize_xla,
    materialize_all=_materialize_all_xla,
    honours_nan=False,  # (XLA's CPU code was seen to drop comparisons with NaN)
    **_COMMON,
)
PLAIN = SimpleNamespace(
    variadic=_variadic_tree,
    pair_sum=_pair_sum_tree,
    sums_min=_sums_min_plain,
    pair_sums_min=_pair_sums_min_plain,
    exact_sum=tf.reduce_sum,
    materialize=tf.identity,
    materialize_all=list,
    honours_nan=True,
    **_COMMON,
)
