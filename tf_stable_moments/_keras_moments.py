"""keras_moments: a backend-agnostic drop-in for keras.ops.moments on the certified kernel.

Dispatches on keras.backend.backend(): tf_stable_moments.moments on the
TensorFlow backend, jax_kernel.moments on the JAX backend (the same bits).
mean and variance are correctly rounded to the input's format.

float16 follows keras.ops.moments (issue 15, item 7): a variance that overflows
float16 is clipped to the float16 maximum (65504) instead of inf (the
tf.nn-style drop-ins keep inf).  For bfloat16 keras clips to the *float16*
range too, which turns every mean or variance above 65504 into 65504; that is
not reproduced: an overflowing bfloat16 variance is clipped to the bfloat16
maximum, and other values are the correctly rounded ones.  NaN stays NaN.

synchronized=True: on the TensorFlow backend inside a tf.distribute replica
context with more than one replica, the replicas' inputs are gathered along the
first reduced axis and every replica computes the moments of the global batch
(the same bits as one device holding it; keras sums float32 partial moments
instead).  Otherwise (one replica, no strategy) it is the plain computation, as
in keras.  On the JAX backend it raises NotImplementedError, as keras does.
"""

import keras
import numpy as np

from moments_core._validate import canonical_axes, out_shape

__all__ = ["keras_moments"]


def _clip(var, dtype, ops):
    """An overflowing (+inf) float16 or bfloat16 variance as the format's maximum."""
    if dtype not in ("float16", "bfloat16"):
        return var
    import ml_dtypes

    top = np.finfo(np.float16 if dtype == "float16" else ml_dtypes.bfloat16).max
    return ops.where(ops.equal(var, float("inf")), np.asarray(top), var)


def _tf_moments(x, axes, keepdims, synchronized):
    import tensorflow as tf

    from tf_stable_moments import _moments

    x = tf.convert_to_tensor(x)
    if synchronized:
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            rank = x.shape.rank
            axes_t = _moments._canonical_axes(axes, rank)
            a = axes_t[0]
            gathered = context.all_gather(x, axis=a)
            return _moments.moments(gathered, list(axes_t), keepdims=keepdims)
    return _moments.moments(x, axes, keepdims=keepdims)


def _jax_moments(x, axes, keepdims, synchronized):
    if synchronized:
        raise NotImplementedError(
            "keras_moments: synchronized=True is not supported with the JAX backend "
            "(as in keras.ops.moments); got synchronized=True"
        )
    import jax_kernel

    return jax_kernel.moments(x, axes, keepdims)


class _Moments(keras.Operation):
    """keras_moments as a Keras operation: on a KerasTensor (a functional model being
    built) it records the call and returns KerasTensors of the output shape and dtype,
    as keras.ops.moments does."""

    def __init__(self, axes, keepdims=False, synchronized=False, *, name=None):
        super().__init__(name=name)
        self.axes, self.keepdims, self.synchronized = axes, keepdims, synchronized

    def call(self, x):
        return _moments(x, self.axes, self.keepdims, self.synchronized)

    def compute_output_spec(self, x):
        dtype = keras.backend.standardize_dtype(x.dtype)
        if "int" in dtype or dtype == "bool":
            dtype = keras.config.floatx()
        axes = canonical_axes(self.axes, len(x.shape))
        shape = out_shape(x.shape, axes, self.keepdims)
        return keras.KerasTensor(shape, dtype=dtype), keras.KerasTensor(shape, dtype=dtype)


def keras_moments(x, axes, keepdims=False, synchronized=False):
    """Correctly rounded mean and variance: a drop-in for keras.ops.moments.

    Args:
      x: a tensor of the current Keras backend (float16, bfloat16, float32,
        float64; integer inputs are cast to keras.config.floatx() as keras does).
      axes: an int or a list of ints.
      keepdims: keep reduced axes with length 1.
      synchronized: see the module docstring.

    Returns:
      (mean, variance) in x's dtype; var = (1/n) sum (x - mean)**2, each the
      exact value rounded once (float16: an overflowing variance is the float16
      maximum, as in keras).  On a KerasTensor: KerasTensors of that shape and dtype
      (the call is recorded in the functional model being built).
    """
    if isinstance(x, keras.KerasTensor):
        return _Moments(axes, keepdims, synchronized).symbolic_call(x)
    return _moments(x, axes, keepdims, synchronized)


def _moments(x, axes, keepdims, synchronized):
    from keras import ops

    backend = keras.backend.backend()
    x = ops.convert_to_tensor(x)
    dtype = keras.backend.standardize_dtype(x.dtype)
    if "int" in dtype or dtype == "bool":
        x = ops.cast(x, keras.config.floatx())
        dtype = keras.config.floatx()
    if backend == "tensorflow":
        mean, var = _tf_moments(x, axes, keepdims, synchronized)
    elif backend == "jax":
        mean, var = _jax_moments(x, axes, keepdims, synchronized)
    else:
        raise NotImplementedError(
            f"keras_moments: the Keras backend must be 'tensorflow' or 'jax'; got {backend!r}"
        )
    return mean, _clip(var, dtype, ops)
