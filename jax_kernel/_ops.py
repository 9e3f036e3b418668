"""The array operations the shared kernel (moments_core/_kernel.py) uses, in JAX.

Called with 64-bit types enabled (``jax.enable_x64``) around the kernel.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moments_core._kernel import SUB

_DTYPES = {
    "float64": jnp.float64,
    "float32": jnp.float32,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "int64": jnp.int64,
    "int32": jnp.int32,
    "int16": jnp.int16,
    "bool": jnp.bool_,
}
_INT = {16: jnp.int16, 32: jnp.int32, 64: jnp.int64}

abs = jnp.abs  # noqa: A001
sqrt = jnp.sqrt
isnan = jnp.isnan
isfinite = jnp.isfinite
maximum = jnp.maximum
minimum = jnp.minimum
round = jnp.round  # noqa: A001  (half to even)
floor = jnp.floor
truncdiv = lax.div  # rounds toward zero
zeros_like = jnp.zeros_like
transpose = jnp.transpose
expand_dims = jnp.expand_dims
squeeze = jnp.squeeze
honours_nan = False  # XLA (moments_core/_affine.py canonical_nan)


def ones_like(x, dtype=None):
    return jnp.ones_like(x, None if dtype is None else _DTYPES[dtype])


def cast(x, dtype):
    return jnp.asarray(x).astype(_DTYPES[dtype])


def bitcast(x, dtype):
    return lax.bitcast_convert_type(x, _DTYPES[dtype])


def from_bits(bits, fmt):
    """int64 bit patterns (as signed integers of fmt.bits) -> float64 values of fmt."""
    return bitcast(bits.astype(_INT[fmt.bits]), fmt.name).astype(jnp.float64)


def band(a, b):
    return jnp.bitwise_and(a, b)


def shl(a, k):
    return jnp.left_shift(jnp.asarray(a, jnp.int64), k)


def shr(a, k):
    return jnp.right_shift(a, k)  # arithmetic for signed integers


def eq(a, b):
    return jnp.equal(a, b)


def ne(a, b):
    return jnp.not_equal(a, b)


def where(c, a, b):
    return jnp.where(c, a, b)


def sum(x, axis, keepdims=False):  # noqa: A001
    return jnp.sum(x, axis=axis, keepdims=keepdims)


def any(x, axis=None):  # noqa: A001
    return jnp.any(x, axis=axis)


def max(x, axis):  # noqa: A001
    return jnp.max(x, axis=axis)


def shape(x, i):
    return x.shape[i]


def iota(n, dtype):
    """0, 1, ..., n - 1.  A short one (a known n, not a symbolic dimension) is a literal
    constant, which XLA folds into what uses it: an iota instruction became a kernel of
    its own wherever XLA hoisted it out of a loop (the exact path's: four small kernels
    that ran on every call, open slices or not; its compilation 5-10% faster)."""
    if isinstance(n, (int, np.integer)) and n <= _LITERAL_IOTA:
        return jnp.asarray(np.arange(n), _DTYPES[dtype])
    return jnp.arange(n, dtype=_DTYPES[dtype])


_LITERAL_IOTA = 2048


def zeros(shape, dtype):
    return jnp.zeros(shape, _DTYPES[dtype])


def concat(xs, axis):
    return jnp.concatenate(xs, axis)


def stack(xs, axis):
    return jnp.stack(xs, axis)


def reshape(x, shape):
    return jnp.reshape(x, shape)


def pad(x, axis, extra, value):
    """x with `extra` copies of `value` appended along axis."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def take(x, idx, axis):
    """x[idx] along axis for indices the kernel keeps in bounds (`_kernel._pick`), in
    "clip" mode: a clamp per index instead of jnp.take's default fill of out-of-bounds
    rows, a select per gathered element that XLA fused into every consumer of the rows
    (the exact path's loop: 2,106 -> 1,850 instructions, float32 [4096, 64])."""
    return jnp.take(x, idx, axis=axis, mode="clip")


