"""Correctly rounded mean and variance for TensorFlow: moments and a Keras layer."""

from tf_stable_moments._layer import StableBatchNormalization
from tf_stable_moments._moments import moments

__all__ = ["StableBatchNormalization", "moments"]
