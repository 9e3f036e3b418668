"""Correctly rounded mean and variance for TensorFlow: moments and Keras normalization layers."""

from tf_stable_moments._group_norm import StableGroupNormalization
from tf_stable_moments._layer import StableBatchNormalization
from tf_stable_moments._layer_norm import StableLayerNormalization
from tf_stable_moments._moments import moments

__all__ = [
    "StableBatchNormalization",
    "StableGroupNormalization",
    "StableLayerNormalization",
    "moments",
]
