"""StableNormalization: keras.layers.Normalization with exact adapted statistics.

Why keras.layers.Normalization breaks on offset data.  Its adapt() computes
float32 moments per batch and merges them with float32 weights,
  mean <- mean * (1 - w) + batch_mean * w,
  var <- (var + (mean - new_mean)**2) * (1 - w) + (batch_var + (batch_mean - new_mean)**2) * w,
so every batch adds roundings of size 2**-24 * |mean| to the mean and of size
2**-24 * mean**2 to the variance: at |mean| / std = 1e6 the variance is wrong
in its leading digit and the result depends on the batch size (measured in
tests/test_norm_layers.py).  Even a correctly rounded float32 mean is off by up
to ulp(mean) / 2 (0.03 at 1e6), so (x - mean) / std carries that error too.

What this layer does instead:
  * adapt() turns each batch into the exact mergeable state of
    tf_stable_moments.moments_state (integer sums n, S1, S2 per feature),
    merges the states exactly (merge_states) and rounds once at the end
    (state_moments): mean and variance are the correctly rounded mean and
    (population) variance of the whole data set, the same bits whatever the
    batch size or order.  The data are converted to float32 (the layer's
    compute dtype, at least float32) first, as keras does for batches.
  * The same exact sums rounded to float64 give the mean to float64 (the mean
    of the data widened to float64); its difference from the float32 mean,
    rounded to float32, is kept
    as a fourth weight "mean_correction" (keyword-only compensated_mean=True,
    the default), so that mean + mean_correction is the mean to about 2**-48
    relative.  Given mean= values are split the same way (float64 -> two
    float32 parts).
  * call: y = ((x - mean) - mean_correction) / max(sqrt(var), eps), and with
    invert=True y = mean + (x * max(sqrt(var), eps) + mean_correction), every
    rounding fixed (docs/algorithm.md section 14): the reciprocal of the scale
    correctly rounded, the inverse RN32(RN64(x scale + mean_correction)).
    x - mean is exact by Sterbenz for x within a factor 2 of the mean, so y is
    accurate to a few float32 ulps of |y| for any offset (keras: an absolute
    error of about 2**-24 * |mean| / std, plus that of its statistics).

The accumulation runs on TensorFlow on both Keras backends (adapt is eager,
host-side preprocessing, like keras's own tf.data iteration); correctly rounded
results do not depend on the framework.
"""

import itertools
import math

import keras
import numpy as np
from keras.src.layers.preprocessing.normalization import _extract_batch
from keras.src.trainers.data_adapters.py_dataset_adapter import PyDataset

from tf_stable_moments import _formulas
from tf_stable_moments._layer_norm import _check_backend

_STANDARD_WEIGHTS = 3  # keras's mean, variance, count
# adapt() joins consecutive batches (along the batch axis, when it is reduced) into chunks of
# at least this many elements before computing a state: fewer, larger kernel calls.  The
# states are exact, so the bits do not depend on it (tests/test_norm_layers.py varies it).
_CHUNK_ELEMENTS = 2**16


