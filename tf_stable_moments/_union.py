"""Statistics of the union of every replica's data in a tf.distribute replica context: the
certified merge of docs/algorithm.md section 13b, for the synchronized layers
(tf_stable_moments/_layer.py), and the public `moments` with `synchronized` (one
replica: tf_stable_moments/_moments.py).

One all-reduce of each replica's fast sums and their error bounds decides the slices of
the union; exact moments states (int32 digits, packed into int64 lanes) only for the
slices it leaves open.  The JAX counterpart is jax_kernel/_union.py.
"""

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


def collectives(context):
    """(all_sum, replica) of a replica context: its SUM all-reduce and (this replica's id,
    the number in sync)."""

    def all_sum(v):
        return context.all_reduce(tf.distribute.ReduceOp.SUM, v)

    return all_sum, (context.replica_id_in_sync_group, context.num_replicas_in_sync)


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

    float32, float16 and bfloat16 with `replica` (this replica's id and
    the number in sync): the certified merge (docs section 13b, `_merged_moments`).
    Else (float64, complex) one all-reduce of the packed states (with `extra`, a
    per-slice int32 count below 2**31, as one more lane of the same collective).  With
    lo, one more all-reduce of the float64 fixed-point sums of mean_lo
    (moments_core/_kernel.py `mean_lo` with reduce=; real data).
    """
    fmt = FORMATS.get(v.dtype.name)  # None for complex data
    summed_extra = None
    if fmt is not None and fmt.wide and replica is not None and not _sync_exact_states:
        mean, var, n = _merged_moments(all_sum, replica, v, axes, fmt, ddof)
        if extra is not None:
            summed_extra = all_sum(tf.cast(extra, tf.int64))
    else:
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
        key = (axis, ddof, v.dtype)

        def sums(ops, x, m, w, count):
            return _kernel.mean_lo_sums(ops, x, axis, m, w, ddof, fmt, count)

        def rounded(ops, total, unscale, ok, count):
            return _kernel.mean_lo_round(ops, total, unscale, ok, count, fmt)

        spec = [_matrix(v.dtype), _vector(tf.float64), _vector(tf.float64), _scalar(tf.int64)]
        total, unscale, ok = _phase(("lo_sums", *key), sums, (laid, m64, v64, n), spec)
        spec = [_vector(tf.float64)] * 3 + [_scalar(tf.int64)]
        mean_lo = _phase(("lo_round", *key), rounded, (all_sum(total), unscale, ok, n), spec)
        mean_lo = tf.reshape(tf.cast(mean_lo, v.dtype), tf.shape(mean))
    return mean, mean_lo, var, n, summed_extra


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


def _merged_moments(all_sum, replica, v, axes, fmt, ddof=0):
    """(mean, var, n) of the global batch of v by the certified merge (docs section 13b)
    in a replica context: the shift of replica 0 (an all-reduce in which it alone
    contributes; 0 if it has no rows), one all-reduce of the fast sums, bounds, the
    smallest magnitudes' exponents and the count.  tf.distribute allows no collective
    inside tf.cond, so the second round always runs, on the slices left open alone (none
    on decided data): their exact states, all-reduced.  Every replica computes the open
    slices from the reduced values alone, so all gather the same ones."""
    rid, replicas = replica
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
    spec = [_vector(tf.float64), _vector(tf.float64)]
    m64, v64, todo, n = _phase(("decide", *key), decide, (all_sum(flat), k), spec)
    # The second round: the open slices (the same on every replica).  Its collective always
    # runs (on no slice where all are decided); the local work around it only if needed.
    width = state_api.state_size(v.dtype)
    any_open = tf.reduce_any(todo)

    def local_states():
        part = tf.gather(laid, tf.where(todo)[:, 0], axis=1 - axis)
        return pack(state_api.moments_state(part, [axis]).values)

    empty = tf.zeros([0, (width + 1) // 2], tf.int64)
    summed = all_sum(tf.cond(any_open, local_states, lambda: empty))

    def fixed():
        exact = state_api.MomentsState(unpack(summed, width), v.dtype)
        em, ev = (tf.cast(t, tf.float64) for t in state_api.state_moments(exact, ddof))
        where = tf.expand_dims(tf.where(todo)[:, 0], 1)
        return tf.tensor_scatter_nd_update(m64, where, em), tf.tensor_scatter_nd_update(
            v64, where, ev
        )

    m64, v64 = tf.cond(any_open, fixed, lambda: (m64, v64))
    shape = tf.gather(tf.shape(v), [a for a in range(v.shape.rank) if a not in axes])
    mean, var = (tf.reshape(tf.cast(t, v.dtype), shape) for t in (m64, v64))
    return mean, var, n


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