def head(x, axis, count):
    """The first `count` elements along axis of a 2-D x (all of a shorter axis).  For a
    symbolic length (jax.export), `count` clamped indices: the last element repeated
    where the axis is shorter (symbolic dimensions are at least 1)."""
    size = x.shape[axis]
    if isinstance(size, int):
        return lax.slice_in_dim(x, 0, min(count, size), axis=axis)
    idx = jnp.minimum(lax.iota(np.int64, count), size - 1)
    return jnp.take(x, idx, axis=axis, mode="clip")


def constant(v, dtype):
    return jnp.asarray(v, _DTYPES[dtype])


def segment_sum(data, ids, num):
    return jax.ops.segment_sum(data, ids, num_segments=num)


def cumsum(x, axis):
    return jnp.cumsum(x, axis)


def top_k(x, k):
    """(values, indices) of the k largest of a 1-D x, largest first, by one sort of
    (-x, position).  Not lax.top_k: it lowers to a StableHLO composite that TensorFlow's
    XlaCallModule (TF 2.21) cannot read, so Keras-JAX `model.export` artifacts failed to
    load."""
    keys, idx = lax.sort((-x, lax.iota(np.int32, x.shape[0])), num_keys=1)
    return -keys[:k], idx[:k]


def cond(pred, fn, state):
    """fn(*state) where pred holds, else state (a tuple of arrays fn maps to their kind)."""
    return lax.cond(pred, lambda s: tuple(fn(*s)), tuple, tuple(state))


def while_loop(cond, body, state):
    return lax.while_loop(lambda s: cond(*s), lambda s: tuple(body(*s)), tuple(state))


def _pair(a, b):
    (h0, l0), (h1, l1) = a, b
    s = h0 + h1
    bb = s - h0
    return s, (l0 + l1) + ((h0 - (s - bb)) + (h1 - bb))


def _whole_blocks(x, axis):
    """Whether a 2-D x has at least two whole blocks of SUB terms along axis and nothing
    else: `sums_min` and `exact_sum` then reduce it block by block (each in its order)."""
    n = x.shape[axis]
    return x.ndim == 2 and n % SUB == 0 and n >= 2 * SUB


def _sums_min(a, b):
    return a[0] + b[0], a[1] + b[1], jnp.minimum(a[2], b[2])


