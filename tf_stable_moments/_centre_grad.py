"""The derivatives of centring, shared by the layers (`_layer.py`) and the gradient of
the native StableCentre op (`_native/__init__.py`), in keras.ops.

Centring maps x to (r, var, mean_hi, mean_lo), r = x - mean over a slice, the mean and
variance over its selected elements (w: None, all selected, or a boolean mask; k the
selected count): d mean = sum(w dx) / k, d var = 2 sum(w dx r) / k, d r = dx - d mean,
and mean_lo (a rounding error) gets no tangent.
"""

import math

import keras
from keras import ops


def _expand(v, axes):
    """A per-channel vector shaped to broadcast against the input: as it is where the
    reduced axes lead (channels last), else one reshape where v's shape is static
    (expand_dims adds one operation per axis to a traced graph), by the backend's own
    reshape (keras.ops dispatch costs more than the op in eager mode)."""
    shape = tuple(v.shape)
    if tuple(axes) == tuple(range(len(axes))):
        return v  # the kept axes are the trailing ones: broadcasting aligns them as they are
    if None in shape or any(a < 0 for a in axes):
        return ops.expand_dims(v, axes)
    kept = iter(shape)
    target = [1 if a in axes else next(kept) for a in range(len(shape) + len(axes))]
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return tf.reshape(v, target)
    return ops.reshape(v, target)


def _counts(x, w, axes):
    """(n, k): elements per slice and selected elements per slice (at least 1)."""
    shape = ops.shape(x)
    n = ops.cast(math.prod(shape[a] for a in axes), x.dtype)
    if w is None:
        return n, n
    k = ops.cast(ops.sum(ops.cast(w, "int32"), axis=axes), x.dtype)
    return n, ops.maximum(k, 1)


def _differentiable_residual(r, x, w, axes):
    """r with the derivative of x - mean: r + (t - sum(w t) / k), t = x - stop_gradient(x) = 0."""
    _, k = _counts(x, w, axes)
    t = x - ops.stop_gradient(x)
    w_t = t if w is None else ops.where(w, t, ops.zeros_like(t))
    return ops.stop_gradient(r) + (t - _expand(ops.sum(w_t, axis=axes) / k, axes))


def _centre_vjp(x, w, axes, r, r_bar, var_bar, mean_bar):
    """x_bar = r_bar + (w / k) * (mean_bar - sum(r_bar) + 2 var_bar r)."""
    _, k = _counts(x, w, axes)
    per_slice = _expand((mean_bar - ops.sum(r_bar, axis=axes)) / k, axes)
    x_bar = per_slice + _expand(2 * var_bar / k, axes) * r
    if w is not None:
        x_bar = ops.where(w, x_bar, ops.zeros_like(x_bar))
    return r_bar + x_bar


def _centre_jvp(x, w, axes, r, dx):
    """Tangents of (r, var, mean_hi, mean_lo); mean_lo, a rounding error, gets none."""
    _, k = _counts(x, w, axes)
    w_dx = dx if w is None else ops.where(w, dx, ops.zeros_like(dx))
    d_mean = ops.sum(w_dx, axis=axes) / k
    d_var = 2 * ops.sum(w_dx * r, axis=axes) / k
    return dx - _expand(d_mean, axes), d_var, d_mean, ops.zeros_like(d_mean)
