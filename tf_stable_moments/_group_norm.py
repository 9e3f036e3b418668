"""StableGroupNormalization: keras.layers.GroupNormalization on the exact moments kernel.

keras.layers.GroupNormalization reshapes the channels axis C into (groups,
C / groups) and normalizes each (sample, group) slice with ops.moments in
float32 and y = x * inv + (beta - mean * inv): on offset data the two
products of size mu / sigma lose 2**-24 * mu / sigma each (0.03 at 1e6).

This layer keeps keras's reshape and broadcast (the same slices, weights and
output), and for each slice computes, as StableLayerNormalization does
(tf_stable_moments/_layer_norm.py):
  (mean_hi, mean_lo, var) = kernel(x),  r = (x - mean_hi) - mean_lo,
  y = (r * (1 / sqrt(var + eps))) * gamma + beta  (every rounding fixed:
                                                  docs/algorithm.md section 14),
accurate to a few float32 ulps of max(|y - beta|, |beta|) for any offset; a
constant slice gives exactly beta.  Gradients are analytic (shared with
StableBatchNormalization).
"""

import keras
from keras import ops

from tf_stable_moments import _formulas
from tf_stable_moments._layer_norm import _check_backend, _normalize


@keras.saving.register_keras_serializable(package="tf_stable_moments")
class StableGroupNormalization(keras.layers.GroupNormalization):
    """keras.layers.GroupNormalization with exact statistics: accurate on offset data.

    A drop-in replacement: the same arguments and defaults (groups=32,
    axis=-1, epsilon=1e-3, center, scale, initializers, regularizers,
    constraints; groups=-1 for instance normalization), the same weights
    (gamma, beta of shape (C,)), argument and shape errors, mask pass-through,
    mixed precision (statistics in float32) and configuration as
    keras.layers.GroupNormalization, on the TensorFlow and JAX Keras backends
    (others raise NotImplementedError).  Per (sample, group) slice,

        y = (x - mean) / sqrt(var + eps) * gamma + beta

    with mean and var from the correctly rounded moments kernel and x centred
    with the mean's two parts (module docstring): accurate to a few float32
    ulps for any offset.

    Migration:

        import tf_stable_moments  # also registers the class for keras.models.load_model
        # was keras.layers.GroupNormalization(groups=8):
        gn = tf_stable_moments.StableGroupNormalization(groups=8)
        model.load_weights("old.weights.h5")  # weight files of the keras layer load as they are

    Raises:
        NotImplementedError: on a Keras backend other than TensorFlow or JAX.
        ValueError: the errors of keras.layers.GroupNormalization (groups not a
            positive int or -1, an undefined channels dimension, more groups
            than channels, channels not a multiple of groups).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _check_backend("StableGroupNormalization")

    def _apply_normalization(self, reshaped_inputs, input_shape):
        """keras's method with the kernel's statistics; reshaped_inputs has the groups axis."""
        inputs_dtype = reshaped_inputs.dtype
        # Statistics in float32 at least (float16/bfloat16 inputs are upcast), float64 kept.
        compute_dtype = _formulas.compute_dtype(inputs_dtype)
        x = ops.cast(reshaped_inputs, compute_dtype)
        ndim = len(x.shape)
        # keras's slices: every axis but the batch axis and the groups axis.
        groups_axis = self.axis if self.axis >= 0 else ndim - 1 + self.axis
        axes = tuple(a for a in range(1, ndim) if a != groups_axis)
        shape = self._create_broadcast_shape(input_shape)

        def weight(w):
            return None if w is None else ops.reshape(ops.cast(w, compute_dtype), shape)

        outputs = _normalize(x, axes, self.epsilon, weight(self.gamma), weight(self.beta))
        return ops.cast(outputs, inputs_dtype)

    def __repr__(self):
        return f"<tf_stable_moments.StableGroupNormalization name={self.name}, built={self.built}>"


# keras's __name__ for the weight-file key, as StableLayerNormalization (see _layer_norm.py).
StableGroupNormalization.__name__ = "GroupNormalization"
