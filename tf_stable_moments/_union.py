"""Statistics of the union of every replica's data in a tf.distribute replica context: the
certified merge of docs/algorithm.md section 13b, for the synchronized layers
(tf_stable_moments/_layer.py), and the public `moments` with `synchronized` (one
replica: tf_stable_moments/_moments.py).

One all-reduce of each replica's fast sums and their error bounds decides the slices of
the union; exact moments states (int32 digits, packed into int64 lanes) only for the
slices it leaves open.  The JAX counterpart is jax_kernel/_union.py.
"""

import collections

import tensorflow as tf

from moments_core import _kernel
from moments_core._formats import FORMATS
from tf_stable_moments import _moments, _ops
from tf_stable_moments import _state as state_api
from tf_stable_moments._xla_context import in_xla_context

__all__ = ["moments"]

# Benchmarks only (benchmarks/sync.py): True sends the TF synchronized layer through the
# exact states of every slice, the path before the certified merge.
_sync_exact_states = False


# A replica of a replica context: its id and the number in sync.
Replica = collections.namedtuple("Replica", ["id", "count"])


def collectives(context):
    """(all_sum, replica) of a replica context: its SUM all-reduce and its `Replica`."""

    def all_sum(v):
        return context.all_reduce(tf.distribute.ReduceOp.SUM, v)

    return all_sum, Replica(context.replica_id_in_sync_group, context.num_replicas_in_sync)


def pack(digits):
    """int32 digits [..., L] (canonical, each < 2**16) -> int64 [..., ceil(L / 2)] lanes.

    Two digits per int64 (d_even + d_odd * 2**32).  A SUM of up to 2**15 packed
    states keeps each 32-bit lane below 2**31, so no lane carries into the next
    and the sum unpacks to the exact digit sums.  (int32 tensors live in host
    memory in TF graphs, and tf.distribute does not batch them with device
    tensors: int64 lanes carry the same bytes as int32 digits.)
    """
    size = digits.shape[-1]
    wide = tf.cast(digits, tf.int64)
    if size % 2:
        wide = tf.concat([wide, tf.zeros_like(wide[..., :1])], -1)
    return wide[..., 0::2] + tf.bitwise.left_shift(wide[..., 1::2], 32)


def unpack(lanes, size):
    """The inverse of `pack` on a sum of packed states: int32 digit sums [..., size]."""
    low = tf.bitwise.bitwise_and(lanes, 0xFFFFFFFF)
    high = tf.bitwise.right_shift(lanes, 32)
    both = tf.reshape(tf.stack([low, high], -1), tf.concat([tf.shape(lanes)[:-1], [-1]], 0))
    return tf.cast(both[..., :size], tf.int32)


