"""Correctly rounded mean and variance for TensorFlow: moments, drop-in functions, a
mergeable state, Keras normalization layers."""

from tf_stable_moments._functions import reduce_std, reduce_variance, weighted_moments
from tf_stable_moments._group_norm import StableGroupNormalization
from tf_stable_moments._keras_moments import keras_moments
from tf_stable_moments._layer import StableBatchNormalization
from tf_stable_moments._layer_norm import StableLayerNormalization
from tf_stable_moments._moments import moments
from tf_stable_moments._normalization import StableNormalization
from tf_stable_moments._state import (
    MomentsState,
    accumulate_state,
    merge_states,
    moments_state,
    state_moments,
)

__all__ = [
    "MomentsState",
    "StableBatchNormalization",
    "StableGroupNormalization",
    "StableLayerNormalization",
    "StableNormalization",
    "accumulate_state",
    "keras_moments",
    "merge_states",
    "moments",
    "moments_state",
    "reduce_std",
    "reduce_variance",
    "state_moments",
    "weighted_moments",
]
