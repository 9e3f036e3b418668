"""Public TensorFlow wrapper: validate, lay out, dispatch to XLA, differentiate."""

import functools
import os
import warnings

import numpy as np
import tensorflow as tf

from tf_stable_moments import _kernel

_COMPUTE = {
    tf.float16: tf.float32,
    tf.bfloat16: tf.float32,
    tf.float32: tf.float32,
    tf.float64: tf.float64,
    tf.complex64: tf.float32,
    tf.complex128: tf.float64,
}

# XLA dispatch: None = not tried yet, True = works, False = fell back to plain ops.
_xla_state = {"ok": None}


def _compute_dtype(dtype):
    """The dtype policy: float16/bfloat16 are computed in float32, complex by parts."""
    if dtype not in _COMPUTE:
        raise TypeError(
            "moments: x must have a floating or complex dtype (float16, bfloat16, float32, "
            f"float64, complex64, complex128); got dtype {dtype.name}"
        )
    return _COMPUTE[dtype]


def _canonical_axes(axes, ndim):
    if axes is None:
        return tuple(range(ndim))
    if isinstance(axes, tf.Tensor):
        axes = tf.get_static_value(axes)
        if axes is None:
            raise ValueError("moments: axes must be known while tracing; got a dynamic tensor")
    if isinstance(axes, (int, np.integer)) and not isinstance(axes, bool):
        axes = (axes,)
    try:
        axes = tuple(int(a) for a in np.asarray(axes).ravel())
    except (TypeError, ValueError):
        raise TypeError(
            f"moments: axes must be an int or a sequence of ints; got {axes!r}"
        ) from None
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"moments: axis {a} is out of range for an input of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"moments: axes contains a repeated axis; got axes={axes}")
    return tuple(sorted(out))


def _check_ddof(ddof):
    if isinstance(ddof, bool) or not isinstance(ddof, (int, np.integer)) or ddof < 0:
        raise ValueError(f"moments: ddof must be a non-negative int; got ddof={ddof!r}")
    return int(ddof)


def _dims(x):
    static = x.shape.as_list()
    if None not in static:
        return static
    dynamic = tf.shape(x, out_type=tf.int64)
    return [d if d is not None else dynamic[i] for i, d in enumerate(static)]


def _reshape(x, shape):
    """tf.reshape, skipped when the static shape already matches (one eager op less)."""
    if not tf.is_tensor(shape) and x.shape.as_list() == list(shape):
        return x
    return tf.reshape(x, shape)


def _product(dims):
    out = 1
    for d in dims:
        out = out * d
    return out


def _layout(x, axes):
    """x as a 2-D tensor whose slices run along axis 0 (leading axes) or 1."""
    ndim = x.shape.rank
    kept = [a for a in range(ndim) if a not in axes]
    dims = _dims(x)
    n = _product([dims[a] for a in axes])
    rest = _product([dims[a] for a in kept])
    if axes == tuple(range(len(axes))):
        return _reshape(x, tf.stack([n, rest]) if tf.is_tensor(n * rest) else [n, rest]), 0
    if axes != tuple(range(ndim - len(axes), ndim)):
        x = tf.transpose(x, kept + list(axes))
    return _reshape(x, tf.stack([rest, n]) if tf.is_tensor(n * rest) else [rest, n]), 1


def _out_shape(x, axes, keepdims):
    dims = _dims(x)
    if keepdims:
        shape = [1 if a in axes else d for a, d in enumerate(dims)]
    else:
        shape = [d for a, d in enumerate(dims) if a not in axes]
    return tf.stack(shape) if any(tf.is_tensor(d) for d in shape) else shape


def _slice_moments_plain(axis, ddof, *parts, xla=False, count=None):
    means, var = _kernel.slice_moments(list(parts), axis, ddof, xla, count)
    return tuple(m for pair in means for m in pair) + (var,)


_compiled = {}


def _slice_moments_xla(axis, ddof, parts, count=None):
    """The kernel as one XLA computation: traced once, compiled per concrete shape.

    count: None, or the kernel's Counts of bucketed slices, passed in as scalars.
    """
    key = (axis, ddof, len(parts), parts[0].dtype, count is not None)
    if key not in _compiled:
        dtype = parts[0].dtype
        spec = [tf.TensorSpec([None, None], dtype)] * len(parts)
        if count is None:
            fn = lambda *p: _slice_moments_plain(axis, ddof, *p, xla=True)  # noqa: E731
        else:
            spec += [tf.TensorSpec([], tf.int64)] + [tf.TensorSpec([], dtype)] * 6

            def fn(*args):
                count = _unflatten_counts(*args[-7:])
                return _slice_moments_plain(axis, ddof, *args[:-7], xla=True, count=count)

        _compiled[key] = tf.function(fn, input_signature=spec, jit_compile=True)
    if count is None:
        return _compiled[key](*parts)
    return _compiled[key](*parts, *_flatten_counts(count))


