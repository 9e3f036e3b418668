"""Drop-ins for tf.math.reduce_variance, tf.math.reduce_std and tf.nn.weighted_moments.

reduce_variance is `moments` (correctly rounded).  reduce_std is the square root
of the exact variance, RN_p(fl64(sqrt(RN_53(var)))): the variance correctly
rounded to float64 by the kernel (the input read as float64 after the flush of
its own format), its float64 square root, rounded once to the output format;
within 0.5 + 1.5 * 2**(p - 53) ulp of the exact value (float16/bfloat16/float32:
0.5 + 2**-28.4 ulp; float64: faithful, below 1 ulp).  See jax_kernel/_functions.py.

weighted_moments: frequency weights are counts.  Per slice the weights are
scaled by a power of two so that they become integers (the weighted mean and
variance do not change under a common scale); with W their sum, the weighted
mean sum(w x) / W and variance sum(w (x - mean)**2) / W of the input floats are
rounded once, certified by the kernel's weighted fast path and its exact path
(integer digits multiplied by the weights).  When the scaled sum W reaches
2**39, the scale is made coarser until W < 2**39 and the scaled weights are
rounded to integers: the result is then the correctly rounded weighted
moments of weights each changed by at most 2**-40 W (relative to the slice's
total weight); with weights of one binade (or integers) and fewer than 2**15
elements per slice this never happens.  float64 inputs take the exact path for
every slice (slow).  Elements of weight 0 do not count (a NaN of weight 0 does
not make the slice NaN, unlike tf.nn.weighted_moments); a slice whose weights
sum to 0 gives mean 0 and variance 0 (as tf.nn.weighted_moments' div_no_nan); a
negative or non-finite weight makes its slice NaN.
"""

import math

import tensorflow as tf

from moments_core import _kernel, _state
from moments_core._formats import FORMATS
from moments_core._validate import canonical_axes
from tf_stable_moments import _moments, _ops
from tf_stable_moments._state import _wide_moments, moments_state
from tf_stable_moments._xla_context import in_xla_context

__all__ = ["reduce_std", "reduce_variance", "weighted_moments"]

_REAL = (tf.float16, tf.bfloat16, tf.float32, tf.float64)


def _check_dtype(x, fn, complex_ok=True):
    if x.dtype in _REAL or (complex_ok and x.dtype in (tf.complex64, tf.complex128)):
        return
    kinds = "floating or complex" if complex_ok else "floating"
    raise TypeError(
        f"{fn}: the input must have a {kinds} dtype (float16, bfloat16, float32, float64"
        f"{', complex64, complex128' if complex_ok else ''}); got dtype {x.dtype.name}"
    )


def _axes(axis, x, fn, arg="axis"):
    if x.shape.rank is None:
        raise ValueError(f"{fn}: the input must have a known rank; got a tensor of unknown rank")
    if isinstance(axis, tf.Tensor):
        value = tf.get_static_value(axis)
        if value is None:
            raise ValueError(f"{fn}: {arg} must be known while tracing; got a dynamic tensor")
        axis = value
    return canonical_axes(axis, x.shape.rank, fn, arg)


@tf.autograph.experimental.do_not_convert
def reduce_variance(input_tensor, axis=None, keepdims=False, name=None):
    """Correctly rounded variance: a drop-in for tf.math.reduce_variance.

    var = (1/n) sum (x_i - mean)**2 over the n elements of each slice, the exact
    value for the input floats rounded once to the input's format (real for
    complex input: E|z - mean z|**2).  See `moments` (docs/algorithm.md).  float16
    follows tf.math: an overflowing variance is inf.
    """
    with tf.name_scope(name or "reduce_variance"):
        x = tf.convert_to_tensor(input_tensor)
        _check_dtype(x, "reduce_variance")
        axes = _axes(axis, x, "reduce_variance")
        return _moments.moments(x, list(axes), keepdims=keepdims)[1]


def _wide(x, fmt):
    """x flushed to its format's normal range, as float64 (complex128): exact."""
    tiny = 2.0**fmt.emin

    def flush(p):
        p = tf.cast(p, tf.float64)
        return tf.where(tf.abs(p) < tiny, tf.zeros_like(p), p)

    if x.dtype.is_complex:
        return tf.complex(flush(tf.math.real(x)), flush(tf.math.imag(x)))
    return flush(x)