def global_stats(all_sum, v, axes, lo, extra=None, replica=None, ddof=0):
    """(mean, mean_lo or None, var, n, extra summed) of the global batch of v (all replicas).

    float32, float16 and bfloat16 with `replica` (a `Replica`): the certified merge
    (docs section 13b, `_merged_moments`, mean_lo included).  Else (float64, complex)
    one all-reduce of the packed states (with `extra`, a per-slice int32 count below
    2**31, as one more lane of the same collective); with lo, one more all-reduce of
    the float64 fixed-point sums of mean_lo (moments_core/_kernel.py `mean_lo` with
    reduce=; real data).
    """
    fmt = FORMATS.get(v.dtype.name)  # None for complex data
    if fmt is not None and fmt.wide and replica is not None and not _sync_exact_states:
        mean, mean_lo, var, n = _merged_moments(all_sum, replica, v, axes, fmt, ddof, lo)
        summed_extra = None if extra is None else all_sum(tf.cast(extra, tf.int64))
        return mean, mean_lo, var, n, summed_extra
    state = state_api.moments_state(v, axes)
    size = state.values.shape[-1]
    lanes = pack(state.values)
    if extra is not None:
        lanes = tf.concat([lanes, tf.cast(tf.expand_dims(extra, -1), tf.int64)], -1)
    summed = all_sum(lanes)
    total = state_api.MomentsState(unpack(summed[..., : (size + 1) // 2], size), state.dtype)
    mean, var = state_api.state_moments(total, ddof)
    digits = tf.cast(tf.reshape(total.values, [-1, size])[0, :3], tf.int64)
    n = digits[0] + digits[1] * 2**16 + digits[2] * 2**32  # a digit sum: valid uncarried
    summed_extra = summed[..., -1] if extra is not None else None
    mean_lo = None
    if lo:
        laid, axis = _moments._layout(v, axes)
        m64 = tf.cast(tf.reshape(mean, [-1]), tf.float64)
        v64 = tf.cast(tf.reshape(var, [-1]), tf.float64)
        n = tf.cast(n, tf.int64)
        mean_lo = _mean_lo(all_sum, laid, axis, m64, v64, n, ddof, fmt)
        mean_lo = tf.reshape(tf.cast(mean_lo, v.dtype), tf.shape(mean))
    return mean, mean_lo, var, n, summed_extra


def _mean_lo(all_sum, laid, axis, m64, v64, n, ddof, fmt):
    """mean_lo (float64, [kept]) of the union from the global mean and variance m64, v64
    and count n: each replica's fixed-point sums of its part (`_kernel.mean_lo_sums`),
    all-reduced (exact: integers below 2**53), then rounded (`_kernel.mean_lo_round`)."""
    total, unscale, ok = _mean_lo_sums(laid, axis, m64, v64, n, ddof, fmt)
    return _mean_lo_round(all_sum(total), unscale, ok, n, fmt)


def _lo_sums(ops, x, axis, m, w, count, ddof, fmt, integer=False):
    """`_kernel.mean_lo_sums`; integer: the sums as int64 (0 where undefined)."""
    total, unscale, ok = _kernel.mean_lo_sums(ops, x, axis, m, w, ddof, fmt, count)
    if integer:  # integers below 2**53: exact
        total = ops.cast(ops.where(ok > 0.0, total, 0.0), "int64")
    return total, unscale, ok


def _mean_lo_sums(laid, axis, m64, v64, n, ddof, fmt):
    """`_lo_sums` as a phase."""

    def sums(ops, x, m, w, count):
        return _lo_sums(ops, x, axis, m, w, count, ddof, fmt)

    spec = [_matrix(laid.dtype), _vector(tf.float64), _vector(tf.float64), _scalar(tf.int64)]
    key = ("lo_sums", axis, ddof, laid.dtype)
    return _phase(key, sums, (laid, m64, v64, n), spec)


def _mean_lo_round(total, unscale, ok, n, fmt):
    def rounded(ops, total, unscale, ok, count):
        return _kernel.mean_lo_round(ops, total, unscale, ok, count, fmt)

    spec = [_vector(tf.float64)] * 3 + [_scalar(tf.int64)]
    return _phase(("lo_round", fmt.name), rounded, (total, unscale, ok, n), spec)


# The open slices' elements in the second round (`_merged_moments` with lo): each
# replica writes its rows into its block of the union, rows [r M, r M + n_r), as int64
# lanes holding the element's bit pattern (unsigned) plus 2**32 (present); the rows of
# the other blocks are zero, so the integer SUM over the replicas concatenates the
# blocks exactly (-0.0 and NaN payloads included) and marks the rows that hold an
# element.  M >= every n_r comes from sum_r n_r**2 (one float64 lane of the sums'
# all-reduce, the same on every replica): n_r <= sqrt(sum n_r**2); M = n_r when the
# replicas hold equal parts, at most sqrt(R) max n_r otherwise.
_BITS = {tf.float32: tf.uint32, tf.float16: tf.uint16, tf.bfloat16: tf.uint16}
_PRESENT = 2**32


def _union_rows(squares):
    """M: an int64 bound on every replica's row count from the SUM of their squares
    (exact below 2**53; the margin covers the rounding of a larger sum)."""
    return tf.cast(tf.math.ceil(tf.sqrt(squares) * (1.0 + 2.0**-30)), tf.int64)


def _lanes(part, bits_type):
    """int64 lanes of a float array: its unsigned bit pattern plus _PRESENT."""
    return tf.cast(tf.bitcast(part, bits_type), tf.int64) + _PRESENT


def _from_lanes(lanes, bits_type, dtype):
    """The rows of the SUM of every replica's lanes [R M, open] that hold an element, as
    dtype: the union of the open slices (open >= 1)."""
    present = tf.equal(tf.bitwise.right_shift(lanes[:, 0], 32), 1)
    lanes = tf.boolean_mask(lanes, present) - _PRESENT
    return tf.bitcast(tf.cast(lanes, bits_type), dtype)


def _matrix(dtype):
    return tf.TensorSpec([None, None], dtype)


def _vector(dtype):
    return tf.TensorSpec([None], dtype)


def _scalar(dtype):
    return tf.TensorSpec([], dtype)


def _phase(key, fn, args, spec):
    """fn(ops, *args), the local work between two collectives, as an XLA computation of
    its own (traced once per TensorFlow context and key, compiled per shape; inlined where
    XLA compiles the caller), or on plain operations where XLA is switched off.  Run as
    plain operations, the merge's steps were about 1,500 TensorFlow operations per replica
    and call, each dispatched on its own (benchmarks/sync.py: the step's time)."""
    if not _moments._use_xla():
        return fn(_ops.PLAIN, *args)
    jit = None if in_xla_context() else True
    compiled = _moments._compiled(("union", *key), lambda *a: fn(_ops.XLA, *a), spec, jit)
    return compiled(*args)


def _merged_moments(all_sum, replica, v, axes, fmt, ddof=0, lo=False):
    """(mean, mean_lo or None, var, n) of the global batch of v by the certified merge
    (docs section 13b) in a replica context: the shift of replica 0 (an all-reduce in which
    it alone contributes; 0 if it has no rows), one all-reduce of the fast sums, bounds,
    the smallest magnitudes' exponents and the count.  Every replica computes the open
    slices from the reduced values alone, so all take the same ones.  tf.distribute
    allows no collective inside tf.cond, so the second round always runs, on the open
    slices alone (none on decided data):

    * without lo, their exact states, all-reduced;
    * with lo, their elements, beside mean_lo's sums of every slice (from the merged
      mean and variance: those of the decided slices) in one all-reduce.  An open
      slice's mean_lo needs its final mean, which its states would give only after
      that round (a third one, always run); its elements give every replica the open
      slices of the union, whose mean, variance and mean_lo it computes as one device
      holding them (the same bits).  Three rounds instead of four.  The elements travel
      as integer lanes in each replica's block of the union (`_lanes`); an all-gather
      would do, but TensorFlow's collective all-gather of an empty tensor (no slice
      open) crashes the process.
    """
    rid, replicas = replica.id, replica.count
    laid, axis = _moments._layout(v, axes)
    size = tf.shape(laid, out_type=tf.int64)[axis]

    def shift(k, has):
        # K is an input of a format of precision <= 24: sent as float32 (4 bytes a slice).
        k32 = tf.cast(tf.where(tf.equal(rid, 0), k, tf.zeros_like(k)), tf.float32)
        return tf.cast(all_sum(k32), tf.float64)

    first, _ = _kernel.merge_first(_ops.PLAIN, laid, axis, fmt, size)
    k = shift(first, None)
    key = (axis, ddof, v.dtype, replicas)

    def rows(ops, x, k, count):
        return _kernel.merge_rows(ops, x, axis, fmt, k, count)

    def decide(ops, reduced, k):
        return _kernel.merge_decide(ops, reduced, k, fmt, replicas, "scalar", None, ddof)

    spec = [_matrix(v.dtype), _vector(tf.float64), _scalar(tf.int64)]
    flat = _phase(("rows", *key), rows, (laid, k, size), spec)
    if lo:  # the square of the replica's row count (`_union_rows`)
        flat = tf.concat([tf.reshape(tf.cast(size, tf.float64) ** 2, [1]), flat], 0)
    reduced = all_sum(flat)
    if lo:
        block, reduced = _union_rows(reduced[0]), reduced[1:]
    spec = [_vector(tf.float64), _vector(tf.float64)]
    if lo:  # the decision and mean_lo's sums of this replica's rows: one computation

        def decide_lo(ops, reduced, k, x):
            m, v, todo, n = decide(ops, reduced, k)
            total, unscale, ok = _lo_sums(ops, x, axis, m, v, n, ddof, fmt, True)
            return m, v, todo, n, total, unscale, ok

        m64, v64, todo, n, total, unscale, ok = _phase(
            ("decide_lo", *key), decide_lo, (reduced, k, laid), [*spec, _matrix(v.dtype)]
        )
    else:
        m64, v64, todo, n = _phase(("decide", *key), decide, (reduced, k), spec)
    open_slices = tf.where(todo)[:, 0]
    where = tf.expand_dims(open_slices, 1)
    any_open = tf.reduce_any(todo)

    def open_part():  # this replica's part of the open slices, in the layout
        return tf.gather(laid, open_slices, axis=1 - axis)

    lo64 = None
    if lo:
        kept = tf.shape(total, out_type=tf.int64)[0]
        bits_type = _BITS[v.dtype]

        def with_open():  # this replica's rows of the open slices, in its block
            part = open_part() if axis == 0 else tf.transpose(open_part())  # [rows, open]
            lanes = _lanes(part, bits_type)
            start = tf.cast(rid, tf.int64) * block
            pads = tf.stack([start, replicas * block - start - size])
            lanes = tf.pad(lanes, tf.stack([pads, tf.zeros([2], tf.int64)]))
            return tf.concat([total, tf.reshape(lanes, [-1])], 0)

        summed = all_sum(tf.cond(any_open, with_open, lambda: total))
        lo64 = _mean_lo_round(tf.cast(summed[:kept], tf.float64), unscale, ok, n, fmt)

        def exact():
            shape = tf.stack([replicas * block, tf.size(open_slices, tf.int64)])
            union = _from_lanes(tf.reshape(summed[kept:], shape), bits_type, v.dtype)
            em, elo, ev = _moments.stats(union, [0], ddof)
            return tuple(
                tf.tensor_scatter_nd_update(t, where, tf.cast(e, tf.float64))
                for t, e in ((m64, em), (v64, ev), (lo64, elo))
            )

        m64, v64, lo64 = tf.cond(any_open, exact, lambda: (m64, v64, lo64))
    else:
        width = state_api.state_size(v.dtype)

        def local_states():
            return pack(state_api.moments_state(open_part(), [axis]).values)

        empty = tf.zeros([0, (width + 1) // 2], tf.int64)
        summed = all_sum(tf.cond(any_open, local_states, lambda: empty))

        def fixed():
            exact = state_api.MomentsState(unpack(summed, width), v.dtype)
            em, ev = (tf.cast(t, tf.float64) for t in state_api.state_moments(exact, ddof))
            return tf.tensor_scatter_nd_update(m64, where, em), tf.tensor_scatter_nd_update(
                v64, where, ev
            )

        m64, v64 = tf.cond(any_open, fixed, lambda: (m64, v64))
    shape = tf.gather(tf.shape(v), [a for a in range(v.shape.rank) if a not in axes])
    mean, var = (tf.reshape(tf.cast(t, v.dtype), shape) for t in (m64, v64))
    mean_lo = None if lo64 is None else tf.reshape(tf.cast(lo64, v.dtype), shape)
    return mean, mean_lo, var, n


def _expand(t, axes):
    for a in axes:
        t = tf.expand_dims(t, a)
    return t


def _replica_context(synchronized):
    """The replica context whose replicas `moments(synchronized=True)` merges, or None
    (not synchronized, or one replica in sync: the local statistics are the global ones)."""
    if not isinstance(synchronized, bool):
        raise TypeError(f"moments: synchronized must be a bool; got synchronized={synchronized!r}")
    if not synchronized:
        return None
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError(
            "moments: synchronized=True merges the replicas of a replica context (call it "
            "inside strategy.run); got the cross-replica context"
        )
    return context if context.num_replicas_in_sync > 1 else None


@tf.autograph.experimental.do_not_convert
def moments(
    x, axes, shift=None, keepdims=None, name=None, *, ddof=0, keep_dims=None, synchronized=False
):
    """Mean and variance of `x` over `axes`, correctly rounded: a drop-in for tf.nn.moments.

    The variance is sum((x - mean)**2) / (n - ddof) over the n reduced
    elements and the mean sum(x) / n, each the exact value for the input floats
    rounded once to the target format (nearest, ties to even), certified per
    slice (docs/algorithm.md), in eager mode, in tf.function and under XLA, with
    the same bits in every mode and as ``jax_kernel.moments``.

    Numerical choices (docs/algorithm.md, sections 4-7):
      * shift by the slice's first element K; S1 = sum(x - K) and
        S2 = sum((x - K)**2) in float64 (float64 pairs for float64 input), in
        any order, with an error bound that holds for every order:
        |error of a sum of n terms| <= gamma_(n-1) * sum|t_i|;
      * mean ~ K + S1/n, var ~ (S2 - S1**2/n) / (n - ddof), each with a bound;
      * rounding test (Ziv): if [v - err, v + err] holds no rounding midpoint,
        the nearest float to v is the correctly rounded result;
      * otherwise (ties, near-ties, NaN/Inf) the exact path: integer sums of the
        inputs' significands, N = n*S2 - S1**2 in integers, one rounding.

    Args:
      x: a Tensor of dtype float16, bfloat16, float32, float64, complex64 or
        complex128.  float16/bfloat16 results are correctly rounded to their own
        format.  Complex inputs give the complex mean (each part rounded once)
        and the real variance E|z - mean z|**2, rounded once (no gradient).
      axes: int or sequence of ints: the axes to reduce.
      shift: accepted for compatibility with tf.nn.moments and ignored, as in
        tf.nn.moments: the kernel chooses its own shift (the first element of
        each slice), and its result does not depend on any shift.
      keepdims: keep reduced axes with length 1 (None: False).
      name: name scope of the operations.
      ddof: delta degrees of freedom (keyword only): divide by n - ddof.
      keep_dims: deprecated alias of keepdims (keyword only), as
        tf.compat.v1.nn.moments takes it: a DeprecationWarning; both given is an error.
      synchronized: (keyword only) inside a tf.distribute replica context
        (`strategy.run`), the statistics of the union of every replica's x, joined
        along the reduced axes (shards may be uneven or empty): the same bits on every
        replica and as one device holding the union, by the certified merge of
        docs/algorithm.md section 13b (one all-reduce of the fast sums and bounds,
        exact states for the slices it leaves open).  Every replica must call it
        with the same dtype and kept dimensions.  With one replica in sync, the
        local statistics; in a cross-replica context, an error.

    Returns:
      (mean, variance), Tensors of the dtype of x (variance real for complex x).
      NaN or Inf in a slice makes that slice's variance NaN and its mean follow
      IEEE rules (Inf, or NaN if mixed or NaN); other slices are unaffected.
      An empty slice, or n - ddof <= 0, gives NaN.

    Gradients are analytic: d mean/dx = 1/n, d var/dx = 2 (x - mean)/(n - ddof)
    with x - mean from the kernel's exact two-part mean; second order works
    (synchronized: the first order, n the global count, the upstream gradients of
    every replica all-reduced).

    References:
      Chan, Golub, LeVeque (1983), shifted data; Higham (2002), sum bounds;
      Ziv (1991), the rounding test; Ogita, Rump, Oishi (2005), TwoSum;
      Neal (2015), exact summation; docs/algorithm.md.

    >>> import tensorflow as tf
    >>> mean, var = moments(tf.constant([1e10, 1e10, 1e10]), axes=[0])
    >>> float(var)
    0.0
    """
    keepdims = _moments._keepdims(keepdims, keep_dims)
    context = _replica_context(synchronized)
    if context is None:
        return _moments.moments(x, axes, shift, keepdims, name, ddof=ddof)
    del shift  # documented: ignored, as in tf.nn.moments
    with tf.name_scope(name or "moments"):
        x = tf.convert_to_tensor(x)
        _moments._compute_dtype(x.dtype)
        if x.shape.rank is None:
            raise ValueError("moments: x must have a known rank; got a tensor of unknown rank")
        axes = _moments._canonical_axes(axes, x.shape.rank)
        ddof = _moments._check_ddof(ddof)
        return synchronized_moments(x, axes, ddof, keepdims, context)


def synchronized_moments(x, axes, ddof, keepdims, context):
    """`moments(x, axes, ddof=ddof, synchronized=True)` in a replica context of more than
    one replica: the mean and variance of the union of every replica's x (their reduced
    axes joined), each correctly rounded, the same bits on every replica and as one
    device holding the union.  Every replica must call it with the same dtype and kept
    dimensions (the reduced ones may differ: uneven shards, empty ones).

    Gradient (real data): with g the all-reduce SUM over the replicas of (mean_bar,
    var_bar), x_bar = g_0 / N + 2 g_1 r / (N - ddof), N the global count and r = x -
    mean from the exact two-part mean (section 9), as on one device; complex data have
    none, as `moments`."""
    all_sum, replica = collectives(context)
    if x.dtype.is_complex:
        x = tf.stop_gradient(x)
        mean, _, var, _, _ = global_stats(all_sum, x, axes, False, None, replica, ddof)
    else:

        @tf.custom_gradient
        def fn(x):
            mean, mean_lo, var, n, _ = global_stats(all_sum, x, axes, True, None, replica, ddof)

            def grad(mean_bar, var_bar):
                g = all_sum(tf.stack([mean_bar, var_bar]))
                r = (x - _expand(mean, axes)) - _expand(mean_lo, axes)
                count = tf.cast(n, x.dtype)
                return _expand(g[0] / count, axes) + _expand(2 * g[1] / (count - ddof), axes) * r

            return (mean, var), grad

        mean, var = fn(x)
    if keepdims:
        mean, var = _expand(mean, axes), _expand(var, axes)
    return mean, var
