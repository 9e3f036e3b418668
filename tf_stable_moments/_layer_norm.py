"""StableLayerNormalization: keras.layers.LayerNormalization on the exact moments kernel.

Why keras.layers.LayerNormalization breaks on offset data.  For a row
x = mu + sigma * z (float32) it computes mean and var with float32 sums and
then y = x * inv + (beta - mean * inv), inv = gamma / sqrt(var + eps).  Both
x * inv and mean * inv are of size mu / sigma and each is rounded to
2**-24 * mu / sigma, so every output carries an absolute error of that size
(0.03 at mu / sigma = 1e6) on top of the errors of mean and var (measured in
tests/test_norm_layers.py: > 1e-2 at 1e6).

What this layer does instead, for each row (the elements that share the
indices of the axes not in `axis`):
  * (mean_hi, mean_lo, var) = kernel(x) over `axis`: mean_hi + mean_lo is the
    row mean to double precision, var the correctly rounded variance
    (tf_stable_moments on the TensorFlow backend, jax_kernel on the JAX
    backend: the same bits).
  * r = (x - mean_hi) - mean_lo: x - mean to about 2**-23 * |x - mean|
    (x - mean_hi is exact by Sterbenz for offset data); no error of size mu
    survives.
  * y = (r * (1 / sqrt(var + eps))) * gamma + beta with every rounding fixed
    (docs/algorithm.md section 14): t = RN32(1 / sqrt(var + eps)) correctly
    rounded, p = RN32(r t), y = RN32(RN64(p gamma + beta)) (p gamma exact in
    float64; RN32(RN64(r t + beta)) without gamma).  No compiler changes these
    bits (contraction, graph rewriting, excess precision), so every mode gives
    the same outputs.  Each product has a relative error of a few 2**-24 and is
    of size |y - beta|, so y is accurate to a few ulps of max(|y - beta|, |beta|).
    A constant row gives r = 0 exactly, hence y = beta exactly.
  * rms_scaling=True (deprecated in keras, kept for drop-in use) is keras's
    formula y = x * (1 / sqrt(var + eps)) * gamma, with var from the kernel (the
    same fixed roundings, x for r);
    x is not centred, as in keras.

Gradients are analytic (tf.custom_gradient / jax.custom_jvp, shared with
StableBatchNormalization: tf_stable_moments/_layer.py): with n the row size,
d mean = sum(dx) / n, d r = dx - d mean, d var = 2 sum(r dx) / n.
"""

import keras
from keras import ops

from tf_stable_moments import _formulas
from tf_stable_moments._layer import _BACKENDS, _backend_centre, _expand


def _check_backend(cls_name):
    """The active Keras backend's name; NotImplementedError if the kernel has none for it."""
    name = keras.backend.backend()
    if name not in _BACKENDS:
        raise NotImplementedError(
            f"{cls_name} runs on the 'tensorflow' and 'jax' Keras backends "
            f"(the backends of the moments kernel); the active Keras backend is '{name}'."
        )
    return name


def _normalize(x, axes, epsilon, gamma, beta, centred=True):
    """((x - mean) or x) * (1 / sqrt(var + eps)) * gamma + beta, statistics over `axes`,
    every rounding fixed (docs section 14).

    x is in the compute dtype (float32 at least); gamma and beta are None or
    shaped to broadcast against x.  Returns the output in x's dtype.
    """
    backend = keras.backend.backend()
    formulas = _formulas.formulas(backend)
    r, var, _, _ = _backend_centre(backend)(x, None, axes)
    # docs section 14: y = RN32(RN64(RN32(r t) gamma + beta)), or RN32(RN64(r t + beta))
    v = _expand(var + epsilon, axes)
    return formulas.scale_shift(r if centred else x, v, gamma, beta, shared=False)


@keras.saving.register_keras_serializable(package="tf_stable_moments")
class StableLayerNormalization(keras.layers.LayerNormalization):
    """keras.layers.LayerNormalization with exact statistics: accurate on offset data.

    A drop-in replacement: the same arguments and defaults (axis=-1,
    epsilon=1e-3, center, scale, initializers, regularizers, constraints, the
    deprecated rms_scaling), the same weights (gamma, beta: names, shapes and
    order), mask pass-through, mixed precision (statistics in float32, output in
    the compute dtype) and configuration as keras.layers.LayerNormalization, on
    the TensorFlow and JAX Keras backends (others raise NotImplementedError).
    What differs is the arithmetic (module docstring): the mean and variance
    of each row come from the correctly rounded moments kernel and the input is
    centred with the mean's two parts, so

        y = (x - mean) / sqrt(var + eps) * gamma + beta

    is accurate to a few float32 ulps of max(|y - beta|, |beta|) for any offset
    (keras's own layer has an absolute error of about 2**-24 * |mean| / std).

    Migration:

        import tf_stable_moments  # also registers the class for keras.models.load_model
        # was keras.layers.LayerNormalization(axis=-1):
        ln = tf_stable_moments.StableLayerNormalization(axis=-1)
        model.load_weights("old.weights.h5")  # weight files of the keras layer load as they are

    Raises:
        NotImplementedError: on a Keras backend other than TensorFlow or JAX.
        TypeError: the errors of keras.layers.LayerNormalization (axis not an
            int or a list/tuple of ints).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_backend("StableLayerNormalization")

    def call(self, inputs):
        # Statistics in float32 at least (float16/bfloat16 inputs are upcast), float64 kept.
        compute_dtype = _formulas.compute_dtype(inputs.dtype)
        x = ops.cast(inputs, compute_dtype)
        ndim = len(x.shape)
        axes = tuple(sorted(a % ndim for a in self.axis))
        shape = [x.shape[a] if a in axes else 1 for a in range(ndim)]

        def weight(w):
            return None if w is None else ops.reshape(ops.cast(w, compute_dtype), shape)

        gamma, beta = weight(self.gamma), weight(self.beta)
        if self.rms_scaling:
            outputs = _normalize(x, axes, self.epsilon, gamma, None, centred=False)
        else:
            outputs = _normalize(x, axes, self.epsilon, gamma, beta)
        return ops.cast(outputs, self.compute_dtype)

    def __repr__(self):
        return f"<tf_stable_moments.StableLayerNormalization name={self.name}, built={self.built}>"


# Keras 3 weight files (.weights.h5, and the weights inside .keras) address each layer by
# its snake-cased class __name__ and a running count; with keras's __name__ a file written
# by a model with keras.layers.LayerNormalization loads into the same model with this
# class, and the other way round (see the note at the end of tf_stable_moments/_layer.py).
# The class is still registered and deserialised as
# "tf_stable_moments>StableLayerNormalization"; __repr__ names it.
StableLayerNormalization.__name__ = "LayerNormalization"