def _std_value(x, axes, ddof):
    work = tf.float32 if x.dtype == tf.complex64 else x.dtype.real_dtype
    fmt = FORMATS[work.name]
    dims = [x.shape[a] for a in axes]  # None: not known while tracing
    if (
        _state.one_pass_applies(fmt)
        and None not in dims
        and math.prod(dims) >= _state.STD_FROM_STATE
    ):
        v = _wide_moments(moments_state(x, list(axes)), ddof)[1]
    else:
        _, v = _moments.moments(_wide(x, fmt), list(axes), ddof=ddof)
    s = tf.sqrt(v)
    s = tf.where(tf.math.is_finite(s), _kernel.round_to(_ops.XLA, s, fmt), s)
    return tf.cast(s, work)


def _std_real(x, axes, ddof):
    @tf.custom_gradient
    def fn(x):
        s = _std_value(tf.stop_gradient(x), axes, ddof)

        def grad(g):
            keep = _moments._out_shape(x, axes, True)
            mh, ml, _ = _moments.stats(tf.stop_gradient(x), axes, ddof)
            n = tf.cast(_moments._product([_moments._dims(x)[a] for a in axes]), x.dtype)
            r = _moments.residuals(x, tf.reshape(mh, keep), tf.reshape(ml, keep), list(axes))
            sk = tf.reshape(s, keep)
            r = tf.where(tf.math.is_finite(sk), r, tf.zeros_like(r))
            return tf.reshape(g, keep) * r / ((n - ddof) * sk)

        return s, grad

    return fn(x)


@tf.autograph.experimental.do_not_convert
def reduce_std(input_tensor, axis=None, keepdims=False, name=None):
    """Standard deviation: a drop-in for tf.math.reduce_std.

    sqrt of the exact variance, not correctly rounded in general: within
    0.5 + 1.5 * 2**(p - 53) ulp of sqrt(var) for an output of precision p
    (module docstring).  float16: the standard deviation of float16 data never
    overflows here (tf.math.reduce_std gives inf where its float16 variance
    overflows).
    """
    with tf.name_scope(name or "reduce_std"):
        x = tf.convert_to_tensor(input_tensor)
        _check_dtype(x, "reduce_std")
        axes = _axes(axis, x, "reduce_std")
        s = _std_value(x, axes, 0) if x.dtype.is_complex else _std_real(x, axes, 0)
        return _moments._reshape(s, _moments._out_shape(x, axes, keepdims))


# ------------------------------------------------------------------ weighted moments
_MAX_TOTAL_BITS = 39


def _integer_weights(ops, w, axis, fmt):
    """(weights int64, total int64 per slice, bad per slice) from float weights w."""
    w = tf.cast(w, tf.float64)
    bad = tf.reduce_any(~tf.math.is_finite(w) | (w < 0), axis)
    w = tf.where(tf.math.is_finite(w) & (w > 0), w, tf.zeros_like(w))
    nonzero = w > 0
    ulp = _kernel.exponent(ops, w) - (fmt.precision - 1)  # every weight is a multiple of it
    e_min = tf.reduce_min(tf.where(nonzero, ulp, tf.constant(2000, tf.int64)), axis, True)
    e_min = tf.where(e_min > 1023, tf.zeros_like(e_min), e_min)
    scaled = w * _kernel.pow2(ops, tf.maximum(-e_min, -1022))
    total = tf.reduce_sum(scaled, axis, keepdims=True)
    extra = tf.maximum(_kernel.exponent(ops, total) + 1 - _MAX_TOTAL_BITS, 0)
    scaled = tf.round(scaled * _kernel.pow2(ops, -extra))
    weights = tf.cast(scaled, tf.int64)
    return weights, tf.reduce_sum(weights, axis), bad