def sums_min(a, b, c, axis):
    """(sum a, sum b, min c) in one pass: one variadic reduction (XLA would otherwise
    materialise a producer that several reductions share)."""
    zero = np.zeros((), a.dtype)
    inits = (zero, zero, np.array(np.inf, c.dtype))
    # XLA's CPU emitter keeps a reduction vectorised in steps of SUB terms (the kernel's
    # blocks, `_kernel._block_stage`): a 2-D slice of a multiple of SUB terms (at least
    # 2 SUB) is reduced likewise.  Any order: the same certified bits.
    n = a.shape[axis]
    if _whole_blocks(a, axis):
        rows, width = a.shape
        shape = [n // SUB, SUB, width] if axis == 0 else [rows, n // SUB, SUB]
        inner = lax.reduce(tuple(t.reshape(shape) for t in (a, b, c)), inits, _sums_min, (1,))
        return lax.reduce(inner, inits, _sums_min, (axis,))
    return lax.reduce((a, b, c), inits, _sums_min, (axis,))


def _pairs_min(a, b):
    (h0, l0, g0, m0, c0), (h1, l1, g1, m1, c1) = a, b
    return (*_pair((h0, l0), (h1, l1)), *_pair((g0, m0), (g1, m1)), jnp.minimum(c0, c1))


def pair_sums_min(a, b, c, axis):
    """(sum a as a pair, sum b as a pair, min c): compensated sums in any tree, one
    variadic reduction (a different computation from `sums_min`'s: XLA cannot merge
    the two stages of `_kernel.block_sums`)."""
    zero = np.zeros((), a.dtype)
    inits = (zero, zero, zero, zero, np.array(np.inf, c.dtype))
    z = jnp.zeros_like(a)
    return lax.reduce((a, z, b, z, c), inits, _pairs_min, (axis,))


def variadic(arrays, inits, fn, axis):
    """fn's reduction of `arrays` along axis (one variadic reduction, any order): fn
    takes two tuples like `arrays` and returns one."""
    inits = tuple(np.array(v, a.dtype) for v, a in zip(inits, arrays))
    return list(lax.reduce(tuple(arrays), inits, fn, (axis,)))


def scatter(v, idx, new):
    return v.at[idx].set(new)


def pair_sum(h, l, axis):
    """Compensated sum of pairs along axis, in whatever order XLA reduces."""
    zero = np.zeros((), h.dtype)
    return lax.reduce((h, l), (zero, zero), _pair, (axis,))


def exact_sum(x, axis):
    """sum x along axis for float64 terms whose partial sums are exact (mean_lo's
    integers): any order, the same bits.

    Reduced as compensated pairs (`_pair`; their low parts stay 0 here) in the blocks of
    `_kernel._block_stage` (SUB x SUB terms, then the blocks), reductions that XLA's CPU
    emitter compiles itself, with the input's flush and scaling fused.  A plain float64
    sum went to YNNPACK, which does not fuse the flush (a float32 copy of the input came
    first) and summed columns slowly: mean_lo made `stats` 3.6-3.7x as slow as without
    it on float32 [64, 32, 32, 64] over axes 0-2 and 5.9-6.3x on [4096, 4096] over axis 0,
    1.7-2.4x and 2.2-2.3x this way (JAX, CPU twin, one process per version)."""
    zero = np.zeros((), x.dtype)
    n = x.shape[axis]
    if _whole_blocks(x, axis):
        rows, width = x.shape
        blocks = [SUB, SUB] if n % (SUB * SUB) == 0 else [SUB]
        count = n // math.prod(blocks)
        x = x.reshape([count, *blocks, width] if axis == 0 else [rows, count, *blocks])
        low = jnp.zeros_like(x)
        for a in [2, axis + 1][-len(blocks) :]:  # as `_kernel._block_stage`
            x, low = lax.reduce((x, low), (zero, zero), _pair, (a,))
    else:
        low = jnp.zeros_like(x)
    high, low = lax.reduce((x, low), (zero, zero), _pair, (axis,))
    return high + low


def materialize_all(values):
    """`materialize` of several arrays of one shape in one multi-output reduction, so that
    a chain they share is computed once per element (a reduction of their stack computes
    each row's own).

    The reduction is a max of the encodings as integers (each paired with the smallest
    integer), which keeps every bit, NaN included, under any compiler flags: TensorFlow's
    XLA, which compiles this kernel inside TensorFlow (tf_stable_moments/_xla_module.py),
    may drop a NaN from a float min (its fast min/max: min(NaN, inf) gave inf)."""
    kinds = [_INT_OF_SIZE[np.dtype(v.dtype).itemsize] for v in values]
    pairs = tuple(
        jnp.stack([lax.bitcast_convert_type(v, k), jnp.full_like(v, np.iinfo(k).min, k)])
        for v, k in zip(values, kinds)
    )
    inits = tuple(np.array(np.iinfo(k).min, k) for k in kinds)
    out = lax.reduce(pairs, inits, _maxima, (0,))
    return [lax.bitcast_convert_type(o, v.dtype) for o, v in zip(out, values)]


_INT_OF_SIZE = {2: np.int16, 4: np.int32, 8: np.int64}  # a float's encoding as an integer


def _maxima(a, b):
    return tuple(jnp.maximum(x, y) for x, y in zip(a, b))


def materialize(v):
    """v as a buffer of its own: a reduction over a stacked pair (`materialize_all`), the
    same bits.  XLA fuses a cheap per-slice chain into each consumer, i.e.
    recomputes it per element (see tf_stable_moments/_ops.py `_materialize_xla`); a
    reduction is not fused into its consumers.  Measured on the CPU backend without the
    native kernel: six 1x1 conv + BN layers on [8, 8, 8, 128], 1.71x keras's jit step
    with mean_lo's rounding fused, 1.33x without."""
    return materialize_all([v])[0]
