"""Correctly rounded mean and variance for TensorFlow: moments, drop-in functions, a Keras layer."""

from tf_stable_moments._functions import reduce_std, reduce_variance, weighted_moments
from tf_stable_moments._keras_moments import keras_moments
from tf_stable_moments._layer import StableBatchNormalization
from tf_stable_moments._moments import moments

__all__ = [
    "StableBatchNormalization",
    "keras_moments",
    "moments",
    "reduce_std",
    "reduce_variance",
    "weighted_moments",
]