_counts_compiled = {}


@functools.lru_cache(maxsize=256)
def _host_counts(n, ddof, dtype):
    with tf.init_scope():
        count = _kernel.counts(n, ddof, _kernel.FORMATS[dtype])
        return count._replace(n=tf.constant(n, tf.int64))


def _counts(n, ddof, dtype):
    """The kernel's Counts of n elements, computed by XLA apart from the kernel."""
    if isinstance(n, int):  # on the host
        return _host_counts(n, ddof, dtype)
    key = (ddof, dtype)
    if key not in _counts_compiled:
        fmt = _kernel.FORMATS[dtype]

        def fn(n):
            return _flatten_counts(_kernel.counts(n, ddof, fmt))

        spec = [tf.TensorSpec([], tf.int64)]
        _counts_compiled[key] = tf.function(fn, input_signature=spec, jit_compile=True)
    return _unflatten_counts(*_counts_compiled[key](tf.cast(n, tf.int64)))


def _flatten_counts(count):
    return (count.n, *count.rn, *count.rd, *count.pair)


def _unflatten_counts(n, rn_h, rn_l, rd_h, rd_l, pair_h, pair_l):
    return _kernel.Counts(n, (rn_h, rn_l), (rd_h, rd_l), (pair_h, pair_l))


# XLA compiles the kernel once per concrete shape (about a second each), so
# shapes are bucketed (8 steps per octave): a dimension unknown while tracing
# always, and every dimension of eager calls once EXACT_SHAPES distinct shapes
# have been compiled for a kernel variant.  Some slices are also padded to a
# power of two, for static shapes too (see _power_of_two_slices).  The padding
# holds copies of each slice's first element (kernel: `count`) and zeros on the
# kept axis: the bits are those of the unpadded slices (docs section 5).
EXACT_SHAPES = 8
_exact_shapes = {}