def _weighted_kernel(ops, x, w, axis, fmt):
    """(mean, var) as float64 values of fmt, per slice of the 2-D x (layout axis)."""
    weights, total, bad = _integer_weights(ops, w, axis, fmt)
    valid = weights > 0
    size = tf.shape(valid, out_type=tf.int64)[axis]
    index = tf.range(size, dtype=tf.int64)
    index = tf.expand_dims(index, 1 - axis)
    first = tf.reduce_min(tf.where(valid, index, size), axis, keepdims=True)
    first = tf.minimum(first, tf.maximum(size - 1, 0))
    k = tf.reduce_sum(tf.where(tf.equal(index, first), x, tf.zeros_like(x)), axis, keepdims=True)
    k = tf.where(tf.expand_dims(total > 0, axis), k, tf.zeros_like(k))
    x = tf.where(valid, x, k)
    means, var, _ = _kernel.slice_moments(
        ops, [x], axis, 0, fmt, total, False, weights, _kernel.f32_pairs()
    )
    empty = tf.equal(total, 0)
    mean = tf.where(empty, tf.zeros_like(means[0]), means[0])
    var = tf.where(empty, tf.zeros_like(var), var)
    nan = tf.constant(float("nan"), tf.float64)
    return tf.where(bad, nan, mean), tf.where(bad, nan, var)


def _weighted_call(x, w, axis):
    """The weighted kernel on 2-D x, w in the mode at hand (XLA where it can)."""
    fmt = FORMATS[x.dtype.name]

    def run(ops):
        return lambda a, b: tuple(
            tf.cast(v, x.dtype) for v in _weighted_kernel(ops, a, b, axis, fmt)
        )

    if in_xla_context():
        return run(_ops.XLA)(x, w)
    if _moments._use_xla():
        spec = [tf.TensorSpec([None, None], x.dtype)] * 2
        return _moments._compiled(("weighted", axis, x.dtype), run(_ops.XLA), spec)(x, w)
    if tf.executing_eagerly():
        return run(_ops.PLAIN)(x, w)
    out = tf.py_function(run(_ops.PLAIN), [x, w], Tout=[x.dtype, x.dtype])
    return tuple(tf.ensure_shape(o, [None]) for o in out)


@tf.autograph.experimental.do_not_convert
def weighted_moments(x, axes, frequency_weights, keepdims=False, name=None):
    """Weighted mean and variance, correctly rounded: a drop-in for tf.nn.weighted_moments.

    With frequency weights w (broadcast to x, cast to x's dtype as tf.nn does)
    and W = sum w per slice: mean = sum(w x) / W and var = sum(w (x - mean)**2) / W,
    the exact values for the input floats and weights, rounded once to x's format
    (float16 and bfloat16 to their own format; an overflowing float16 variance is
    inf, as in tf.nn).  Exactness conditions, weight 0, W = 0 and bad weights: see
    the module docstring.

    Gradients (w.r.t. x and the weights) are those of the formulas above with the
    certified mean held fixed: w (1/W) and 2 w (x - mean) / W for x,
    (x - mean) / W and ((x - mean)**2 - var) / W for the weights.
    """
    with tf.name_scope(name or "weighted_moments"):
        x = tf.convert_to_tensor(x)
        w = tf.convert_to_tensor(frequency_weights)
        _check_dtype(x, "weighted_moments", complex_ok=False)
        axes = _axes(axes, x, "weighted_moments", "axes")
        if w.dtype != x.dtype:
            if not (w.dtype.is_floating or w.dtype.is_integer):
                raise TypeError(
                    "weighted_moments: frequency_weights must be real numbers; got dtype "
                    f"{w.dtype.name}"
                )
            w = tf.cast(w, x.dtype)
        wb = tf.broadcast_to(w, tf.shape(x)) if w.shape != x.shape else w
        wb = tf.ensure_shape(wb, x.shape)
        xl, axis = _moments._layout(tf.stop_gradient(x), axes)
        wl, _ = _moments._layout(tf.stop_gradient(wb), axes)
        mean, var = _weighted_call(xl, wl, axis)
        keep = _moments._out_shape(x, axes, True)
        mean, var = tf.reshape(mean, keep), tf.reshape(var, keep)
        # Zero in value, the formulas' derivatives (certified mean held fixed).
        total = tf.reduce_sum(wb, axes, keepdims=True)
        d = x - tf.stop_gradient(mean)
        t_mean = tf.math.divide_no_nan(tf.reduce_sum(wb * d, axes, keepdims=True), total)
        t_var = tf.math.divide_no_nan(tf.reduce_sum(wb * d * d, axes, keepdims=True), total)

        def zero(t):
            return tf.where(tf.math.is_finite(t), t - tf.stop_gradient(t), tf.zeros_like(t))

        mean = mean + zero(t_mean)
        var = var + zero(t_var)
        shape = _moments._out_shape(x, axes, keepdims)
        return _moments._reshape(mean, shape), _moments._reshape(var, shape)