def _input_shape_and_batches(data):
    """(input_shape, iterable of batches) for the data types of keras's adapt()."""
    import tensorflow as tf  # adapt() runs on TensorFlow (the class itself needs none)

    if isinstance(data, np.ndarray) or keras.ops.is_tensor(data) or tf.is_tensor(data):
        return tuple(data.shape), [data]
    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
        shape = tuple((spec[0] if isinstance(spec, tuple) else spec).shape)
        if len(shape) == 1:  # as keras: an unbatched dataset of vectors
            data = data.batch(128)
            spec = data.element_spec
            shape = tuple((spec[0] if isinstance(spec, tuple) else spec).shape)
        return shape, data
    if isinstance(data, PyDataset):
        return tuple(_extract_batch(data[0]).shape), data
    if hasattr(data, "__iter__"):
        data_iter = iter(data)
        first = next(data_iter, None)
        if first is None:
            raise ValueError(
                "adapt() received an empty iterable (no batches). "
                "Expected at least one batch. Pass a non-empty iterable "
                "of arrays or tensors, e.g. layer.adapt([x]) or "
                "layer.adapt(list_of_batches)."
            )
        first = _extract_batch(first)
        shape = getattr(first, "shape", None)
        if shape is None:
            raise TypeError(
                "adapt() expects an iterable that yields arrays or "
                "tensors with a `.shape` attribute (e.g. numpy arrays or "
                "backend tensors). Got an element of type "
                f"{type(first).__name__}. Ensure each yielded "
                "element is array-like with a `.shape` attribute."
            )
        return tuple(shape), itertools.chain([first], data_iter)
    raise TypeError(
        f"Unsupported data type: {type(data)}. `adapt` supports "
        f"`np.ndarray`, backend tensors, `tf.data.Dataset`, "
        f"`keras.utils.PyDataset`, and iterables of batches (e.g. "
        f"list, generator)."
    )


def _split(mean64):
    """(hi, lo) float32 with hi = fl32(mean64), lo = fl32(mean64 - hi); lo = 0 where not finite."""
    hi = mean64.astype(np.float32)
    with np.errstate(invalid="ignore"):
        lo = (mean64 - hi.astype(np.float64)).astype(np.float32)
    return hi, np.where(np.isfinite(lo), lo, np.float32(0))