def _bucket(m, octave_steps):
    """m (an int or an int64 tensor) rounded up to one of `octave_steps` steps per octave."""
    shift = octave_steps.bit_length()  # m in (2**(t-1), 2**t]: steps of 2**(t - shift)
    if tf.is_tensor(m):
        top = _kernel._bit_length(tf.maximum(m - 1, 0))
        step = tf.bitwise.left_shift(tf.constant(1, tf.int64), tf.maximum(top - shift, 0))
        return tf.maximum((m + step - 1) // step * step, 1)
    step = 1 << max(max(m - 1, 0).bit_length() - shift, 0)
    return max(-(-m // step) * step, 1)


def _power_of_two_slices(static, axis):
    """Whether slices are padded to a power of two before the XLA call.

    XLA's CPU code for the tree over an axis that it pads itself is slower than
    over one padded by this wrapper (2 cores, measured): along axis 1 10-20x
    ([4000, 4000]: 260 ms, padded 28 ms); along axis 0 up to 2-4x for narrow
    rows, erratically ([102400, 64]: 35 ms, padded 20 ms; [70000, 64]: 10 ms,
    padded 19 ms), and not for wide ones ([4000, 4000]: 21 ms).  Also inside a
    user's jit_compile function, where XLA fuses this padding too, and it still
    helps ([100, 32, 32, 64] over axes 0, 1, 2: 53 ms, padded 17 ms).
    """
    n, kept = static[axis], static[1 - axis]
    if axis == 1 or n is None:  # an unknown length: the tree pads to 2**k anyway
        return True
    return kept is not None and kept <= 256 and n * kept >= 1 << 20


def _sizes(x, axis, dims):
    """The padded [rows, columns] the kernel runs on, or None for the exact shape."""
    static = x.shape.as_list()
    bucket = [d is None for d in static]
    if None not in static and tf.executing_eagerly():
        seen = _exact_shapes.setdefault((axis, x.dtype), set())
        if tuple(static) not in seen and len(seen) >= EXACT_SHAPES:
            bucket = [True, True]
        else:
            seen.add(tuple(static))
    steps = [8, 8]
    if _power_of_two_slices(static, axis):
        steps[axis] = 1
        bucket[axis] = bucket[axis] or dims[axis] & (dims[axis] - 1) != 0
    if not any(bucket):
        return None
    return [_bucket(d, k) if b else d for d, b, k in zip(dims, bucket, steps)]


def _bucketed(parts, axis, ddof):
    """(parts, count, kept): parts padded to _sizes, with their Counts if slices are padded
    (else None) and the kept length if the kept axis is padded (else None)."""
    dims = _dims(parts[0])
    sizes = _sizes(parts[0], axis, dims)
    if sizes is None:
        return parts, None, None
    padded = [_pad(p, axis, dims, sizes) for p in parts]
    count = _counts(dims[axis], ddof, parts[0].dtype) if _differs(sizes[axis], dims[axis]) else None
    kept = dims[1 - axis] if _differs(sizes[1 - axis], dims[1 - axis]) else None
    return padded, count, kept


def _differs(a, b):
    return tf.is_tensor(a) or tf.is_tensor(b) or a != b


def _pad(x, axis, dims, sizes):
    """x padded to `sizes`: slices with copies of their first element, the kept axis with zeros."""
    if _differs(sizes[axis], dims[axis]):
        first = x[:1] if axis == 0 else x[:, :1]
        extra = tf.cast(sizes[axis] - dims[axis], tf.int32)
        if tf.is_tensor(dims[axis]):  # an empty slice (n = 0) pads with a zero
            one = [[0, 0], [0, 0]]
            one[axis] = [0, 1 - tf.shape(first)[axis]]
            first = tf.pad(first, one)
        elif dims[axis] == 0:
            first = tf.zeros([1, dims[1]] if axis == 0 else [dims[0], 1], x.dtype)
        x = tf.concat([x, tf.tile(first, [extra, 1] if axis == 0 else [1, extra])], axis)
    if _differs(sizes[1 - axis], dims[1 - axis]):
        rows = [[0, 0], [0, 0]]
        rows[1 - axis] = [0, tf.cast(sizes[1 - axis] - dims[1 - axis], tf.int32)]
        x = tf.pad(x, rows)
    return x


def _use_xla():
    if os.environ.get("TF_STABLE_MOMENTS_XLA", "1") == "0":
        return False
    return _xla_state["ok"] is not False


_XLA_ERRORS = (
    tf.errors.UnimplementedError,
    tf.errors.NotFoundError,
    tf.errors.InvalidArgumentError,
)


def _xla_runs(dtype):
    """Whether XLA compiles and runs the kernel at all: an eager probe on a 1 x 1 input."""
    try:
        with tf.init_scope():
            _slice_moments_xla(1, 0, [tf.zeros([1, 1], dtype)])
        return True
    except _XLA_ERRORS:
        return False


def _slice_moments(parts, axis, ddof):
    """Kernel call: through an XLA-compiled function when XLA is available.

    If the first XLA call fails with an error that a missing or unusable XLA
    gives, a 1 x 1 probe decides: if the probe fails too, XLA is switched off
    for the process (with a warning) and plain operations run; if it runs, the
    error belongs to this call and is raised.
    """
    if _use_xla():
        try:
            padded, count, kept = _bucketed(parts, axis, ddof)
            out = _slice_moments_xla(axis, ddof, padded, count)
            _xla_state["ok"] = True
            return out if kept is None else tuple(o[:kept] for o in out)
        except _XLA_ERRORS as err:
            if _xla_state["ok"] or _xla_runs(parts[0].dtype):
                raise
            warnings.warn(
                f"tf_stable_moments: XLA unavailable ({err.__class__.__name__}); using plain ops",
                stacklevel=3,
            )
            _xla_state["ok"] = False
    if not tf.executing_eagerly():
        # Grappler (constant folding, then the arithmetic optimizer's AddN and
        # common-factor rewrites) changes the rounding of a plain graph; run the
        # same operations eagerly instead (a fallback: needs the Python runtime).
        out = tf.py_function(
            lambda *p: _slice_moments_plain(axis, ddof, *p),
            parts,
            Tout=[parts[0].dtype] * (2 * len(parts) + 1),
        )
        return tuple(tf.ensure_shape(o, [None]) for o in out)
    return _slice_moments_plain(axis, ddof, *parts)


def stats(x, axes, ddof):
    """(mean_hi, mean_lo, var) in the compute dtype, shaped like the kept axes."""
    work = _compute_dtype(x.dtype)
    parts = [tf.math.real(x), tf.math.imag(x)] if x.dtype.is_complex else [x]
    parts = [tf.cast(p, work) for p in parts]
    laid = [_layout(p, axes) for p in parts]
    out = _slice_moments([p for p, _ in laid], laid[0][1], ddof)
    shape = _out_shape(x, axes, False)
    if len(parts) == 1:
        mh, ml, var = out
    else:
        mh, ml = tf.complex(out[0], out[2]), tf.complex(out[1], out[3])
        var = out[4]
    return _reshape(mh, shape), _reshape(ml, shape), _reshape(var, shape)


def residuals(x, mean_hi, mean_lo, axes):
    """x - mean from the mean's two parts, differentiable as x - mean(x)."""
    # Zero in value (no overflow near the float maximum), mean(dx) in derivative.
    linear = tf.reduce_mean(x - tf.stop_gradient(x), axis=axes, keepdims=True)
    return ((x - tf.stop_gradient(mean_hi)) - tf.stop_gradient(mean_lo)) - linear


def _moments_real(x, axes, ddof):
    @tf.custom_gradient
    def fn(x):
        # The kernel is not differentiated (its gradient is analytic): no tape records it.
        mh, ml, var = stats(tf.stop_gradient(x), axes, ddof)

        def grad(g_mean, g_var):
            keep = _out_shape(x, axes, True)
            n = tf.cast(_product([_dims(x)[a] for a in axes]), x.dtype)
            r = residuals(x, tf.reshape(mh, keep), tf.reshape(ml, keep), list(axes))
            g_mean, g_var = tf.reshape(g_mean, keep), tf.reshape(g_var, keep)
            return g_mean / n + g_var * (2 * r) / (n - ddof)

        return (mh, var), grad

    return fn(x)


def moments(x, axes, shift=None, keepdims=False, name=None, *, ddof=0):
    """Mean and variance of `x` over `axes`, correctly rounded: a drop-in for tf.nn.moments.

    The variance is sum((x - mean)**2) / (n - ddof) over the n reduced
    elements, computed as described in docs/algorithm.md and rounded once; the
    mean is rounded once.  In float32 and float64 the result is the exact
    variance of the input floats, correctly rounded (errors before the final
    rounding are below 2**-40 relative), in eager mode, in tf.function and
    under XLA, with the same bits in every mode and as ``jax_kernel.moments``.

    Numerical choices:
      * shift by the slice's first element K, scale by a power of two so that
        max|x| * 2**e is in [2, 4) (no overflow, no flushed subnormals);
      * centre c = K + sum(x - K) / n (rounded: any c is exact, a near one is
        well conditioned);
      * residuals d = x - c as exact pairs (TwoSum), squares from exact
        products of 12-bit halves (immune to FMA contraction);
      * sum(d) and sum(d**2) by one fixed binary tree with TwoSum at each node;
      * var = (S2 - S1**2 / n) / (n - ddof) in double-float, rounded once.

    Args:
      x: a Tensor of dtype float16, bfloat16, float32, float64, complex64 or
        complex128.  float16/bfloat16 are computed in float32 and cast back, as
        tf.nn.moments does.  Complex inputs give the complex mean and the real
        variance E|z - mean z|**2 (no gradient).
      axes: int or sequence of ints: the axes to reduce.
      shift: accepted for compatibility with tf.nn.moments and ignored, as in
        tf.nn.moments: the kernel chooses its own shift (the first element of
        each slice), and its result does not depend on any shift.
      keepdims: keep reduced axes with length 1.
      name: name scope of the operations.
      ddof: delta degrees of freedom (keyword only): divide by n - ddof.

    Returns:
      (mean, variance), Tensors of the dtype of x (variance real for complex x).
      NaN or Inf in a slice makes that slice's variance NaN and its mean follow
      IEEE rules (Inf, or NaN if mixed or NaN); other slices are unaffected.
      An empty slice, or n - ddof <= 0, gives NaN.

    Gradients are analytic: d mean/dx = 1/n, d var/dx = 2 (x - mean)/(n - ddof)
    with x - mean from the kernel's exact two-part mean; second order works.

    References:
      Chan, Golub, LeVeque (1983), shifted data; Ogita, Rump, Oishi (2005),
      TwoSum; Dekker (1971), double-float products; docs/algorithm.md.

    >>> import tensorflow as tf
    >>> mean, var = moments(tf.constant([1e10, 1e10, 1e10]), axes=[0])
    >>> float(var)
    0.0
    """
    del shift  # documented: ignored, as in tf.nn.moments
    with tf.name_scope(name or "moments"):
        x = tf.convert_to_tensor(x)
        _compute_dtype(x.dtype)
        if x.shape.rank is None:
            raise ValueError("moments: x must have a known rank; got a tensor of unknown rank")
        axes = _canonical_axes(axes, x.shape.rank)
        ddof = _check_ddof(ddof)
        if x.dtype.is_complex:
            mean, _, var = stats(x, axes, ddof)
        else:
            work = _compute_dtype(x.dtype)
            mean, var = _moments_real(tf.cast(x, work), axes, ddof)
            mean, var = tf.cast(mean, x.dtype), tf.cast(var, x.dtype)
        shape = _out_shape(x, axes, keepdims)
        return _reshape(mean, shape), _reshape(var, shape)
