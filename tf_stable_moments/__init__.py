"""Correctly rounded mean and variance for TensorFlow: moments, a mergeable state, a Keras layer."""

from tf_stable_moments._layer import StableBatchNormalization
from tf_stable_moments._moments import moments
from tf_stable_moments._state import MomentsState, merge_states, moments_state, state_moments

__all__ = [
    "MomentsState",
    "StableBatchNormalization",
    "merge_states",
    "moments",
    "moments_state",
    "state_moments",
]