@keras.saving.register_keras_serializable(package="tf_stable_moments")
class StableNormalization(keras.layers.Normalization):
    """keras.layers.Normalization with exactly adapted statistics: accurate on offset data.

    A drop-in replacement: the same arguments (axis=-1, mean, variance,
    invert), adapt() on numpy arrays, tensors, tf.data.Dataset (batched),
    keras.utils.PyDataset and iterables of batches, the same errors, weights
    (mean, variance, count, then "mean_correction" appended, see below) and
    configuration as keras.layers.Normalization, on the TensorFlow and JAX
    Keras backends (others raise NotImplementedError).  What differs:

      * adapt() gives the correctly rounded mean and variance of the whole
        data set (exact mergeable states, merged across batches, rounded once),
        the same bits for any batching;
      * the mean is kept in two float32 parts, mean + mean_correction, and the
        input is centred with both:
            y = ((x - mean) - mean_correction) / max(sqrt(var), eps),
        so y is accurate to a few float32 ulps for any offset.

    Migration:

        import tf_stable_moments  # also registers the class for keras.models.load_model
        # was keras.layers.Normalization(axis=-1):
        norm = tf_stable_moments.StableNormalization(axis=-1)
        norm.adapt(dataset)  # any batch size: the same bits

    Args:
        axis, mean, variance, invert, **kwargs: those of keras.layers.Normalization.
        compensated_mean: keyword only, default True.  Keep the fourth weight
            "mean_correction" (float32, the mean's low part; with a given mean,
            no weight but the same split).  set_weights and weight files of
            keras's Normalization (three weights) load into it, the correction
            then 0 (the accuracy of a float32 mean).  With False the weights are
            keras's three and the mean is one float32 (an error of up to
            ulp(mean) / 2 / std in y), the statistics still exact.

    Raises:
        NotImplementedError: on a Keras backend other than TensorFlow or JAX.
        ValueError, TypeError: the errors of keras.layers.Normalization, and
            compensated_mean that is not a bool.
    """

    def __init__(
        self, axis=-1, mean=None, variance=None, invert=False, *, compensated_mean=True, **kwargs
    ):
        super().__init__(axis=axis, mean=mean, variance=variance, invert=invert, **kwargs)
        _check_backend("StableNormalization")
        if not isinstance(compensated_mean, bool):
            raise ValueError(
                f"compensated_mean must be a bool; received: compensated_mean={compensated_mean!r}"
            )
        self.compensated_mean = compensated_mean
        self.mean_correction = None
        self._mean_lo = None
        self._given = None

    # ------------------------------------------------------------ weights and state
    @property
    def _work_dtype(self):
        """Statistics and arithmetic in float32 at least (float16/bfloat16 are upcast)."""
        return _formulas.compute_dtype(self.compute_dtype)

    def build(self, input_shape):
        super().build(input_shape)
        if input_shape is None:
            return
        if self.input_mean is None:
            if self.compensated_mean:
                self.mean_correction = self.add_weight(
                    name="mean_correction",
                    shape=self._mean_and_var_shape,
                    initializer="zeros",
                    trainable=False,
                )
            self.finalize_state()
            return
        # Given mean/variance: keras's broadcast (of float64 numpy values), the mean in two parts.
        mean64 = np.asarray(self.input_mean, np.float64)
        hi, lo = _split(mean64)
        self._given = (
            self._broadcast_given(hi if self.compensated_mean else mean64),
            self._broadcast_given(np.asarray(self.input_variance, np.float64)),
            self._broadcast_given(lo) if self.compensated_mean else None,
        )

    def _broadcast_given(self, value):
        """keras's alignment of a given mean/variance to the kept axes (right to left)."""
        expanded = [1] * len(self._broadcast_shape)
        for i in range(1, value.ndim + 1):
            expanded[self._keep_axis[-i]] = value.shape[-i]
        value = np.broadcast_to(value.reshape(expanded), self._broadcast_shape)
        value = value.astype(self._work_dtype)
        if keras.backend.backend() != "tensorflow":
            return keras.ops.convert_to_tensor(value)
        # An eager tensor even when built inside a tf.function: graphs capture it as an input,
        # so grappler cannot fold (x - mean) - mean_lo into x - fl32(mean + mean_lo).
        import tensorflow as tf

        with tf.init_scope():
            return tf.constant(value)

    def finalize_state(self):
        if self.input_mean is not None or not self.built:
            return
        work = self._work_dtype
        ops = keras.ops
        self.mean = ops.cast(ops.reshape(self.adapt_mean, self._broadcast_shape), work)
        self.variance = ops.cast(ops.reshape(self.adapt_variance, self._broadcast_shape), work)
        self._mean_lo = None
        if self.mean_correction is not None:
            self._mean_lo = ops.cast(ops.reshape(self.mean_correction, self._broadcast_shape), work)

    def set_weights(self, weights):
        """keras's set_weights; with compensated_mean also keras's three weights (correction 0)."""
        if self.mean_correction is not None and len(weights) == _STANDARD_WEIGHTS:
            weights = [*weights, np.zeros(self.mean_correction.shape, np.float32)]
        super().set_weights(weights)
        self.finalize_state()

    def load_own_variables(self, store):
        """keras's loader; also reads the entry of a keras Normalization (three weights)."""
        if self.mean_correction is not None and len(store.keys()) == _STANDARD_WEIGHTS:
            for i, variable in enumerate([self.adapt_mean, self.adapt_variance, self.count]):
                variable.assign(store[f"{i}"])
            self.mean_correction.assign(keras.ops.zeros_like(self.mean_correction))
            self.finalize_state()
            return
        super().load_own_variables(store)

    # ------------------------------------------------------------ adapt
    def adapt(self, data):
        """The correctly rounded mean and variance of all of `data` (see the class docstring).

        data: a numpy array, a tensor, a batched tf.data.Dataset (an unbatched
        one of rank-1 elements is batched by 128, as in keras), a PyDataset or
        an iterable of batches; (x, y[, sample_weight]) elements use x.
        """
        input_shape, batches = _input_shape_and_batches(data)
        if not self.built:
            self.build(input_shape)
        else:
            for d in self._keep_axis:
                if input_shape[d] != self._build_input_shape[d]:
                    raise ValueError(
                        "The layer was built with "
                        f"input_shape={self._build_input_shape}, "
                        "but adapt() is being called with data with "
                        f"an incompatible shape, data.shape={input_shape}"
                    )
        import tensorflow as tf

        from tf_stable_moments._state import (
            _wide_moments,
            merge_states,
            moments_state,
            state_moments,
        )

        work = tf.as_dtype(self._work_dtype)
        state = None
        count = 0
        for x in self._chunks(batches):
            x = tf.cast(tf.convert_to_tensor(x), work)
            current = moments_state(x, self._reduce_axis)
            state = current if state is None else merge_states(state, current)
            count += math.prod(x.shape[d] for d in self._reduce_axis)
        mean, variance = (t.numpy() for t in state_moments(state))
        wide_mean = _wide_moments(state)[0].numpy()
        self.adapt_mean.assign(mean)
        self.adapt_variance.assign(variance)
        self.count.assign(count)
        if self.mean_correction is not None:
            with np.errstate(invalid="ignore"):
                lo = (wide_mean - mean.astype(np.float64)).astype(np.float32)
            self.mean_correction.assign(np.where(np.isfinite(lo), lo, np.float32(0)))
        self.finalize_state()

    def _chunks(self, batches):
        """The batches as numpy arrays, checked, consecutive ones joined along the batch axis
        (when it is reduced and the other dimensions agree) into >= _CHUNK_ELEMENTS elements."""
        joinable = 0 in self._reduce_axis
        buffer, size = [], 0
        for batch in batches:
            x = np.asarray(_extract_batch(batch))
            for d in self._keep_axis:
                expected = self._build_input_shape[d]
                if expected is not None and x.shape[d] != expected:
                    raise ValueError(
                        "adapt() yielded a batch with incompatible shape. Expected "
                        f"{self._build_input_shape}, got {tuple(x.shape)}."
                    )
            if not joinable:
                yield x
                continue
            if buffer and x.shape[1:] != buffer[0].shape[1:]:
                yield np.concatenate(buffer)
                buffer, size = [], 0
            buffer.append(x)
            size += x.size
            if size >= _CHUNK_ELEMENTS:
                yield np.concatenate(buffer)
                buffer, size = [], 0
        if buffer:
            yield np.concatenate(buffer)

    # ------------------------------------------------------------ call
    def call(self, inputs):
        if self.mean is None:
            raise ValueError("You must call `.build(input_shape)` on the layer before using it.")
        np_ops = self.backend.numpy  # backend-native, so that the layer runs in tf.data
        work = self._work_dtype
        x = self.backend.core.cast(self.backend.core.convert_to_tensor(inputs), work)
        if self._given is not None:
            mean, variance, lo = self._given
        else:
            mean, variance, lo = self.mean, self.variance, self._mean_lo
        mean, variance = self.convert_weight(mean), self.convert_weight(variance)
        scale = np_ops.maximum(np_ops.sqrt(variance), keras.config.epsilon())
        lo = None if lo is None else self.convert_weight(lo)
        # docs section 14: every rounding fixed, whatever the compiler makes of the code
        formulas = _formulas.formulas(self.backend.name)
        if self.invert:  # mean + RN32(RN64(x scale + lo)), or RN32(RN64(x scale + mean))
            if lo is None:
                y = formulas.affine(x, scale, mean)
            else:
                y = np_ops.add(mean, formulas.affine(x, scale, lo))
        else:
            y = np_ops.subtract(x, mean)
            if lo is not None:
                y = np_ops.subtract(y, lo)
            # times the correctly rounded reciprocal: a division would not be IEEE in XLA
            # (by a broadcast vector) nor 1 / scale in a TensorFlow graph (a Reciprocal)
            y = np_ops.multiply(y, formulas.recip(scale))
        return self.backend.core.cast(y, self.compute_dtype)

    def get_config(self):
        return {**super().get_config(), "compensated_mean": self.compensated_mean}

    def __repr__(self):
        return f"<tf_stable_moments.StableNormalization name={self.name}, built={self.built}>"


# keras's __name__ for the weight-file key, as StableLayerNormalization (see _layer_norm.py).
StableNormalization.__name__ = "Normalization"
